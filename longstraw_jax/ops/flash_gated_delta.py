"""The chunked gated delta rule (Gated DeltaNet core) as Pallas kernels for the Triton backend: the contract of
`ops.gated_delta.gated_delta_rule_chunked`, stage by stage as flash-linear-attention's `chunk_gated_delta_rule`.

With chunks of C tokens, per value head (docs/models.md 1.5; gamma = the in-chunk cumulative sum of g):
- stage A, chunk-local (one program per (chunk, head), all chunks at once): gamma, the WY matrix
  A = -(beta k) k^T * e^{gamma_t - gamma_j} (j < t), and the triangular solves (Id - A) [value | w] =
  [beta v | beta e^gamma k] by the doubling product (`_chunk_local`);
- stage B, the inter-chunk state pass (one program per (head, block of value columns), a loop over the chunks):
  u = value - w S, S <- e^{gamma_C} S + (k e^{gamma_C - gamma})^T u, the state at every chunk's start kept
  (`_state_step`; value columns are independent, so blocks of them run side by side);
- stage C, the output (one program per (chunk, head, column block)): o = (q e^gamma) S_start + (q k^T * decay) u
  (`_chunk_output`).

The backward runs the same stages in reverse order, each kernel applying `jax.vjp` of its stage's function to
the tile it holds (C, then B as a reverse loop over the chunks carrying the state's cotangent, then A), so every
derivative is the forward's own by construction, except the solve's: stage A's backward forms T = (Id - A)^-1 and
takes dA = T^T dT T^T in closed form (`_chunk_local_vjp`: the doubling steps' vjp kept too much); the partial
cotangents of q, k, g that several column blocks or stages produce are summed outside. The carried state goes in
and out as in the XLA path (its cotangent too).

Float32 throughout. T is padded to a multiple of C (g = beta = k = 0: the state passes unchanged) and head widths
to powers of two >= 16 (zero channels stay zero); C is chunk_size rounded up to a power of two >= 16, at most
MAX_CHUNK (any C gives the same result, up to round-off).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from longstraw_jax.ops.flash_attention import on_gpu

MAX_CHUNK = 32  # the longest chunk the kernels take (64 at dk = dv = 128: stage A's backward needs 272 KiB of shared
# memory, more than an H100 block's 227 KiB; 32: every kernel <= 92 KiB, tools/triton_resources.py)
COLUMN_BLOCK = 32  # value columns per program in stages B and C (64 of 64-token chunks: the state's backward needs 240
# KiB at dk = dv = 128, more than an H100 block has; 32: 169 KiB, 92 at 32-token chunks; the state pass's programs
# double, 192 for 48 heads)


def _tile(n: int) -> int:
    return max(16, 1 << max(0, n - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class _Static:
    chunk: int  # C
    columns: int  # value columns per program
    interpret: bool


# ----- the three stages on one head's tiles (pure functions, differentiated inside the backward kernels) -----


def _masks(chunk):
    t, j = jnp.arange(chunk)[:, None], jnp.arange(chunk)[None, :]
    return t >= j, t > j  # lower (with the diagonal), strictly lower


def _cumulative(g):
    """gamma_t = g_1 + ... + g_t of one chunk [C] (a masked row sum: Triton has no cumsum)."""
    lower, _ = _masks(g.shape[0])
    return jnp.sum(jnp.where(lower, g[None, :], 0.0), axis=1)


def _last(x):
    """x[C - 1] of a [C] vector (a masked sum: Triton cannot slice a loaded vector)."""
    return jnp.sum(jnp.where(jnp.arange(x.shape[0]) == x.shape[0] - 1, x, 0.0))


def _decay(gamma):
    """[C, C]: e^{gamma_t - gamma_j} for j <= t, else 0 (only exponents <= 0 are evaluated)."""
    lower, _ = _masks(gamma.shape[0])
    return jnp.where(lower, jnp.exp(jnp.where(lower, gamma[:, None] - gamma[None, :], 0.0)), 0.0)


def _dot(a, b):
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _dot_t(a, b):
    """a^T b."""
    return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _dot_bt(a, b):
    """a b^T."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _wy_inputs(k, v, g, beta):
    """Stage A's system, from k [C, dk], v [C, dv], g, beta [C]: (A [C, C] strictly lower, beta v, beta e^gamma k,
    gamma [C])."""
    gamma = _cumulative(g)
    _, strictly_lower = _masks(g.shape[0])
    k_beta = k * beta[:, None]
    a = -_dot_bt(k_beta, k) * jnp.where(strictly_lower, _decay(gamma), 0.0)
    return a, v * beta[:, None], k_beta * jnp.exp(gamma)[:, None], gamma


