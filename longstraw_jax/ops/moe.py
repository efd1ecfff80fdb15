"""Mixture of experts (docs/models.md 2.9): the sigmoid top-k router and the sort-based grouped expert computation.

Routing is discrete: the chosen experts are constants of the computation (as in autograd of transformers' module),
gradients flow through the chosen experts' weights and outputs. The correction bias only ranks experts.

The experts run as a grouped matmul: the M = T * Ek (token, expert) assignments are sorted by expert, each expert's
weights multiply only its own contiguous rows (`jax.lax.ragged_dot_general`), and the weighted rows are added back
to their tokens. Weights keep transformers' `[out, in]` orientation per expert (no transposes).

Backends: on GPU/TPU `ragged_dot` lowers to a grouped GEMM. On XLA:CPU jax 0.10.2 expands `ragged_dot` to a masked
dense `[E, M, D]` product (E times the memory of a grouped GEMM: 192 GiB per layer for GLM-5.2 at 64K tokens), so
on CPU the experts run one at a time in a `lax.scan` (`_grouped_scan`: each step multiplies all rows by one expert
and keeps its own rows; E times the work, the memory of a grouped GEMM). Tests run that path; the capacity planner
compiles it, so its sizes stand for the GPU's grouped GEMM rather than for CPU's expansion.
"""
import jax
import jax.numpy as jnp

from longstraw_jax.ops import lora
from longstraw_jax.ops.dtypes import accum_dtype, at_least_f32

_HIGHEST = jax.lax.Precision.HIGHEST


