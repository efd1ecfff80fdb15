"""GLM-5.x (docs/models.md 2)'s forward passes on a ("data", "seq") mesh: sequence-parallel capture, replay over the
seq-sharded prompt state, and decoding after it.

The layer code is the model's own (`decoder_layers`, glm52/layers.py); only the way a layer reads the prompt
changes: a `PromptReader` with the same three methods, working inside `shard_map` on this shard's slice of the
cache. This module depends on the model only through its methods (nothing of glm52/model.py is imported here; the
one-device decoding reader of glm52/layers.py uses its candidate and partial helpers).

Capture (in rounds, `RoundLayout`; each round laid out zigzag like Qwen3.6's). Per layer, for this shard's queries:
- DSA indexer: the round's indexer queries are all-gathered; each shard scores them against its *own* indexer keys
  (earlier rounds' slots and its part of the round, causally) and keeps a top-k per query; an `all_to_all` sends
  each query's candidates to the query's shard, which merges the n candidate lists into the global top-k. The
  scores are the O(P^2) part of GLM's prompt work, and the zigzag layout gives every shard the same share of it.
- MLA: each query attends to exactly k rows, anywhere before it (one 576-wide latent row per position, shared by
  all heads: 1/57 of per-head keys and values at 64 heads). The round's own rows are all-gathered (O(round)).
  Earlier rounds' rows, `attention`:
  "ring" (default): the layer's cache slots travel around the ring (`sequence.ring_take`) and each shard keeps the
  rows its queries selected, [2L, k, 576] live; n - 1 hops, each taking the selected rows held by the shard just
  received (n times the gathers of one lookup), and the backward sends the rows' cotangents back the same way.
  Used while 2L k < P (`reads_around_ring`); otherwise, and with "allgather": the layer's whole cache is
  all-gathered (one collective) and the rows looked up in it: [P, 576] rows live for one layer (and in the exact
  backward their float32 cotangent), ~11 GiB at GLM-5.2's 2.1M positions.
Replay: a branch's queries run on every shard. Each shard scores its own prompt keys (top-k candidates, all-gathered
and merged with the branch's own keys' candidates); attention is a partial over the selected rows this shard holds,
merged across shards by log-sum-exp (`sequence.psum_merge`), then merged with the branch's own rows.
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from longstraw_jax.ops import attention as attn_ops
from longstraw_jax.ops.dsa import merge_candidates, topk_over_keys
from longstraw_jax.ops.lora import shape_of
from longstraw_jax.ops.mla import sparse_latent_attention, sparse_latent_attention_partial
from longstraw_jax.ops.moe import grouped_swiglu
from longstraw_jax.ops.norms import rms_norm
from longstraw_jax.sharding import rules, sequence
from longstraw_jax.sharding.experts import routed_swiglu
from longstraw_jax.sharding.layout import RoundLayout, SeqLayout, ShardedPromptState
from longstraw_jax.sharding.rules import gather_layer, param_specs, prompt_state_specs
from longstraw_jax.sharding.sequence import SEQ
from longstraw_jax.sharding.tensor import tensor_parallel_layer, varying_axes

ROW_SPEC = P(None, SEQ)  # latent rows / indexer keys [layers, S, Dk] or [F, S, Di], positions split along seq
_NEVER = jnp.iinfo(jnp.int32).max  # key position of a padding slot: never visible to any query


def _everyone(x):
    """All shards' x, concatenated along the leading axis in shard order (stored order of a round)."""
    return jax.lax.all_gather(x, SEQ, tiled=True)


def topk_common(c, k: int) -> dict:
    return dict(k=k, scale=c.index_head_dim**-0.5, query_block=c.query_block_size, key_block=c.index_key_block_size)


def attend_common(c) -> dict:
    return dict(scale=c.qk_head_dim**-0.5, value_dim=c.kv_lora_rank, block_size=c.query_block_size,
                kernels=c.kernels)


# the matrices the layer code applies only through `ops.mlp.linear`: decoding multiplies by their shards in place
# (kv_b_proj, reshaped per head, and the indexer's weights_proj and the router, read by einsum, are gathered)
LINEAR_LEAVES = frozenset({"q_a_proj", "q_b_proj", "kv_a_proj", "o_proj", "wq_b", "wk", "gate_proj", "up_proj",
                           "down_proj"})


