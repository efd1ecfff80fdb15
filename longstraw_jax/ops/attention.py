"""Blockwise softmax attention with an online softmax and a flash-style backward pass.

Keys are visited in blocks of W = `block_size`; only a `[T, Hq, W]` score tile is ever live, never `[T, S]`,
in the forward pass *and* in the backward pass (a `jax.custom_vjp` that recomputes each tile from q, k, v and the
saved log-sum-exp, instead of letting autodiff store every tile).

The result over one run of keys is `Attended(out, lse)`: the normalised output and the log-sum-exp of the scores.
Attention over several disjoint key sets (a captured prompt cache, then the new tokens; or the shards of a
sequence-parallel cache) merges exactly: `merge(a, b)` (both from ops/attended.py). GQA: query head h reads
key/value head h // rep, where rep = Hq / Hkv.

This is the XLA path, the CPU path and the oracle; `attend(..., kernels="pallas")` runs the same contract as the
Pallas kernels of `ops.flash_attention`.
"""
import functools

import jax
import jax.numpy as jnp

from longstraw_jax.ops import flash_attention
from longstraw_jax.ops.attended import MASKED, Attended, merge  # noqa: F401 (merge: part of this module's API)
from longstraw_jax.ops.dtypes import accum_dtype, int32_indices


def attend(q: jax.Array, k: jax.Array, v: jax.Array, *, q_positions: jax.Array, k_offset, scale: float,
           causal: bool, kv_length=None, block_size: int = 512, kv_index: tuple = (), left_pad=None,
           kv_positions=None, kernels: str = "xla", heads_as_stored: bool = False) -> Attended:
    """Softmax attention of queries over one contiguous run of keys.

    q: [T, Hq, hd]; q_positions: int [T]. k, v: [*lead, S, Hkv, hd]; `kv_index` selects the leading entries (e.g.
    (block, layer) of a stacked cache), so the caller never copies a whole cache out.
    Key i has position `k_offset + i`; it is visible to query t when `i < kv_length` (if given) and, when `causal`,
    `k_offset + i <= q_positions[t]`. Key blocks no query can see are never visited, so a chunk of a prompt
    does not pay for the unwritten tail of a preallocated cache.

    left_pad (int32 [], traced; None: no padding): keys at positions < left_pad are a left-padded prompt's pads and
    are never visible (their probability is exactly 0, so their cotangents are exactly 0). A key's position is
    `k_offset + i`, or `kv_positions[i]` (int32 [S]) when given (a sharded cache in stored order).

    kernels: "xla" (this module) or "pallas" (`ops.flash_attention`, the same contract; `block_size` is then the
    kernels' own). heads_as_stored: with one query row (T = 1, a decoded token), multiply the key and value rows as
    they are stored, every query head by every key head (`_per_head`), instead of per head: Hkv times the products
    but no head-major copy of each key block (what XLA:CPU's decoding wants; the gradient is the same either way).
    """
    if kernels == "pallas":
        return flash_attention.attend(q, k, v, q_positions=q_positions, k_offset=k_offset, scale=scale, causal=causal,
                                      kv_length=kv_length, kv_index=kv_index, left_pad=left_pad,
                                      kv_positions=kv_positions)
    if kernels != "xla":
        raise ValueError(f"attend: kernels={kernels!r}; allowed: 'xla', 'pallas'")
    kv_length = jnp.asarray(k.shape[-3] if kv_length is None else kv_length, jnp.int32)
    k_offset = jnp.asarray(k_offset, jnp.int32)
    index = tuple(jnp.asarray(i, jnp.int32) for i in kv_index)
    pads = None
    if left_pad is not None:
        pads = (jnp.asarray(left_pad, jnp.int32), None if kv_positions is None else kv_positions.astype(jnp.int32))
    as_stored = heads_as_stored and q.shape[0] == 1
    return _attend(scale, causal, block_size, as_stored, q, k, v, q_positions.astype(jnp.int32), k_offset, kv_length,
                   index, pads)


# ----- shared pieces of the forward and backward passes -----


def _read(cache, index, start, size):
    """cache[*index, start:start + size] -> [size, Hkv, hd] without copying the rest of the cache."""
    starts = int32_indices(*index, start, 0, 0)
    sizes = (1,) * len(index) + (size,) + cache.shape[-2:]
    return jax.lax.dynamic_slice(cache, starts, sizes).reshape((size,) + cache.shape[-2:])


def _visible(start, size, q_positions, k_offset, kv_length, causal, pads=None):
    """[T, size] mask of the keys start..start+size-1 each query may see. pads: None or (left_pad, kv_positions or
    None): keys at positions < left_pad are hidden."""
    idx = start + jnp.arange(size)
    mask = (idx < kv_length)[None, :] & jnp.ones((q_positions.shape[0], 1), bool)
    if causal:
        mask &= (k_offset + idx)[None, :] <= q_positions[:, None]
    if pads is not None:
        left_pad, kv_positions = pads
        key_positions = k_offset + idx if kv_positions is None else jax.lax.dynamic_slice_in_dim(kv_positions, start,
                                                                                                 size)
        mask &= (key_positions >= left_pad)[None, :]
    return mask