def route(x: jax.Array, weight: jax.Array, bias: jax.Array, *, top_k: int, n_group: int, topk_group: int,
          norm_topk_prob: bool, scaling: float) -> tuple[jax.Array, jax.Array]:
    """Noaux-tc sigmoid router. x [T, D]; weight [E, D]; bias [E] (selection only).

    Returns (experts int32 [T, Ek], weights float32 [T, Ek]): `sigmoid(x @ weight.T)` in float32 at the chosen
    experts, normalised over the Ek (if norm_topk_prob) and times `scaling`. Selection ranks `sigmoid + bias`,
    restricted to the `topk_group` groups (of E / n_group experts) with the largest sum of their two best biased
    scores.
    """
    scores = jax.nn.sigmoid(jnp.einsum("td,ed->te", at_least_f32(x), at_least_f32(weight), precision=_HIGHEST))
    choice = jax.lax.stop_gradient(scores) + at_least_f32(bias)
    num_experts = weight.shape[0]
    if n_group > 1:
        grouped = choice.reshape(-1, n_group, num_experts // n_group)
        group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [T, n_group]
        keep = jax.lax.top_k(group_scores, topk_group)[1]
        group_mask = jnp.zeros(group_scores.shape, bool).at[jnp.arange(group_scores.shape[0])[:, None], keep].set(True)
        choice = jnp.where(jnp.repeat(group_mask, num_experts // n_group, axis=-1), choice, -jnp.inf)
    experts = jax.lax.top_k(choice, top_k)[1].astype(jnp.int32)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return experts, weights * scaling


def merged_rows(sizes: jax.Array, num_rows: int) -> tuple[jax.Array, jax.Array]:
    """N batches of M = num_rows rows, each sorted by group (sizes int [N, E]: batch n's first sizes[n, 0] rows are
    group 0's, ...; rows past sum(sizes[n]) belong to no group) -> (where int32 [N, M]: each row's place in the
    batches merged into one [N * M] sorted by group, merged sizes int32 [E] = sizes summed over the batches).

    Merged order: group 0's rows of batch 0, of batch 1, ..., then group 1's, ...; rows of no group last, in batch
    order (past sum(merged sizes): no group there either). `where` is a permutation of range(N * M)."""
    sizes = sizes.astype(jnp.int32)
    merged = jnp.sum(sizes, axis=0)
    ends = jnp.cumsum(sizes, axis=1)  # [N, E]: one past batch n's last row of group e
    row = jnp.arange(num_rows, dtype=jnp.int32)
    group = jax.vmap(lambda e: jnp.searchsorted(e, row, side="right"))(ends)  # [N, M]; E: no group
    in_group = group < sizes.shape[1]
    g = jnp.minimum(group, sizes.shape[1] - 1)
    take = lambda a: jnp.take_along_axis(a, g, axis=1)
    group_start = (jnp.cumsum(merged) - merged)[g]  # the group's first merged row
    earlier = take(jnp.cumsum(sizes, axis=0) - sizes)  # the group's rows in earlier batches
    placed = group_start + earlier + row - take(ends - sizes)
    used = ends[:, -1]  # [N] rows in some group
    spare = num_rows - used
    rest = jnp.sum(merged) + (jnp.cumsum(spare) - spare)[:, None] + row - used[:, None]
    return jnp.where(in_group, placed, rest).astype(jnp.int32), merged


def _merge(rows: jax.Array, where: jax.Array) -> jax.Array:
    """rows [N, M, ...] -> [N * M, ...] in merged order (`merged_rows`' where)."""
    flat = rows.reshape((-1,) + rows.shape[2:])
    return flat[jnp.argsort(where.reshape(-1))]


def _unmerge(merged: jax.Array, where: jax.Array) -> jax.Array:
    """[N * M, ...] in merged order -> [N, M, ...]."""
    return merged[where]


def _shared_weights(f):
    """f(lhs [M, k], rhs [E, ...], sizes [E]) -> [M, ...], batched under `vmap` with the expert weights rhs shared
    (unbatched: a caller vmapping a model over branches): the N batches' rows merge into one [N * M] sorted by group
    (`merged_rows`), f runs once on them, so each expert's weights are read once for all N and never copied per
    batch, and the rows are put back [N, M, ...]. With rhs batched too, whatever is unbatched is broadcast (the
    batching rule of `ragged_dot_general`, jax 0.10.2, needs every operand batched)."""
    g = jax.custom_batching.custom_vmap(f)

    @g.def_vmap
    def rule(axis_size, in_batched, lhs, rhs, sizes):
        full = lambda a, b: a if b else jnp.broadcast_to(a, (axis_size,) + a.shape)
        lhs, sizes = full(lhs, in_batched[0]), full(sizes, in_batched[2])
        if in_batched[1]:
            return jax.vmap(f)(lhs, rhs, sizes), True
        where, merged = merged_rows(sizes, lhs.shape[1])
        return _unmerge(g(_merge(lhs, where), rhs, merged), where), True  # g: an outer vmap merges again

    return g


def _all_batched(f):
    """f under `vmap` with its unbatched arguments broadcast (`ragged_dot_general`'s batching rule needs every operand
    batched): for products whose operands are per batch anyway (the weights' cotangent, from rows)."""
    g = jax.custom_batching.custom_vmap(f)

    @g.def_vmap
    def rule(axis_size, in_batched, *args):
        args = [a if b else jnp.broadcast_to(a, (axis_size,) + a.shape) for a, b in zip(args, in_batched)]
        return jax.vmap(f)(*args), True

    return g


def _ragged(lhs, rhs, sizes, rhs_contracting: int):
    """lhs [M, k] (rows sorted by group) x rhs [E, a, b]: row block e times rhs[e], contracting rhs's dimension
    rhs_contracting (2: rhs [E, out, in] -> [M, out]; 1: rhs transposed, [E, out, in] -> [M, in]), float32."""
    numbers = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [rhs_contracting]), ([], [])),
                                                lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
    return jax.lax.ragged_dot_general(lhs, rhs, sizes, numbers, preferred_element_type=accum_dtype(lhs.dtype))


def _ragged_weights(d_out, lhs, sizes):
    """d_out [M, out], lhs [M, in] (rows sorted by group) -> [E, out, in]: group e's rows' sum of d_out^T lhs."""
    numbers = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([0], [0]), ([], [])),
                                                lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
    return jax.lax.ragged_dot_general(d_out, lhs, sizes, numbers, preferred_element_type=accum_dtype(lhs.dtype))


_rows_times_experts = _shared_weights(lambda lhs, rhs, sizes: _ragged(lhs, rhs, sizes, 2))
_rows_times_experts_t = _shared_weights(lambda d_out, rhs, sizes: _ragged(d_out, rhs, sizes, 1))
_experts_cotangent = _all_batched(_ragged_weights)