class ShardedLayers(NamedTuple):
    """FSDP-sharded layer parameters: each layer is all-gathered whole right before use, except routed experts split
    by expert index (expert parallelism: `sharding/experts.py`); decoding (`tensor_parallel`), the matrices in
    LINEAR_LEAVES are applied as shards (`sharding/tensor.py`: only the few tokens' activations move). varying: the
    mesh axes over which the tokens differ."""

    specs: dict  # param_specs(params)["layers"]
    tensor_parallel: bool = False
    varying: tuple = ()

    def layer_params(self, lp, segment: int, group: str):
        if self.tensor_parallel:
            return tensor_parallel_layer(lp, self.specs[str(segment)][group], LINEAR_LEAVES, self.varying)
        return gather_layer(lp, self.specs[str(segment)][group])

    def routed_experts(self, x, experts, weights, p, replicated_over_seq: bool = False):
        """The layer's routed experts: this device's E / n (expert-parallel; replicated_over_seq: x is the same on
        every seq shard) or, when n does not divide E, all of them (gathered like any weight)."""
        weights_of = (p["experts_gate"], p["experts_up"], p["experts_down"])
        if shape_of(p["experts_gate"])[0] == shape_of(p["router"])[0]:
            return grouped_swiglu(x, experts, weights, *weights_of)
        return routed_swiglu(x, experts, weights, *weights_of, replicated_over_seq=replicated_over_seq)


class _ShardReader:
    """What every reader on the mesh (`RoundReader`, `ReplayReader`, `DecodeReader`) does the same way: layer
    parameters and routed experts through its `params` (`ShardedLayers`). replicated_over_seq: whether the layer's
    tokens are the same on every seq shard (after the prompt) or this shard's own (a capture round)."""

    replicated_over_seq = False

    def layer_params(self, lp, segment, group):
        return self.params.layer_params(lp, segment, group)

    def routed_experts(self, x, experts, weights, p):
        return self.params.routed_experts(x, experts, weights, p, replicated_over_seq=self.replicated_over_seq)


@dataclasses.dataclass(frozen=True)
class RoundReader(_ShardReader):
    """Inside `shard_map`: a layer of capture round `index` (laid out by `layout`) on this shard. kv [layers, S, Dk] and
    index_keys [F, S, Di]: this shard's cache slots (`rounds`' stored order), of which the first index *
    round_slots hold the earlier rounds; positions [2L]: the natural positions of this shard's tokens; method:
    `sequence.ATTENTION_METHODS`; left_pad: natural positions < left_pad are the prompt's pads (never selected)."""

    kv: jax.Array
    index_keys: jax.Array
    positions: jax.Array
    index: jax.Array
    rounds: RoundLayout
    layout: SeqLayout
    params: ShardedLayers
    method: str  # how earlier rounds' rows are read: "ring" or "allgather" (`attend`)
    left_pad: Any = None

    @property
    def offset(self):
        return self.index * self.rounds.round_positions

    def select(self, c, q, w, keys, full, k):
        """Global top-k: every shard scores all the round's queries over its own keys; candidates go to the
        queries' shards (all_to_all) and merge there."""
        common = dict(topk_common(c, k), left_pad=self.left_pad)
        queries, weights, q_positions = _everyone(q), _everyone(w), _everyone(self.positions)
        candidates = [topk_over_keys(queries, weights, keys, self.positions, q_positions, **common)]
        if self.rounds.full:
            me = jax.lax.axis_index(SEQ)
            candidates.append(topk_over_keys(
                queries, weights, jax.lax.stop_gradient(self.index_keys), self.rounds.slot_positions(me),
                q_positions, visible_prefix=self.index * self.rounds.round_slots, layer=full, **common))
        scores, positions = merge_candidates(*(jnp.concatenate(x, axis=-1) for x in zip(*candidates)), k)
        n, per_shard = self.layout.shards, self.layout.per_shard
        to_owner = lambda x: jax.lax.all_to_all(x.reshape(n, per_shard, k), SEQ, 0, 0, tiled=True)
        mine = lambda x: jnp.moveaxis(to_owner(x), 0, 1).reshape(per_shard, n * k)  # [2L, n shards' k]
        return merge_candidates(mine(scores), mine(positions), k)[1]

    def attend(self, c, q_abs, rows, layer, selected):
        """Over the selected rows: this round's from its all-gathered rows, earlier rounds' from the cache, either
        fetched around the ring (only the queries' selected rows, [2L, k, Dk], live) or taken from the all-gathered
        layer (one collective, the layer's n S rows live): `reads_around_ring`."""
        round_rows = _everyone(rows)  # [n * 2L, Dk]: the round in stored order
        shard, slot = self.layout.shard_and_slot(jnp.maximum(selected - self.offset, 0))
        index = shard * self.layout.per_shard + slot
        if self.rounds.full:
            shard, slot = self.rounds.shard_and_slot(jnp.maximum(selected, 0))
            if not reads_around_ring(self.method, selected.size, self.rounds):
                cache = _everyone(self.kv[layer])[None]  # [1, n * S, Dk]
                earlier = shard * self.rounds.per_shard + slot
            else:
                cache = sequence.ring_take(self.kv[layer], shard, slot, self.layout.shards)[None]  # [1, 2L, k, Dk]
                cache = cache.reshape(1, -1, rows.shape[-1])
                earlier = jnp.arange(selected.size, dtype=jnp.int32).reshape(selected.shape)
            index = jnp.where(selected < self.offset, earlier, cache.shape[1] + index)
        else:
            cache = jnp.zeros((1, 0, rows.shape[-1]), rows.dtype)
        index = jnp.where(selected >= 0, index, -1)
        return sparse_latent_attention(q_abs, cache, 0, round_rows, index, cache.shape[1], **attend_common(c))