def _chunk_local(k, v, g, beta):
    """Stage A: k [C, dk], v [C, dv], g, beta [C] -> (value [C, dv], w [C, dk], gamma [C]) with (Id - A) value =
    beta v and (Id - A) w = beta e^gamma k; (Id - A)^-1 = (Id + A)(Id + A^2)(Id + A^4)... (A^C = 0), each factor
    applied to the right-hand sides."""
    a, value, w, gamma = _wy_inputs(k, v, g, beta)
    steps = (g.shape[0] - 1).bit_length()
    for i in range(steps):
        value, w = value + _dot(a, value), w + _dot(a, w)
        if i + 1 < steps:
            a = _dot(a, a)
    return value, w, gamma


def _unit_lower_inverse(a):
    """T = (Id - A)^-1 [C, C] of a strictly lower A, by the same doubling product as a matrix."""
    lower, strictly_lower = _masks(a.shape[0])
    inverse, power = jnp.where(lower & ~strictly_lower, 1.0, 0.0) + a, a
    for _ in range((a.shape[0] - 1).bit_length() - 1):
        power = _dot(power, power)
        inverse = inverse + _dot(inverse, power)
    return inverse


def _chunk_local_vjp(k, v, g, beta, d_value, d_w, d_gamma):
    """Stage A's cotangents of (k, v, g, beta) given those of (value, w, gamma): through the solve in closed form
    (value = T beta v, w = T beta e^gamma k, T = (Id - A)^-1: dA = T^T dT T^T with dT = d_value (beta v)^T +
    d_w (beta e^gamma k)^T), the rest by `jax.vjp` of `_wy_inputs`. (`jax.vjp` of `_chunk_local` would keep every
    doubling step's [C, C] and [C, dk + dv] products: 768 KiB of shared memory at C = 64, dk = dv = 128.)"""
    (a, beta_v, beta_k, _), vjp = jax.vjp(_wy_inputs, k, v, g, beta)
    inverse = _unit_lower_inverse(a)
    d_inverse = _dot_bt(d_value, beta_v) + _dot_bt(d_w, beta_k)
    d_a = _dot_bt(_dot_t(inverse, d_inverse), inverse)
    return vjp((d_a, _dot_t(inverse, d_value), _dot_t(inverse, d_w), d_gamma))


def _state_step(state, value, w, k, gamma):
    """Stage B, one chunk: state [dk, V] (a block of value columns) at the chunk's start -> (u [C, V], the state at
    its end)."""
    u = value - _dot(w, state)
    last = _last(gamma)
    return u, state * jnp.exp(last) + _dot_t(k * jnp.exp(last - gamma)[:, None], u)


def _chunk_output(q, k, u, gamma, state):
    """Stage C: o [C, V] = (q e^gamma) state + (q k^T * decay) u, state the chunk's start state [dk, V]."""
    return _dot(q * jnp.exp(gamma)[:, None], state) + _dot(_dot_bt(q, k) * _decay(gamma), u)


# ----- entry point -----


