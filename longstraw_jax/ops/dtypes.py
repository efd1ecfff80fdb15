"""The accumulation dtype rule shared by every op: float32, or float64 when the inputs are float64 (so that the
whole model can run as an fp64 reference under `jax_enable_x64`)."""
import jax.numpy as jnp


def accum_dtype(dtype) -> jnp.dtype:
    return jnp.promote_types(dtype, jnp.float32)


def at_least_f32(x):
    return x.astype(accum_dtype(x.dtype))
