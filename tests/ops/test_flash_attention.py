"""The Pallas flash-attention kernels (ops/flash_attention.py, interpret mode on CPU) against the XLA path of
ops/attention.py and a dense softmax: outputs, log-sum-exp and the gradients of q, k, v through both (a loss that
reads the LSE, as a merge of partial results does); the whole model's GRPO gradient with kernels="pallas"; and
every kernel lowered for CUDA on this CPU host (Triton's block-shape rules, which interpretation does not check)."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longstraw_jax import models
from longstraw_jax.ops import attention, flash_attention, kernels
from longstraw_jax.ops.attention import MASKED
from tests.helpers import triton_calls
from tests.ops.pallas_checks import assert_model_gradient_matches_xla, outputs_and_grads, pallas_grids


@dataclasses.dataclass(frozen=True)
class Case:
    """One row of the table: T queries over S keys (per layer) of a cache with `lead` leading axes."""

    T: int
    S: int
    Hq: int = 4
    Hkv: int = 2
    D: int = 32
    Dv: int | None = None
    causal: bool = True
    lead: tuple = ()
    index: tuple = ()
    k_offset: int = 0
    kv_length: int | None = None
    left_pad: int | None = None
    kv_positions: bool = False  # keys' positions from an array (a sharded cache in stored order), reversed here
    dtype: str = "float32"


CASES = {
    "prompt chunk, causal over itself": Case(T=64, S=64),
    "non-multiples of the blocks": Case(T=37, S=70, k_offset=5),
    "one decoded token over a cache": Case(T=1, S=83, causal=False, kv_length=61),
    # one query row: also ops/attention's heads_as_stored products (every head by every head, no key transposes)
    "one decoded token, GQA 3:1, head dims 24 / 20, stacked cache, left pads": Case(
        T=1, S=70, Hq=6, Hkv=2, D=24, Dv=20, lead=(2,), index=(1,), causal=False, kv_length=50, left_pad=9),
    "one decoded token, MHA, bfloat16": Case(T=1, S=40, Hq=3, Hkv=3, causal=False, dtype="bfloat16"),
    "fewer keys than a tile": Case(T=5, S=3, k_offset=2),
    "GQA 3:1, head dims 24 / 20 (padded)": Case(T=20, S=40, Hq=6, Hkv=2, D=24, Dv=20),
    "MHA, head dim 64": Case(T=24, S=130, Hq=2, Hkv=2, D=64),
    "stacked cache, kv_index, kv_length": Case(T=20, S=130, lead=(2, 3), index=(1, 2), causal=False, kv_length=100),
    "left pads": Case(T=30, S=90, k_offset=0, left_pad=17),
    "left pads by kv_positions": Case(T=20, S=50, left_pad=15, kv_positions=True, causal=False),
    "queries behind the keys (ring: nothing visible)": Case(T=16, S=32, k_offset=1000),
    "bfloat16": Case(T=40, S=100, dtype="bfloat16"),
}


def _inputs(case: Case, seed=0):
    rng = np.random.default_rng(seed)
    dv = case.Dv or case.D
    dtype = jnp.dtype(case.dtype)
    q = jnp.asarray(rng.normal(size=(case.T, case.Hq, case.D)), dtype)
    k = jnp.asarray(rng.normal(size=case.lead + (case.S, case.Hkv, case.D)), dtype)
    v = jnp.asarray(rng.normal(size=case.lead + (case.S, case.Hkv, dv)), dtype)
    # queries are the last T positions of a run of S keys starting at k_offset (a prompt chunk after its cache)
    q_positions = jnp.arange(case.T, dtype=jnp.int32) + max(case.S - case.T, 0) + min(case.k_offset, 100)
    kv_positions = jnp.arange(case.S, dtype=jnp.int32)[::-1] + case.k_offset if case.kv_positions else None
    options = dict(q_positions=q_positions, k_offset=case.k_offset, scale=case.D**-0.5, causal=case.causal,
                   kv_length=case.kv_length, kv_index=case.index, left_pad=case.left_pad, kv_positions=kv_positions)
    return (q, k, v), options


def _dense(q, k, v, *, q_positions, k_offset, scale, causal, kv_length=None, kv_index=(), left_pad=None,
           kv_positions=None, block_size=None):
    """Naive softmax over the whole [T, S] score matrix, float32."""
    k, v = k[kv_index].astype(jnp.float32), v[kv_index].astype(jnp.float32)
    seq_len, kv_heads = k.shape[0], k.shape[1]
    rep = q.shape[1] // kv_heads
    idx = jnp.arange(seq_len)
    visible = (idx < (seq_len if kv_length is None else kv_length))[None, :] & jnp.ones((q.shape[0], 1), bool)
    if causal:
        visible &= (k_offset + idx)[None, :] <= q_positions[:, None]
    if left_pad is not None:
        key_positions = k_offset + idx if kv_positions is None else kv_positions
        visible &= (key_positions >= left_pad)[None, :]
    s = jnp.einsum("thd,shd->hts", q.astype(jnp.float32), jnp.repeat(k, rep, axis=1)) * scale
    s = jnp.where(visible[None], s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    seen = jnp.isfinite(lse)
    p = jnp.where(seen[..., None], jnp.exp(s - jnp.where(seen, lse, 0.0)[..., None]), 0.0)
    out = jnp.einsum("hts,shd->thd", p, jnp.repeat(v, rep, axis=1))
    return attention.Attended(out, jnp.where(seen, lse, MASKED).T)


@pytest.mark.parametrize("name", list(CASES))
def test_kernels_match_xla_and_dense(name):
    case = CASES[name]
    args, options = _inputs(case)
    xla = outputs_and_grads(functools.partial(attention.attend, block_size=16), args, options)
    pallas = outputs_and_grads(flash_attention.attend, args, options)
    dense = outputs_and_grads(_dense, args, options)
    # bf16: matmul inputs (p, ds) are rounded to bf16 in the kernels, as in every flash attention; XLA keeps f32
    atol = 2e-5 if case.dtype == "float32" else 2e-2
    for what, a, b, c in zip(("out", "lse", "dq", "dk", "dv"), pallas, xla, dense):
        scale = max(1.0, float(jnp.max(jnp.abs(c))))
        np.testing.assert_allclose(a, b, atol=atol * scale, rtol=0, err_msg=f"{name}: {what} vs XLA")
        np.testing.assert_allclose(a, c, atol=atol * scale, rtol=0, err_msg=f"{name}: {what} vs dense")
    assert float(jnp.max(jnp.abs(pallas[3]))) > 0 or name.startswith("queries behind")
    if case.T == 1:  # decoding's form of the XLA path
        stored = outputs_and_grads(functools.partial(attention.attend, block_size=16, heads_as_stored=True), args,
                                   options)
        for what, a, c in zip(("out", "lse", "dq", "dk", "dv"), stored, dense):
            scale = max(1.0, float(jnp.max(jnp.abs(c))))
            np.testing.assert_allclose(a, c, atol=atol * scale, rtol=0, err_msg=f"{name}: {what}, heads as stored")


def test_tiles_set_the_grids_not_the_result():
    """Each kernel's launch shape (`FlashTiles`) is its own: a forward in query blocks of 16 over key steps of 32, dQ
    in blocks of 64 (the queries padded to a multiple of every kernel's block), dK / dV in key blocks of 16 stepping
    32 queries at a time; the grids show it, and outputs, LSE and gradients are the default tiles' and the dense
    softmax's."""
    from longstraw_jax.ops.flash_attention import FlashTiles, KernelTiles

    case = CASES["non-multiples of the blocks"]  # T 37, S 70
    args, options = _inputs(case)
    tiles = FlashTiles(forward=KernelTiles(16, 32), dq=KernelTiles(64, 16, num_warps=2),
                       dkv=KernelTiles(32, 16, num_warps=4, num_stages=3))
    tiled = functools.partial(flash_attention.attend, tiles=tiles)

    def grads(attend):
        return jax.grad(lambda q, k, v: jnp.sum(jnp.sin(attend(q, k, v, **options).out)), argnums=(0, 1, 2))

    grids = pallas_grids(grads(tiled), *args)
    assert grids == {"flash_attention_forward": [(4, case.Hq, 1)], "flash_attention_dq": [(1, case.Hq, 1)],
                     "flash_attention_dkv": [(5, case.Hkv)]}, grids
    default = pallas_grids(grads(flash_attention.attend), *args)
    # the default: 37 queries < a block of 64, so a key/value head's 2 query heads are rows of one call (74 rows)
    assert default["flash_attention_forward"] == [(2, case.Hkv, 1)]
    assert default["flash_attention_dkv"] == [(2, case.Hkv)]
    got = outputs_and_grads(tiled, args, options)
    for what, a, b, c in zip(("out", "lse", "dq", "dk", "dv"), got, outputs_and_grads(flash_attention.attend, args,
                                                                                       options),
                             outputs_and_grads(_dense, args, options)):
        scale = max(1.0, float(jnp.max(jnp.abs(c))))
        np.testing.assert_allclose(a, b, atol=2e-5 * scale, rtol=0, err_msg=f"{what} vs the default tiles")
        np.testing.assert_allclose(a, c, atol=2e-5 * scale, rtol=0, err_msg=f"{what} vs dense")


SPLIT_CASES = {  # few query rows over many keys: the forward splits each row block's keys (flash-decoding)
    "one decoded token, GQA 3:1, left pads, kv_length: the last splits see nothing": Case(
        T=1, S=700, Hq=6, Hkv=2, causal=False, kv_length=500, left_pad=30),
    "8 causal queries at the end of a long cache": Case(T=8, S=600),
    "left pads by kv_positions": Case(T=1, S=500, causal=False, left_pad=40, kv_positions=True),
    "queries behind the keys: no split sees a key": Case(T=16, S=600, k_offset=1000),
}


@pytest.mark.parametrize("name", list(SPLIT_CASES))
def test_split_keys_merge_to_the_whole(name):
    """With a grid of fewer programs than `FlashTiles.min_programs` each row block's keys are split over more
    programs (the grid's third axis: `key_splits`, parts of >= MIN_SPLIT_BLOCKS key blocks): the forward's partial
    out / lse merge by log-sum-exp, dQ's partial sums add; out, LSE and gradients are the dense softmax's and the
    unsplit kernels' (min_programs 1), a query that sees no key in any part stays out 0, lse MASKED; under
    `jax.vmap` over branches sharing the cache the folded forward splits the same way."""
    from longstraw_jax.ops.flash_attention import MIN_SPLIT_BLOCKS, FlashTiles, KernelTiles, key_splits

    case = SPLIT_CASES[name]
    args, options = _inputs(case)
    tiles = FlashTiles(forward=KernelTiles(64, 16))
    split = functools.partial(flash_attention.attend, tiles=tiles)
    whole = functools.partial(flash_attention.attend, tiles=dataclasses.replace(tiles, min_programs=1))
    call = lambda attend: lambda q, k, v: attend(q, k, v, **options).out
    grads = lambda attend: jax.grad(lambda q, k, v: jnp.sum(call(attend)(q, k, v)), argnums=(0, 1, 2))
    grids = pallas_grids(grads(split), *args)
    key_blocks = -(-case.S // 16)
    (rows, heads, parts), = grids["flash_attention_forward"]
    want_parts, per_part = key_splits(rows * heads, key_blocks, 128)
    assert parts == want_parts > 1 and per_part >= MIN_SPLIT_BLOCKS and (parts - 1) * per_part < key_blocks
    (dq_rows, dq_heads, dq_parts), = grids["flash_attention_dq"]  # dQ's default key blocks of 64: 8 to 11 blocks
    assert dq_parts == key_splits(dq_rows * dq_heads, -(-case.S // 64), 128)[0] == 2, grids
    assert {kernel: [g[2:] for g in found] for kernel, found in pallas_grids(grads(whole), *args).items()} == {
        "flash_attention_forward": [(1,)], "flash_attention_dq": [(1,)], "flash_attention_dkv": [()]}
    got, unsplit, dense = (outputs_and_grads(f, args, options) for f in (split, whole, _dense))
    for what, a, b, c in zip(("out", "lse", "dq", "dk", "dv"), got, unsplit, dense):
        scale = max(1.0, float(jnp.max(jnp.abs(c))))
        np.testing.assert_allclose(a, b, atol=2e-5 * scale, rtol=0, err_msg=f"{name}: {what} vs unsplit")
        np.testing.assert_allclose(a, c, atol=2e-5 * scale, rtol=0, err_msg=f"{name}: {what} vs dense")
    if name.startswith("queries behind"):
        assert np.all(np.asarray(got[1]) == MASKED) and not np.any(np.asarray(got[0]))
    if case.T == 1:  # 4 branches' tokens over the shared cache: one folded call, split the same way
        q, k, v = args
        qs = jnp.stack([q * (b + 1) for b in range(4)])
        together = jax.vmap(call(split), in_axes=(0, None, None))
        (_, _, folded_parts), = pallas_grids(together, qs, k, v)["flash_attention_forward"]
        assert folded_parts > 1
        np.testing.assert_allclose(jax.jit(together)(qs, k, v), jax.vmap(call(whole), in_axes=(0, None, None))(
            qs, k, v), atol=2e-5)


def test_bad_min_programs_name_the_field():
    from longstraw_jax.ops.flash_attention import FlashTiles

    with pytest.raises(ValueError, match="FlashTiles.min_programs=0 must be an int >= 1"):
        FlashTiles(min_programs=0)


@pytest.mark.parametrize("field,value,bound", [("block_q", 48, "power of two >= 16"), ("block_k", 8, "power of two"),
                                               ("num_warps", 3, "power of two <= 16"), ("num_stages", 0, ">= 1")])
def test_bad_tiles_name_the_field(field, value, bound):
    from longstraw_jax.ops.flash_attention import KernelTiles

    with pytest.raises(ValueError, match=f"KernelTiles.{field}={value}.*{bound}"):
        KernelTiles(**{field: value})


def test_branches_over_one_cache_read_it_once():
    """Decoding: N branches' query rows over one shared cache (`jax.vmap` over q, the cache unbatched) run as one
    forward call whose programs each read a key/value head's keys once for every branch and every query head that
    reads them (rows = N x T x rep, one row block), not one grid per branch and query head; out, LSE and gradients
    as one call per branch. A cache per branch keeps a grid per branch."""
    case = Case(T=1, S=70, Hq=6, Hkv=2, D=24, Dv=20, lead=(2,), index=(1,), causal=False, kv_length=50, left_pad=9)
    (q, k, v), options = _inputs(case)
    branches = 4
    qs = jnp.asarray(np.random.default_rng(1).normal(size=(branches,) + q.shape), q.dtype)
    positions = options.pop("q_positions")
    call = lambda q, k, v, q_positions: flash_attention.attend(q, k, v, q_positions=q_positions, **options)
    # one branch: the 3 query heads of a key/value head are rows of one tile (a program per key/value head)
    assert pallas_grids(call, q, k, v, positions) == {"flash_attention_forward": [(1, case.Hkv, 1)]}
    together = jax.vmap(call, in_axes=(0, None, None, None))
    grids = pallas_grids(together, qs, k, v, positions)
    assert grids == {"flash_attention_forward": [(1, case.Hkv, 1)]}, grids  # 4 x 1 x 3 rows: one block per head
    got = jax.jit(together)(qs, k, v, positions)
    for b in range(branches):
        want = _dense(qs[b], k, v, q_positions=positions, **options)
        np.testing.assert_allclose(got.out[b], want.out, atol=2e-5)
        np.testing.assert_allclose(got.lse[b], want.lse, atol=2e-5)
    # gradients: per branch (vmap of grad) and of the branches' summed loss (the cache's cotangent summed)
    loss = lambda q, k, v: jnp.sum(jnp.sin(call(q, k, v, positions).out)) + jnp.sum(call(q, k, v, positions).lse)
    dense_loss = lambda q, k, v: (jnp.sum(jnp.sin(_dense(q, k, v, q_positions=positions, **options).out))
                                  + jnp.sum(_dense(q, k, v, q_positions=positions, **options).lse))
    got = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2)), in_axes=(0, None, None)))(qs, k, v)
    want = jax.vmap(jax.grad(dense_loss, argnums=(0, 1, 2)), in_axes=(0, None, None))(qs, k, v)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, atol=5e-5)
    summed = lambda f: jax.grad(lambda q, k, v: jnp.sum(jax.vmap(f, in_axes=(0, None, None))(q, k, v)), (0, 1, 2))
    for a, b in zip(jax.jit(summed(loss))(qs, k, v), summed(dense_loss)(qs, k, v)):
        np.testing.assert_allclose(a, b, atol=5e-5)
    # per-branch caches (a branch's own tail): a grid per branch, as before
    ks, vs = jnp.stack([k] * branches), jnp.stack([v * (b + 1) for b in range(branches)])
    own = jax.vmap(call, in_axes=(0, 0, 0, None))
    assert pallas_grids(own, qs, ks, vs, positions)["flash_attention_forward"][0] != (1, case.Hkv, 1)
    got = jax.jit(own)(qs, ks, vs, positions)
    for b in range(branches):
        np.testing.assert_allclose(got.out[b], _dense(qs[b], ks[b], vs[b], q_positions=positions, **options).out,
                                   atol=2e-5)


