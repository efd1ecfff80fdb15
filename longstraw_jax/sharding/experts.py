"""Expert parallelism for the routed experts of a MoE layer (GLM-5.x; docs/architecture.md 5.10).

Each device of the mesh holds E / n of a layer's experts (`rules.param_specs` splits the routed-expert weights by
expert index over the whole mesh when n divides E); they are never all-gathered. Inside the sequence-parallel
`shard_map`, every device routes its own tokens (the router and the shared expert stay FSDP, gathered like any layer
weight), and `routed_swiglu` brings each (token, expert) assignment to its expert's device and the result back by
one of two exchanges, chosen by backend (`exchange_for`; `routed_swiglu(..., exchange=)` forces either):

1. `gathered` (XLA:CPU; runs on every backend: all-gather and reduce-scatter only). The tokens, their expert ids and
   routing weights are all-gathered over the mesh: [n * T, D]; each device computes only its own experts' rows
   (`local_experts`: it sorts the n * T * k gathered assignments with its own first, by expert, and runs them
   through its experts in fixed blocks of `block` rows, a `lax.scan` whose blocks past the last local row are
   skipped (`lax.cond`) and rematerialised in the backward); the weighted rows are added to their tokens (partial
   outputs [n * T, D]) and `psum_scatter` returns each device the sums for its own tokens [T, D]. Memory per layer:
   the gathered tokens and the partial outputs (2 n T D) plus one block's rows (block x (D + 3 I)); traffic: the
   n-fold token gather and the reduce-scatter.
2. `ragged` (GPU, TPU: `jax.lax.ragged_all_to_all`, grouped `ragged_dot`). Each device sorts its M = T * k
   assignments by expert (so by destination device), learns every device's send sizes (an all-gather of [n] vectors:
   `_ragged_plan` turns the [n, n] matrix into the primitive's offsets) and sends the rows [M, D] with their local
   expert ids to their experts' devices; a device receives them in source order into a buffer of n * T * min(k, E /
   n) rows (dropless: every device may send it all the rows it can), computes them with `local_experts` (k = 1, unit
   weights, blocks past the received rows skipped) and sends the outputs back by the reverse exchange (the
   transposed size matrix); the routing weights multiply them on the tokens' own device. Traffic: only the routed
   rows, M * D per device each way. Memory per layer: the receive buffer and its outputs, 2 n T min(k, E / n) D (the
   dropless worst case: a token's k experts are distinct, so it sends at most min(k, E / n) rows to one device),
   min(k, E / n) times the gathered path's, plus a block.

Both: every (token, expert) assignment is computed exactly once, by the expert's device, whatever the routing (a
device that receives every row runs all n * T * k / block blocks); the outputs equal one device's up to the order of
the floating-point sum over a token's top-k experts. Under autodiff the collectives transpose into their reverse
(all-gather <-> reduce-scatter; a ragged all-to-all into the reverse ragged all-to-all, JAX's rule): an expert's
weight gradient is computed on its own device, from every token routed to it, and stays there.

Tokens that are the same on every `seq` shard (replay and decoding: the branch's tokens run on every shard) are
computed once: each seq shard sends only its 1 / seq slice of them (`replicated_over_seq`), and the outputs are
all-gathered over `seq` afterwards. Under the collectives' summing transposes each shard's cotangent for the
replicated tokens is then its slice's; their sum over shards is the whole.

Tested where (tests/sharding/test_experts.py, tests/models/test_glm52_mesh.py; CPU only): `gathered` as it runs.
`ragged` with `jax.lax.ragged_all_to_all` replaced by an all-gather emulation of its documented semantics (XLA:CPU
cannot compile the primitive; the emulation is checked against a transcription of the documentation): values and
gradients equal one device, alone and inside the GLM model. Its real program (the primitive, `ragged_dot`) is lowered
for CUDA on a CPU machine, which checks JAX's lowering, not XLA:GPU: the primitive has not compiled or run on a GPU in
this project (nor on a TPU).
"""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from longstraw_jax.ops.dtypes import at_least_f32
from longstraw_jax.ops.lora import shape_of
from longstraw_jax.ops.moe import add_to_tokens, expert_rows
from longstraw_jax.sharding.rules import FSDP
from longstraw_jax.sharding.sequence import SEQ

