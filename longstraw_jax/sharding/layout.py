"""Where prompt positions live on the `seq` axis: a load-balanced ("zigzag") layout with end padding.

A prompt of P tokens is padded at the end to 2 * n * L positions (n = seq shards, L = segment length) and cut into
2n segments of L positions. Shard s holds segments s and 2n-1-s, in that order: under a causal mask, segment i
attends over i+1 segments, so every shard does (s+1) + (2n-s) = 2n+1 segments' worth of attention work.

Padding positions (>= P) come after every real position, so causal attention, the causal conv and the recurrence
can never carry them into a real position; the sharded code also gives them zero write strength and zero decay in
the Gated DeltaNet (the recurrent state passes through them unchanged) and zero keys/values in the cache, and
replay masks them out by position.

"Stored order" is the order along a seq-sharded position axis (shard-major); `to_natural` undoes it.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np


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

    def stored_positions(self) -> np.ndarray:
        """int32 [padded]: the natural position of each stored index."""
        shard, half, t = np.unravel_index(np.arange(self.padded), (self.shards, 2, self.segment))
        seg = np.where(half == 0, shard, 2 * self.shards - 1 - shard)
        return (seg * self.segment + t).astype(np.int32)

    def to_stored(self, tokens: jnp.ndarray, pad_id: int = 0) -> jnp.ndarray:
        """tokens [P, ...] in natural order -> [padded, ...] in stored order (padding filled with `pad_id`)."""
        pad = [(0, self.padded - self.length)] + [(0, 0)] * (tokens.ndim - 1)
        return jnp.pad(tokens, pad, constant_values=pad_id)[self.stored_positions()]

    def to_natural(self, x: jnp.ndarray, axis: int) -> jnp.ndarray:
        """x with a stored-order position axis of size `padded` -> natural order, padding dropped (size P)."""
        inverse = np.argsort(self.stored_positions())[: self.length]
        return jnp.take(x, inverse, axis=axis)
