"""Qwen3.6 (docs/models.md 1)'s forward passes on a ("data", "seq") mesh: sequence-parallel capture, replay over the
seq-sharded prompt state, and decoding after it. The layer code is the model's own (`Qwen36.block_with_reader`);
this file supplies the *readers* through which a layer sees the prompt on one shard, and the drivers that walk
rounds and blocks.

Capture: a round of the prompt is laid out by `SeqLayout` (two segments per `seq` shard, padded at the end);
parameters stay FSDP-sharded and each layer is all-gathered just before use (`layer_params`). Per layer, every shard
works on its own segments only (`RoundReader`):
- gated attention: `sequence.causal_attention` (ring or all-gather of keys/values), merged by log-sum-exp with the
  round's queries over the cache of earlier rounds (every shard attends all shards' queries over its own slots);
- Gated DeltaNet: the conv reads a K-1 row halo from the previous segment; the delta rule runs once per segment
  from the augmented state [0 | Id] with values [v | 0] (the rule is linear in (values, state) jointly), which yields
  in one pass the local outputs o0, the segment's affine map S_out = A_i S_in + B_i (B_i and A_i are the two column
  blocks of the final state) and q'_t = A_{<=t}^T q_t (the last dk output columns). `sequence.affine_fold` gives the
  incoming state S_in, and the exact outputs are o_t = o0_t + S_in^T q'_t: no second pass, no shard idles.
Rounds (`RoundLayout`): only one round's activations are live; the GDN state and conv tail carry across rounds;
position-wise work runs in blocks of ROWS rows (`rowwise`).
Replay (`ReplayReader`): the branch runs on every shard; the GDN state is replicated and read as on one device;
attention over the seq-sharded prompt cache is merged across shards by log-sum-exp (`sequence.psum_merge`).

It depends on the model only through its methods (no import of qwen36/model.py, which imports the adapter).
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from einops import rearrange
from jax.sharding import PartitionSpec as P

from longstraw_jax.common import progress
from longstraw_jax.models.qwen36.layers import tail_block
from longstraw_jax.ops import attention as attn_ops
from longstraw_jax.ops.conv import causal_depthwise_conv
from longstraw_jax.ops.dtypes import accum_dtype
from longstraw_jax.sharding import rules, sequence
from longstraw_jax.sharding.layout import RoundLayout, SeqLayout, ShardedPromptState
from longstraw_jax.sharding.rules import gather_layer, param_specs, prompt_state_specs
from longstraw_jax.sharding.sequence import SEQ
from longstraw_jax.sharding.tensor import tensor_parallel_layer, varying_axes

ROWS = 4096  # position-wise work (projections, norms, MLP) runs over at most this many local positions at a time
_KV = P(None, None, SEQ)  # a KV cache or its cotangent: [blocks (or 1), nf, S, Hkv, hd], S split along seq


def _by_rows(fn, *xs, rows: int | None = None):
    """fn(*xs) for a row-wise fn (row i of every output depends only on row i of every input), computed over blocks
    of `rows` leading-axis rows in a `lax.map` (the last block zero-padded), so that fn's intermediates exist for one
    block at a time: at P / seq positions per device the wide ones (MLP, GDN projections) would not fit whole."""
    t, rows = xs[0].shape[0], rows or ROWS
    if t <= rows:
        return fn(*xs)
    n = -(-t // rows)
    blocks = [jnp.pad(x, [(0, n * rows - t)] + [(0, 0)] * (x.ndim - 1)).reshape((n, rows) + x.shape[1:]) for x in xs]
    out = jax.lax.map(lambda args: fn(*args), tuple(blocks))
    return jax.tree.map(lambda y: y.reshape((n * rows,) + y.shape[2:])[:t], out)


# the matrices the layer code applies only through `ops.mlp.linear`: decoding multiplies by their shards in place
LINEAR_LEAVES = frozenset({"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "q_proj", "k_proj",
                           "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})


class _ShardedLayers(NamedTuple):
    """What every reader on the mesh shares: FSDP-sharded layers gathered whole one at a time, rows in blocks; or,
    decoding (`tensor_parallel`), the matrices applied as shards (`sharding/tensor.py`: no weights move, only the
    few tokens' activations) and the small rest gathered. varying: the mesh axes over which the tokens differ."""

    specs: dict  # param_specs(params)["blocks"]: {"linear": ..., "full": ...} specs of the stacked leaves
    tensor_parallel: bool = False
    varying: tuple = ()

    def layer_params(self, p: dict, group: str) -> dict:
        if self.tensor_parallel:
            return tensor_parallel_layer(p, self.specs[group], LINEAR_LEAVES, self.varying)
        return gather_layer(p, self.specs[group])

    def rowwise(self, fn, *xs):
        return _by_rows(fn, *xs)


# ----- capture -------------------------------------------------------------------------------------------------


class RoundReader(NamedTuple):
    """Inside `shard_map`: block b's layers in capture round `index` (laid out by `layout`) on this shard. carry:
    (conv, recurrent) carried into the round and this shard's (keys, values) cache [nb, nf, S, Hkv, hd], each with a
    leading block axis; the caches are only read (the first index * round_slots slots: earlier rounds).
    positions [2L]: the natural positions of this shard's two segments; within [2, L]: the same within the round.
    left_pad (int32 [] or None): natural positions < left_pad are the prompt's pads (in the first shard(s))."""

    carry: tuple
    b: Any
    index: Any
    rounds: RoundLayout
    layout: SeqLayout
    method: str
    within: jax.Array
    positions: jax.Array
    layers: _ShardedLayers
    left_pad: Any = None

    def layer_params(self, p, group):
        return self.layers.layer_params(p, group)

    def rowwise(self, fn, *xs):
        return self.layers.rowwise(fn, *xs)

    def conv(self, mixed, weight, j):
        """The causal conv of both segments, each after the K-1 rows that precede it (the previous segment's last
        rows, or the carried tail before the round); the new tail is read from the shard holding the round's end."""
        layout, km1 = self.layout, weight.shape[-1] - 1
        seg, tail_in = layout.segment, self.carry[0][self.b, j]
        mixed = rearrange(mixed, "(a t) c -> a t c", a=2)  # [2 segments, L, conv_dim]
        halo = sequence.previous_rows(mixed[:, seg - km1 :], tail_in.astype(mixed.dtype), layout)
        out = jax.vmap(lambda m, t: causal_depthwise_conv(m, weight, t)[0])(mixed, halo)
        last = (layout.length - 1) // seg  # the natural segment holding the round's last real position
        owner, half = (int(a[last]) for a in layout.natural_segment_source())
        extended = jnp.concatenate([halo[half], mixed[half]], axis=0)
        start = layout.length - last * seg
        tail = jnp.where(jax.lax.axis_index(SEQ) == owner, extended[start : start + km1], 0)
        return rearrange(out, "a t c -> (a t) c"), jax.lax.psum(tail, SEQ).astype(tail_in.dtype)

    def delta_rule(self, core, q, k, v, g, beta, j):
        """Each segment once from the augmented state [0 | Id], then the affine fold across segments (module doc)."""
        (hv, dk), dv = q.shape[1:], v.shape[-1]
        real = (self.within < self.layout.length).reshape(-1, 1)  # padding: no decay, no write (state unchanged)
        beta, g = jnp.where(real, beta, 0), jnp.where(real, g, 0)
        f32 = accum_dtype(v.dtype)
        v_aug = jnp.concatenate([v.astype(f32), jnp.zeros(v.shape[:-1] + (dk,), f32)], axis=-1)
        s_aug = jnp.concatenate([jnp.zeros((hv, dk, dv), f32), jnp.broadcast_to(jnp.eye(dk, dtype=f32), (hv, dk, dk))],
                                axis=-1)
        per_segment = lambda x: rearrange(x, "(a t) ... -> a t ...", a=2)
        # a Python loop, not vmap: a vmapped chunked rule (batched triangular solves) deadlocked XLA:CPU collectives
        runs = [core(*(a[h] for a in map(per_segment, (q, k, v_aug, g, beta))), s_aug) for h in (0, 1)]
        o_aug, end = (jnp.stack(x) for x in zip(*runs))
        state_in = self.carry[1][self.b, j].astype(f32)
        incoming, final = sequence.affine_fold(end[..., dv:], end[..., :dv], state_in, self.layout)
        o = o_aug[..., :dv] + jnp.einsum("athd,ahdv->athv", o_aug[..., dv:], incoming)
        return rearrange(o, "a t h v -> (a t) h v"), final

    def attend(self, q, k, v, j, *, scale, block_size, kernels):
        """Causal attention within the round across shards, merged with attention over earlier rounds' cache."""
        layout, rounds = self.layout, self.rounds
        per_segment = lambda x: rearrange(x, "(a t) ... -> a t ...", a=2)
        common = dict(scale=scale, block_size=block_size, kernels=kernels)
        within_pad = None if self.left_pad is None else self.left_pad - self.index * rounds.round_positions
        att = sequence.causal_attention(per_segment(q), per_segment(k), per_segment(v), self.within, layout,
                                        method=self.method, left_pad=within_pad, **common)
        if rounds.full:
            # Every shard's queries see every shard's earlier slots: each shard attends the round's queries of all
            # shards over its own slots (same work as its own queries over all slots), the partials merge by psum.
            keys, values = self.carry[2], self.carry[3]
            queries = jax.lax.all_gather(q, SEQ)  # [n, 2L, Hq, hd]
            pads = {} if self.left_pad is None else dict(left_pad=self.left_pad,
                                                         kv_positions=rounds.slot_positions(jax.lax.axis_index(SEQ)))
            part = _by_rows(lambda q: attn_ops.attend(
                q, keys, values, k_offset=0, causal=False, kv_length=self.index * rounds.round_slots,
                q_positions=jnp.zeros(q.shape[0], jnp.int32), kv_index=(self.b, j), **pads, **common),
                rearrange(queries, "n t h d -> (n t) h d"))
            mine = jax.tree.map(lambda x: per_segment(rearrange(x, "(n t) ... -> n t ...", n=queries.shape[0])[
                jax.lax.axis_index(SEQ)]), sequence.psum_merge(part))
            att = attn_ops.merge(att, mine)
        return jax.tree.map(lambda x: rearrange(x, "a t ... -> (a t) ..."), att)


def round_block(model, block_specs, method, rounds: RoundLayout, layout: SeqLayout, index, bp, h, carry, b,
                left_pad=None):
    """Block `b` of round `index` on this shard: h [2L, D] -> (h, entries {"linear": (tails, states) [nl, ...],
    "full": (keys, values) [nf, 2L, Hkv, hd], zero at padding positions}). bp: the block's FSDP-sharded parameters
    ({group: leaves [per_block, ...]}). carry: as `RoundReader.carry`. left_pad: the prompt's pads (or None)."""
    within = sequence.local_positions(layout)
    reader = RoundReader(carry, b, index, rounds, layout, method, within,
                         index * rounds.round_positions + within.reshape(-1), _ShardedLayers(block_specs), left_pad)
    h, entries = model.block_with_reader(bp, h, reader)
    real = (within.reshape(-1) < layout.length)[None, :, None, None]
    return h, dict(entries, full=tuple(jnp.where(real, x, 0) for x in entries["full"]))


def _capture_round(model, block_specs, method, blocks, h, layout: SeqLayout, index, rounds: RoundLayout, carry,
                   left_pad=None):
    """One round (round number `index`, laid out by `layout`) over this shard's h [2L, D], given the carried state
    and cache of the rounds before it; returns the carry with the round's state written in."""
    @jax.checkpoint
    def body(h, xs):
        bp, b = xs
        return round_block(model, block_specs, method, rounds, layout, index, bp, h, carry, b, left_pad)

    _, entries = jax.lax.scan(body, h, (blocks, jnp.arange(model.num_blocks)))
    (conv, recurrent), (k, v) = entries["linear"], entries["full"]
    slots = index * rounds.round_slots
    write = lambda cache, new: jax.lax.dynamic_update_slice_in_dim(cache, new.astype(cache.dtype), slots, axis=2)
    return conv, recurrent, write(carry[2], k), write(carry[3], v)


def boundaries_per_shard(rounds: RoundLayout) -> int:
    """Round boundaries each shard keeps: the rounds.full + 1 GDN states carried into the rounds are spread over the
    shards (round r on shard r // per), so no device holds all of them."""
    return -(-(rounds.full + 1) // rounds.shards)


def _keep_boundary(owned, carried, r, per: int):
    """Store the GDN state carried into round r at its owner's slot r % per; other shards write the scratch slot
    `per` (buffers [per + 1, ...])."""
    slot = jnp.where(jax.lax.axis_index(SEQ) == r // per, r % per, per)
    return jax.tree.map(lambda buf, x: buf.at[slot].set(x.astype(buf.dtype)), owned, carried)


def read_boundary(owned, r, per: int):
    """Inside `shard_map`: round r's boundary (conv, recurrent), on every shard (a psum from its owner; exact)."""
    mine = jax.lax.axis_index(SEQ) == r // per
    return jax.tree.map(lambda buf: jax.lax.psum(jnp.where(mine, buf[r % per], 0).astype(buf.dtype), SEQ), owned)


def _capture_local(model, rounds: RoundLayout, block_specs, method, blocks, h, left_pad=None):
    """This shard's h [rounds.per_shard, D] -> ((conv, recurrent, keys, values), boundaries): a scan over the full
    rounds, then the last round. Only one round's activations are ever live; the cache fills in place.
    boundaries: this shard's (conv, recurrent) carried into its rounds, [per + 1, ...] (`boundaries_per_shard`;
    the last slot is scratch), for the exact backward (`read_boundary`)."""
    empty = model.init_state(rounds.per_shard, h.dtype)
    carry = (empty.conv, empty.recurrent, empty.keys, empty.values)
    one_round = lambda *args: _capture_round(model, block_specs, method, blocks, *args, left_pad=left_pad)
    per = boundaries_per_shard(rounds)
    owned = tuple(jnp.zeros((per + 1,) + a.shape, a.dtype) for a in carry[:2])
    if rounds.full:
        def step(c, xs):
            carry, owned = c
            owned = _keep_boundary(owned, carry[:2], xs[1], per)
            carry = one_round(xs[0], rounds.round, xs[1], rounds, carry)
            progress.tick("capture", xs[1] + 1, rounds.full + 1, rounds.round_positions, after=carry)
            return (carry, owned), None

        h_full = h[: rounds.full * rounds.round_slots].reshape(rounds.full, rounds.round_slots, -1)
        (carry, owned), _ = jax.lax.scan(step, (carry, owned), (h_full, jnp.arange(rounds.full)))
    owned = _keep_boundary(owned, carry[:2], rounds.full, per)
    carry = one_round(h[rounds.full * rounds.round_slots :], rounds.last, rounds.full, rounds, carry)
    progress.tick("capture", jnp.int32(rounds.full + 1), rounds.full + 1, rounds.last.padded, after=carry)
    return carry, owned


def capture(model, params, stored_tokens, mesh, rounds: RoundLayout, attention: str, left_pad=None):
    """Traceable: stored_tokens [rounds.padded] (stored order) -> (ShardedPromptState, boundaries: the GDN (conv,
    recurrent) carried into each round, spread over the seq shards as `_capture_local` keeps them). left_pad: the
    prompt's first left_pad natural positions are pads (int32 [] or None)."""
    specs = param_specs(params, mesh)
    h = rules.constrain(model.embed(params, stored_tokens), P(SEQ), mesh)
    (conv, recurrent, keys, values), boundaries = rules.shard_map(
        functools.partial(_capture_local, model, rounds, specs["blocks"], attention), mesh,
        (specs["blocks"], P(SEQ), P()), ((P(), P(), _KV, _KV), (P(SEQ), P(SEQ))))(model.block_params(params), h,
                                                                                 left_pad)
    state = model.state_type(conv=conv, recurrent=recurrent, keys=keys, values=values, length=rounds.length)
    return ShardedPromptState(state, rounds), boundaries


# ----- replay ------------------------------------------------------------------------------------------------------


class ReplayReader(NamedTuple):
    """Inside `shard_map`: a block's layers over new tokens (the same on every shard) after this shard's slice of the
    prompt state, `prompt` (keys / values [nb, nf, S, Hkv, hd]). local: the model's one-device reader of what the
    layers read as on one device: in the replay the prompt slice itself (its GDN conv tail and recurrent matrix are
    replicated), in decoding (`decoding=True`) the replicated tail (`init_tail`: the decoded positions P.. before
    the token, with cache_length = their count, and the carried GDN state). Attention is the log-sum-exp merge of
    the prompt (`prompt_attention`, merged over shards) with the rest: the new tokens causally (replay), or
    local.attend: the tail, then the token itself (decoding)."""

    prompt: Any
    local: Any
    rounds: RoundLayout
    layers: _ShardedLayers
    decoding: bool = False
    left_pad: Any = None  # the prompt's pads (natural positions < left_pad): never attended

    @property
    def positions(self):
        return self.local.positions

    def layer_params(self, p, group):
        return self.layers.layer_params(p, group)

    def rowwise(self, fn, *xs):
        return self.layers.rowwise(fn, *xs)

    def conv(self, mixed, weight, j):
        return self.local.conv(mixed, weight, j)

    def delta_rule(self, core, q, k, v, g, beta, j):
        return self.local.delta_rule(core, q, k, v, g, beta, j)

    def attend(self, q, k, v, j, *, scale, block_size, kernels):
        common = dict(q_positions=self.positions, scale=scale, block_size=block_size, kernels=kernels)
        prompt = prompt_attention(self.prompt, self.local.prefix + (j,), self.rounds, q, left_pad=self.left_pad,
                                  **common)
        if self.decoding:
            rest = self.local.attend(q, k, v, j, scale=scale, block_size=tail_block(self.local.state, block_size),
                                     kernels=kernels)
        else:
            rest = attn_ops.attend(q, k, v, k_offset=self.rounds.length, causal=True, **common)
        return attn_ops.merge(prompt, rest)


def prompt_attention(state, index: tuple, rounds: RoundLayout, q, *, q_positions, scale: float,
                     block_size: int, kernels: str = "xla", left_pad=None) -> attn_ops.Attended:
    """Inside `shard_map`: q [T, Hq, hd] (the same on every shard, after the prompt) over the prompt cache of the
    full layer at `index` ((b, j) of state.keys / values [nb, nf, S, Hkv, hd], this shard's slots), merged across
    shards by log-sum-exp: exact attention over the whole prompt. Every slot of the full rounds is a real position;
    of the last round's two segments, a prefix of each (padding slots are never visited). Slots at natural
    positions < left_pad (int32 [] or None) are the prompt's left pads: never visible."""
    common = dict(q_positions=q_positions, scale=scale, block_size=block_size, kernels=kernels)
    earlier, last = rounds.full * rounds.round_slots, rounds.last
    slot_positions = rounds.slot_positions(jax.lax.axis_index(SEQ))  # [S]
    pads = lambda positions: {} if left_pad is None else dict(left_pad=left_pad, kv_positions=positions)
    parts = []
    if rounds.full:
        parts.append(attn_ops.attend(q, state.keys, state.values, k_offset=0, causal=False, kv_length=earlier,
                                     kv_index=index, **pads(slot_positions), **common))
    split = lambda cache: rearrange(cache[..., earlier:, :, :], "... (a t) h d -> ... a t h d", a=2)
    visible = jnp.clip(last.length - sequence.local_segments(last) * last.segment, 0, last.segment)
    last_positions = slot_positions[earlier:].reshape(2, -1)
    parts += [attn_ops.attend(q, split(state.keys), split(state.values), k_offset=0, causal=False,
                              kv_length=visible[h], kv_index=index + (h,), **pads(last_positions[h]), **common)
              for h in (0, 1)]
    return sequence.psum_merge(functools.reduce(attn_ops.merge, parts))


def replay_block(model, block_specs, rounds: RoundLayout, bp, h, state, b, left_pad=None):
    """Block b of the replay on this shard: new tokens' h [T, D] (the same on every shard) at positions P.. over this
    shard's slice of the prompt state (leading block axis indexed by b; its pads < left_pad hidden)."""
    positions = rounds.length + jnp.arange(h.shape[0], dtype=jnp.int32)
    reader = ReplayReader(state, model.prompt_reader(state, (b,), positions), rounds, _ShardedLayers(block_specs),
                          left_pad=left_pad)
    return model.block_with_reader(bp, h, reader)[0]


def extend_hidden(model, params, sstate: ShardedPromptState, tokens, mesh, left_pad=None):
    """Traceable: tokens int32 [T] after the sharded state -> final-normed hidden [T, D] (replicated)."""
    specs = param_specs(params, mesh)["blocks"]

    def local(blocks, state, h, left_pad):
        body = jax.checkpoint(lambda h, xs: (replay_block(model, specs, sstate.layout, xs[0], h, state, xs[1],
                                                          left_pad), None))
        return jax.lax.scan(body, h, (blocks, jnp.arange(model.num_blocks)))[0]

    h = rules.shard_map(local, mesh, (specs, prompt_state_specs(sstate.state), P(), P()), P())(
        model.block_params(params), sstate.state, model.embed(params, tokens), left_pad)
    return model.final_norm(params, h)


# ----- decoding (sampling on the mesh: sampling/mesh.py) -----------------------------------------------------


def init_tail(model, params, sstate: ShardedPromptState, capacity: int):
    """The replicated decoding state after the sharded prompt: a Qwen36State of length 0 with room for `capacity`
    decoded positions (P.., keys / values [nb, nf, capacity, Hkv, hd]) and the prompt's carried GDN state (conv
    tails, recurrent matrices: replicated already)."""
    return model.init_tail(params, sstate.state, capacity)  # the carried part is replicated: as on one device


def decode(model, params, sstate: ShardedPromptState, tail, token, position, mesh, left_pad=None):
    """Traceable: one token (int32 []) at `position` (P <= position < P + tail capacity, traced) after the sharded
    prompt and the tail's positions P..position-1 -> (final-normed hidden [1, D] (replicated), the tail with the
    token's keys / values written at slot position - P and the carried GDN state advanced past it). The prompt cache
    stays seq-sharded and is only read; each device multiplies by its own shards of the layers' matrices (no weights
    move: `sharding/tensor.py`). left_pad: the prompt's pads (never attended)."""
    specs = param_specs(params, mesh)["blocks"]
    rounds = sstate.layout
    slot = position - rounds.length
    varying = varying_axes()  # over_data: each slice decodes its own groups

    def local(blocks, state, tail, h, position, slot, left_pad):
        positions = position[None]

        def body(h, b):  # over block numbers, each layer's shards sliced once from the stack (`decoder_block`)
            reader = ReplayReader(state, model.prompt_reader(tail, (b,), positions, slot), rounds,
                                  _ShardedLayers(specs, True, varying), decoding=True, left_pad=left_pad)
            return model.block_with_reader(blocks, h, reader, (b,))

        return jax.lax.scan(body, h, jnp.arange(model.num_blocks))

    in_specs = (specs, prompt_state_specs(sstate.state), P(), P(), P(), P(), P())
    h, entries = rules.shard_map(local, mesh, in_specs, (P(), P()))(
        model.block_params(params), sstate.state, tail, model.embed(params, jnp.reshape(token, (1,))),
        jnp.asarray(position, jnp.int32), jnp.asarray(slot, jnp.int32), left_pad)
    return model.final_norm(params, h), model.write_entries(tail, entries, slot)