def gated_delta_rule(q, k, v, g, beta, state, chunk_size: int = MAX_CHUNK, interpret: bool | None = None):
    """q, k: [T, H, dk]; v: [T, H, dv]; g, beta: [T, H]; state: [H, dk, dv]. Returns (o [T, H, dv], state), float32.
    Differentiable in every input (the state included)."""
    if interpret is None:
        interpret = not on_gpu()
    f32 = lambda x: jnp.asarray(x, jnp.promote_types(x.dtype, jnp.float32))
    q, k, v, g, beta, state = map(f32, (q, k, v, g, beta, state))
    length, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    chunk = _tile(min(chunk_size, MAX_CHUNK, length))
    padded = -(-length // chunk) * chunk
    dk, dv = _tile(key_dim), _tile(value_dim)
    rows = lambda x, width=None: jnp.pad(x, [(0, padded - length), (0, 0)] + ([(0, width - x.shape[-1])]
                                                                              if width else []))
    static = _Static(chunk=chunk, columns=min(COLUMN_BLOCK, dv), interpret=interpret)
    o, final = _gdn(static, rows(q, dk), rows(k, dk), rows(v, dv), rows(g), rows(beta),
                    jnp.pad(state, ((0, 0), (0, dk - key_dim), (0, dv - value_dim))))
    return o[:length, :, :value_dim], final[:, :key_dim, :value_dim]


# ----- kernels -----


def _stage_a_kernel(k_ref, v_ref, g_ref, beta_ref, value_ref, w_ref, gamma_ref):
    value_ref[...], w_ref[...], gamma_ref[...] = _chunk_local(k_ref[...], v_ref[...], g_ref[...], beta_ref[...])


def _stage_b_kernel(value_ref, w_ref, k_ref, gamma_ref, state_ref, u_ref, starts_ref, final_ref, *, chunk):
    def body(n, state):
        rows = pl.ds(n * chunk, chunk)
        starts_ref[n] = state
        u, state = _state_step(state, value_ref[rows, :], w_ref[rows, :], k_ref[rows, :], gamma_ref[rows])
        u_ref[rows, :] = u
        return state

    final_ref[...] = jax.lax.fori_loop(0, starts_ref.shape[0], body, state_ref[...])


def _stage_c_kernel(q_ref, k_ref, u_ref, gamma_ref, start_ref, o_ref):
    o_ref[...] = _chunk_output(q_ref[...], k_ref[...], u_ref[...], gamma_ref[...], start_ref[...])


def _stage_c_backward_kernel(q_ref, k_ref, u_ref, gamma_ref, start_ref, do_ref, dq_ref, dk_ref, du_ref, dgamma_ref,
                             dstart_ref):
    _, vjp = jax.vjp(_chunk_output, q_ref[...], k_ref[...], u_ref[...], gamma_ref[...], start_ref[...])
    dq_ref[...], dk_ref[...], du_ref[...], dgamma_ref[...], dstart_ref[...] = vjp(do_ref[...])


def _stage_b_backward_kernel(value_ref, w_ref, k_ref, gamma_ref, starts_ref, du_ref, dstarts_ref, dfinal_ref,
                             dvalue_ref, dw_ref, dk_ref, dgamma_ref, dstate_ref, *, chunk):
    chunks = starts_ref.shape[0]

    def body(i, d_end):  # d_end: the cotangent of the state at the end of chunk n
        n = chunks - 1 - i
        rows = pl.ds(n * chunk, chunk)
        _, vjp = jax.vjp(_state_step, starts_ref[n], value_ref[rows, :], w_ref[rows, :], k_ref[rows, :],
                         gamma_ref[rows])
        d_start, dvalue_ref[rows, :], dw_ref[rows, :], dk_ref[rows, :], dgamma_ref[rows] = vjp((du_ref[rows, :],
                                                                                                 d_end))
        return d_start + dstarts_ref[n]  # the start state is also read by the chunk's output (stage C)

    dstate_ref[...] = jax.lax.fori_loop(0, chunks, body, dfinal_ref[...])


def _stage_a_backward_kernel(k_ref, v_ref, g_ref, beta_ref, dvalue_ref, dw_ref, dgamma_ref, dk_ref, dv_ref, dg_ref,
                             dbeta_ref):
    dk_ref[...], dv_ref[...], dg_ref[...], dbeta_ref[...] = _chunk_local_vjp(
        k_ref[...], v_ref[...], g_ref[...], beta_ref[...], dvalue_ref[...], dw_ref[...], dgamma_ref[...])


# ----- pallas_call wrappers and the custom VJP -----


def _call(static, kernel, grid, in_specs, out_specs, out_shapes, name):
    return pl.pallas_call(kernel, out_shape=out_shapes, grid=grid, in_specs=in_specs, out_specs=out_specs,
                          compiler_params=plt.CompilerParams(num_warps=4, num_stages=2), interpret=static.interpret,
                          name=name)


def _shape(shape):
    return jax.ShapeDtypeStruct(shape, jnp.float32)


class _Specs:
    """BlockSpecs of the [Tp, H, ...] inputs and the [N, H, dk, dv] chunk-start states for each stage's grid."""

    def __init__(self, static, padded, heads, dk, dv):
        self.c, self.v, self.n = static.chunk, static.columns, padded // static.chunk
        self.padded, self.heads, self.dk, self.dv = padded, heads, dk, dv

    # grid (chunk n, head h): one chunk's rows
    def chunk_rows(self, width=None):
        if width is None:
            return pl.BlockSpec((self.c, None), lambda n, h, *_: (n, h))
        return pl.BlockSpec((self.c, None, width), lambda n, h, *_: (n, h, 0))

    # grid (chunk n, head h, column block c)
    def chunk_columns(self):
        return pl.BlockSpec((self.c, None, self.v), lambda n, h, c: (n, h, c))

    def chunk_start(self):
        return pl.BlockSpec((None, None, self.dk, self.v), lambda n, h, c: (n, h, 0, c))

    def partial(self, width=None):  # one column block's share of a sum, [blocks, Tp, H(, width)]
        if width is None:
            return pl.BlockSpec((None, self.c, None), lambda n, h, c: (c, n, h))
        return pl.BlockSpec((None, self.c, None, width), lambda n, h, c: (c, n, h, 0))

    # grid (head h, column block c): every chunk
    def all_rows(self, width=None, columns=False):
        if width is None:
            return pl.BlockSpec((self.padded, None), lambda h, c: (0, h))
        if columns:
            return pl.BlockSpec((self.padded, None, self.v), lambda h, c: (0, h, c))
        return pl.BlockSpec((self.padded, None, width), lambda h, c: (0, h, 0))

    def all_starts(self):
        return pl.BlockSpec((self.n, None, self.dk, self.v), lambda h, c: (0, h, 0, c))

    def state(self):
        return pl.BlockSpec((None, self.dk, self.v), lambda h, c: (h, 0, c))

    def all_partial(self, width=None):
        if width is None:
            return pl.BlockSpec((None, self.padded, None), lambda h, c: (c, 0, h))
        return pl.BlockSpec((None, self.padded, None, width), lambda h, c: (c, 0, h, 0))


def _forward(static, q, k, v, g, beta, state):
    padded, heads, dk = q.shape
    dv = v.shape[-1]
    s = _Specs(static, padded, heads, dk, dv)
    blocks = dv // s.v
    value, w, gamma = _call(
        static, _stage_a_kernel, (s.n, heads),
        [s.chunk_rows(dk), s.chunk_rows(dv), s.chunk_rows(), s.chunk_rows()],
        (s.chunk_rows(dv), s.chunk_rows(dk), s.chunk_rows()),
        (_shape(v.shape), _shape(k.shape), _shape(g.shape)), "gated_delta_chunk_local")(k, v, g, beta)
    u, starts, final = _call(
        static, functools.partial(_stage_b_kernel, chunk=s.c), (heads, blocks),
        [s.all_rows(dv, columns=True), s.all_rows(dk), s.all_rows(dk), s.all_rows(), s.state()],
        (s.all_rows(dv, columns=True), s.all_starts(), s.state()),
        (_shape(v.shape), _shape((s.n, heads, dk, dv)), _shape(state.shape)), "gated_delta_state_pass",
    )(value, w, k, gamma, state)
    o = _call(static, _stage_c_kernel, (s.n, heads, blocks),
              [s.chunk_rows(dk), s.chunk_rows(dk), s.chunk_columns(), s.chunk_rows(), s.chunk_start()],
              s.chunk_columns(), _shape(v.shape), "gated_delta_output")(q, k, u, gamma, starts)
    return (o, final), (value, w, gamma, u, starts)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gdn(static, q, k, v, g, beta, state):
    return _forward(static, q, k, v, g, beta, state)[0]


def _gdn_fwd(static, q, k, v, g, beta, state):
    outputs, stages = _forward(static, q, k, v, g, beta, state)
    return outputs, (q, k, v, g, beta) + stages


def _gdn_bwd(static, residuals, cotangents):
    q, k, v, g, beta, value, w, gamma, u, starts = residuals
    d_o, d_final = cotangents
    padded, heads, dk = q.shape
    dv = v.shape[-1]
    s = _Specs(static, padded, heads, dk, dv)
    blocks = dv // s.v
    partial = lambda width=None: _shape((blocks,) + (q.shape if width else g.shape))
    dq, dk_c, du, dgamma_c, dstarts = _call(
        static, _stage_c_backward_kernel, (s.n, heads, blocks),
        [s.chunk_rows(dk), s.chunk_rows(dk), s.chunk_columns(), s.chunk_rows(), s.chunk_start(), s.chunk_columns()],
        (s.partial(dk), s.partial(dk), s.chunk_columns(), s.partial(), s.chunk_start()),
        (partial(dk), partial(dk), _shape(v.shape), partial(), _shape(starts.shape)), "gated_delta_output_backward",
    )(q, k, u, gamma, starts, d_o)
    dvalue, dw, dk_b, dgamma_b, d_state = _call(
        static, functools.partial(_stage_b_backward_kernel, chunk=s.c), (heads, blocks),
        [s.all_rows(dv, columns=True), s.all_rows(dk), s.all_rows(dk), s.all_rows(), s.all_starts(),
         s.all_rows(dv, columns=True), s.all_starts(), s.state()],
        (s.all_rows(dv, columns=True), s.all_partial(dk), s.all_partial(dk), s.all_partial(), s.state()),
        (_shape(v.shape), partial(dk), partial(dk), partial(), _shape(d_final.shape)), "gated_delta_state_backward",
    )(value, w, k, gamma, starts, du, dstarts, d_final)
    dk_a, dv_a, dg, dbeta = _call(
        static, _stage_a_backward_kernel, (s.n, heads),
        [s.chunk_rows(dk), s.chunk_rows(dv), s.chunk_rows(), s.chunk_rows(), s.chunk_rows(dv), s.chunk_rows(dk),
         s.chunk_rows()],
        (s.chunk_rows(dk), s.chunk_rows(dv), s.chunk_rows(), s.chunk_rows()),
        (_shape(k.shape), _shape(v.shape), _shape(g.shape), _shape(g.shape)), "gated_delta_chunk_local_backward",
    )(k, v, g, beta, dvalue, dw.sum(0), dgamma_c.sum(0) + dgamma_b.sum(0))
    return dq.sum(0), dk_a + dk_c.sum(0) + dk_b.sum(0), dv_a, dg, dbeta, d_state


_gdn.defvjp(_gdn_fwd, _gdn_bwd)
