"""Sequence-parallel building blocks, called inside `shard_map` over the `seq` mesh axis (model-agnostic).

Every shard holds two segments of L positions in the layout of `SeqLayout` (local arrays lead with [2, L, ...]).

- `causal_attention`: softmax attention of the local query segments over all earlier keys of every shard, either by
  passing key/value blocks around a ring (`ppermute`, n - 1 hops, online-softmax merge; O(P / n) memory) or by
  all-gathering the keys and values of the layer (O(P) transient memory, fewer collectives).
- `psum_merge`: exact softmax attention over keys split across shards, from each shard's (out, lse) partial.
- `ring_take`: rows of a seq-sharded array at (shard, slot) pairs, fetched by passing the shards' rows around a ring
  (GLM's capture reads its selected latent rows this way: O(P / n) memory instead of an all-gathered layer).
- `affine_fold`: the exclusive fold of per-segment affine maps S_out = A_i S_in + B_i (Gated DeltaNet; segment i)
  across segments, giving each segment its incoming state.
- `previous_rows`: the last rows of the previous segment (the causal conv's K-1 halo).
Called outside `shard_map`, for engines that walk a prompt in rounds (`RoundLayout`): `round_slots` (each shard's
slots of one round) and `each_round` (the walk itself, forwards or in reverse).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from longstraw_jax.common import progress
from longstraw_jax.ops import attention as attn_ops
from longstraw_jax.ops.dtypes import accum_dtype
from longstraw_jax.sharding import rules
from longstraw_jax.sharding.layout import RoundLayout, SeqLayout

SEQ = "seq"
ATTENTION_METHODS = ("ring", "allgather")


def local_segments(layout: SeqLayout) -> jax.Array:
    """int32 [2]: the natural segment indices of this shard."""
    s = jax.lax.axis_index(SEQ)
    return jnp.stack(layout.segments_of(s)).astype(jnp.int32)


def local_positions(layout: SeqLayout) -> jax.Array:
    """int32 [2, L]: natural positions of this shard's tokens."""
    return local_segments(layout)[:, None] * layout.segment + jnp.arange(layout.segment, dtype=jnp.int32)


def natural_segments(x: jax.Array, layout: SeqLayout) -> jax.Array:
    """Per-shard [2, ...] -> [2n, ...] on every shard, in natural segment order (one all-gather)."""
    gathered = jax.lax.all_gather(x, SEQ)  # [n, 2, ...]
    shard, half = layout.natural_segment_source()
    return gathered[shard, half]


def previous_rows(last_rows: jax.Array, initial: jax.Array, layout: SeqLayout) -> jax.Array:
    """last_rows [2, K-1, conv_dim]: each local segment's last K-1 rows; initial [K-1, conv_dim]: the rows before
    position 0. Returns [2, K-1, conv_dim]: the K-1 rows that precede each local segment (needs L >= K-1). Any row
    width and row count work; these are the GDN conv's."""
    every = natural_segments(last_rows, layout)
    before = jnp.concatenate([initial[None].astype(every.dtype), every[:-1]], axis=0)
    return before[local_segments(layout)]


def affine_fold(a: jax.Array, b: jax.Array, initial: jax.Array, layout: SeqLayout) -> tuple[jax.Array, jax.Array]:
    """Segments map a state by S_out = a @ S_in + b: a [2, H, dk, dk], b [2, H, dk, dv] for the local segments
    (float32); initial [H, dk, dv] is the state before position 0.

    Returns (incoming [2, H, dk, dv]: the state before each local segment, final [H, dk, dv]: after the last
    segment, the same on every shard). (a, b) of all 2n segments are all-gathered and folded in order on every
    shard: 2n small matmuls, no shard waits on another's fold.
    """
    def step(s, ab):
        a_i, b_i = ab
        return jnp.einsum("hdc,hcv->hdv", a_i, s) + b_i, s

    final, before = jax.lax.scan(step, initial, (natural_segments(a, layout), natural_segments(b, layout)))
    return before[local_segments(layout)], final


def psum_merge(part: attn_ops.Attended, axis=SEQ) -> attn_ops.Attended:
    """Exact attention over the union of the shards' disjoint key sets: rescale each partial by exp(lse - max)."""
    top = jax.lax.pmax(jax.lax.stop_gradient(part.lse), axis)  # any common shift is exact; keep it out of autodiff
    weight = jnp.exp(part.lse - top)
    total = jax.lax.psum(weight, axis)  # >= 1: the shard holding the max contributes exp(0)
    out = jax.lax.psum(part.out * weight[..., None], axis) / total[..., None]
    return attn_ops.Attended(out, top + jnp.log(total))


def _empty(q: jax.Array, value_dim: int) -> attn_ops.Attended:
    """Attention over no keys (the merge identity): out 0, lse "minus infinity"."""
    acc = accum_dtype(q.dtype)
    return attn_ops.Attended(jnp.zeros(q.shape[:-1] + (value_dim,), acc), jnp.full(q.shape[:-1], attn_ops.MASKED, acc))


def _to_next_shard(x, shards: int):
    """One hop of a ring: every shard sends x to shard + 1 (mod shards); after h hops shard s holds shard s - h's."""
    return jax.lax.ppermute(x, SEQ, [(i, (i + 1) % shards) for i in range(shards)])


