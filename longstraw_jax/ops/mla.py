"""Absorbed multi-head latent attention over DSA-selected positions (docs/models.md 2.6), with a flash-style backward.

Keys and values are never expanded per head. Each position holds one row `kv = [c | k_pe]` (the normalised latent
and the roped rope key, Dk = kv_lora_rank + qk_rope_head_dim); the query is absorbed, `q = [W_UK^T q_nope | q_pe]`,
so `score = q . kv * scale`, and the output is the latent `sum_u p_u c_u` (W_UV is applied by the caller).

Every query attends to its own k selected positions (k = index_topk): queries are processed in blocks of W
(`block_size`), each block gathers its `[W, k, Dk]` rows from the cache (positions < start) and from the new tokens
(positions >= start), and takes an exact softmax over them. Memory is O(W * k * Dk) whatever the prompt length.
The backward pass is a `jax.custom_vjp` that regathers the rows and recomputes the probabilities from the saved
log-sum-exp, instead of letting autodiff store every block's gathered rows; the rows' cotangents are scatter-added
into the layer's cache cotangent and the new tokens' cotangent.
"""
import functools

import jax
import jax.numpy as jnp

from longstraw_jax.ops import flash_mla
from longstraw_jax.ops.attended import MASKED, Attended
from longstraw_jax.ops.dtypes import accum_dtype


def sparse_latent_attention(q: jax.Array, cache: jax.Array, layer, new: jax.Array, selected: jax.Array, start, *,
                            scale: float, value_dim: int, block_size: int, kernels: str = "xla") -> jax.Array:
    """q [T, H, Dk]; cache [layers, S, Dk] (`cache[layer, :start]` are positions 0..start-1); new [T, Dk] (positions
    start..start+T-1); selected int [T, k]: the positions query t attends to (-1 = unused slot; every query must
    have at least one). Returns the latent output [T, H, value_dim] in float32 (the first value_dim channels of kv).
    """
    return sparse_latent_attention_partial(q, cache, layer, new, selected, start, scale=scale, value_dim=value_dim,
                                           block_size=block_size, kernels=kernels).out


def sparse_latent_attention_partial(q: jax.Array, cache: jax.Array, layer, new: jax.Array, selected: jax.Array,
                                    start, *, scale: float, value_dim: int, block_size: int,
                                    kernels: str = "xla") -> Attended:
    """As `sparse_latent_attention`, also returning the log-sum-exp [T, H] of the scores: a partial result over
    some of the selected positions (queries may have none: out 0, lse MASKED) that `ops.attention.merge` or
    `sharding.sequence.psum_merge` combine exactly with partials over the others. Differentiable in both.
    kernels: "xla" (this module) or "pallas" (`ops.flash_mla`, the same contract; a query's selected positions
    must then be distinct, as a top-k's are)."""
    if kernels == "pallas":
        return flash_mla.sparse_latent_attention_partial(q, cache, layer, new, selected, start, scale=scale,
                                                         value_dim=value_dim)
    if kernels != "xla":
        raise ValueError(f"sparse_latent_attention: kernels={kernels!r}; allowed: 'xla', 'pallas'")
    block_size = max(1, min(block_size, q.shape[0]))  # fewer queries than a block (decoding): no padded rows
    return Attended(*_attend(scale, value_dim, block_size, q, cache, new, jnp.asarray(layer, jnp.int32),
                             selected.astype(jnp.int32), jnp.asarray(start, jnp.int32)))