def test_partials_merge_exactly_under_autodiff():
    """Attention over a cache and over new keys, merged by log-sum-exp (how every reader combines parts): its
    gradient through both kernels' LSE equals dense attention over the concatenation."""
    args, options = _inputs(Case(T=24, S=80, causal=False))
    q, k, v = args
    positions = options["q_positions"] + 200

    def merged(fn, q, k, v):
        cached = fn(q, k[:50], v[:50], q_positions=positions, k_offset=0, scale=0.2, causal=False)
        new = fn(q, k[50:], v[50:], q_positions=positions, k_offset=50, scale=0.2, causal=False)
        return jnp.sum(jnp.sin(attention.merge(cached, new).out))

    whole = lambda q, k, v: jnp.sum(jnp.sin(_dense(q, k, v, q_positions=positions, k_offset=0, scale=0.2,
                                                   causal=False).out))
    want = jax.grad(whole, argnums=(0, 1, 2))(q, k, v)
    got = jax.jit(jax.grad(functools.partial(merged, flash_attention.attend), argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, atol=2e-5)


def test_an_empty_cache_launches_no_kernel():
    """No keys at all (S = 0: a forward from the start reads an empty cache) gives what the XLA path gives, out 0
    and LSE MASKED, without a pallas_call (a 0-row Triton block); merged with the new keys it is their attention."""
    args, options = _inputs(Case(T=5, S=12, Hq=4, Hkv=2, causal=True))
    q, k, v = args
    empty = lambda q: flash_attention.attend(q, k[:0], v[:0], **options)
    assert pallas_grids(empty, q) == {}
    got, want = empty(q), attention.attend(q, k[:0], v[:0], **options)
    np.testing.assert_array_equal(got.out, want.out)
    np.testing.assert_array_equal(got.lse, want.lse)
    assert np.all(np.asarray(got.lse) == MASKED) and not np.any(np.asarray(got.out))
    new = flash_attention.attend(q, k, v, **options)
    merged = attention.merge(got, new)
    np.testing.assert_allclose(merged.out, new.out, atol=1e-6)
    np.testing.assert_allclose(merged.lse, new.lse, atol=1e-6)


@pytest.mark.parametrize("dtype,T,S,Hq,Hkv,D,lead", [
    ("bfloat16", 300, 1000, 24, 4, 256, ()),  # Qwen3.6-27B's attention: a prompt chunk over itself
    ("bfloat16", 8, 1000, 24, 4, 256, (3, 2)),  # G decoded tokens over a stacked prompt cache
    ("float32", 37, 70, 4, 2, 24, ()),  # a tiny model's head dim (padded to 32)
])
def test_every_kernel_lowers_for_cuda(dtype, T, S, Hq, Hkv, D, lead):
    """The forward, dQ and dK/dV kernels lower to Triton custom calls for a GPU, traced on this CPU host, each
    kernel's module valid (MLIR's verifier: what XLA's GPU compiler runs first)."""
    q = jax.ShapeDtypeStruct((T, Hq, D), jnp.dtype(dtype))
    kv = jax.ShapeDtypeStruct(lead + (S, Hkv, D), jnp.dtype(dtype))
    index = tuple(n - 1 for n in lead)

    def grads(q, k, v, q_positions):
        def loss(q, k, v):
            r = flash_attention.attend(q, k, v, q_positions=q_positions, k_offset=0, scale=D**-0.5, causal=True,
                                       kv_index=index, left_pad=3, interpret=False)
            return jnp.sum(r.out) + jnp.sum(r.lse)
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    lowered = jax.jit(grads).trace(q, kv, kv, jax.ShapeDtypeStruct((T,), jnp.int32)).lower(
        lowering_platforms=("cuda",))
    calls = triton_calls(lowered)
    assert [call.name for call in calls] == ["flash_attention_forward", "flash_attention_dq", "flash_attention_dkv"]


def test_decoding_forms_lower_for_cuda():
    """A decode step of 8 branches over one stacked Qwen3.6-27B cache (vmapped, the forward folded: 8 x 6 packed rows
    in one call, its keys split over programs; the backward a grid per branch) compiles to Triton custom calls for a
    GPU on this CPU host."""
    q = jax.ShapeDtypeStruct((8, 1, 24, 256), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((3, 2, 1000, 4, 256), jnp.bfloat16)

    def loss(q, k, v):
        one = lambda q: flash_attention.attend(q, k, v, q_positions=jnp.array([999], jnp.int32), k_offset=0,
                                               scale=0.0625, causal=False, kv_index=(2, 1), left_pad=3,
                                               kv_length=900, interpret=False)
        r = jax.vmap(one)(q)
        return jnp.sum(r.out) + jnp.sum(r.lse)

    calls = triton_calls(jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv).lower(
        lowering_platforms=("cuda",)))
    assert sorted(call.name for call in calls) == ["flash_attention_dkv", "flash_attention_dq",
                                                    "flash_attention_forward"]
    # 48 rows in one block x 4 key/value heads = 4 programs: the 1000 keys (16 blocks) split in 4 parts of 4 blocks
    forward, = [call for call in calls if call.name == "flash_attention_forward"]
    assert forward.grid == (1, 4, 4), forward


def test_kernel_choice():
    assert kernels.resolve("auto", backend="gpu") == "pallas"
    assert kernels.resolve("auto", backend="cpu") == "xla"
    assert kernels.resolve("pallas", backend="cpu") == "pallas"
    with pytest.raises(ValueError, match="kernels='triton'; allowed: auto, xla, pallas"):
        kernels.resolve("triton")
    with pytest.raises(ValueError, match="kernels='cuda'"):
        models.Qwen36Config.tiny(kernels="cuda")
    args, options = _inputs(Case(T=4, S=4))
    with pytest.raises(ValueError, match="kernels='cudnn'"):
        attention.attend(*args, **options, kernels="cudnn")


@pytest.mark.slow  # compiles the model engine twice, once with interpreted kernels
def test_model_grpo_gradient_with_pallas_kernels_equals_xla():
    """Exact-mode GRPO gradient of the tiny Qwen3.6 (capture in chunks, replay over the cache, the prompt's
    backward; softmax attention and the chunked GDN): kernels="pallas" (interpreted) == kernels="xla"."""
    assert_model_gradient_matches_xla(models.Qwen36Config.tiny(vocab_size=64, gdn_chunk_size=16,
                                                               attention_block_size=16), 40, 2, 6)
