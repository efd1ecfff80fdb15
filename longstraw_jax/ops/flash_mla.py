"""Absorbed latent attention over DSA-selected rows as Pallas kernels (Triton backend): the contract of
`ops.mla.sparse_latent_attention_partial`.

Every query reads only its own k selected rows `kv = [c | k_pe]` (latent Dl = value_dim channels, rope Dr) of the
layer's cache (positions < start) or of the chunk's new rows (positions >= start): a gather, not a dense tile.
A grid of (query, block of heads, part of its slots) programs, the heads as the matmuls' M dimension:
- forward, all H heads in one program (GLM-5.x has 64+: one gather serves them all): over the selected slots in
  blocks of BLOCK_SLOTS, gather the rows, s = (q_lat . c + q_rope . k_pe) * scale [H, block], online softmax,
  out += p c; returns out [T, H, Dl] and lse [T, H], float32. A grid of fewer than `min_programs` (decoding) splits
  each query's slots over more programs (`flash_attention.key_splits`), their partial out / lse merged by
  log-sum-exp (flash-decoding: 8 decoded queries would otherwise be 8 programs);
- backward (dO and dLSE, delta = rowsum(dO * O) - dLSE, so partials merge exactly), in programs of BACKWARD_HEADS
  heads: regather, p = exp(s - lse), ds = p (dO . c - delta) scale; dq = ds [c | k_pe]; the rows' cotangents
  ds^T q (+ p^T dO on the latent) are atomically added to the cache's and the new rows' cotangents (float32; the
  head blocks' shares sum there too); split as the forward is (dq's partials summed). A query's selected positions
  are distinct (a top-k), so one atomic add never names a row twice; unused slots (-1) add into a sink row past the
  end. On a GPU atomics also sum repeated rows; interpretation on a CPU would not, which is why distinctness is the
  contract.

Shared memory per program (`tools/triton_resources.py`, GLM-5.x's widths, sm_90): forward 128 KiB at 16 slots a
block (180 at 32, 289 at 64), backward 121 KiB at 16 heads and 16 slots (412 with all 64 heads at 32 slots); a
program may have 227 KiB on an H100, 163 KiB on an A100 (sm_80: 126 and 121 KiB).

The cache is read in place ([layers, S, Dk] viewed as [layers * S, Dk]); head counts and channel widths that are
not powers of two >= 16 are zero-padded (the tiny test models; GLM-5.x's 512 + 64 channels need none).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from longstraw_jax.ops.attended import MASKED, Attended, merge_all
from longstraw_jax.ops.dtypes import accum_dtype
from longstraw_jax.ops.flash_attention import MIN_PROGRAMS, MIN_TILE, key_splits, on_gpu, split_range

BLOCK_SLOTS = 16  # selected rows gathered per loop step (32: more shared memory than an A100's program has; above)
BACKWARD_HEADS = 16  # heads per backward program (all 64 of GLM-5.x: 1.8x the shared memory an H100 block has)


@dataclasses.dataclass(frozen=True)
class _Static:
    scale: float
    latent: int  # Dl (padded)
    rope: int  # Dr (padded)
    cache_rows: int  # S, one layer's rows (0: no cache)
    new_rows: int
    block: int
    interpret: bool
    min_programs: int  # the forward and backward split a query's slots while they have fewer programs


def _tile(n: int) -> int:
    return max(MIN_TILE, 1 << max(0, n - 1).bit_length())


def sparse_latent_attention_partial(q: jax.Array, cache: jax.Array, layer, new: jax.Array, selected: jax.Array,
                                    start, *, scale: float, value_dim: int, interpret: bool | None = None,
                                    min_programs: int = MIN_PROGRAMS) -> Attended:
    """q [T, H, Dk]; cache [layers, S, Dk]; new [T_new, Dk] (positions start..); selected int [T, k] (-1: unused;
    distinct otherwise). Returns out [T, H, value_dim] and lse [T, H], float32 (a query with no slot: out 0, lse
    MASKED). min_programs: a kernel's grid of fewer programs than this splits each query's slots over more, forward
    and backward (1: never)."""
    if interpret is None:
        interpret = not on_gpu()
    num_q, heads, _ = q.shape
    layers, cache_rows, _ = cache.shape
    latent, rope = _tile(value_dim), _tile(q.shape[-1] - value_dim)
    block = min(BLOCK_SLOTS, _tile(selected.shape[1]))
    slots = -(-selected.shape[1] // block) * block

    def channels(x):  # [..., Dl + Dr] -> [..., latent + rope], zero-padded per part (no copy when none is needed)
        if (latent, rope) == (value_dim, x.shape[-1] - value_dim):
            return x
        widths = [(0, 0)] * (x.ndim - 1)
        return jnp.concatenate([jnp.pad(x[..., :value_dim], widths + [(0, latent - value_dim)]),
                                jnp.pad(x[..., value_dim:], widths + [(0, rope - (x.shape[-1] - value_dim))])], axis=-1)

    q = jnp.pad(channels(q), ((0, 0), (0, _tile(heads) - heads), (0, 0)))
    cache_flat = channels(cache).reshape(layers * cache_rows, latent + rope)
    if not cache_rows:  # no cache (a chunk over itself): a dummy row, never read
        cache_flat = jnp.zeros((1, latent + rope), cache.dtype)
    selected = jnp.pad(selected.astype(jnp.int32), ((0, 0), (0, slots - selected.shape[1])), constant_values=-1)
    scalars = jnp.stack([jnp.asarray(layer, jnp.int32) * cache_rows, jnp.asarray(start, jnp.int32)])
    static = _Static(scale=scale, latent=latent, rope=rope, cache_rows=cache_rows, new_rows=new.shape[0],
                     block=block, interpret=interpret, min_programs=min_programs)
    out, lse = _sparse(static, q, cache_flat, channels(new), selected, scalars)
    return Attended(out[:, :heads, :value_dim], lse[:, :heads])


# ----- the gather, shared by the kernels -----


def _gather(static, cache_ref, new_ref, sel, row0, start):
    """Rows of the selected positions sel [block]: (latent [block, Dl], rope [block, Dr], valid, in_cache, cache
    row, new row). Indices are clamped into range (a gather never reads past an array) and masked here."""
    valid = sel >= 0
    new_row = jnp.clip(sel - start, 0, static.new_rows - 1)
    lat = new_ref[new_row, pl.ds(0, static.latent)]
    rope = new_ref[new_row, pl.ds(static.latent, static.rope)]
    in_cache = valid & (sel < start)
    cache_row = jnp.clip(sel, 0, max(static.cache_rows - 1, 0))
    if static.cache_rows:
        lat = jnp.where(in_cache[:, None], cache_ref[row0 + cache_row, pl.ds(0, static.latent)], lat)
        rope = jnp.where(in_cache[:, None], cache_ref[row0 + cache_row, pl.ds(static.latent, static.rope)], rope)
    return lat, rope, valid, in_cache, cache_row, new_row


def _scores(static, q_lat, q_rope, lat, rope, valid, acc):
    s = (plt.dot(q_lat, lat, trans_b=True) + plt.dot(q_rope, rope, trans_b=True)).astype(acc) * static.scale
    return jnp.where(valid[None, :], s, MASKED)


# ----- kernels -----


def _forward_kernel(scalars_ref, q_ref, sel_ref, cache_ref, new_ref, out_ref, lse_ref, *, static, split_blocks):
    """One (query, all heads, slot part) program: the online softmax over slot blocks [part * split_blocks, ...)."""
    row0, start = scalars_ref[0], scalars_ref[1]
    q_lat, q_rope = q_ref[:, pl.ds(0, static.latent)], q_ref[:, pl.ds(static.latent, static.rope)]
    acc = accum_dtype(q_lat.dtype)
    heads = q_lat.shape[0]

    def body(j, carry):
        m, denom, numer = carry
        lat, rope, valid, *_ = _gather(static, cache_ref, new_ref, sel_ref[pl.ds(j * static.block, static.block)],
                                       row0, start)
        s = _scores(static, q_lat, q_rope, lat, rope, valid, acc)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.where(valid[None, :], jnp.exp(s - m_new[:, None]), 0.0)
        alpha = jnp.exp(m - m_new)
        numer = numer * alpha[:, None] + plt.dot(p.astype(lat.dtype), lat).astype(acc)
        return m_new, denom * alpha + jnp.sum(p, axis=1), numer

    init = (jnp.full((heads,), MASKED, acc), jnp.zeros((heads,), acc), jnp.zeros((heads, static.latent), acc))
    m, denom, numer = jax.lax.fori_loop(*split_range(2, split_blocks, sel_ref.shape[0] // static.block), body, init)
    seen = denom > 0
    out_ref[...] = jnp.where(seen[:, None], numer / jnp.where(seen, denom, 1.0)[:, None], 0.0).astype(out_ref.dtype)
    lse_ref[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, denom, 1.0)), MASKED).astype(lse_ref.dtype)


def _backward_kernel(scalars_ref, q_ref, sel_ref, cache_ref, new_ref, do_ref, lse_ref, delta_ref, _cache_zeros,
                     _new_zeros, dq_ref, d_cache_ref, d_new_ref, *, static, split_blocks):
    """One (query, head block, slot part) program: its share of dq, and of its slots' rows' cotangents (atomic)."""
    row0, start = scalars_ref[0], scalars_ref[1]
    q_lat, q_rope = q_ref[:, pl.ds(0, static.latent)], q_ref[:, pl.ds(static.latent, static.rope)]
    do, lse, delta = do_ref[...], lse_ref[...], delta_ref[...]
    acc = lse.dtype
    lat_cols, rope_cols = jnp.arange(static.latent), static.latent + jnp.arange(static.rope)

    def add_rows(ref, rows, use, sink, d_lat, d_rope):  # rows not `use`d go to the sink row
        rows = jnp.where(use, rows, sink)[:, None]
        plt.atomic_add(ref, (rows, lat_cols[None, :]), d_lat)
        plt.atomic_add(ref, (rows, rope_cols[None, :]), d_rope)

    def body(j, carry):
        dq_lat, dq_rope = carry
        lat, rope, valid, in_cache, cache_row, new_row = _gather(
            static, cache_ref, new_ref, sel_ref[pl.ds(j * static.block, static.block)], row0, start)
        p = jnp.where(valid[None, :], jnp.exp(_scores(static, q_lat, q_rope, lat, rope, valid, acc) - lse[:, None]),
                      0.0)
        ds = p * (plt.dot(do, lat, trans_b=True).astype(acc) - delta[:, None]) * static.scale  # [H, block]
        ds_in = ds.astype(lat.dtype)
        d_lat = (plt.dot(ds_in, q_lat, trans_a=True) + plt.dot(p.astype(do.dtype), do, trans_a=True)).astype(acc)
        d_rope = plt.dot(ds_in, q_rope, trans_a=True).astype(acc)
        if static.cache_rows:
            add_rows(d_cache_ref, cache_row, in_cache, static.cache_rows, d_lat, d_rope)
        add_rows(d_new_ref, new_row, valid & ~in_cache, static.new_rows, d_lat, d_rope)
        return (dq_lat + plt.dot(ds_in, lat).astype(acc), dq_rope + plt.dot(ds_in, rope).astype(acc))

    init = (jnp.zeros(q_lat.shape, acc), jnp.zeros(q_rope.shape, acc))
    dq_lat, dq_rope = jax.lax.fori_loop(*split_range(2, split_blocks, sel_ref.shape[0] // static.block), body, init)
    dq_ref[:, pl.ds(0, static.latent)] = dq_lat.astype(dq_ref.dtype)
    dq_ref[:, pl.ds(static.latent, static.rope)] = dq_rope.astype(dq_ref.dtype)


# ----- pallas_call wrappers and the custom VJP -----


class _Grid:
    """A kernel's grid of (query, block of `heads` heads, part of the query's slots) programs and its BlockSpecs.
    Fewer programs than `min_programs` split each query's slots into parts (`flash_attention.key_splits`)."""

    def __init__(self, static, q, selected, heads: int):
        self.heads = heads
        num_q, head_blocks = q.shape[0], q.shape[1] // heads
        self.parts, self.per_part = key_splits(num_q * head_blocks, selected.shape[1] // static.block,
                                               static.min_programs)
        self.grid = (num_q, head_blocks, self.parts)

    @staticmethod
    def whole(x):
        return pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)

    @staticmethod
    def by_query(x):  # [T, ...]: the program's query
        return pl.BlockSpec((None,) + x.shape[1:], lambda t, h, s: (t,) + (0,) * (x.ndim - 1))

    def by_heads(self, x):  # [T, H, ...]: the program's query and heads
        return pl.BlockSpec((None, self.heads) + x.shape[2:], lambda t, h, s: (t, h) + (0,) * (x.ndim - 2))

    def by_part(self, x):  # [parts, T, H, ...]: the program's partial result
        return pl.BlockSpec((None, None, self.heads) + x.shape[3:], lambda t, h, s: (s, t, h) + (0,) * (x.ndim - 3))

    def inputs(self, q, selected, cache, new):
        """The in-specs of (scalars, q, selected, cache, new)."""
        return [pl.BlockSpec((2,), lambda *_: (0,)), self.by_heads(q), self.by_query(selected), self.whole(cache),
                self.whole(new)]