def _blocks(x: jax.Array, block: int, fill=0) -> jax.Array:
    """[T, ...] -> [ceil(T / block), block, ...], padded with `fill`."""
    blocks = -(-x.shape[0] // block)
    pad = [(0, blocks * block - x.shape[0])] + [(0, 0)] * (x.ndim - 1)
    return jnp.pad(x, pad, constant_values=fill).reshape((blocks, block) + x.shape[1:])


def _gather(cache, layer, new, sel, start):
    """Rows [W, k, Dk] of the selected positions sel [W, k]; -1 slots read an arbitrary row (masked by the caller)."""
    fresh = new[jnp.clip(sel - start, 0, new.shape[0] - 1)]
    if cache.shape[1] == 0:
        return fresh
    cached = cache[layer, jnp.clip(sel, 0, cache.shape[1] - 1)]
    return jnp.where((sel < start)[..., None], cached, fresh)


def _scores(qb, kv, valid, scale):
    """qb [W, H, Dk], kv [W, k, Dk] -> masked scores [W, H, k] (accumulation dtype)."""
    s = jnp.einsum("whd,wkd->whk", qb, kv, preferred_element_type=accum_dtype(qb.dtype)) * scale
    return jnp.where(valid[:, None, :], s, MASKED)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _attend(scale, value_dim, block_size, q, cache, new, layer, selected, start):
    return _attend_fwd(scale, value_dim, block_size, q, cache, new, layer, selected, start)[0]


def _attend_fwd(scale, value_dim, block_size, q, cache, new, layer, selected, start):
    acc = accum_dtype(q.dtype)

    def block(args):
        qb, sel = args
        kv = _gather(cache, layer, new, sel, start)
        valid = sel >= 0
        s = _scores(qb, kv, valid, scale)
        m = jnp.max(s, axis=-1)
        p = jnp.where(valid[:, None, :], jnp.exp(s - m[..., None]), 0.0)
        denom = jnp.sum(p, axis=-1)
        seen = denom > 0
        out = jnp.einsum("whk,wkd->whd", p.astype(kv.dtype), kv[..., :value_dim], preferred_element_type=acc)
        out = jnp.where(seen[..., None], out / jnp.where(seen, denom, 1.0)[..., None], 0.0)
        return out, jnp.where(seen, m + jnp.log(jnp.where(seen, denom, 1.0)), MASKED)

    out, lse = jax.lax.map(block, (_blocks(q, block_size), _blocks(selected, block_size, -1)))
    num_q = q.shape[0]
    out, lse = out.reshape((-1,) + out.shape[2:])[:num_q], lse.reshape((-1,) + lse.shape[2:])[:num_q]
    return (out, lse), (q, cache, new, layer, selected, start, out, lse)


def _attend_bwd(scale, value_dim, block_size, residuals, cotangents):
    """Per query block: p = exp(s - lse); dp = do . v; ds = p * (dp - sum(do * out) + dlse) * scale; dq = ds kv;
    d kv = ds^T q (+ p^T do on the value channels), scatter-added to the positions it was gathered from."""
    q, cache, new, layer, selected, start, out, lse = residuals
    d_out, d_lse = cotangents
    acc = accum_dtype(q.dtype)
    cache_len, new_len = cache.shape[1], new.shape[0]
    delta = jnp.sum(d_out.astype(acc) * out, axis=-1) - d_lse.astype(acc)  # [T, H]

    def block(carry, args):
        d_cache, d_new = carry
        qb, sel, dob, lse_b, delta_b = args
        kv = _gather(cache, layer, new, sel, start)
        valid = sel >= 0
        p = jnp.where(valid[:, None, :], jnp.exp(_scores(qb, kv, valid, scale) - lse_b[..., None]), 0.0)
        dp = jnp.einsum("whd,wkd->whk", dob, kv[..., :value_dim].astype(acc))
        ds = p * (dp - delta_b[..., None]) * scale
        dq = jnp.einsum("whk,wkd->whd", ds, kv.astype(acc))
        d_kv = jnp.einsum("whk,whd->wkd", ds, qb.astype(acc))
        d_kv = d_kv.at[..., :value_dim].add(jnp.einsum("whk,whd->wkd", p, dob))
        in_cache = valid & (sel < start)
        d_cache = d_cache.at[jnp.where(in_cache, sel, cache_len)].add(d_kv, mode="drop")
        d_new = d_new.at[jnp.where(valid & ~in_cache, sel - start, new_len)].add(d_kv, mode="drop")
        return (d_cache, d_new), dq

    xs = (_blocks(q, block_size), _blocks(selected, block_size, -1), _blocks(d_out.astype(acc), block_size),
          _blocks(lse, block_size), _blocks(delta, block_size))
    init = (jnp.zeros(cache.shape[1:], acc), jnp.zeros(new.shape, acc))
    (d_cache, d_new), dq = jax.lax.scan(block, init, xs)
    dq = dq.reshape((-1,) + dq.shape[2:])[: q.shape[0]]
    d_cache = jnp.zeros(cache.shape, cache.dtype).at[layer].set(d_cache.astype(cache.dtype))
    return dq.astype(q.dtype), d_cache, d_new.astype(new.dtype), None, None, None


_attend.defvjp(_attend_fwd, _attend_bwd)