def reads_around_ring(method: str, rows_wanted: int, rounds: RoundLayout) -> bool:
    """Whether a capture round fetches its queries' `rows_wanted` (2L k) selected rows of earlier rounds around the
    ring: with `method` "ring" when they are fewer than the layer's rows (rounds.padded), else the all-gathered layer
    is the smaller buffer (e.g. GLM-5.2, 2.1M positions, 16K rounds: 2L k = 1.0M rows on 32 shards, 4.2M on 8)."""
    return method == "ring" and rows_wanted < rounds.padded


class _AfterPrompt(_ShardReader):
    """A reader of tokens after the prompt, at positions [T] (the same on every shard), over this shard's slice of
    the prompt state (kv [layers, S, Dk], index_keys [F, S, Di]): the indexer's top-k merges the prompt's candidates
    (every shard's: `prompt_candidates`) with those among the keys after the prompt (`own_candidates`), attention
    merges the prompt's partial (over shards: `prompt_partial`) with the partial over the rows after the prompt
    (`own_partial`). Subclasses have the fields kv, index_keys, positions, rounds, params and the two `own_` methods:
    own_candidates(q, w, keys, full, common) -> (scores, positions) [T, k], the top-k among the keys after the
    prompt (natural positions); own_partial(q_abs, rows, layer, index, common) -> `attn_ops.Attended` over the rows
    after the prompt, index [T, k] = selected - P (-1: a prompt position or an unused slot)."""

    replicated_over_seq = True

    def select(self, c, q, w, keys, full, k):
        common = topk_common(c, k)
        prompt = prompt_candidates(q, w, self.index_keys, self.rounds, self.positions, full,
                                   dict(common, left_pad=self.left_pad))
        own = self.own_candidates(q, w, keys, full, common)
        return merge_candidates(*(jnp.concatenate(x, axis=-1) for x in zip(prompt, own)), k)[1]

    def attend(self, c, q_abs, rows, layer, selected):
        length, common = self.rounds.length, attend_common(c)
        prompt = prompt_partial(q_abs, self.kv, rows, layer, selected, self.rounds, common)
        own = self.own_partial(q_abs, rows, layer, jnp.where(selected >= length, selected - length, -1), common)
        return attn_ops.merge(prompt, own).out


