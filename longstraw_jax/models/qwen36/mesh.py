"""Qwen3.6 on a ("data", "seq") mesh: the adapter the engine asks the model for (`Qwen36Mesh`, the `MeshAdapter`
protocol of models/base.py) and the backward passes. The forward passes (capture, replay, decoding) and their
readers are in `mesh_forward.py`.

Replay backward and exact backward go block by block through `engine/layerwise.py` (`branch_grads` over
`_ReplayBlocks`; `prompt_backward`: rounds in reverse, `chunk_grads` over `_RoundBlocks`, the GDN state carried into
the round as its carried part), each block recomputed under `jax.vjp` of its own `shard_map`; JAX transposes the
collectives (all-gathers become reduce-scatters, the ring runs backwards).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from longstraw_jax.engine import layerwise
from longstraw_jax.models.qwen36.mesh_forward import (
    LINEAR_LEAVES,
    boundaries_per_shard,
    capture,
    decode,
    extend_hidden,
    init_tail,
    read_boundary,
    replay_block,
    round_block,
)
from longstraw_jax.ops.dtypes import at_least_f32
from longstraw_jax.sharding import rules
from longstraw_jax.sharding.layout import RoundLayout, SeqLayout
from longstraw_jax.sharding.rules import block_slice_specs, param_specs, prompt_state_specs
from longstraw_jax.sharding.sequence import SEQ, each_round, round_slots


def _embed_grads(grads, tokens, dh):
    """grads + the embedding's gradient given dh [T, D], the cotangent of the embedded rows (`layerwise`'s
    embed_grads): added at the tokens' rows of the accumulator, in place (no table-sized temporary; nothing for a
    frozen embedding)."""
    if grads["embed"] is None:
        return grads
    return dict(grads, embed=grads["embed"].at[tokens].add(dh.astype(grads["embed"].dtype)))


@dataclasses.dataclass(frozen=True)
class _ReplayBlocks(layerwise.Forwarding):
    """The sharded replay's blocks (`layerwise.branch_grads`; inner: the model): a branch's tokens (replicated) over
    the seq-sharded prompt state, each block in its own `shard_map`, so that `layerwise` adds each block's slice of
    the state cotangent into the accumulator in place (no full-size state cotangent per branch)."""

    mesh: Any
    rounds: RoundLayout
    block_specs: dict  # param_specs(params)["blocks"]

    def block(self, bp, h, state_block, positions, cache_length, left_pad=None):
        """One block over tokens h [T, D] (replicated); state_block: a ShardedPromptState sliced at one block."""
        state = jax.tree.map(lambda a: a[None], state_block.state)  # leading block axis of 1: indexed by b = 0
        local = lambda bp, h, state, pad: replay_block(self.inner, self.block_specs, self.rounds, bp, h, state, 0, pad)
        in_specs = (block_slice_specs(self.block_specs), P(), prompt_state_specs(state), P())
        return rules.shard_map(local, self.mesh, in_specs, P())(bp, h, state, left_pad), None


@dataclasses.dataclass(frozen=True)
class _RoundBlocks(layerwise.Forwarding):
    """Capture round `index` (laid out by `layout`) as `layerwise.chunk_grads` sees a chunk: tokens [n * 2L] in
    stored order, embedded seq-sharded; `block` is `round_block` in its own `shard_map` over one block's slice of a
    Qwen36State (KV cache seq-sharded, carried GDN state replicated), returning the block's entries (tails, states:
    replicated; keys, values [nf, n * 2L, Hkv, hd]: seq-sharded, stored order); `read_entries` reads the round's
    slots (`start` is not used: the round knows its slots) and the carried part of a cotangent."""

    mesh: Any
    rounds: RoundLayout
    layout: SeqLayout
    index: jax.Array
    block_specs: dict  # param_specs(params)["blocks"]
    attention: str  # RoundReader.method

    def embed(self, params, tokens):
        return rules.constrain(self.inner.embed(params, tokens), P(SEQ), self.mesh)

    def read_entries(self, acc, start, size: int) -> dict:
        read = lambda cache: round_slots(self.mesh, self.rounds, cache, self.index, self.layout.per_shard, 2)
        return {"linear": self.carried(acc), "full": (read(acc.keys), read(acc.values))}

    def block(self, bp, h, state_block, positions, cache_length, left_pad=None):
        def local(bp, h, state, index, left_pad):
            carry = (state.conv, state.recurrent, state.keys, state.values)
            return round_block(self.inner, self.block_specs, self.attention, self.rounds, self.layout, index, bp, h,
                               carry, 0, left_pad)

        state = jax.tree.map(lambda a: a[None], state_block)  # leading block axis of 1: indexed by b = 0
        out_specs = (P(SEQ), {"linear": (P(), P()), "full": (P(None, SEQ), P(None, SEQ))})
        in_specs = (block_slice_specs(self.block_specs), P(SEQ), prompt_state_specs(state), P(), P())
        return rules.shard_map(local, self.mesh, in_specs, out_specs)(bp, h, state, self.index, left_pad)


# ----- exact mode: the prompt's backward -----------------------------------------------------------------------


def prompt_backward(model, params, stored_tokens, mesh, rounds: RoundLayout, attention: str, state, boundaries,
                    state_cot, grads, left_pad=None) -> dict:
    """grads + the float32 gradient of the sequence-parallel capture of `stored_tokens` ([rounds.padded] in stored
    order) given `state_cot`, the float32 cotangent of the captured state (KV cache seq-sharded, GDN carried state
    replicated). grads: a float32 params-shaped tree, FSDP-sharded (the replay's gradient: added to in place).

    Rounds in reverse, each one `layerwise.chunk_grads` over `_RoundBlocks` (blocks in reverse, each recomputed under
    `jax.vjp` of its `shard_map`) from the final cache (its earlier slots are exactly what the round read; later
    slots are never read) with the GDN state carried into the round (`read_boundary`) as the carried part: its new
    keys/values get their cotangent from the round's slots of the running cotangent, its outgoing GDN state from the
    carried cotangent, which then becomes the cotangent of the state the round started from; its cache reads' are
    added into the running KV cotangent at the block, in place. Memory: the state, its cotangent, the round
    boundaries, one round's block inputs and one block's recomputation."""
    block_specs = param_specs(params, mesh)["blocks"]
    grad_specs = param_specs(grads, mesh)  # the trainable part's (grads has its structure: adapters/trainable.py)
    per = boundaries_per_shard(rounds)

    def one_round(carry, layout, index):
        grads, acc = carry
        tokens = round_slots(mesh, rounds, stored_tokens, index, layout.per_shard, 0)
        boundary = rules.shard_map(lambda b, r: read_boundary(b, r, per), mesh, (P(SEQ), P()), P())(boundaries, index)
        blocks = _RoundBlocks(model, mesh, rounds, layout, index, block_specs, attention)
        grads, acc = layerwise.chunk_grads(blocks, params, model.with_carried(state, boundary), tokens, 0, grads, acc,
                                           embed_grads=_embed_grads, left_pad=left_pad)
        return rules.constrain(grads, grad_specs, mesh), rules.constrain(acc, prompt_state_specs(acc), mesh)

    acc = jax.tree.map(at_least_f32, state_cot)  # float32 (float64 for a float64 model)
    return each_round(rounds, (grads, acc), one_round, reverse=True, phase="prompt backward")[0]


# ----- the adapter the engine asks the model for ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Qwen36Mesh:
    """Qwen3.6's `MeshAdapter` (models/base.py): what the sharded engine needs from a family."""

    model: Any
    linear_leaves = LINEAR_LEAVES

    @property
    def min_segment(self) -> int:
        """The causal conv reads a K-1 row halo from the previous segment."""
        return self.model.config.linear_conv_kernel_dim - 1

    def capture(self, params, stored_tokens, mesh, rounds: RoundLayout, attention: str, left_pad=None):
        return capture(self.model, params, stored_tokens, mesh, rounds, attention, left_pad)

    def extend_hidden(self, params, sstate, tokens, mesh, left_pad=None):
        return extend_hidden(self.model, params, sstate, tokens, mesh, left_pad)

    def branch_grads(self, mesh, rounds: RoundLayout, specs):
        blocks = _ReplayBlocks(self.model, mesh, rounds, specs["blocks"])
        return functools.partial(layerwise.branch_grads, blocks, embed_grads=_embed_grads)

    def prompt_backward(self, params, stored_tokens, mesh, rounds: RoundLayout, attention: str, sstate,
                        capture_aux, state_cot, grads, left_pad=None):
        return prompt_backward(self.model, params, stored_tokens, mesh, rounds, attention, sstate.state, capture_aux,
                               state_cot, grads, left_pad)

    def init_tail(self, params, sstate, capacity: int):
        return init_tail(self.model, params, sstate, capacity)

    def decode(self, params, sstate, tail, token, position, mesh, left_pad=None):
        return decode(self.model, params, sstate, tail, token, position, mesh, left_pad)
