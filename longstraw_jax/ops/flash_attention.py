"""Flash attention as Pallas kernels for the Triton (GPU) backend: the contract of `ops.attention.attend`.

Same arguments, same result `Attended(out, lse)` (float32 output and log-sum-exp), same masks: causal by
`q_positions` against key positions `k_offset + i` (or `kv_positions[i]` for pads), `kv_length`, left pads; GQA
(query head h reads key/value head h // rep). The log-sum-exp is differentiable, so partial results over disjoint
key sets (a prompt cache and new tokens, the shards of a ring) still merge exactly under autodiff: the backward
takes dO and dLSE and uses delta = rowsum(dO * O) - dLSE.

Three kernels, each over a grid of (row block, head) programs; every tile is [block, D] (powers of two >= 16, what
Triton's `dot` needs), scores and accumulators float32, matmul inputs in the input dtype (bf16 tensor cores):
- forward, one program per (query block, query head, key split): an online softmax over the key blocks a causal
  query block can see (later blocks are never loaded); a grid of fewer programs than `FlashTiles.min_programs`
  (decoding: a few rows over a long cache) splits each block's keys over more programs, whose partial out and
  log-sum-exp merge exactly (`attended.merge_all`; flash-decoding);
- dQ, one program per (query block, query head, key split): the same loop, dq += ds k (split the same way, the
  parts' dq summed: a few response rows over a long prompt in exact mode);
- dK / dV, one program per (key block, key/value head): a loop over the query blocks of each of the rep query
  heads that read it, dk += ds^T q, dv += p^T dO (no atomics: each program owns its rows); a causal query block
  that ends before the key block, and a key block past kv_length, are skipped.
Each kernel's block sizes, warps and pipeline stages are its `KernelTiles` in `FlashTiles` (`attend(tiles=...)`).

Decoding reads each key once per step, not once per branch and query head: with fewer queries than a row block,
the rep query heads of a key/value head become rows of one tile (`_heads_as_rows`: one program per key/value head,
not per query head), and under `jax.vmap` over branches that share the cache (q batched, the cache unbatched) the
forward folds every branch's rows into one call (`_forward_folding`). The backward keeps a grid per branch (the
cache's cotangent is per branch, as `vmap` defines it).

The cache is read in place: k, v [*lead, S, Hkv, D] are viewed as [lead * S, Hkv, D] (a reshape, no copy) and the
kernels load rows `row0 + i` of the layer `kv_index` selects, masked at S (a masked load never reads past the
end, on a GPU or in interpret mode). Queries are padded to a multiple of the query block (position -1: no key
visible, cotangent 0) and head dims that are not a power of two >= 16 are zero-padded (exact: zero channels add
nothing to a score and give zero output channels); production head dims (Qwen3.6: 256) need neither.

On a host without a GPU the kernels run with `interpret=True` (numerics only, slow): the proof on CPU
(tests/ops/test_flash_attention.py) compares them with the XLA path of `ops.attention` and a naive softmax, and
lowers each kernel for CUDA on the CPU host (`lowering_platforms=("cuda",)`), which checks what interpretation
does not (Triton's block-shape rules).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from longstraw_jax.ops.attended import MASKED, Attended, merge_all
from longstraw_jax.ops.dtypes import accum_dtype

MIN_TILE = 16  # Triton's dot needs every dimension >= 16
MIN_SPLIT_BLOCKS = 4  # a forward program whose keys are split (flash-decoding) still loops over at least this many
MIN_PROGRAMS = 128  # a grid with fewer programs splits its keys (`key_splits`): about an H100's 132 SMs
NO_PAD = -(2**30)  # left_pad when there is none: every key position is >= it
# the scalars every kernel reads: [row0 (the layer's first row in the flattened cache), k_offset, kv_length, left_pad]
_ROW0, _K_OFFSET, _KV_LENGTH, _LEFT_PAD = range(4)


@dataclasses.dataclass(frozen=True)
class KernelTiles:
    """One kernel's launch shape: block_q query rows and block_k key rows per tile (powers of two >= 16; a call with
    fewer rows or keys uses the smallest power of two >= 16 that holds them), num_warps (a power of two <= 16; None:
    4 for head dims <= 64, else 8) and num_stages (how many tiles' loads Triton pipelines ahead, >= 1). Numerics do
    not depend on them (up to the order of float sums); speed and whether a kernel fits the GPU's shared memory and
    registers do (`tools/bench_device.py` times candidates on the device)."""

    block_q: int = 64
    block_k: int = 64
    num_warps: int | None = None
    num_stages: int = 2

    def __post_init__(self):
        power_of_two = lambda n, low: isinstance(n, int) and n >= low and not n & (n - 1)
        for name in ("block_q", "block_k"):
            if not power_of_two(getattr(self, name), MIN_TILE):
                raise ValueError(f"KernelTiles.{name}={getattr(self, name)!r} must be a power of two >= {MIN_TILE}")
        if self.num_warps is not None and not (power_of_two(self.num_warps, 1) and self.num_warps <= 16):
            raise ValueError(f"KernelTiles.num_warps={self.num_warps!r} must be None or a power of two <= 16")
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"KernelTiles.num_stages={self.num_stages!r} must be an int >= 1")


@dataclasses.dataclass(frozen=True)
class FlashTiles:
    """The launch shapes of the three kernels: the forward (rows: a program's query block; keys: its loop step), dQ
    (the same roles) and dK / dV (keys: a program's key block; rows: its loop step over the queries).

    min_programs: while the forward's or dQ's grid (row blocks x heads) has fewer programs than this, each row
    block's keys are split over more programs (up to min_programs in all, each looping over at least
    MIN_SPLIT_BLOCKS key blocks): the forward's partial (out, lse) merged by log-sum-exp (flash-decoding), dQ's
    partial sums added. A decode step's few rows over a long cache (one row block per key/value head: 4 programs for
    Qwen3.6-27B), or exact mode's R response rows over a long prompt in dQ, would otherwise leave most of a GPU's SMs
    idle. 1: never split."""

    forward: KernelTiles = KernelTiles()
    dq: KernelTiles = KernelTiles()
    dkv: KernelTiles = KernelTiles()
    min_programs: int = MIN_PROGRAMS

    def __post_init__(self):
        if not isinstance(self.min_programs, int) or self.min_programs < 1:
            raise ValueError(f"FlashTiles.min_programs={self.min_programs!r} must be an int >= 1")


DEFAULT_TILES = FlashTiles()


def on_gpu() -> bool:
    """Whether the default backend compiles Pallas kernels (else they run in interpret mode)."""
    return jax.default_backend() == "gpu"


def attend(q: jax.Array, k: jax.Array, v: jax.Array, *, q_positions: jax.Array, k_offset, scale: float,
           causal: bool, kv_length=None, kv_index: tuple = (), left_pad=None, kv_positions=None,
           interpret: bool | None = None, tiles: FlashTiles = DEFAULT_TILES) -> Attended:
    """`ops.attention.attend` as flash kernels. q [T, Hq, D]; k [*lead, S, Hkv, D]; v [*lead, S, Hkv, Dv];
    `kv_index` selects the leading entries. interpret: None = interpret unless the default backend is a GPU. tiles:
    the kernels' launch shapes (`FlashTiles`).
    Returns out [T, Hq, Dv] and lse [T, Hq], float32. No keys at all (S = 0: an empty cache, e.g. a forward from the
    start) launches no kernel: out 0 and lse MASKED, as for a query that sees no key (a 0-row block has no defined
    strides in Pallas's Triton lowering, which divides by the block's size)."""
    num_q, num_heads, _ = q.shape
    lead, (seq_len, kv_heads, value_dim) = k.shape[:-3], v.shape[-3:]
    if num_heads % kv_heads:
        raise ValueError(f"attend: {num_heads} query heads are not a multiple of {kv_heads} key/value heads")
    if seq_len == 0:
        acc = accum_dtype(q.dtype)
        return Attended(jnp.zeros((num_q, num_heads, value_dim), acc), jnp.full((num_q, num_heads), MASKED, acc))
    if interpret is None:
        interpret = not on_gpu()
    rep = num_heads // kv_heads
    if rep > 1 and num_q < tiles.forward.block_q:  # few queries (decoding): a key/value head's rep heads as rows
        packed = attend(_heads_as_rows(q, rep), k, v, q_positions=jnp.repeat(q_positions, rep), k_offset=k_offset,
                        scale=scale, causal=causal, kv_length=kv_length, kv_index=kv_index, left_pad=left_pad,
                        kv_positions=kv_positions, interpret=interpret, tiles=tiles)
        return Attended(_rows_as_heads(packed.out, rep), _rows_as_heads(packed.lse, rep))
    if len(kv_index) != len(lead):
        raise ValueError(f"attend: kv_index selects {len(kv_index)} of the cache's {len(lead)} leading axes")
    rows = math.prod(lead) * seq_len
    k_flat, v_flat = k.reshape((rows,) + k.shape[-2:]), v.reshape((rows,) + v.shape[-2:])
    row0 = jnp.int32(0)
    for i, size in zip(kv_index, lead):  # row-major flat index of the selected layer, times S
        row0 = row0 * size + jnp.asarray(i, jnp.int32)
    row0 = row0 * (seq_len if lead else 0)
    kv_length = seq_len if kv_length is None else kv_length
    scalars = jnp.stack([row0, jnp.asarray(k_offset, jnp.int32), jnp.asarray(kv_length, jnp.int32),
                         jnp.asarray(NO_PAD if left_pad is None else left_pad, jnp.int32)])
    kv_positions = None if left_pad is None or kv_positions is None else kv_positions.astype(jnp.int32)

    static = _Static(scale=scale, causal=causal, seq_len=seq_len, tiles=tiles, interpret=interpret, num_q=num_q)
    padded_q = static.padded_q
    q = jnp.pad(_pad_dim(q), ((0, padded_q - num_q), (0, 0), (0, 0)))
    q_positions = jnp.pad(q_positions.astype(jnp.int32), (0, padded_q - num_q), constant_values=-1)
    out, lse = _flash(static, q, _pad_dim(k_flat), _pad_dim(v_flat), q_positions, scalars, kv_positions)
    return Attended(out[:num_q, :, :value_dim], lse[:num_q])


def _heads_as_rows(q: jax.Array, rep: int) -> jax.Array:
    """q [T, Hkv * rep, D] -> [T * rep, Hkv, D]: row t * rep + g of head h is query head h * rep + g of token t (the
    heads that read key/value head h), so one program per key/value head reads its keys once for all of them."""
    t, kv_heads = q.shape[0], q.shape[1] // rep
    grouped = jnp.swapaxes(q.reshape((t, kv_heads, rep) + q.shape[2:]), 1, 2)  # [T, rep, Hkv, D]
    return grouped.reshape((t * rep, kv_heads) + q.shape[2:])


def _rows_as_heads(x: jax.Array, rep: int) -> jax.Array:
    """The inverse of `_heads_as_rows` for a result [T * rep, Hkv, ...] -> [T, Hkv * rep, ...]."""
    t, kv_heads = x.shape[0] // rep, x.shape[1]
    grouped = jnp.swapaxes(x.reshape((t, rep, kv_heads) + x.shape[2:]), 1, 2)  # [T, Hkv, rep, ...]
    return grouped.reshape((t, kv_heads * rep) + x.shape[2:])


def _tile(n: int) -> int:
    """The smallest power of two >= max(n, MIN_TILE)."""
    return max(MIN_TILE, 1 << max(0, n - 1).bit_length())


def _pad_dim(x: jax.Array) -> jax.Array:
    """Zero-pad the last (head) axis to a tile size; no copy when it already is one."""
    pad = _tile(x.shape[-1]) - x.shape[-1]
    return x if not pad else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])


@dataclasses.dataclass(frozen=True)
class _Static:
    """The static configuration of one call (hashable: a custom_vjp nondiff argument)."""

    scale: float
    causal: bool
    seq_len: int  # S, the keys of one layer
    tiles: FlashTiles  # as asked; `kernel` fits them to the call
    interpret: bool
    num_q: int  # the real query rows (the rest, to `padded_q`, are padding)

    def kernel(self, name: str) -> KernelTiles:
        """The tiles of kernel `name` ("forward", "dq", "dkv") for this call: blocks no larger than the smallest
        power of two >= 16 that holds its query rows / keys."""
        tiles = getattr(self.tiles, name)
        return dataclasses.replace(tiles, block_q=min(tiles.block_q, _tile(self.num_q)),
                                   block_k=min(tiles.block_k, _tile(self.seq_len)))

    @property
    def padded_q(self) -> int:
        """The query rows every kernel sees: num_q rounded up to a multiple of each kernel's block_q (powers of
        two: of the largest)."""
        block = max(self.kernel(name).block_q for name in ("forward", "dq", "dkv"))
        return -(-self.num_q // block) * block


# ----- masks, shared by the kernels -----


def _read_scalars(ref):
    """The four scalars, each loaded on its own (Triton cannot slice a loaded vector)."""
    return tuple(ref[i] for i in range(4))


def _key_mask(scalars, kv_positions_ref, start, block_k, seq_len):
    """[block_k] bool: keys start..start+block_k-1 that exist, are < kv_length and are not left pads."""
    idx = start + jnp.arange(block_k)
    ok = (idx < seq_len) & (idx < scalars[_KV_LENGTH])
    if kv_positions_ref is None:
        positions = scalars[_K_OFFSET] + idx
    else:
        positions = plt.load(kv_positions_ref.at[pl.ds(start, block_k)], mask=idx < seq_len, other=0)
    return ok & (positions >= scalars[_LEFT_PAD])


def _visible(key_ok, q_positions, scalars, start, block_k, causal):
    """[block_q, block_k] visibility of one tile."""
    mask = key_ok[None, :]
    if causal:
        mask = mask & ((scalars[_K_OFFSET] + start + jnp.arange(block_k))[None, :] <= q_positions[:, None])
    return mask


def _key_trips(scalars, q_positions, static, block_k):
    """Key blocks (of block_k) a query block can see: up to kv_length, and for causal up to its last position."""
    limit = jnp.minimum(scalars[_KV_LENGTH], static.seq_len)
    if static.causal:
        limit = jnp.minimum(limit, jnp.max(q_positions) - scalars[_K_OFFSET] + 1)
    return (jnp.maximum(limit, 0) + block_k - 1) // block_k


def _load_rows(ref, scalars, start, block_k, seq_len):
    """Rows start..start+block_k-1 of the selected layer: [block_k, D], zeros past S."""
    idx = start + jnp.arange(block_k)
    return plt.load(ref.at[pl.ds(scalars[_ROW0] + start, block_k), :], mask=(idx < seq_len)[:, None], other=0.0)


# ----- kernels -----


def _forward_kernel(scalars_ref, q_positions_ref, q_ref, k_ref, v_ref, *rest, static, has_kv_positions,
                    split_blocks):
    """One (query block, head, key split) program: the online softmax over key blocks [split * split_blocks, ...),
    those the block can see; out and lse of that part (0 and MASKED when it sees none)."""
    kv_positions_ref = rest[0] if has_kv_positions else None
    out_ref, lse_ref = rest[-2:]
    scalars, q_positions, q = _read_scalars(scalars_ref), q_positions_ref[...], q_ref[...]
    block_q, block_k = q.shape[0], static.kernel("forward").block_k
    acc = accum_dtype(q.dtype)

    def body(j, carry):
        m, denom, numer = carry
        start = j * block_k
        k_blk = _load_rows(k_ref, scalars, start, block_k, static.seq_len)
        v_blk = _load_rows(v_ref, scalars, start, block_k, static.seq_len)
        key_ok = _key_mask(scalars, kv_positions_ref, start, block_k, static.seq_len)
        visible = _visible(key_ok, q_positions, scalars, start, block_k, static.causal)
        s = jnp.where(visible, plt.dot(q, k_blk, trans_b=True).astype(acc) * static.scale, MASKED)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.where(visible, jnp.exp(s - m_new[:, None]), 0.0)
        alpha = jnp.exp(m - m_new)
        numer = numer * alpha[:, None] + plt.dot(p.astype(v_blk.dtype), v_blk).astype(acc)
        return m_new, denom * alpha + jnp.sum(p, axis=1), numer

    init = (jnp.full((block_q,), MASKED, acc), jnp.zeros((block_q,), acc), jnp.zeros((block_q, v_ref.shape[-1]), acc))
    m, denom, numer = jax.lax.fori_loop(*split_range(2, split_blocks, _key_trips(scalars, q_positions, static,
                                                                                  block_k)), body, init)
    seen = denom > 0
    out_ref[...] = jnp.where(seen[:, None], numer / jnp.where(seen, denom, 1.0)[:, None], 0.0).astype(out_ref.dtype)
    lse_ref[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, denom, 1.0)), MASKED).astype(lse_ref.dtype)


def _probabilities(q, k_blk, lse, visible, scale):
    """p = exp(s - lse) of one tile, recomputed from the saved log-sum-exp: [block_q, block_k] float32."""
    s = plt.dot(q, k_blk, trans_b=True).astype(lse.dtype) * scale
    return jnp.where(visible, jnp.exp(s - lse[:, None]), 0.0)


def _dq_kernel(scalars_ref, q_positions_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest, static,
               has_kv_positions, split_blocks):
    kv_positions_ref = rest[0] if has_kv_positions else None
    dq_ref = rest[-1]
    scalars, q_positions, q = _read_scalars(scalars_ref), q_positions_ref[...], q_ref[...]
    do, lse, delta = do_ref[...], lse_ref[...], delta_ref[...]
    block_k = static.kernel("dq").block_k

    def body(j, dq):
        start = j * block_k
        k_blk = _load_rows(k_ref, scalars, start, block_k, static.seq_len)
        v_blk = _load_rows(v_ref, scalars, start, block_k, static.seq_len)
        key_ok = _key_mask(scalars, kv_positions_ref, start, block_k, static.seq_len)
        p = _probabilities(q, k_blk, lse, _visible(key_ok, q_positions, scalars, start, block_k, static.causal),
                           static.scale)
        ds = p * (plt.dot(do, v_blk, trans_b=True).astype(p.dtype) - delta[:, None]) * static.scale
        return dq + plt.dot(ds.astype(k_blk.dtype), k_blk).astype(dq.dtype)

    dq = jax.lax.fori_loop(*split_range(2, split_blocks, _key_trips(scalars, q_positions, static, block_k)), body,
                           jnp.zeros(q.shape, lse.dtype))
    dq_ref[...] = dq.astype(dq_ref.dtype)


def _dkv_kernel(scalars_ref, q_positions_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest, static,
                has_kv_positions, rep):
    kv_positions_ref = rest[0] if has_kv_positions else None
    dk_ref, dv_ref = rest[-2:]
    scalars = _read_scalars(scalars_ref)
    tiles = static.kernel("dkv")
    block_q, block_k = tiles.block_q, tiles.block_k
    start = pl.program_id(0) * block_k
    k_blk = _load_rows(k_ref, scalars, start, block_k, static.seq_len)
    v_blk = _load_rows(v_ref, scalars, start, block_k, static.seq_len)
    key_ok = _key_mask(scalars, kv_positions_ref, start, block_k, static.seq_len)
    acc = accum_dtype(q_ref.dtype)
    dk, dv = jnp.zeros(k_blk.shape, acc), jnp.zeros(v_blk.shape, acc)
    # none past kv_length / S: a product with the block's 0 / 1 max, not a select of two constants (Pallas's Triton
    # lowering typed those as the predicate, i1: a loop bound MLIR's verifier rejects and 16 read as 0; and a max, not
    # any: Triton lowers no reduce_or)
    query_blocks = jnp.max(key_ok.astype(jnp.int32)) * (q_ref.shape[0] // block_q)
    for g in range(rep):  # the query heads that read this key/value head
        def tile(carry, rows, q_positions, g=g):
            dk, dv = carry
            q, do = q_ref[rows, g, :], do_ref[rows, g, :]
            p = _probabilities(q, k_blk, lse_ref[rows, g],
                               _visible(key_ok, q_positions, scalars, start, block_k, static.causal), static.scale)
            dv = dv + plt.dot(p.astype(do.dtype), do, trans_a=True).astype(acc)
            ds = p * (plt.dot(do, v_blk, trans_b=True).astype(acc) - delta_ref[rows, g][:, None]) * static.scale
            return dk + plt.dot(ds.astype(q.dtype), q, trans_a=True).astype(acc), dv

        def body(i, carry, tile=tile):
            rows = pl.ds(i * block_q, block_q)
            q_positions = q_positions_ref[rows]
            if not static.causal:
                return tile(carry, rows, q_positions)
            # a causal query block that ends before this key block sees none of it: skipped
            sees = jnp.max(q_positions) >= scalars[_K_OFFSET] + start
            return jax.lax.cond(sees, lambda c: tile(c, rows, q_positions), lambda c: c, carry)

        dk, dv = jax.lax.fori_loop(0, query_blocks, body, (dk, dv))
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


# ----- pallas_call wrappers and the custom VJP -----


def _compiler_params(tiles: KernelTiles, head_dim: int):
    return plt.CompilerParams(num_warps=tiles.num_warps or (4 if head_dim <= 64 else 8), num_stages=tiles.num_stages)


def _whole(shape):
    """A BlockSpec of the whole array, the same block for every program (rows are then loaded by hand)."""
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def _cache_spec(cache, by_program):
    """The flattened cache [rows, Hkv, D] as one [rows, D] block per key/value head."""
    return pl.BlockSpec((cache.shape[0], None, cache.shape[2]), lambda *ids: (0, by_program(*ids), 0))


def key_splits(programs: int, key_blocks: int, min_programs: int) -> tuple[int, int]:
    """(parts, key blocks per part): how the forward or dQ splits each row block's key blocks. One part when its
    grid already has `min_programs` programs, else enough parts to reach that many, at most one per
    MIN_SPLIT_BLOCKS key blocks, none empty."""
    if programs >= min_programs or key_blocks < 2 * MIN_SPLIT_BLOCKS:
        return 1, key_blocks
    per_part = -(-key_blocks // min(-(-min_programs // programs), key_blocks // MIN_SPLIT_BLOCKS))
    return -(-key_blocks // per_part), per_part


def split_range(axis: int, per_part: int, trips):
    """The blocks [first, last) of this program's part (its index on grid `axis`) among the `trips` it can see."""
    first = pl.program_id(axis) * per_part
    return first, jnp.minimum(trips, first + per_part)