@dataclasses.dataclass(frozen=True)
class ReplayReader(_AfterPrompt):
    """Inside `shard_map`: a layer of the replay of tokens at positions [T] = P.. (the same on every shard) over
    this shard's slice of the prompt state (kv [layers, S, Dk], index_keys [F, S, Di]). After the prompt: the
    tokens' own keys and rows (causal)."""

    kv: jax.Array
    index_keys: jax.Array
    positions: jax.Array
    rounds: RoundLayout
    params: ShardedLayers
    left_pad: Any = None  # the prompt's pads (natural positions < left_pad): never candidates

    def own_candidates(self, q, w, keys, full, common):
        start = self.rounds.length
        return topk_over_keys(q, w, keys, self.positions, self.positions,
                              visible_prefix=lambda pb: jnp.max(pb) - start + 1, **common)

    def own_partial(self, q_abs, rows, layer, index, common):
        empty = jnp.zeros((1, 0, rows.shape[-1]), rows.dtype)
        return sparse_latent_attention_partial(q_abs, empty, 0, rows, index, 0, **common)


def prompt_candidates(q, w, index_keys, rounds: RoundLayout, positions, full, common: dict):
    """Inside `shard_map`: each query's top-k candidates (scores [T, n * k], positions [T, n * k]) among the prompt's
    indexer keys of full layer `full`, for queries q [T, Hi, Di], w [T, Hi] at `positions` (the same on every shard,
    after the prompt): each shard scores its own slots (index_keys [F, S, Di]; padding slots never visible), the
    n shards' candidate lists are all-gathered."""
    slots = rounds.slot_positions(jax.lax.axis_index(SEQ))
    slots = jnp.where(slots < rounds.length, slots, _NEVER)
    prompt = topk_over_keys(q, w, jax.lax.stop_gradient(index_keys), slots, positions, layer=full, **common)
    return [jnp.moveaxis(jax.lax.all_gather(x, SEQ), 0, 1).reshape(q.shape[0], -1) for x in prompt]


def prompt_partial(q_abs, kv, rows, layer, selected, rounds: RoundLayout, common: dict) -> attn_ops.Attended:
    """Inside `shard_map`: absorbed attention of q_abs [T, H, Dk] over the selected prompt positions (selected int
    [T, k], natural positions; others ignored) of layer `layer`, each shard over the rows it holds (kv [layers, S,
    Dk]), merged across shards by log-sum-exp."""
    length = rounds.length
    shard, slot = rounds.shard_and_slot(jnp.clip(selected, 0, length - 1))
    held = (selected >= 0) & (selected < length) & (shard == jax.lax.axis_index(SEQ))
    part = sparse_latent_attention_partial(q_abs, kv, layer, rows, jnp.where(held, slot, -1), kv.shape[1], **common)
    return sequence.psum_merge(part)


@dataclasses.dataclass(frozen=True)
class DecodeReader(_AfterPrompt):
    """Inside `shard_map`: a layer decoding one token at positions [1] (the same on every shard) after this shard's
    slice of the prompt state (kv [layers, S, Dk], index_keys [F, S, Di]) and the replicated tail (`init_tail`: a
    Glm52State whose rows hold the decoded positions P.., `slot` of them before the token). The indexer's top-k runs
    over prompt + tail + the token (prompt candidates from every shard, merged with the tail's and the token's),
    as the one-device model's over its cache; attention merges the prompt's partial (over shards) with the tail's
    and the token's rows."""

    kv: jax.Array
    index_keys: jax.Array
    tail: Any
    slot: jax.Array
    positions: jax.Array
    rounds: RoundLayout
    params: ShardedLayers
    left_pad: Any = None  # the prompt's pads (natural positions < left_pad): never candidates

    def own_candidates(self, q, w, keys, full, common):
        return tail_candidates(q, w, keys, full, self.tail, self.slot, self.rounds.length, self.positions, common)

    def own_partial(self, q_abs, rows, layer, index, common):
        return tail_partial(q_abs, rows, layer, index, self.tail, self.slot, common)