def _visible_prefix(q_positions, k_offset, kv_length, causal):
    """Number of leading keys any query may see (keys are visited in order, so later blocks can be skipped)."""
    limit = kv_length
    if causal:
        limit = jnp.minimum(limit, jnp.max(q_positions) - k_offset + 1)
    return jnp.maximum(limit, 0)


def _per_head(qg, k_blk, acc, as_stored: bool = False):
    """qg [T, Hkv, rep, d], k_blk [W, Hkv, d] -> [T, Hkv, rep, W]: sum_d qg[t, h, g, d] k_blk[w, h, d].

    as_stored (one query row: decoding): multiply the key rows as they are stored, every head by every head, and
    keep the products of a head with itself: Hkv times the arithmetic of a per-head product, but no copy of the
    keys. With the head as a batch dimension XLA:CPU transposes each key block to [Hkv, d, W] first, a copy of the
    cache per decode step that cost more than the products (a third of a Qwen3.6 step at P 4096)."""
    t, hkv, rep, d = qg.shape
    if not as_stored:
        return jnp.einsum("thgd,shd->thgs", qg, k_blk, preferred_element_type=acc)
    every = jnp.einsum("sd,qd->qs", k_blk.reshape(-1, d), qg.reshape(-1, d), preferred_element_type=acc)
    every = every.reshape(t, hkv, rep, k_blk.shape[0], hkv)  # [.., w, h'] of query head h
    return jnp.stack([every[:, h, :, :, h] for h in range(hkv)], axis=1)


def _weighted(p, v_blk, acc, as_stored: bool = False):
    """p [T, Hkv, rep, W], v_blk [W, Hkv, dv] -> [T, Hkv, rep, dv]: sum_w p[t, h, g, w] v_blk[w, h, dv]; as_stored
    as in `_per_head`: the value rows as stored, every head by every head."""
    t, hkv, rep, _ = p.shape
    if not as_stored:
        return jnp.einsum("thgs,shd->thgd", p, v_blk, preferred_element_type=acc)
    every = jnp.einsum("qs,sd->qd", p.reshape(t * hkv * rep, -1), v_blk.reshape(v_blk.shape[0], -1),
                       preferred_element_type=acc).reshape(t, hkv, rep, hkv, -1)
    return jnp.stack([every[:, h, :, h] for h in range(hkv)], axis=1)


def _scores(qg, k_blk, visible, scale, as_stored: bool = False):
    """qg [T, Hkv, rep, hd], k_blk [W, Hkv, hd] -> masked scores [T, Hkv, rep, W] in the accumulation dtype."""
    s = _per_head(qg, k_blk, accum_dtype(qg.dtype), as_stored) * scale
    return jnp.where(visible[:, None, None, :], s, MASKED)