def _params(static):
    return plt.CompilerParams(num_warps=4 if static.latent <= 64 else 8, num_stages=2)


def _forward(static, q, cache, new, selected, scalars):
    """The forward's pallas_call over (query, all heads, slot part) programs; the parts' partials merged."""
    num_q, heads, _ = q.shape
    acc = accum_dtype(q.dtype)
    grid = _Grid(static, q, selected, heads)
    out_shape = (jax.ShapeDtypeStruct((grid.parts, num_q, heads, static.latent), acc),
                 jax.ShapeDtypeStruct((grid.parts, num_q, heads), acc))
    out, lse = pl.pallas_call(
        functools.partial(_forward_kernel, static=static, split_blocks=grid.per_part),
        out_shape=out_shape, grid=grid.grid, in_specs=grid.inputs(q, selected, cache, new),
        out_specs=tuple(grid.by_part(s) for s in out_shape), compiler_params=_params(static),
        interpret=static.interpret, name="sparse_latent_attention_forward",
    )(scalars, q, selected, cache, new)
    return (out[0], lse[0]) if grid.parts == 1 else tuple(merge_all(Attended(out, lse)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _sparse(static, q, cache, new, selected, scalars):
    return _forward(static, q, cache, new, selected, scalars)


def _sparse_fwd(static, q, cache, new, selected, scalars):
    out, lse = _forward(static, q, cache, new, selected, scalars)
    return (out, lse), (q, cache, new, selected, scalars, out, lse)


def _sparse_bwd(static, residuals, cotangents):
    q, cache, new, selected, scalars, out, lse = residuals
    d_out, d_lse = cotangents
    delta = jnp.sum(d_out * out, axis=-1) - d_lse  # [T, H]
    acc = lse.dtype
    width = static.latent + static.rope
    # one layer's rows plus a sink row each, zero-initialised and accumulated in place (aliased to the outputs)
    cache_zeros = jnp.zeros((static.cache_rows + 1, width), acc)
    new_zeros = jnp.zeros((static.new_rows + 1, width), acc)
    grid = _Grid(static, q, selected, min(BACKWARD_HEADS, q.shape[1]))
    dq_parts = jax.ShapeDtypeStruct((grid.parts,) + q.shape, acc)
    whole = grid.whole
    dq, d_layer, d_new = pl.pallas_call(
        functools.partial(_backward_kernel, static=static, split_blocks=grid.per_part),
        out_shape=(dq_parts, jax.ShapeDtypeStruct(cache_zeros.shape, acc), jax.ShapeDtypeStruct(new_zeros.shape, acc)),
        grid=grid.grid,
        in_specs=grid.inputs(q, selected, cache, new) + [grid.by_heads(d_out), grid.by_heads(lse),
                                                         grid.by_heads(delta), whole(cache_zeros), whole(new_zeros)],
        out_specs=(grid.by_part(dq_parts), whole(cache_zeros), whole(new_zeros)),
        input_output_aliases={8: 1, 9: 2}, compiler_params=_params(static), interpret=static.interpret,
        name="sparse_latent_attention_backward",
    )(scalars, q, selected, cache, new, d_out.astype(q.dtype), lse, delta, cache_zeros, new_zeros)
    d_cache = jax.lax.dynamic_update_slice_in_dim(jnp.zeros(cache.shape, cache.dtype),
                                                  d_layer[: static.cache_rows].astype(cache.dtype), scalars[0], 0)
    return jnp.sum(dq, axis=0).astype(q.dtype), d_cache, d_new[: static.new_rows].astype(new.dtype), None, None


_sparse.defvjp(_sparse_fwd, _sparse_bwd)
