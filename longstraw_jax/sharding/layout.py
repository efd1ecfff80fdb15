"""Where prompt positions live on the `seq` axis: a load-balanced ("zigzag") layout with end padding.

A prompt of P tokens is padded at the end to 2 * n * L positions (n = seq shards, L = segment length) and cut into
2n segments of L positions. Shard s holds segments s and 2n-1-s, in that order: under a causal mask, segment i
attends over i+1 segments, so every shard does (s+1) + (2n-s) = 2n+1 segments' worth of attention work.

Padding positions (>= P) come after every real position, so causal attention, the causal conv and the recurrence
can never carry them into a real position; the sharded code also gives them zero write strength and zero decay in
the Gated DeltaNet (the recurrent state passes through them unchanged) and zero keys/values in the cache, and
replay masks them out by position.

"Stored order" is the order along a seq-sharded position axis (shard-major); `to_natural` undoes it.

`RoundLayout`: a long prompt is captured in rounds (bounded activation memory): full rounds of one fixed SeqLayout
(no padding) followed by a last round with its own SeqLayout; each shard stores its two segments of round 0, then
of round 1, ..., then of the last round.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from flax import struct

from longstraw_jax.sharding.rules import SEQ_AXES


@dataclasses.dataclass(frozen=True)
class SeqLayout:
    """length: real prompt positions P; shards: n (the mesh's `seq` size); segment: L positions per segment."""

    length: int
    shards: int
    segment: int

    @classmethod
    def for_prompt(cls, length: int, shards: int, min_segment: int = 1) -> "SeqLayout":
        """The smallest layout that holds `length` positions with segments of at least `min_segment` (a model's
        halo, e.g. K-1 conv inputs, must fit in the previous segment)."""
        if length < 1 or shards < 1:
            raise ValueError(f"SeqLayout needs length >= 1 and shards >= 1, got length={length}, shards={shards}")
        return cls(length, shards, max(-(-length // (2 * shards)), min_segment, 1))

    @property
    def padded(self) -> int:
        return 2 * self.shards * self.segment

    @property
    def per_shard(self) -> int:
        return 2 * self.segment

    def segments_of(self, shard):
        """The two natural segment indices held by `shard` (an int or a traced index)."""
        return shard, 2 * self.shards - 1 - shard

    def natural_segment_source(self) -> tuple[np.ndarray, np.ndarray]:
        """For natural segment i: (shard, half) that holds it. Used to reorder all-gathered [n, 2, ...] arrays."""
        seg = np.arange(2 * self.shards)
        return np.where(seg < self.shards, seg, 2 * self.shards - 1 - seg), (seg >= self.shards).astype(np.int32)

    def shard_and_slot(self, positions):
        """Where natural positions (an int array, 0 <= p < padded) are stored: (shard, slot within the shard)."""
        seg, t = positions // self.segment, positions % self.segment
        upper = seg >= self.shards
        return jnp.where(upper, 2 * self.shards - 1 - seg, seg), jnp.where(upper, self.segment, 0) + t

    def slot_positions(self, shard):
        """int32 [per_shard]: the natural positions of `shard`'s slots (shard may be traced)."""
        first, second = self.segments_of(shard)
        t = jnp.arange(self.segment, dtype=jnp.int32)
        return jnp.concatenate([first * self.segment + t, second * self.segment + t]).astype(jnp.int32)

    def stored_positions(self) -> np.ndarray:
        """int32 [padded]: the natural position of each stored index."""
        shard, half, t = np.unravel_index(np.arange(self.padded), (self.shards, 2, self.segment))
        seg = np.where(half == 0, shard, 2 * self.shards - 1 - shard)
        return (seg * self.segment + t).astype(np.int32)

    def to_stored(self, tokens: jnp.ndarray, pad_id: int = 0) -> jnp.ndarray:
        return _to_stored(self, tokens, pad_id)

    def to_natural(self, x: jnp.ndarray, axis: int) -> jnp.ndarray:
        return _to_natural(self, x, axis)


def _to_stored(layout, tokens: jnp.ndarray, pad_id: int) -> jnp.ndarray:
    """tokens [P, ...] in natural order -> [padded, ...] in stored order (padding filled with `pad_id`)."""
    pad = [(0, layout.padded - layout.length)] + [(0, 0)] * (tokens.ndim - 1)
    return jnp.pad(tokens, pad, constant_values=pad_id)[layout.stored_positions()]


def _to_natural(layout, x: jnp.ndarray, axis: int) -> jnp.ndarray:
    """x with a stored-order position axis of size `padded` -> natural order, padding dropped (size P)."""
    inverse = np.argsort(layout.stored_positions())[: layout.length]
    return jnp.take(x, inverse, axis=axis)


@dataclasses.dataclass(frozen=True)
class RoundLayout:
    """P = length positions in `full` rounds laid out by `round` (each round.padded positions, none padding) and a
    last round of length - full * round.padded positions laid out by `last`. One round: full = 0, round None."""

    length: int
    full: int
    round: SeqLayout | None
    last: SeqLayout

    @classmethod
    def for_prompt(cls, length: int, shards: int, min_segment: int = 1, chunk_size: int | None = None):
        """Rounds of about `chunk_size` positions (rounded up to whole segments); None: the whole prompt at once."""
        single = SeqLayout.for_prompt(length, shards, min_segment)
        if chunk_size is None or chunk_size >= length:
            return cls(length, 0, None, single)
        round_ = SeqLayout.for_prompt(chunk_size, shards, min_segment)
        round_ = SeqLayout(round_.padded, shards, round_.segment)  # a full round has no padding
        full = (length - 1) // round_.padded
        if full == 0:
            return cls(length, 0, None, single)
        return cls(length, full, round_, SeqLayout.for_prompt(length - full * round_.padded, shards, min_segment))

    @property
    def shards(self) -> int:
        return self.last.shards

    @property
    def round_positions(self) -> int:
        """Positions per full round (0 with a single round)."""
        return self.round.padded if self.full else 0

    @property
    def round_slots(self) -> int:
        """Slots per shard of one full round."""
        return self.round.per_shard if self.full else 0

    @property
    def per_shard(self) -> int:
        return self.full * self.round_slots + self.last.per_shard

    @property
    def padded(self) -> int:
        return self.shards * self.per_shard

    def shard_and_slot(self, positions):
        """Where natural positions (an int array, 0 <= p < padded) are stored: (shard, slot within the shard)."""
        if not self.full:
            return self.last.shard_and_slot(positions)
        in_full = positions < self.full * self.round_positions
        r = jnp.minimum(positions // self.round_positions, self.full)
        shard_f, slot_f = self.round.shard_and_slot(positions % self.round_positions)
        shard_l, slot_l = self.last.shard_and_slot(jnp.maximum(positions - self.full * self.round_positions, 0))
        return (jnp.where(in_full, shard_f, shard_l),
                r * self.round_slots + jnp.where(in_full, slot_f, slot_l))

    def slot_positions(self, shard):
        """int32 [per_shard]: the natural positions of `shard`'s slots, round by round (shard may be traced)."""
        parts = [r * self.round_positions + self.round.slot_positions(shard) for r in range(self.full)]
        parts.append(self.full * self.round_positions + self.last.slot_positions(shard))
        return jnp.concatenate(parts).astype(jnp.int32)

    def stored_positions(self) -> np.ndarray:
        """int32 [padded]: the natural position of each stored index (per shard: its slots round by round)."""
        rounds = [(r * self.round_positions, self.round) for r in range(self.full)]
        rounds.append((self.full * self.round_positions, self.last))
        per_shard = [np.concatenate([offset + layout.stored_positions().reshape(self.shards, -1)[s]
                                     for offset, layout in rounds]) for s in range(self.shards)]
        return np.concatenate(per_shard).astype(np.int32)

    def to_stored(self, tokens: jnp.ndarray, pad_id: int = 0) -> jnp.ndarray:
        return _to_stored(self, tokens, pad_id)

    def to_natural(self, x: jnp.ndarray, axis: int) -> jnp.ndarray:
        return _to_natural(self, x, axis)


@struct.dataclass
class ShardedPromptState:
    """A model's prompt state (Qwen3.6 PromptState, GLM-5.x Glm52State) whose position axes (`rules.SEQ_AXES`) are in
    `layout`'s stored order, padded to `layout.padded`, and split along `seq`; `state.length` is the real prompt
    length P (padding slots hold zeros and are never attended)."""

    state: object
    layout: RoundLayout = struct.field(pytree_node=False)

    @property
    def length(self) -> int:
        return self.state.length

    def natural(self):
        """The same state in natural order with the padding dropped (gathers the cache: for checks and export)."""
        fields = {f.name for f in dataclasses.fields(self.state)}
        return self.state.replace(**{name: self.layout.to_natural(getattr(self.state, name), axis=axis)
                                     for name, axis in SEQ_AXES.items() if name in fields})