def for_each_block(seq_len, block_size, carry, visit, visible_prefix, outputs=None):
    """Run `visit(carry, start, size) -> (carry, block outputs or None)` over the key blocks that hold one of the
    first `visible_prefix` keys: a `lax.while_loop` over full blocks (dynamic trip count: invisible blocks cost
    nothing; its condition also states the static bound seq_len // block_size), then the static tail block if it
    is visible. Per-block outputs are written into `outputs`, a tuple of [seq_len, ...] buffers. A while loop (not
    a scan) so that partial evaluation under an outer autodiff can never stack per-block residuals: the custom VJP
    below is the only way these loops are differentiated.
    """
    num_blocks, tail = divmod(seq_len, block_size)

    def store(outputs, block_outputs, start):
        if outputs is None:
            return None
        return tuple(jax.lax.dynamic_update_slice_in_dim(o, b.astype(o.dtype), start, 0)
                     for o, b in zip(outputs, block_outputs))

    if num_blocks:
        trips = jnp.minimum(num_blocks, (visible_prefix + block_size - 1) // block_size)

        def body(state):
            i, carry, outputs = state
            carry, block_outputs = visit(carry, i * block_size, block_size)
            return i + 1, carry, store(outputs, block_outputs, i * block_size)

        # `i < num_blocks` is implied by `i < trips`; stated so that the compiled condition carries a static bound
        # (a cost model that cannot evaluate `trips` counts the loop at num_blocks: capacity/hlo/walk.py)
        cond = lambda st: (st[0] < trips) & (st[0] < num_blocks)
        _, carry, outputs = jax.lax.while_loop(cond, body, (jnp.int32(0), carry, outputs))
    if tail:
        start = num_blocks * block_size

        def visit_tail(args):
            carry, outputs = args
            carry, block_outputs = visit(carry, start, tail)
            return carry, store(outputs, block_outputs, start)

        carry, outputs = jax.lax.cond(start < visible_prefix, visit_tail, lambda args: args, (carry, outputs))
    return carry, outputs


# ----- forward and backward -----


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _attend(scale, causal, block_size, as_stored, q, k, v, q_positions, k_offset, kv_length, index, pads):
    return _attend_fwd(scale, causal, block_size, as_stored, q, k, v, q_positions, k_offset, kv_length, index, pads)[0]


def _attend_fwd(scale, causal, block_size, as_stored, q, k, v, q_positions, k_offset, kv_length, index, pads):
    num_q, num_heads, head_dim = q.shape
    kv_heads, value_dim = k.shape[-2], v.shape[-1]
    group = num_heads // kv_heads
    acc = accum_dtype(q.dtype)
    qg = q.reshape(num_q, kv_heads, group, head_dim)

    def visit(carry, start, size):
        m, denom, numer = carry
        k_blk, v_blk = _read(k, index, start, size), _read(v, index, start, size)
        visible = _visible(start, size, q_positions, k_offset, kv_length, causal, pads)
        s = _scores(qg, k_blk, visible, scale, as_stored)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        p = jnp.where(visible[:, None, None, :], jnp.exp(s - m_new[..., None]), 0.0)
        alpha = jnp.exp(m - m_new)
        pv = _weighted(p.astype(v_blk.dtype), v_blk, acc, as_stored)
        return (m_new, denom * alpha + jnp.sum(p, axis=-1), numer * alpha[..., None] + pv), None

    init = (jnp.full((num_q, kv_heads, group), MASKED, acc), jnp.zeros((num_q, kv_heads, group), acc),
            jnp.zeros((num_q, kv_heads, group, value_dim), acc))
    prefix = _visible_prefix(q_positions, k_offset, kv_length, causal)
    (m, denom, numer), _ = for_each_block(k.shape[-3], block_size, init, visit, prefix)
    seen = denom > 0
    out = jnp.where(seen[..., None], numer / jnp.where(seen, denom, 1.0)[..., None], 0.0)
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, denom, 1.0)), MASKED)
    result = Attended(out.reshape(num_q, num_heads, value_dim), lse.reshape(num_q, num_heads))
    return result, (q, k, v, q_positions, k_offset, kv_length, index, pads, result)


def _attend_bwd(scale, causal, block_size, as_stored, residuals, cotangent):
    """Flash-attention backward: per key block, p = exp(s - lse); dv = p^T do; ds = p * (do.v - do.out + dlse);
    dq += ds k * scale; dk = ds^T q * scale. Cache cotangents are built per layer and placed at `index`."""
    q, k, v, q_positions, k_offset, kv_length, index, pads, (out, lse) = residuals
    d_out, d_lse = cotangent
    num_q, num_heads, head_dim = q.shape
    kv_heads, value_dim = k.shape[-2], v.shape[-1]
    group = num_heads // kv_heads
    acc = accum_dtype(q.dtype)
    qg = q.reshape(num_q, kv_heads, group, head_dim)
    do = d_out.astype(acc).reshape(num_q, kv_heads, group, value_dim)
    lse_g = lse.reshape(num_q, kv_heads, group)
    delta = jnp.sum(do * out.reshape(do.shape), axis=-1) - d_lse.astype(acc).reshape(lse_g.shape)  # [T, Hkv, rep]

    def visit(dq, start, size):
        k_blk, v_blk = _read(k, index, start, size), _read(v, index, start, size)
        visible = _visible(start, size, q_positions, k_offset, kv_length, causal, pads)
        s = _scores(qg, k_blk, visible, scale)
        p = jnp.where(visible[:, None, None, :], jnp.exp(s - lse_g[..., None]), 0.0)
        dv = jnp.einsum("thgs,thgd->shd", p, do)
        dp = jnp.einsum("thgd,shd->thgs", do, v_blk.astype(acc))
        ds = p * (dp - delta[..., None]) * scale
        dq = dq + jnp.einsum("thgs,shd->thgd", ds, k_blk.astype(acc))
        dk = jnp.einsum("thgs,thgd->shd", ds, qg.astype(acc))
        return dq, (dk, dv)

    prefix = _visible_prefix(q_positions, k_offset, kv_length, causal)
    buffers = (jnp.zeros(k.shape[-3:], acc), jnp.zeros(v.shape[-3:], acc))
    dq, (dk_layer, dv_layer) = for_each_block(k.shape[-3], block_size, jnp.zeros(qg.shape, acc), visit, prefix,
                                               buffers)

    def place(layer_cot, cache):
        if not index:
            return layer_cot.astype(cache.dtype)
        return jnp.zeros(cache.shape, cache.dtype).at[index].set(layer_cot.astype(cache.dtype))

    return (dq.reshape(q.shape).astype(q.dtype), place(dk_layer, k), place(dv_layer, v),
            None, None, None, tuple(None for _ in index), jax.tree.map(lambda _: None, pads))


_attend.defvjp(_attend_fwd, _attend_bwd)