# (x, experts, weights, gate_proj, up_proj, down_proj, axes, block) -> [T, D]: `gathered` or `ragged`
Exchange = Callable[..., jax.Array]


def routed_swiglu(x: jax.Array, experts: jax.Array, weights: jax.Array, gate_proj: jax.Array, up_proj: jax.Array,
                  down_proj: jax.Array, axes=FSDP, replicated_over_seq: bool = False, block: int | None = None,
                  exchange: Exchange | None = None) -> jax.Array:
    """Inside `shard_map` over `axes`: this device's tokens x [T, D] with their routing (experts int [T, k] global
    ids, weights float32 [T, k]) through the experts of all devices. gate_proj, up_proj [E / n, I, D] and down_proj
    [E / n, D, I] (or LoRA nodes over them, with their experts' adapters) are this device's experts e in
    [i * E / n, (i + 1) * E / n), i = its index along `axes`. -> [T, D] in x.dtype, the same as `grouped_swiglu`
    with all E experts on one device. replicated_over_seq: x and its routing are the same on every `seq` shard
    (each shard then sends only its slice). block: rows per block of `local_experts` (default T * k, after the
    slice). exchange: `gathered` or `ragged` (default: `exchange_for(jax.default_backend())`)."""
    exchange = exchange or exchange_for(jax.default_backend())
    if replicated_over_seq:
        return _seq_slices(lambda *a: routed_swiglu(*a, gate_proj, up_proj, down_proj, axes, block=block,
                                                    exchange=exchange),
                           x, experts, weights, num_experts=shape_of(gate_proj)[0] * jax.lax.axis_size(axes))
    return exchange(x, experts, weights, gate_proj, up_proj, down_proj, axes, block or experts.size)


def exchange_for(backend: str) -> Exchange:
    """The exchange a backend runs: `ragged` where XLA has `ragged_all_to_all` and a grouped `ragged_dot` (GPU,
    TPU), `gathered` elsewhere (XLA:CPU)."""
    return ragged if backend in ("gpu", "cuda", "rocm", "tpu") else gathered


def gathered(x, experts, weights, gate_proj, up_proj, down_proj, axes, block: int) -> jax.Array:
    """The all-gather exchange (module docstring, path 1); arguments as in `routed_swiglu`. -> [T, D]."""
    local = shape_of(gate_proj)[0]
    everyone = lambda a: jax.lax.all_gather(a, axes, tiled=True)
    ids = everyone(experts) - jax.lax.axis_index(axes) * local
    partial = local_experts(everyone(x), ids, everyone(weights), gate_proj, up_proj, down_proj, block)
    return jax.lax.psum_scatter(partial, axes, tiled=True)


