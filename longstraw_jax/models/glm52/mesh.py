"""GLM-5.x on a ("data", "seq") mesh: the adapter the engine asks the model for (`Glm52Mesh`, the `MeshAdapter`
protocol of models/base.py) and the backward passes. The forward passes (capture, replay, decoding) and their
readers are in `mesh_forward.py`.

Replay backward and exact backward go block by block (`layerwise`, one stage per segment, a block = one repeat of
its pattern, each block in its own `shard_map`): a branch, or a capture round recomputed from the final cache (its
earlier slots are what it read), is backpropagated one block at a time under `jax.vjp`, each block's slice of the
state cotangent added in place (none for the indexer keys); the ring and the all-gathers transpose to the reverse
ring and to reduce-scatters (cache-read cotangents land on the shards that hold the rows, layer gradients on their
FSDP shards).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from longstraw_jax.engine import layerwise
from longstraw_jax.models.glm52.mesh_forward import (
    LINEAR_LEAVES,
    ROW_SPEC,
    ReplayReader,
    RoundReader,
    ShardedLayers,
    capture,
    decode,
    extend_hidden_fn,
    init_tail,
)
from longstraw_jax.ops.dtypes import at_least_f32
from longstraw_jax.sharding import rules, sequence
from longstraw_jax.sharding.layout import RoundLayout, SeqLayout
from longstraw_jax.sharding.rules import block_slice_specs, param_specs, prompt_state_specs
from longstraw_jax.sharding.sequence import SEQ

# ----- exact mode: the prompt's backward -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _RoundBlocks(layerwise.Forwarding):
    """What `layerwise.chunk_grads` needs besides the stages, for capture round `index` (laid out by `layout`; inner:
    the model): the round's tokens (stored order, seq-sharded) embedded with an empty selection as the block carry,
    and the round's slots of the state cotangent as its entries' cotangent (`start` is not used: the round knows its
    slots)."""

    mesh: Any
    rounds: RoundLayout
    layout: SeqLayout
    index: jax.Array

    def embed(self, params, tokens):
        k = min(self.inner.config.index_topk, self.rounds.length)  # as `round_entries`
        h = rules.constrain(params["embed"][tokens], P(SEQ), self.mesh)
        return h, rules.constrain(jnp.full((tokens.shape[0], k), -1, jnp.int32), P(SEQ), self.mesh)

    def read_entries(self, acc, start, size: int) -> dict:
        return {"kv": sequence.round_slots(self.mesh, self.rounds, acc.kv, self.index, self.layout.per_shard, 1),
                "index_keys": None}


@dataclasses.dataclass(frozen=True)
class _RoundStage(layerwise.Forwarding):
    """A `layerwise.Stage` of the sharded prompt backward (inner: the model's `SegmentStage`), whose block runs one
    repeat of capture round `index` in its own `shard_map` (a `RoundReader` over the block's slice of the final cache,
    layer numbers local to the slice). Returns the block's latent rows (zero at padding); its indexer keys get no
    cotangent and are not returned."""

    mesh: Any
    rounds: RoundLayout
    layout: SeqLayout
    index: jax.Array
    layer_specs: dict  # param_specs(params)["layers"]
    attention: str  # RoundReader.method

    def block(self, bp, carry, state_block, positions, cache_length, left_pad=None):
        rounds, layout = self.rounds, self.layout

        def local(bp, carry, kv, index_keys, index, left_pad):
            positions = index * rounds.round_positions + sequence.local_positions(layout).reshape(-1)
            reader = RoundReader(kv, index_keys, positions, index, rounds, layout, ShardedLayers(self.layer_specs),
                                 self.attention, left_pad)
            carry, entries = self.inner.block_with_reader(bp, carry, reader)
            return carry, jnp.where((positions < rounds.length)[None, :, None], entries["kv"], 0)

        slice_specs = block_slice_specs(self.layer_specs[str(self.inner.s)])
        in_specs = (slice_specs, P(SEQ), ROW_SPEC, ROW_SPEC, P(), P())
        carry, rows = rules.shard_map(local, self.mesh, in_specs, (P(SEQ), ROW_SPEC))(
            bp, carry, state_block.kv, state_block.index_keys, self.index, left_pad)
        return carry, {"kv": rows, "index_keys": None}


def prompt_backward(model, params, stored_tokens, mesh, rounds: RoundLayout, state, state_cot,
                    grads, attention: str = "ring", left_pad=None) -> dict:
    """grads + the float32 gradient of the sequence-parallel capture given `state_cot` (the float32 cotangent of the
    captured Glm52State, sharded like it; no index_keys: `Glm52.differentiable_state`). Rounds in reverse, and in each
    round blocks in reverse (`layerwise.chunk_grads` over `_RoundStage` stages): a forward over the blocks keeps
    each block's input carry (h, selected); then each block is recomputed from the final cache (its earlier slots are
    what the round read) under `jax.vjp` of its `shard_map`, its rows' cotangent read from the round's slots of the
    running cotangent, and the cotangent of its cache reads added into the running cotangent at the block's layers,
    in place. Live: the state, its float32 cotangent, one round's block inputs and one block's recomputation."""
    layer_specs = param_specs(params, mesh)["layers"]
    grad_specs = param_specs(grads, mesh)  # the trainable part's (grads has its structure: adapters/trainable.py)
    place = lambda tree, spec_tree: rules.constrain(tree, spec_tree, mesh)

    def one_round(carry, layout, index):
        grads, acc = carry
        tokens = sequence.round_slots(mesh, rounds, stored_tokens, index, layout.per_shard, 0)
        stages = tuple(_RoundStage(stage, mesh, rounds, layout, index, layer_specs, attention)
                       for stage in model.block_stages())
        grads, acc = layerwise.chunk_grads(_RoundBlocks(model, mesh, rounds, layout, index), params, state, tokens,
                                           0, grads, acc, stages=stages, left_pad=left_pad)
        return place(grads, grad_specs), acc.replace(kv=rules.constrain(acc.kv, ROW_SPEC, mesh))

    acc = model.differentiable_state(state_cot).replace(kv=at_least_f32(state_cot.kv))
    return sequence.each_round(rounds, (grads, acc), one_round, reverse=True, phase="prompt backward")[0]


# ----- the adapter the engine asks the model for ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _ReplayStage(layerwise.Forwarding):
    """A `layerwise.Stage` of the sharded replay (inner: the model's segment stage, `Glm52.block_stages`), whose block
    runs one repeat in its own `shard_map` over the block's slice of the seq-sharded state (a `ReplayReader` over it,
    layer numbers local to the slice), so `layerwise.branch_grads` backpropagates block by block and adds each
    block's slice of the state cotangent into the accumulator in place (no state-sized cotangent per branch; none at
    all for the indexer keys). Everything else is the stage's."""

    mesh: Any
    rounds: RoundLayout
    layer_specs: dict  # param_specs(params)["layers"]

    def block(self, bp, carry, state_block, positions, cache_length, left_pad=None):
        """One repeat over carry (h [T, D], selected [T, k]) (replicated); state_block: a ShardedPromptState sliced at
        the block (its pads < left_pad never selected). Returns (carry, None): the replay needs no entries."""
        rounds, slice_specs = self.rounds, block_slice_specs(self.layer_specs[str(self.inner.s)])

        def local(bp, carry, state, left_pad):
            positions = rounds.length + jnp.arange(carry[0].shape[0], dtype=jnp.int32)
            reader = ReplayReader(state.kv, state.index_keys, positions, rounds, ShardedLayers(self.layer_specs),
                                  left_pad)
            return self.inner.block_with_reader(bp, carry, reader)[0]

        state = state_block.state
        in_specs = (slice_specs, P(), prompt_state_specs(state), P())
        return rules.shard_map(local, self.mesh, in_specs, P())(bp, carry, state, left_pad), None


