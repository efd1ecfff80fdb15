"""Gated delta rule (Gated DeltaNet core, docs/models.md 1.5), float32 throughout.

Per value head, with the state S_t a [dk, dv] matrix, decay g_t <= 0 and write strength beta_t in (0, 1):

    S_t = exp(g_t) * S_{t-1}
    S_t = S_t + k_t (beta_t * (v_t - S_t^T k_t))^T      i.e. S_t = (Id - b k k^T) e^g S_{t-1} + b k v^T
    o_t = S_t^T q_t                                     (the output reads the state *after* token t)

`gated_delta_rule_sequential` is that loop, literally (the reference). `gated_delta_rule_chunked` is the WY/UT form
used by default: inside a chunk of Cg tokens t = 1..Cg, with gamma_t = g_1 + ... + g_t, K_c the chunk's keys
stacked [Cg, dk] and u the pseudo-values,

    (Id - A_c) u = beta*v - (beta*e^gamma) * (K_c S_0),   A_c[t, j] = -beta_t e^{gamma_t - gamma_j} k_t.k_j   (j < t)
    o_t          = e^{gamma_t} S_0^T q_t + sum_{j <= t} e^{gamma_t - gamma_j} (q_t.k_j) u_j
    S_Cg         = e^{gamma_Cg} S_0 + sum_j e^{gamma_Cg - gamma_j} k_j u_j^T

solved per chunk by matmuls (`_solve_unit_lower`). Only exponents <= 0 are ever evaluated.
Inputs are already l2-normalised and scaled; q/k heads already expanded to the value heads.
"""
import jax
import jax.numpy as jnp

from longstraw_jax.ops.dtypes import at_least_f32 as _at_least_f32


def _step(s, inputs):
    """One token of the recurrence, all heads: s [H, dk, dv]; q_t, k_t [H, dk]; v_t [H, dv]; g_t, b_t [H]."""
    q_t, k_t, v_t, g_t, b_t = inputs
    s = s * jnp.exp(g_t)[:, None, None]
    kv = jnp.einsum("hd,hdv->hv", k_t, s)
    s = s + jnp.einsum("hd,hv->hdv", k_t, (v_t - kv) * b_t[:, None])
    return s, jnp.einsum("hd,hdv->hv", q_t, s)


def gated_delta_rule_sequential(q, k, v, g, beta, state):
    """q, k: [T, H, dk]; v: [T, H, dv]; g, beta: [T, H]; state: [H, dk, dv]. Returns (o [T, H, dv], state)."""
    state, o = jax.lax.scan(_step, _at_least_f32(state), tuple(map(_at_least_f32, (q, k, v, g, beta))))
    return o, state


def _solve_unit_lower(a, rhs):
    """x with (Id - a) x = rhs, for a [H, Cg, Cg] strictly lower triangular (so a^Cg = 0): the doubling product
    (Id - a)^-1 = (Id + a)(Id + a^2)(Id + a^4)..., ceil(log2 Cg) steps of matmuls. (Not `solve_triangular`: XLA:CPU's
    triangular-solve call deadlocked next to shard_map collectives on 8 simulated CPU devices.)"""
    steps = (a.shape[-1] - 1).bit_length()
    power = a
    for i in range(steps):
        rhs = rhs + jnp.einsum("htj,hjd->htd", power, rhs)
        if i + 1 < steps:
            power = jnp.einsum("htj,hjl->htl", power, power)
    return rhs


def _chunk(state, inputs):
    """One chunk of Cg tokens, all heads. inputs: q, k [H, Cg, dk]; v [H, Cg, dv]; g, beta [H, Cg]."""
    q, k, v, g, beta = inputs
    length = q.shape[1]
    cum = jnp.cumsum(g, axis=-1)  # gamma_t
    lower = jnp.tril(jnp.ones((length, length), bool))
    strictly_lower = jnp.tril(jnp.ones((length, length), bool), -1)
    diff = cum[:, :, None] - cum[:, None, :]  # gamma_t - gamma_j
    decay = jnp.where(lower, jnp.exp(jnp.where(lower, diff, 0.0)), 0.0)

    k_beta = k * beta[..., None]
    a = -jnp.einsum("htd,hjd->htj", k_beta, k) * jnp.where(strictly_lower, decay, 0.0)
    rhs = jnp.concatenate([v * beta[..., None], k_beta * jnp.exp(cum)[..., None]], axis=-1)
    solved = _solve_unit_lower(a, rhs)
    value, k_cumdecay = solved[..., : v.shape[-1]], solved[..., v.shape[-1] :]
    u = value - jnp.einsum("htd,hdv->htv", k_cumdecay, state)

    o_inter = jnp.einsum("htd,hdv->htv", q * jnp.exp(cum)[..., None], state)
    scores = jnp.einsum("htd,hjd->htj", q, k) * decay
    o = o_inter + jnp.einsum("htj,hjv->htv", scores, u)

    to_end = jnp.exp(cum[:, -1:] - cum)  # e^{gamma_Cg - gamma_j}
    state = state * jnp.exp(cum[:, -1])[:, None, None] + jnp.einsum("hjd,hjv->hdv", k * to_end[..., None], u)
    return state, o


def gated_delta_rule_chunked(q, k, v, g, beta, state, chunk_size: int = 64):
    """Same contract as `gated_delta_rule_sequential`; T need not be a multiple of chunk_size.

    The tail is padded with g = 0, beta = 0, k = 0: such tokens leave the state unchanged and are dropped. T <=
    chunk_size (a short replay or prompt) is one chunk of exactly T tokens, without padding or a loop: a padded chunk
    would cost chunk_size rows (and log2(chunk_size) doubling steps) for T; T = 1 (a decoded token) is one step of
    the recurrence.
    """
    length, heads = q.shape[0], q.shape[1]
    if length == 1:  # a decoded token: the recurrence's own step
        state, o = _step(_at_least_f32(state), tuple(_at_least_f32(x)[0] for x in (q, k, v, g, beta)))
        return o[None], state
    if length <= chunk_size:
        heads_first = lambda x: jnp.moveaxis(_at_least_f32(x), 0, 1)  # [H, T, ...]
        state, o = _chunk(_at_least_f32(state), tuple(map(heads_first, (q, k, v, g, beta))))
        return jnp.moveaxis(o, 0, 1), state
    num_chunks = -(-length // chunk_size)
    pad = num_chunks * chunk_size - length

    def to_chunks(x):
        x = jnp.pad(_at_least_f32(x), [(0, pad)] + [(0, 0)] * (x.ndim - 1))
        x = x.reshape((num_chunks, chunk_size) + x.shape[1:])
        return jnp.moveaxis(x, 2, 1)  # [N, H, Cg, ...]

    state, o = jax.lax.scan(_chunk, _at_least_f32(state), tuple(map(to_chunks, (q, k, v, g, beta))))
    o = jnp.moveaxis(o, 1, 2).reshape(num_chunks * chunk_size, heads, v.shape[-1])
    return o[:length], state
