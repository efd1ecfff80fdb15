"""The dtype rules shared by every op: accumulation in float32, or float64 when the inputs are float64 (so that the
whole model can run as an fp64 reference under `jax_enable_x64`); indices in int32, also under x64."""
import jax.numpy as jnp
import numpy as np


def accum_dtype(dtype) -> jnp.dtype:
    return jnp.promote_types(dtype, jnp.float32)


def at_least_f32(x):
    return x.astype(accum_dtype(x.dtype))


def int32_indices(*indices) -> tuple:
    """`lax.dynamic_slice` start indices as int32: XLA wants one index dtype, and under `jax_enable_x64` a Python
    int is int64 while positions and layer indices are int32. Static ints stay static (np.int32) and int32 arrays
    are passed through, so without x64 this changes nothing (same HLO)."""
    def one(i):
        if isinstance(i, (int, np.integer)):
            return np.int32(i)
        return i if i.dtype == jnp.int32 else i.astype(jnp.int32)

    return tuple(map(one, indices))