def causal_attention(q, k, v, positions, layout: SeqLayout, *, scale: float, block_size: int,
                     method: str = "ring", left_pad=None, kernels: str = "xla") -> attn_ops.Attended:
    """q [2, L, Hq, hd], k, v [2, L, Hkv, hd], positions int [2, L] (this shard's segments). left_pad (int32 [],
    in the same coordinates as positions, or None): keys at positions < left_pad are pads, never visible.

    Causal attention over the keys of every shard; returns Attended with out [2, L, Hq, hd], lse [2, L, Hq].
    Key blocks that lie wholly in a query segment's future are skipped inside `attend`, and the zigzag layout
    gives every shard the same number of visible (query, key) segment pairs.
    """
    common = dict(scale=scale, block_size=block_size, causal=True, kernels=kernels)
    if left_pad is not None:
        common["left_pad"] = left_pad
    if method == "allgather":
        keys = natural_segments(k, layout).reshape((layout.padded,) + k.shape[2:])
        values = natural_segments(v, layout).reshape((layout.padded,) + v.shape[2:])
        parts = [attn_ops.attend(q[h], keys, values, q_positions=positions[h], k_offset=0, **common) for h in (0, 1)]
        return jax.tree.map(lambda *x: jnp.stack(x), *parts)
    if method != "ring":
        raise ValueError(f"attention method {method!r}; allowed: {ATTENTION_METHODS}")
    n, length = layout.shards, layout.segment
    me = jax.lax.axis_index(SEQ)

    def visit(acc, held, source):
        """Merge the attention of both local query segments over the two key segments `held` (from `source`)."""
        key_segments = layout.segments_of(source)
        out = []
        for h in (0, 1):
            a = jax.tree.map(lambda x: x[h], acc)
            for kh in (0, 1):
                part = attn_ops.attend(q[h], held[0], held[1], q_positions=positions[h],
                                       k_offset=key_segments[kh] * length, kv_index=(kh,), **common)
                a = attn_ops.merge(a, part)
            out.append(a)
        return jax.tree.map(lambda *x: jnp.stack(x), *out)

    acc = visit(_empty(q, v.shape[-1]), (k, v), me)

    def hop(step, carry):
        acc, held = carry
        held = _to_next_shard(held, n)
        return visit(acc, held, (me - step) % n), held

    acc, _ = jax.lax.fori_loop(1, n, hop, (acc, (k, v)))
    return acc


def ring_take(x: jax.Array, shard: jax.Array, slot: jax.Array, shards: int) -> jax.Array:
    """x [S, ...]: this shard's rows of a seq-sharded array; shard, slot int [...]: the rows wanted (shard `shard`'s
    row `slot`; in range). Returns [*shard.shape, *x.shape[1:]]: every wanted row, whichever shard holds it.

    x travels around the ring (`shards` - 1 `ppermute` hops); at each hop the rows of the shard just received are
    taken where wanted. Live: two shards' rows and the result, never the n S rows of an all-gather. Differentiable in
    x: the transpose sends the rows' cotangents back around the ring, each landing on the shard that holds its row.
    """
    me = jax.lax.axis_index(SEQ)

    def take(held, source):
        """The wanted rows `source` holds, zero elsewhere. An out-of-range index, not a mask: the backward keeps one
        int32 index per wanted row and hop, not a mask as wide as the rows."""
        return held.at[jnp.where(shard == source, slot, held.shape[0])].get(mode="fill", fill_value=0)

    def hop(step, carry):
        got, held = carry
        held = _to_next_shard(held, shards)
        return got + take(held, (me - step) % shards), held  # each row is taken at exactly one hop

    return jax.lax.fori_loop(1, shards, hop, (take(x, me), x))[0]


def round_slots(mesh, rounds: RoundLayout, x, index, size: int, axis: int):
    """Each shard's slots [index * rounds.round_slots, + size) along `axis` (the seq-sharded axis) of x: round
    `index` of a seq-sharded array, still seq-sharded."""
    spec = P(*([None] * axis + [SEQ]))
    take = lambda x, i: jax.lax.dynamic_slice_in_dim(x, i * rounds.round_slots, size, axis)
    return rules.shard_map(take, mesh, (spec, P()), spec)(x, index)


def each_round(rounds: RoundLayout, carry, one_round, reverse: bool = False, phase: str | None = None):
    """carry = one_round(carry, layout, index) over the full rounds (a scan; `rounds.round`) and the last round
    (`rounds.last`), in order or reversed; with `phase`, a `progress.tick` after each round (rounds done, of
    full + 1)."""
    total = rounds.full + 1

    def tick(carry, done, positions):
        if phase is not None:
            progress.tick(phase, done, total, positions, after=carry)
        return carry

    def full(carry):
        if not rounds.full:
            return carry

        def step(c, r):
            c = one_round(c, rounds.round, r)
            return tick(c, rounds.full - r + 1 if reverse else r + 1, rounds.round_positions), None

        return jax.lax.scan(step, carry, jnp.arange(rounds.full, dtype=jnp.int32), reverse=reverse)[0]

    def last(carry):
        carry = one_round(carry, rounds.last, jnp.int32(rounds.full))
        return tick(carry, jnp.int32(1 if reverse else total), rounds.last.padded)

    return full(last(carry)) if reverse else last(full(carry))
