"""The Pallas kernels of the chunked gated delta rule (ops/flash_gated_delta.py, interpret mode on CPU) against the
XLA chunked form and the sequential recurrence (the reference): outputs, final state, and the gradients of q, k, v,
g, beta and the carried state; and all six kernels lowered for CUDA on this CPU host."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longstraw_jax.ops import flash_gated_delta
from longstraw_jax.ops.gated_delta import gated_delta_rule_chunked, gated_delta_rule_sequential
from tests.helpers import triton_calls
from tests.ops.test_kernels import _gdn_inputs

CASES = {  # (length, chunk_size, heads, dk, dv); the kernels run 64 as MAX_CHUNK = 32, XLA as 64: equal results
    "several chunks and a padded tail": (130, 64, 3, 8, 12),
    "one short chunk": (50, 64, 3, 8, 12),
    "chunks of 16, non-multiple": (77, 16, 2, 16, 16),
    "one token": (1, 64, 3, 8, 12),
    "four blocks of value columns": (40, 16, 2, 16, 128),
}


def _results(fn, args):
    def loss(*args):
        o, state = fn(*args)
        return jnp.sum(jnp.sin(o)) + jnp.sum(jnp.cos(state)), (o, state)

    (_, (o, state)), grads = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(6)), has_aux=True))(*args)
    return (o, state) + grads


@pytest.mark.parametrize("name", list(CASES))
def test_kernels_match_xla_and_the_recurrence(name):
    length, chunk, heads, dk, dv = CASES[name]
    args = _gdn_inputs(length, heads, dk, dv)
    pallas = _results(lambda *a: flash_gated_delta.gated_delta_rule(*a, chunk_size=chunk), args)
    xla = _results(lambda *a: gated_delta_rule_chunked(*a, chunk_size=chunk), args)
    reference = _results(gated_delta_rule_sequential, args)
    for what, a, b, c in zip(("o", "state", "dq", "dk", "dv", "dg", "dbeta", "dstate"), pallas, xla, reference):
        scale = max(1.0, float(jnp.max(jnp.abs(c))))
        np.testing.assert_allclose(a, b, atol=2e-5 * scale, rtol=0, err_msg=f"{name}: {what} vs XLA")
        np.testing.assert_allclose(a, c, atol=2e-5 * scale, rtol=0, err_msg=f"{name}: {what} vs the recurrence")
        assert float(jnp.max(jnp.abs(a))) > 0, f"{name}: {what} is zero"


def test_every_kernel_lowers_for_cuda():
    """Qwen3.6-27B's GDN (48 value heads, dk = dv = 128) over 1000 tokens in chunks of 64: the three forward and
    three backward kernels lower to Triton custom calls for a GPU, traced on this CPU host, each module valid."""
    T, H, dk, dv = 1000, 48, 128, 128
    shape = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)

    def grads(*args):
        def loss(*args):
            o, state = flash_gated_delta.gated_delta_rule(*args, chunk_size=64, interpret=False)
            return jnp.sum(o) + jnp.sum(state)
        return jax.grad(loss, argnums=tuple(range(6)))(*args)

    calls = triton_calls(jax.jit(grads).trace(shape(T, H, dk), shape(T, H, dk), shape(T, H, dv), shape(T, H),
                                              shape(T, H), shape(H, dk, dv)).lower(lowering_platforms=("cuda",)))
    assert [call.name for call in calls] == [f"gated_delta_{name}" for name in (
        "chunk_local", "state_pass", "output", "output_backward", "state_backward", "chunk_local_backward")]