@jax.custom_vjp
def _grouped_ragged(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """lhs [M, in] (rows sorted by group) x rhs [E, out, in] -> [M, out] (float32): row block e multiplies rhs[e].
    A custom VJP (the transpose `ragged_dot` defines) so that the forward and backward can both be vmapped. Under a
    vmap with the weights shared, the forward and the rows' cotangent read each expert once for all batches
    (`_shared_weights`); the weights' cotangent is per batch, as `vmap` defines it (the gradient of a sum over the
    batches then sums them)."""
    return _rows_times_experts(lhs, rhs, group_sizes)


def _grouped_ragged_bwd(residuals, d_out):
    lhs, rhs, sizes = residuals
    d_lhs = _rows_times_experts_t(d_out.astype(rhs.dtype), rhs, sizes).astype(lhs.dtype)
    return d_lhs, _experts_cotangent(d_out.astype(lhs.dtype), lhs, sizes).astype(rhs.dtype), None


_grouped_ragged.defvjp(lambda lhs, rhs, sizes: (_rows_times_experts(lhs, rhs, sizes), (lhs, rhs, sizes)),
                       _grouped_ragged_bwd)


def _rows_of(group_sizes: jax.Array, num_rows: int):
    """e -> bool [M]: the rows of group e (rows sorted by group, group e has group_sizes[e] rows)."""
    ends = jnp.cumsum(group_sizes)
    row = jnp.arange(num_rows)
    return lambda e: (row >= ends[e] - group_sizes[e]) & (row < ends[e])


@jax.custom_vjp
def _grouped_scan(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """As `_grouped_ragged`, one expert at a time (a scan over E): memory O(M * out), never O(E * M * out)."""
    rows_of = _rows_of(group_sizes, lhs.shape[0])

    def step(out, e):
        y = jnp.einsum("mi,oi->mo", lhs, rhs[e], preferred_element_type=accum_dtype(lhs.dtype))
        return jnp.where(rows_of(e)[:, None], y, out), None

    init = jnp.zeros((lhs.shape[0], rhs.shape[1]), accum_dtype(lhs.dtype))
    return jax.lax.scan(step, init, jnp.arange(rhs.shape[0]))[0]


def _grouped_scan_bwd(residuals, d_out):
    """d lhs = sum_e [rows of e] d_out rhs[e]; d rhs[e] = (d_out on rows of e)^T lhs (stacked by the scan)."""
    lhs, rhs, group_sizes = residuals
    rows_of = _rows_of(group_sizes, lhs.shape[0])
    acc = accum_dtype(lhs.dtype)

    def step(d_lhs, e):
        d = jnp.where(rows_of(e)[:, None], d_out, 0).astype(acc)
        d_lhs = d_lhs + jnp.einsum("mo,oi->mi", d, rhs[e].astype(acc))
        return d_lhs, jnp.einsum("mo,mi->oi", d, lhs.astype(acc)).astype(rhs.dtype)

    d_lhs, d_rhs = jax.lax.scan(step, jnp.zeros(lhs.shape, acc), jnp.arange(rhs.shape[0]))
    return d_lhs.astype(lhs.dtype), d_rhs, None


_grouped_scan.defvjp(lambda lhs, rhs, sizes: (_grouped_scan(lhs, rhs, sizes), (lhs, rhs, sizes)), _grouped_scan_bwd)


def _grouped(lhs: jax.Array, rhs, group_sizes: jax.Array) -> jax.Array:
    """The backend's grouped matmul (module docstring): `ragged_dot` on GPU/TPU, one expert at a time on CPU. rhs may
    be a `ops.lora.LoRA` node over the expert stack (per-expert adapters: three grouped matmuls, never merged)."""
    return lora.grouped(_grouped_scan if jax.default_backend() == "cpu" else _grouped_ragged, lhs, rhs, group_sizes)


def expert_rows(rows: jax.Array, sizes: jax.Array, gate_proj, up_proj, down_proj) -> jax.Array:
    """rows [M, D] sorted by expert (the first sizes[0] rows are expert 0's, the next sizes[1] expert 1's, ...; rows
    past sum(sizes) belong to no expert) -> Expert_e(row) [M, D] in rows.dtype (0 for rows of no expert), one grouped
    matmul per projection. Weights as in `grouped_swiglu`."""
    gate, up = (_grouped(rows, w, sizes).astype(rows.dtype) for w in (gate_proj, up_proj))
    return _grouped(jax.nn.silu(gate) * up, down_proj, sizes).astype(rows.dtype)


def grouped_swiglu(x: jax.Array, experts: jax.Array, weights: jax.Array, gate_proj: jax.Array, up_proj: jax.Array,
                   down_proj: jax.Array) -> jax.Array:
    """sum_j weights[t, j] * Expert_{experts[t, j]}(x[t]), Expert_e(u) = down_e(silu(gate_e(u)) * up_e(u)).

    x [T, D]; experts int [T, Ek]; weights [T, Ek]; gate_proj, up_proj [E, I, D]; down_proj [E, D, I] (each may be
    a LoRA node with per-expert adapters). Returns [T, D] in x.dtype. Work is proportional to the M = T * Ek rows
    (on backends with a grouped `ragged_dot`), never T * E. An id >= E means "not one of these experts" (expert
    parallelism: another device's): such rows sort last, belong to no group and contribute nothing.
    """
    num_tokens, k = experts.shape
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # assignments grouped by expert
    token = order // k
    num_experts = lora.shape_of(gate_proj)[0]
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)  # ids >= E are counted nowhere
    out = expert_rows(x[token], sizes, gate_proj, up_proj, down_proj)
    weights = jnp.where(flat < num_experts, weights.reshape(-1), 0)[order]  # float32; 0 for rows of no group
    return add_to_tokens(out, token, weights, num_tokens)


def _gathered(lhs: jax.Array, rhs: jax.Array, expert_of_row: jax.Array) -> jax.Array:
    """lhs [M, in] x rhs[expert_of_row[m]] ([E, out, in] gathered to [M, out, in]) -> [M, out] (float32)."""
    return jnp.einsum("mi,moi->mo", lhs, rhs[expert_of_row], preferred_element_type=accum_dtype(lhs.dtype))


def gathered_swiglu(x: jax.Array, experts: jax.Array, weights: jax.Array, gate_proj, up_proj, down_proj) -> jax.Array:
    """`grouped_swiglu` for a few tokens (decoding): each (token, slot) row gathers its own expert's weights, so a
    step reads M = T * Ek expert matrices per projection, not all E, and the stack is never copied whole (the
    grouped matmul on CPU multiplies every row by all E experts, and slicing a layer's stack for it copies all E).
    Under `jax.vmap` over N branches it reads N * M: the form for N * M below E (GLM-5.2: E 256, Ek 8).

    Same arguments and result as `grouped_swiglu` (every id < E: one device's experts); the slots' weighted outputs
    are summed in slot order, not in expert order (equal up to round-off)."""
    num_tokens, k = experts.shape
    ids = experts.reshape(-1)
    rows = jnp.repeat(x, k, axis=0)  # row t * k + j: token t through its slot j
    gate, up = (lora.grouped(_gathered, rows, w, ids).astype(x.dtype) for w in (gate_proj, up_proj))
    out = lora.grouped(_gathered, jax.nn.silu(gate) * up, down_proj, ids).astype(x.dtype)
    return add_to_tokens(out, jnp.arange(num_tokens * k) // k, weights.reshape(-1), num_tokens)


def decoding_swiglu(x: jax.Array, experts: jax.Array, weights: jax.Array, gate_proj, up_proj, down_proj) -> jax.Array:
    """`grouped_swiglu` for a decoded token, by backend (as `_grouped`): on a CPU `gathered_swiglu` (the CPU's grouped
    matmul runs every row through all E experts); elsewhere `grouped_swiglu` (`ragged_dot`: under the sampler's vmap
    the branches' rows merge into one call and each chosen expert is read once, where gathering would copy N x k
    expert matrices per layer and step)."""
    swiglu = gathered_swiglu if jax.default_backend() == "cpu" else grouped_swiglu
    return swiglu(x, experts, weights, gate_proj, up_proj, down_proj)


def add_to_tokens(rows: jax.Array, tokens: jax.Array, weights: jax.Array, num_tokens: int) -> jax.Array:
    """sum over rows r of weights[r] * rows[r], added to token tokens[r]: rows [M, D]; tokens int [M] in
    [0, num_tokens); weights float32 [M] (products in float32, rounded to rows.dtype). -> [num_tokens, D]."""
    out = (at_least_f32(rows) * weights[:, None]).astype(rows.dtype)
    return jnp.zeros((num_tokens, rows.shape[-1]), rows.dtype).at[tokens].add(out)