def _forward(static, q, k, v, q_positions, scalars, kv_positions):
    """The forward's pallas_call over a grid of (query block, head, key split) programs; split partials merged."""
    padded_q, num_heads, head_dim = q.shape
    rep = num_heads // k.shape[1]
    acc = accum_dtype(q.dtype)
    extra = () if kv_positions is None else (kv_positions,)
    tiles = static.kernel("forward")
    block_q, value_dim = tiles.block_q, v.shape[-1]
    splits, per_part = key_splits(padded_q // block_q * num_heads, -(-static.seq_len // tiles.block_k),
                                  static.tiles.min_programs)
    out, lse = pl.pallas_call(
        functools.partial(_forward_kernel, static=static, has_kv_positions=kv_positions is not None,
                          split_blocks=per_part),
        out_shape=(jax.ShapeDtypeStruct((splits, padded_q, num_heads, value_dim), acc),
                   jax.ShapeDtypeStruct((splits, padded_q, num_heads), acc)),
        grid=(padded_q // block_q, num_heads, splits),
        in_specs=[_whole(scalars.shape), pl.BlockSpec((block_q,), lambda i, h, s: (i,)),
                  pl.BlockSpec((block_q, None, head_dim), lambda i, h, s: (i, h, 0)),
                  _cache_spec(k, lambda i, h, s: h // rep), _cache_spec(v, lambda i, h, s: h // rep)]
                 + [_whole(x.shape) for x in extra],
        out_specs=(pl.BlockSpec((None, block_q, None, value_dim), lambda i, h, s: (s, i, h, 0)),
                   pl.BlockSpec((None, block_q, None), lambda i, h, s: (s, i, h))),
        compiler_params=_compiler_params(tiles, head_dim), interpret=static.interpret, name="flash_attention_forward",
    )(scalars, q_positions, q, k, v, *extra)
    return (out[0], lse[0]) if splits == 1 else tuple(merge_all(Attended(out, lse)))


def _backward(static, q, k, v, q_positions, scalars, kv_positions, d_out, lse, delta):
    padded_q, num_heads, head_dim = q.shape
    kv_heads, value_dim = k.shape[1], v.shape[-1]
    rep = num_heads // kv_heads
    dq_tiles, dkv_tiles = static.kernel("dq"), static.kernel("dkv")
    block_q, block_k = dq_tiles.block_q, dkv_tiles.block_k
    extra = () if kv_positions is None else (kv_positions,)
    has = kv_positions is not None
    common = (scalars, q_positions, q, k, v, d_out, lse, delta, *extra)
    splits, per_part = key_splits(padded_q // block_q * num_heads, -(-static.seq_len // dq_tiles.block_k),
                                  static.tiles.min_programs)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, static=static, has_kv_positions=has, split_blocks=per_part),
        out_shape=jax.ShapeDtypeStruct((splits,) + q.shape, lse.dtype),
        grid=(padded_q // block_q, num_heads, splits),
        in_specs=[_whole(scalars.shape), pl.BlockSpec((block_q,), lambda i, h, s: (i,)),
                  pl.BlockSpec((block_q, None, head_dim), lambda i, h, s: (i, h, 0)),
                  _cache_spec(k, lambda i, h, s: h // rep), _cache_spec(v, lambda i, h, s: h // rep),
                  pl.BlockSpec((block_q, None, value_dim), lambda i, h, s: (i, h, 0)),
                  pl.BlockSpec((block_q, None), lambda i, h, s: (i, h)),
                  pl.BlockSpec((block_q, None), lambda i, h, s: (i, h))]
                 + [_whole(x.shape) for x in extra],
        out_specs=pl.BlockSpec((None, block_q, None, head_dim), lambda i, h, s: (s, i, h, 0)),
        compiler_params=_compiler_params(dq_tiles, head_dim), interpret=static.interpret, name="flash_attention_dq",
    )(*common)
    dq = dq[0] if splits == 1 else jnp.sum(dq, axis=0)
    key_blocks = -(-static.seq_len // block_k)
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, static=static, has_kv_positions=has, rep=rep),
        out_shape=(jax.ShapeDtypeStruct((key_blocks * block_k, kv_heads, head_dim), lse.dtype),
                   jax.ShapeDtypeStruct((key_blocks * block_k, kv_heads, value_dim), lse.dtype)),
        grid=(key_blocks, kv_heads),
        in_specs=[_whole(scalars.shape), _whole(q_positions.shape),
                  pl.BlockSpec((padded_q, rep, head_dim), lambda j, h: (0, h, 0)),
                  _cache_spec(k, lambda j, h: h), _cache_spec(v, lambda j, h: h),
                  pl.BlockSpec((padded_q, rep, value_dim), lambda j, h: (0, h, 0)),
                  pl.BlockSpec((padded_q, rep), lambda j, h: (0, h)),
                  pl.BlockSpec((padded_q, rep), lambda j, h: (0, h))]
                 + [_whole(x.shape) for x in extra],
        out_specs=(pl.BlockSpec((block_k, None, head_dim), lambda j, h: (j, h, 0)),
                   pl.BlockSpec((block_k, None, value_dim), lambda j, h: (j, h, 0))),
        compiler_params=_compiler_params(dkv_tiles, head_dim), interpret=static.interpret,
        name="flash_attention_dkv",
    )(*common)
    return dq, dk[: static.seq_len], dv[: static.seq_len]


def _forward_folding(static, q, k, v, q_positions, scalars, kv_positions):
    """`_forward`, and under `jax.vmap` with the cache shared (k, v, the scalars and kv_positions unbatched: branches
    decoding over one prompt cache) the N batches' real query rows fold into one call ([N * num_q] rows, padded to a
    new block), so each key block is read once for all N rather than by N grids of programs; its results are put
    back [N, Tp, ...] (padding rows: 0). Otherwise `pallas_call`'s own batching (a grid per batch)."""
    extra = () if kv_positions is None else (kv_positions,)

    def forward(q, k, v, q_positions, scalars, *extra):
        return _forward(static, q, k, v, q_positions, scalars, *(extra or (None,)))

    g = jax.custom_batching.custom_vmap(forward)

    @g.def_vmap
    def rule(axis_size, in_batched, q, k, v, q_positions, scalars, *extra):
        if any(in_batched[1:3]) or in_batched[4] or any(in_batched[5:]):  # per-batch caches: a grid per batch
            axes = tuple(0 if b else None for b in in_batched)
            return jax.vmap(forward, in_axes=axes)(q, k, v, q_positions, scalars, *extra), (True, True)
        if not in_batched[0]:
            q = jnp.broadcast_to(q, (axis_size,) + q.shape)
        if not in_batched[3]:
            q_positions = jnp.broadcast_to(q_positions, (axis_size,) + q_positions.shape)
        num_q, padded = static.num_q, q.shape[1]
        rows = axis_size * num_q
        folded = dataclasses.replace(static, num_q=rows)
        pad = folded.padded_q - rows
        folded_q = jnp.pad(q[:, :num_q].reshape((rows,) + q.shape[2:]), ((0, pad), (0, 0), (0, 0)))
        folded_positions = jnp.pad(q_positions[:, :num_q].reshape(rows), (0, pad), constant_values=-1)
        out, lse = _forward_folding(folded, folded_q, k, v, folded_positions, scalars, *(extra or (None,)))
        unfold = lambda x: jnp.pad(x[:rows].reshape((axis_size, num_q) + x.shape[1:]),
                                   [(0, 0), (0, padded - num_q)] + [(0, 0)] * (x.ndim - 1))
        return (unfold(out), unfold(lse)), (True, True)

    return g(q, k, v, q_positions, scalars, *extra)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(static, q, k, v, q_positions, scalars, kv_positions):
    """q [Tp, Hq, D] (Tp a multiple of block_q); k, v: the flattened cache [rows, Hkv, D]. -> (out [Tp, Hq, Dv],
    lse [Tp, Hq]) float32."""
    return _forward_folding(static, q, k, v, q_positions, scalars, kv_positions)


def _flash_fwd(static, q, k, v, q_positions, scalars, kv_positions):
    out, lse = _forward_folding(static, q, k, v, q_positions, scalars, kv_positions)
    return (out, lse), (q, k, v, q_positions, scalars, kv_positions, out, lse)


def _flash_bwd(static, residuals, cotangents):
    q, k, v, q_positions, scalars, kv_positions, out, lse = residuals
    d_out, d_lse = cotangents
    delta = jnp.sum(d_out * out, axis=-1) - d_lse  # [Tp, Hq]: rowsum(dO * O) - dLSE
    dq, dk, dv = _backward(static, q, k, v, q_positions, scalars, kv_positions, d_out.astype(q.dtype), lse, delta)
    row0 = scalars[_ROW0]

    def place(layer_cot, cache):  # the selected layer's rows of a zero cotangent for the whole cache
        zeros = jnp.zeros(cache.shape, cache.dtype)
        return jax.lax.dynamic_update_slice_in_dim(zeros, layer_cot.astype(cache.dtype), row0, 0)

    return dq.astype(q.dtype), place(dk, k), place(dv, v), None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)