def tail_candidates(q, w, keys, full, tail, slot, start: int, positions, common: dict):
    """Top-k candidates (scores, natural positions) [T, k] of a decoded token (q [T, Hi, Di], w [T, Hi] at
    `positions`) among the keys after the prompt: the tail's keys of full layer `full` (tail.index_keys [F, R, Di],
    slots < `slot` hold positions start..) with the token's own `keys` [T, Di] at `slot`; slots > `slot` unseen.
    Shared by the one-device decoder (`glm52.DecodeReader`) and the mesh's (`DecodeReader` above)."""
    cache = tail.index_keys[full]
    cache = jax.lax.dynamic_update_slice_in_dim(cache, keys.astype(cache.dtype), slot, 0)
    cache_positions = start + jnp.arange(cache.shape[0], dtype=jnp.int32)
    return topk_over_keys(q, w, cache, cache_positions, positions, visible_prefix=slot + 1, **common)


def tail_partial(q_abs, rows, layer, index, tail, slot, common: dict) -> attn_ops.Attended:
    """Absorbed attention of a decoded token (q_abs [T, H, Dk]) over its selected positions after the prompt (index
    [T, k] = selected - P, -1 elsewhere): tail rows (slots < `slot`, tail.kv [layers, R, Dk]) and its own row at
    `slot` (rows [T, Dk])."""
    return sparse_latent_attention_partial(q_abs, tail.kv, layer, rows, index, slot, **common)


# ----- capture -------------------------------------------------------------------------------------------------


def _write_round(mesh, rounds: RoundLayout, cache, new, index):
    """cache [layers, S, Dk] (or [F, S, Di]) with each shard's round slots from index * round_slots replaced by new."""
    write = lambda c, x, i: jax.lax.dynamic_update_slice_in_dim(c, x.astype(c.dtype), i * rounds.round_slots, 1)
    return rules.shard_map(write, mesh, (ROW_SPEC, ROW_SPEC, P()), ROW_SPEC)(cache, new, index)


def round_entries(model, mesh, rounds: RoundLayout, layout: SeqLayout, layer_specs, layers, h, kv,
                  index_keys, index, attention: str, left_pad=None):
    """All layers of capture round `index` (laid out by `layout`) on the mesh: h [n * 2L, D] the round's embedded
    tokens (stored order, seq-sharded) -> (rows [layers, n * 2L, Dk], indexer keys [F, n * 2L, Di]), zero at padding.
    Reads kv / index_keys (the sharded cache) at earlier rounds' slots only. left_pad: the prompt's pads."""
    c = model.config

    def local(layers, h, kv, index_keys, index, left_pad):
        positions = index * rounds.round_positions + sequence.local_positions(layout).reshape(-1)
        reader = RoundReader(kv, index_keys, positions, index, rounds, layout, ShardedLayers(layer_specs), attention,
                             left_pad)
        _, entries, _ = model.decoder_layers(layers, h, reader, min(c.index_topk, rounds.length), remat=True)
        real = (positions < rounds.length)[None, :, None]
        return jnp.where(real, entries["kv"], 0), jnp.where(real, entries["index_keys"], 0)

    return rules.shard_map(local, mesh, (layer_specs, P(SEQ), ROW_SPEC, ROW_SPEC, P(), P()), (ROW_SPEC, ROW_SPEC))(
        layers, h, kv, index_keys, index, left_pad)


def _embedded_round(params, mesh, rounds, stored_tokens, index, size):
    tokens = sequence.round_slots(mesh, rounds, stored_tokens, index, size, 0)
    return tokens, rules.constrain(params["embed"][tokens], P(SEQ), mesh)


