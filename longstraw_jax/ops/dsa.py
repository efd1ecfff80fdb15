"""DeepSeek Sparse Attention selection: the lightning indexer's top-k (docs/models.md 2.8).

For each query, the index score of a visible key u is `score[t, u] = sum_h w[t, h] * relu(q[t, h] . k[u] * scale)`
(float32, or float64 for a float64 model; matmuls at `precision=HIGHEST`: top-k is sensitive to near-ties), and
the query attends to the k keys with the largest scores. Queries are processed in blocks of `query_block`; for each
block the keys are visited in blocks of `key_block` and a running top-k is merged, so memory is
O(query_block * (k + key_block)): no `[T, P]` score or mask array ever exists, whatever the prompt length.

Selection is discrete and carries no gradient (transformers runs the indexer under `torch.no_grad()`).
"""
import jax
import jax.numpy as jnp

from longstraw_jax.ops.attention import for_each_block
from longstraw_jax.ops.dtypes import int32_indices

_HIGHEST = jax.lax.Precision.HIGHEST


def _index_scores(q: jax.Array, w: jax.Array, keys: jax.Array, scale: float) -> jax.Array:
    """q [W, Hi, Di], w [W, Hi] in the accumulation dtype (float32; float64 for a float64 model), keys [S, Di] ->
    scores [W, S] in that dtype."""
    s = jnp.einsum("whd,sd->whs", q, keys.astype(q.dtype), precision=_HIGHEST) * scale
    return jnp.einsum("wh,whs->ws", w, jax.nn.relu(s), precision=_HIGHEST)


def _merge_topk(carry, scores, positions, k):
    """Running top-k: (values [W, k], positions [W, k]) merged with a block's scores [W, S] at positions [S]."""
    values, chosen = carry
    values = jnp.concatenate([values, scores], axis=-1)
    chosen = jnp.concatenate([chosen, jnp.broadcast_to(positions, scores.shape)], axis=-1)
    top, where = jax.lax.top_k(values, k)
    return top, jnp.take_along_axis(chosen, where, axis=-1)


def topk_over_keys(q: jax.Array, w: jax.Array, keys: jax.Array, key_positions: jax.Array, q_positions: jax.Array,
                   *, k: int, scale: float, query_block: int, key_block: int, visible_prefix=None, layer=None,
                   left_pad=None):
    """Each query's k best candidates among `keys` [S, Di] (float32 scores, any order along S); with `layer`, keys
    is [F, S, Di] and `keys[layer]` is read block by block (never copied whole).

    q [T, Hi, Di] and w [T, Hi] as in `select_topk`; key_positions int [S]: the keys' natural positions; query t
    sees key u iff u < visible_prefix (a count, or a function of a query block's positions [query_block] giving
    one: keys beyond it are never visited) and key_positions[u] <= q_positions[t].

    Returns (scores float32 [T, k], positions int32 [T, k]); -inf / -1 where fewer than k keys are visible.
    Candidates from disjoint key sets combine exactly with `merge_candidates` (the sequence-parallel indexer).
    """
    num_q, heads, dim = q.shape
    query_block = max(1, min(query_block, num_q))  # fewer queries than a block (decoding): no padded rows
    blocks = -(-num_q // query_block)
    pad = blocks * query_block - num_q
    q = jnp.pad(q, ((0, pad), (0, 0), (0, 0))).reshape(blocks, query_block, heads, dim)
    w = jnp.pad(w, ((0, pad), (0, 0))).reshape(blocks, query_block, heads)
    q_pos = jnp.pad(q_positions, (0, pad), constant_values=-1).reshape(blocks, query_block)
    num_keys = keys.shape[-2]
    if visible_prefix is None:
        visible_prefix = num_keys
    if layer is None:
        keys, layer = keys[None], 0

    def one_block(args):
        qb, wb, pb = args

        prefix = visible_prefix(pb) if callable(visible_prefix) else visible_prefix

        def visit(carry, first, size):
            u = jax.lax.dynamic_slice_in_dim(key_positions, first, size)
            seen = (first + jnp.arange(size) < prefix)[None, :] & (u[None, :] <= pb[:, None])
            if left_pad is not None:
                seen &= (u >= left_pad)[None, :]
            block = jax.lax.dynamic_slice(keys, int32_indices(layer, first, 0), (1, size, dim))[0]
            s = _index_scores(qb, wb, block, scale)
            return _merge_topk(carry, jnp.where(seen, s, -jnp.inf), u, k), None

        carry = (jnp.full((query_block, k), -jnp.inf, q.dtype), jnp.full((query_block, k), -1, jnp.int32))
        (values, chosen), _ = for_each_block(num_keys, key_block, carry, visit, prefix)
        return values, jnp.where(values > -jnp.inf, chosen, -1)

    values, chosen = jax.lax.map(one_block, (q, w, q_pos))
    return values.reshape(-1, k)[:num_q], chosen.reshape(-1, k)[:num_q]


def merge_candidates(scores: jax.Array, positions: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The k best of several candidate lists, concatenated along the last axis: scores [T, m], positions [T, m]
    (-inf / -1: no candidate) -> (scores [T, k], positions int32 [T, k]), -inf / -1 where fewer than k exist."""
    top, where = jax.lax.top_k(scores, k)
    return top, jnp.where(top > -jnp.inf, jnp.take_along_axis(positions, where, axis=-1), -1)


def select_topk(q: jax.Array, w: jax.Array, cache_keys: jax.Array, layer, new_keys: jax.Array, positions: jax.Array,
                start, *, k: int, scale: float, query_block: int, key_block: int, left_pad=None) -> jax.Array:
    """Positions of the k largest index scores among the keys each query may see.

    q [T, Hi, Di] and w [T, Hi] (float32; w already includes Hi^-0.5); cache_keys [F, S, Di]: indexer keys of the full
    layers, of which `cache_keys[layer, :start]` hold positions 0..start-1 (later rows are never read); new_keys
    [T, Di] at positions start..start+T-1; positions int [T] = start + arange(T). Query t sees cache positions
    < start and new positions <= positions[t], none at a position < left_pad (int32 [] or None: a left-padded
    prompt's pads).

    Returns int32 [T, k]; -1 marks unused slots when fewer than k keys are visible (then every visible key is chosen,
    which is exactly dense causal attention).
    """
    common = dict(k=k, scale=scale, query_block=query_block, key_block=key_block, left_pad=left_pad)
    cached = topk_over_keys(q, w, cache_keys, jnp.arange(cache_keys.shape[1], dtype=jnp.int32), positions,
                            visible_prefix=jnp.asarray(start, jnp.int32), layer=layer, **common)
    new = topk_over_keys(q, w, new_keys, start + jnp.arange(new_keys.shape[0], dtype=jnp.int32), positions,
                         visible_prefix=lambda pb: jnp.max(pb) - start + 1, **common)
    return merge_candidates(*(jnp.concatenate(pair, axis=-1) for pair in zip(cached, new)), k)[1]