def ragged(x, experts, weights, gate_proj, up_proj, down_proj, axes, block: int,
           collective=jax.lax.ragged_all_to_all) -> jax.Array:
    """The ragged all-to-all exchange (module docstring, path 2); arguments as in `routed_swiglu`. -> [T, D].
    collective: `jax.lax.ragged_all_to_all` or a stand-in with its signature and semantics (tests on XLA:CPU).
    Invariants: a token's k ids are distinct (the router's top-k; padding rows: all E), so a token sends at most
    min(k, L) rows to one device and no device receives more than n * T * min(k, L) (the dropless worst case: the
    receive buffer's size); the M = T * k rows leave sorted by expert, hence by destination (ids >= E last, sent
    nowhere); a device's receive buffer holds its received rows first, in source order, then fill (id L: no
    expert)."""
    n, me, local = jax.lax.axis_size(axes), jax.lax.axis_index(axes), shape_of(gate_proj)[0]
    num_tokens, k = experts.shape
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # by destination device, then expert
    sends = jnp.bincount(flat // local, length=n).astype(jnp.int32)  # ids >= E are counted nowhere
    sizes = jax.lax.all_gather(sends, axes)  # [n, n]: sizes[s, d] rows device s sends device d
    received = n * num_tokens * min(k, local)

    def send(operand, fill, buffer_rows, plan):
        output = jnp.full((buffer_rows,) + operand.shape[1:], fill, operand.dtype)
        return collective(operand, output, *plan, axis_name=axes)

    there = _ragged_plan(sizes, me)
    rows = send(x[order // k], 0, received, there)  # [n T min(k, L), D]
    ids = send(flat[order] % local, local, received, there)  # local expert ids; fill `local`: no expert
    out = local_experts(rows, ids[:, None], jnp.ones((received, 1), jnp.float32), gate_proj, up_proj, down_proj,
                        block)
    out = send(out, 0, flat.size, _ragged_plan(sizes.T, me))  # [M, D], sorted like `order`; 0 for ids >= E
    return add_to_tokens(out, order // k, weights.reshape(-1)[order], num_tokens)


def _ragged_plan(sizes: jax.Array, me: jax.Array) -> tuple[jax.Array, ...]:
    """sizes int [n, n] (sizes[s, d]: rows device s sends device d) -> device me's `ragged_all_to_all` arguments
    (input_offsets, send_sizes, output_offsets, recv_sizes), each [n], for rows sent in destination order from
    row 0 of the operand and received in source order from row 0 of the output. The reverse exchange (every row
    back to where it came from) is `_ragged_plan(sizes.T, me)`."""
    before = lambda axis: jnp.cumsum(sizes, axis) - sizes  # rows ahead in the sender's / the receiver's buffer
    return before(1)[me], sizes[me], before(0)[me], sizes[:, me]


def local_experts(x: jax.Array, ids: jax.Array, weights: jax.Array, gate_proj, up_proj, down_proj,
                  block: int) -> jax.Array:
    """sum_j [ids[t, j] local] weights[t, j] * Expert_{ids[t, j]}(x[t]) over this device's L experts: x [N, D];
    ids int [N, k] (local expert index; < 0 or >= L: another device's); weights float32 [N, k]; expert weights
    [L, ...] as in `grouped_swiglu`. -> [N, D] in x.dtype. The M = N * k assignments are sorted local-first by
    expert and computed `block` rows at a time; blocks past the last local row are skipped."""
    num_tokens, k = ids.shape
    local = shape_of(gate_proj)[0]
    flat = ids.reshape(-1)
    mine = (flat >= 0) & (flat < local)
    flat = jnp.where(mine, flat, local)
    order = jnp.argsort(flat, stable=True)  # this device's assignments first, grouped by expert
    counts = jnp.bincount(flat, length=local).astype(jnp.int32)
    ends = jnp.cumsum(counts)
    starts = ends - counts
    num_blocks = -(-flat.size // block)
    pad = num_blocks * block - flat.size
    order = jnp.pad(order, (0, pad))
    row_weights = jnp.pad(jnp.where(mine, weights.reshape(-1), 0)[order[:flat.size]], (0, pad))

    def compute(first):
        rows = jax.lax.dynamic_slice_in_dim(order, first, block)
        sizes = jnp.clip(ends, first, first + block) - jnp.clip(starts, first, first + block)  # per expert, here
        out = expert_rows(x[rows // k], sizes, gate_proj, up_proj, down_proj)
        w = jax.lax.dynamic_slice_in_dim(row_weights, first, block)
        return rows // k, (at_least_f32(out) * w[:, None]).astype(x.dtype)

    skip = lambda first: (jnp.zeros((block,), order.dtype), jnp.zeros((block, x.shape[-1]), x.dtype))

    @jax.checkpoint
    def one_block(first):
        return jax.lax.cond(first < ends[-1], compute, skip, first)

    def step(out, b):
        tokens, rows = one_block(b * block)
        return out.at[tokens].add(rows), None

    init = jnp.zeros((num_tokens, x.shape[-1]), x.dtype)
    return jax.lax.scan(step, init, jnp.arange(num_blocks, dtype=jnp.int32))[0]


def _seq_slices(fn, x, experts, weights, num_experts: int):
    """fn over this `seq` shard's 1 / seq slice of tokens that are the same on every shard (padded to a multiple of
    the shard count: padding rows route to no expert), its outputs all-gathered over `seq` -> [T, D]."""
    shards, tokens = jax.lax.axis_size(SEQ), x.shape[0]
    per = -(-tokens // shards)
    pad = per * shards - tokens
    x, weights = (jnp.pad(a, ((0, pad), (0, 0))) for a in (x, weights))
    experts = jnp.pad(experts, ((0, pad), (0, 0)), constant_values=num_experts)
    mine = lambda a: jax.lax.dynamic_slice_in_dim(a, jax.lax.axis_index(SEQ) * per, per)
    out = fn(mine(x), mine(experts), mine(weights))
    return jax.lax.all_gather(out, SEQ, tiled=True)[:tokens]
