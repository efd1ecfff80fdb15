"""Blockwise softmax attention with an online (streaming) softmax.

Keys are visited in blocks of `block_size`; only a `[T, H, block_size]` score tile is ever live, never `[T, S]`.
Results are kept as an unnormalised `SoftmaxPartial` so that attention over several key sets (a captured prompt
cache, then the new tokens; or the shards of a sequence-parallel cache) can be merged exactly by log-sum-exp.
GQA: query head h reads key/value head h // (Hq // Hkv).
"""
from typing import NamedTuple

import jax
import jax.numpy as jnp

from longstraw_jax.ops.dtypes import accum_dtype

_MASKED = -1e30  # finite, so that exp(m_old - m_new) never sees (-inf) - (-inf)


class SoftmaxPartial(NamedTuple):
    """Running statistics of a softmax over a subset of keys; all float32.

    max: [T, Hq] running max of the scores (float64 for fp64 inputs); denom: [T, Hq] sum of exp(score - max);
    numer: [T, Hq, Dv] sum of exp(score - max) * v.
    """

    max: jax.Array
    denom: jax.Array
    numer: jax.Array


def empty_partial(num_queries: int, num_heads: int, value_dim: int, dtype=jnp.float32) -> SoftmaxPartial:
    return SoftmaxPartial(
        jnp.full((num_queries, num_heads), _MASKED, dtype),
        jnp.zeros((num_queries, num_heads), dtype),
        jnp.zeros((num_queries, num_heads, value_dim), dtype),
    )


def merge_partials(a: SoftmaxPartial, b: SoftmaxPartial) -> SoftmaxPartial:
    """Exact combination of two disjoint key sets."""
    m = jnp.maximum(a.max, b.max)
    wa, wb = jnp.exp(a.max - m), jnp.exp(b.max - m)
    return SoftmaxPartial(m, a.denom * wa + b.denom * wb, a.numer * wa[..., None] + b.numer * wb[..., None])


def finish(p: SoftmaxPartial, dtype) -> jax.Array:
    """Normalise: [T, Hq, Dv] in `dtype`. A query that saw no key gets zeros."""
    denom = jnp.where(p.denom > 0, p.denom, 1.0)
    return (p.numer / denom[..., None]).astype(dtype)


def attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    q_positions: jax.Array,
    k_offset,
    scale: float,
    causal: bool,
    kv_length=None,
    block_size: int = 512,
    kv_index: tuple = (),
) -> SoftmaxPartial:
    """Softmax partial of queries over one contiguous run of keys.

    q: [T, Hq, D]; q_positions: int [T]. k: [*lead, S, Hkv, D], v: [*lead, S, Hkv, Dv]; `kv_index` selects the
    leading entries (e.g. (block, layer) of a stacked cache), so the caller never copies a whole layer out.
    Key i has position `k_offset + i`; it is visible to query t when `i < kv_length` (if given) and, when `causal`,
    `k_offset + i <= q_positions[t]`. Key blocks no query can see are skipped (`lax.cond`), so a chunk of a
    prompt does not pay for the unwritten tail of a preallocated cache.
    """
    num_q, num_heads, head_dim = q.shape
    seq_len, kv_heads = k.shape[-3], k.shape[-2]
    value_dim = v.shape[-1]
    group = num_heads // kv_heads
    qg = q.reshape(num_q, kv_heads, group, head_dim)
    last_query_position = jnp.max(q_positions)
    acc = accum_dtype(q.dtype)

    def read(cache, start, size):
        starts = tuple(kv_index) + (start, 0, 0)
        sizes = (1,) * len(kv_index) + (size,) + cache.shape[-2:]
        return jax.lax.dynamic_slice(cache, starts, sizes).reshape((size,) + cache.shape[-2:])

    def accumulate(carry: SoftmaxPartial, start, size) -> SoftmaxPartial:
        k_blk, v_blk = read(k, start, size), read(v, start, size)
        idx = start + jnp.arange(size)
        visible = jnp.ones((num_q, size), bool)
        if kv_length is not None:
            visible &= (idx < kv_length)[None, :]
        if causal:
            visible &= (k_offset + idx)[None, :] <= q_positions[:, None]
        visible = visible[:, None, None, :]
        s = jnp.einsum("tkgd,bkd->tkgb", qg, k_blk, preferred_element_type=acc) * scale
        s = jnp.where(visible, s, _MASKED)
        m_old = carry.max.reshape(num_q, kv_heads, group)
        m_new = jnp.maximum(m_old, jnp.max(s, axis=-1))
        p = jnp.where(visible, jnp.exp(s - m_new[..., None]), 0.0)
        alpha = jnp.exp(m_old - m_new)
        denom = carry.denom.reshape(m_old.shape) * alpha + jnp.sum(p, axis=-1)
        pv = jnp.einsum("tkgb,bkd->tkgd", p.astype(v_blk.dtype), v_blk, preferred_element_type=acc)
        numer = carry.numer.reshape(num_q, kv_heads, group, value_dim) * alpha[..., None] + pv
        return SoftmaxPartial(
            m_new.reshape(num_q, num_heads), denom.reshape(num_q, num_heads), numer.reshape(num_q, num_heads, value_dim)
        )

    def any_visible(start):
        ok = jnp.bool_(True)
        if kv_length is not None:
            ok &= start < kv_length
        if causal:
            ok &= k_offset + start <= last_query_position
        return ok

    def step(carry, block):
        start = block * block_size
        carry = jax.lax.cond(any_visible(start), lambda c: accumulate(c, start, block_size), lambda c: c, carry)
        return carry, None

    partial = empty_partial(num_q, num_heads, value_dim, acc)
    num_blocks, tail = divmod(seq_len, block_size)
    if num_blocks:
        partial, _ = jax.lax.scan(step, partial, jnp.arange(num_blocks))
    if tail:
        partial = accumulate(partial, num_blocks * block_size, tail)
    return partial
