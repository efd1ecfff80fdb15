"""The Pallas kernels of GLM-5.x's sparse latent attention (ops/flash_mla.py, interpret mode on CPU) against the XLA
path of ops/mla.py and a naive gather + softmax: outputs, log-sum-exp, and the gradients of q, the cache and the new
rows; the whole GLM model's GRPO gradient with kernels="pallas"; and both kernels lowered for CUDA on this host."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longstraw_jax import models
from longstraw_jax.ops import flash_mla, mla
from longstraw_jax.ops.attended import MASKED, Attended
from tests.helpers import triton_calls
from tests.ops.pallas_checks import assert_model_gradient_matches_xla, outputs_and_grads, pallas_grids


@dataclasses.dataclass(frozen=True)
class Case:
    T: int = 10
    H: int = 4
    latent: int = 32
    rope: int = 8
    layers: int = 3
    S: int = 40  # one layer's cache rows (positions < start)
    layer: int = 1
    k: int = 16
    dtype: str = "float32"


CASES = {
    "cache and new rows, ragged slots, padded heads and rope": Case(),
    "no cache (a chunk over itself)": Case(S=0, layers=1, layer=0),
    "one decoded query, more slots than a block": Case(T=1, k=70, S=100),
    "unpadded widths, 16 heads": Case(latent=16, rope=16, H=16),
    "40 heads: the backward's programs take 16 of the 64 padded": Case(H=40, T=6),
    "bfloat16": Case(dtype="bfloat16"),
}


def _inputs(case: Case, seed=0):
    rng = np.random.default_rng(seed)
    dtype = jnp.dtype(case.dtype)
    width = case.latent + case.rope
    q = jnp.asarray(rng.normal(size=(case.T, case.H, width)), dtype)
    cache = jnp.asarray(rng.normal(size=(case.layers, case.S, width)), dtype)
    new = jnp.asarray(rng.normal(size=(case.T, width)), dtype)
    selected = np.full((case.T, case.k), -1, np.int32)
    for t in range(case.T):  # distinct positions among the S cached and the t + 1 causal new ones; some slots unused
        visible = case.S + t + 1
        n = min(visible, case.k if t == 0 else int(rng.integers(0, case.k + 1)))
        selected[t, :n] = rng.choice(visible, size=n, replace=False)
    return (q, cache, new), dict(layer=case.layer, selected=jnp.asarray(selected), start=case.S, scale=0.3,
                                 value_dim=case.latent)


def _naive(q, cache, new, *, layer, selected, start, scale, value_dim, **_):
    """Gather every query's rows, softmax over its valid slots, float32."""
    rows = jnp.concatenate([cache[layer], new]).astype(jnp.float32)[jnp.clip(selected, 0)]  # [T, k, Dk]
    s = jnp.einsum("thd,tkd->thk", q.astype(jnp.float32), rows) * scale
    s = jnp.where((selected >= 0)[:, None, :], s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    seen = jnp.isfinite(lse)
    p = jnp.where(seen[..., None], jnp.exp(s - jnp.where(seen, lse, 0.0)[..., None]), 0.0)
    return Attended(jnp.einsum("thk,tkd->thd", p, rows[..., :value_dim]), jnp.where(seen, lse, MASKED))


def _call(kernels):
    def fn(q, cache, new, *, layer, selected, start, scale, value_dim):
        return mla.sparse_latent_attention_partial(q, cache, layer, new, selected, start, scale=scale,
                                                   value_dim=value_dim, block_size=4, kernels=kernels)
    return fn


@pytest.mark.parametrize("name", list(CASES))
def test_kernels_match_xla_and_naive(name):
    case = CASES[name]
    args, options = _inputs(case)
    pallas, xla, naive = (outputs_and_grads(fn, args, options) for fn in (_call("pallas"), _call("xla"), _naive))
    atol = 2e-5 if case.dtype == "float32" else 2e-2
    for what, a, b, c in zip(("out", "lse", "dq", "d_cache", "d_new"), pallas, xla, naive):
        if not a.size:
            continue
        scale = max(1.0, float(jnp.max(jnp.abs(c))))
        np.testing.assert_allclose(a, b, atol=atol * scale, rtol=0, err_msg=f"{name}: {what} vs XLA")
        np.testing.assert_allclose(a, c, atol=atol * scale, rtol=0, err_msg=f"{name}: {what} vs naive")
    assert float(jnp.max(jnp.abs(pallas[4]))) > 0  # the new rows' cotangent is reached


def test_few_queries_split_their_slots():
    """Two queries of 512 selected slots (32 blocks of 16): fewer programs than `min_programs`, so each query's slots
    are split over 8 forward and 8 backward programs (grids (2, 1, 8): query, head block, part): partial out / lse
    merge by log-sum-exp, partial dq add; out, LSE and gradients are the unsplit kernels' (min_programs 1, grids
    (2, 1, 1)), the XLA path's and the naive softmax's."""
    case = Case(T=2, k=512, S=600)
    args, options = _inputs(case)

    def attend(min_programs):
        def fn(q, cache, new, *, layer, selected, start, scale, value_dim):
            return flash_mla.sparse_latent_attention_partial(q, cache, layer, new, selected, start, scale=scale,
                                                             value_dim=value_dim, min_programs=min_programs)
        return fn

    split, whole = attend(128), attend(1)
    grads = lambda fn: jax.grad(lambda *a: jnp.sum(fn(*a, **options).out), argnums=(0, 1, 2))
    for fn, grid in ((split, (2, 1, 8)), (whole, (2, 1, 1))):
        grids = pallas_grids(grads(fn), *args)
        assert grids["sparse_latent_attention_forward"] == [grid]
        assert grids["sparse_latent_attention_backward"] == [grid]
    got, unsplit, xla, naive = (outputs_and_grads(fn, args, options) for fn in (split, whole, _call("xla"), _naive))
    for what, a, b, c, d in zip(("out", "lse", "dq", "d_cache", "d_new"), got, unsplit, xla, naive):
        scale = max(1.0, float(jnp.max(jnp.abs(d))))
        for other, label in ((b, "unsplit"), (c, "XLA"), (d, "naive")):
            np.testing.assert_allclose(a, other, atol=2e-5 * scale, rtol=0, err_msg=f"{what} vs {label}")


def test_backward_programs_take_blocks_of_heads():
    """The forward's programs hold all of a query's heads (40, padded to 64), the backward's BACKWARD_HEADS of them
    (4 blocks of 16: all 64 at GLM-5.x's widths need more shared memory than an H100 has); the values are checked
    by the "40 heads" case above."""
    args, options = _inputs(CASES["40 heads: the backward's programs take 16 of the 64 padded"])
    loss = lambda *a: jnp.sum(flash_mla.sparse_latent_attention_partial(
        *a[:2], options["layer"], a[2], options["selected"], options["start"], scale=0.3, value_dim=32).out)
    grids = pallas_grids(jax.grad(loss, argnums=(0, 1, 2)), *args)
    assert flash_mla.BACKWARD_HEADS == 16
    assert grids == {"sparse_latent_attention_forward": [(6, 1, 1)], "sparse_latent_attention_backward": [(6, 4, 1)]}


def test_both_kernels_lower_for_cuda():
    """GLM-5.x's shapes (64 heads, latent 512 + rope 64, top-2048, bf16): forward and backward lower to Triton
    custom calls for a GPU, traced on this CPU host, each kernel's module valid."""
    T, H, latent, rope, S, k = 64, 64, 512, 64, 4096, 2048
    shape = lambda *s, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(s, dtype)

    def grads(q, cache, new, selected):
        def loss(q, cache, new):
            r = flash_mla.sparse_latent_attention_partial(q, cache, 2, new, selected, S, scale=0.1,
                                                          value_dim=latent, interpret=False)
            return jnp.sum(r.out) + jnp.sum(r.lse)
        return jax.grad(loss, argnums=(0, 1, 2))(q, cache, new)

    calls = triton_calls(jax.jit(grads).trace(shape(T, H, latent + rope), shape(4, S, latent + rope),
                                              shape(T, latent + rope), shape(T, k, dtype=jnp.int32)).lower(
        lowering_platforms=("cuda",)))
    assert [call.name for call in calls] == ["sparse_latent_attention_forward", "sparse_latent_attention_backward"]


@pytest.mark.slow  # compiles the model engine twice, once with interpreted kernels
def test_model_grpo_gradient_with_pallas_kernels_equals_xla():
    """Exact-mode GRPO gradient of the tiny GLM-5.x (sparsity active: index_topk 16 < the 40-token prompt):
    kernels="pallas" (interpreted) == kernels="xla" up to float32 round-off."""
    assert_model_gradient_matches_xla(models.Glm52Config.tiny(vocab_size=64), 40, 2, 4)