@dataclasses.dataclass(frozen=True)
class Glm52Mesh:
    """GLM-5.x's `MeshAdapter` (models/base.py). Its replay backpropagates block by block (`_ReplayStage`:
    one stage per segment, a block = one repeat of its pattern), as one device does."""

    model: Any
    min_segment = 1  # GLM reads no halo from the previous segment: any segment length works
    linear_leaves = LINEAR_LEAVES

    def capture(self, params, stored_tokens, mesh, rounds: RoundLayout, attention: str, left_pad=None):
        """`attention`: how a round reads earlier rounds' latent rows ("ring" / "allgather": `RoundReader.attend`).
        No capture output is kept for the backward (every round is recomputed from the final cache)."""
        return capture(self.model, params, stored_tokens, mesh, rounds, attention, left_pad), None

    def extend_hidden(self, params, sstate, tokens, mesh, left_pad=None):
        return extend_hidden_fn(self.model, mesh, param_specs(params, mesh))(params, sstate, tokens, left_pad)

    def branch_grads(self, mesh, rounds: RoundLayout, specs):
        """`layerwise.branch_grads` over the mesh stages; the top-k width is the sharded replay's (P + T)."""
        stages = tuple(_ReplayStage(stage, mesh, rounds, specs["layers"]) for stage in self.model.block_stages())
        return functools.partial(layerwise.branch_grads, self.model.layerwise_blocks(rounds.length), stages=stages)

    def prompt_backward(self, params, stored_tokens, mesh, rounds: RoundLayout, attention: str, sstate,
                        capture_aux, state_cot, grads, left_pad=None):
        return prompt_backward(self.model, params, stored_tokens, mesh, rounds, sstate.state, state_cot, grads,
                               attention, left_pad)

    def init_tail(self, params, sstate, capacity: int):
        return init_tail(self.model, params, sstate, capacity)

    def decode(self, params, sstate, tail, token, position, mesh, left_pad=None):
        return decode(self.model, params, sstate, tail, token, position, mesh, left_pad)
