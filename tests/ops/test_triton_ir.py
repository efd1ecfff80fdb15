"""`ops.triton_ir`: a CUDA lowering's Triton kernels read back from the program (name, launch) and each module
verified on this CPU host, as XLA's GPU compiler parses it before anything runs. The bad kernel below is the bug the
verifier found in the dK / dV kernel: Pallas's Triton lowering types the constants of a scalar `jnp.where` as its
predicate (i1), so a loop bound chosen between two Python ints is a boolean, a module MLIR rejects."""
import functools

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from longstraw_jax.ops import triton_ir


def _summing_kernel(x_ref, o_ref, *, blocks, select_constants):
    """o = the sum of x's first `blocks` rows of 16 (all of them when any element is positive)."""
    if select_constants:
        trips = jnp.where(jnp.max(x_ref[...]) > 0, blocks, 0)  # both cases Python ints
    else:
        trips = (jnp.max(x_ref[...]) > 0).astype(jnp.int32) * blocks
    o_ref[...] = jax.lax.fori_loop(0, trips, lambda i, acc: acc + x_ref[pl.ds(i * 16, 16), :], jnp.zeros((16, 16)))


def _lowered(select_constants: bool):
    call = pl.pallas_call(functools.partial(_summing_kernel, blocks=4, select_constants=select_constants),
                          out_shape=jax.ShapeDtypeStruct((16, 16), jnp.float32), name="summing",
                          compiler_params=plt.CompilerParams(num_warps=2, num_stages=3))
    return jax.jit(call).trace(jax.ShapeDtypeStruct((64, 16), jnp.float32)).lower(lowering_platforms=("cuda",))


def test_kernels_read_back_with_their_launch_and_module():
    kernel, = triton_ir.triton_kernels(_lowered(select_constants=False))
    assert (kernel.name, kernel.grid, kernel.num_warps, kernel.num_stages) == ("summing", (1, 1, 1), 2, 3)
    assert "tt.func public @summing" in kernel.module and "scf.for" in kernel.module


def test_an_invalid_module_names_its_kernel():
    with pytest.raises(triton_ir.InvalidTritonModule, match="(?s)'summing'.*'scf.for' op failed to verify.*same type"):
        triton_ir.triton_kernels(_lowered(select_constants=True))