def capture(model, params, stored_tokens, mesh, rounds: RoundLayout, attention: str = "ring",
            left_pad=None) -> ShardedPromptState:
    """Traceable: stored_tokens [rounds.padded] (stored order) -> ShardedPromptState (a Glm52State split along
    `seq`), round by round; attention: how a round reads earlier rounds' rows (`RoundReader.attend`); left_pad: the
    prompt's first left_pad natural positions are pads (int32 [] or None)."""
    c = model.config
    layer_specs = param_specs(params, mesh)["layers"]
    dtype = params["embed"].dtype
    place = lambda a: rules.constrain(a, ROW_SPEC, mesh)
    caches = (place(jnp.zeros((c.num_hidden_layers, rounds.padded, c.kv_row_dim), dtype)),
              place(jnp.zeros((c.num_full_layers, rounds.padded, c.index_head_dim), dtype)))

    def one_round(caches, layout, index):
        _, h = _embedded_round(params, mesh, rounds, stored_tokens, index, layout.per_shard)
        entries = round_entries(model, mesh, rounds, layout, layer_specs, params["layers"], h, *caches, index,
                                 attention, left_pad)
        return tuple(_write_round(mesh, rounds, cache, new, index) for cache, new in zip(caches, entries))

    kv, index_keys = sequence.each_round(rounds, caches, one_round, phase="capture")
    return ShardedPromptState(model.state_type(kv=kv, index_keys=index_keys, length=rounds.length), rounds)


# ----- replay --------------------------------------------------------------------------------------------------


def extend_hidden_fn(model, mesh, params_specs):
    """(params, sstate, tokens [T]) -> final-normed hidden [T, D]: the replay over the sharded state (traceable;
    differentiable in params and the state, whose cotangent comes back sharded like the state)."""
    c = model.config

    def fn(params, sstate: ShardedPromptState, tokens, left_pad=None):
        rounds = sstate.layout
        k = min(c.index_topk, rounds.length + tokens.shape[0])

        def local(layers, state, h, left_pad):
            positions = rounds.length + jnp.arange(h.shape[0], dtype=jnp.int32)
            reader = ReplayReader(state.kv, state.index_keys, positions, rounds, ShardedLayers(params_specs["layers"]),
                                  left_pad)
            return model.decoder_layers(layers, h, reader, k, remat=True)[0]

        h = rules.shard_map(local, mesh, (params_specs["layers"], prompt_state_specs(sstate.state), P(), P()), P())(
            params["layers"], sstate.state, params["embed"][tokens], left_pad)
        return rms_norm(h, params["final_norm"], c.rms_norm_eps)

    return fn


# ----- decoding (sampling on the mesh: sampling/mesh.py) -----------------------------------------------------


def init_tail(model, params, sstate: ShardedPromptState, capacity: int):
    """The replicated decoding state after the sharded prompt: a Glm52State of length 0 with room for `capacity`
    decoded positions P.. (kv [layers, capacity, Dk], index_keys [F, capacity, Di]); GLM carries nothing else."""
    return model.init_tail(params, sstate.state, capacity)


def decode(model, params, sstate: ShardedPromptState, tail, token, position, mesh, left_pad=None):
    """Traceable: one token (int32 []) at `position` (P <= position < P + tail capacity, traced) after the sharded
    prompt and the tail's positions P..position-1 -> (final-normed hidden [1, D] (replicated), the tail with the
    token's latent row and indexer keys written at slot position - P). The prompt cache stays seq-sharded and is
    only read; each device multiplies by its own shards of the layers' matrices (`sharding/tensor.py`)."""
    c = model.config
    specs = param_specs(params, mesh)["layers"]
    rounds = sstate.layout
    slot = position - rounds.length
    k = min(c.index_topk, rounds.length + tail.kv.shape[1])  # >= every visible key count, as on one device
    varying = varying_axes()  # over_data: each slice decodes its own groups

    def local(layers, state, tail, h, position, slot, left_pad):
        reader = DecodeReader(state.kv, state.index_keys, tail, slot, position[None], rounds,
                              ShardedLayers(specs, True, varying), left_pad)
        h, entries, _ = model.decoder_layers(layers, h, reader, k, by_layer=True)
        return h, entries

    in_specs = (specs, prompt_state_specs(sstate.state), P(), P(), P(), P(), P())
    h, entries = rules.shard_map(local, mesh, in_specs, (P(), P()))(
        params["layers"], sstate.state, tail, params["embed"][jnp.reshape(token, (1,))],
        jnp.asarray(position, jnp.int32), jnp.asarray(slot, jnp.int32), left_pad)
    return rms_norm(h, params["final_norm"], c.rms_norm_eps), model.write_entries(tail, entries, slot)
