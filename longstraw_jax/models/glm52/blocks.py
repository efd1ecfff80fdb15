"""GLM-5.x block by block (engine/layerwise.py): one `SegmentStage` per segment, a block = one repeat of the
segment's pattern, the IndexShare selection carried with h; `GlmBlocks` is what `layerwise` needs besides the
stages.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from longstraw_jax.engine import layerwise
from longstraw_jax.models.glm52.config import Glm52Config, Glm52State, Segment
from longstraw_jax.models.glm52.layers import PromptReader, full_count, pattern_repeat
from longstraw_jax.ops.norms import rms_norm


def _last_key(path) -> str:
    key = path[-1]
    return getattr(key, "name", None) or getattr(key, "key")


@dataclasses.dataclass(frozen=True)
class SegmentStage:
    """`layerwise.Stage` of segment `s`: block r is repeat r of the segment's pattern, layers first_layer + r * plen
    .. (+ plen) and full layers first_full + r * (full per repeat) ... The block carry is (h, selected): a shared
    layer may reuse the selection of a full layer in an earlier block or segment, so the selection travels with h
    (integer: no cotangent). A block reads its slice of the state: kv [plen, S, Dk], index_keys [full per repeat,
    S, Di] (layer indices local to the slice). `at` / `set_at` / `stacked` work on a Glm52State, a ShardedPromptState
    and a dict of entries alike (by field name, layer axis first), None leaves (the cotangent has no index_keys)
    staying None."""

    config: Glm52Config
    s: int
    seg: Segment

    @property
    def num_blocks(self) -> int:
        return self.seg.repeats

    def block_params(self, params: dict) -> dict:
        return params["layers"][str(self.s)]

    def with_block_params(self, params: dict, blocks: dict) -> dict:
        return dict(params, layers=dict(params["layers"], **{str(self.s): blocks}))

    def block(self, bp: dict, carry, state_block: Glm52State, positions: jax.Array, cache_length, left_pad=None):
        """One repeat on carry (h [T, D], selected [T, k]) at `positions`, reading `state_block` at positions <
        cache_length (pads < left_pad never selected). Returns (carry, {"kv": rows [plen, T, Dk], "index_keys": keys
        [full per repeat, T, Di] or None})."""
        return self.block_with_reader(bp, carry, PromptReader(state_block, positions, cache_length, left_pad))

    def block_with_reader(self, bp: dict, carry, reader):
        """`block` with the prompt read through `reader` (one block's slice of it; the sharded replay's reader)."""
        carry, (rows, keys, _) = pattern_repeat(self.config, self.s, self.seg, bp, carry, reader, 0, 0)
        return carry, {"kv": rows, "index_keys": keys}

    def _rows(self, path) -> tuple[int, int]:
        """(first layer of block 0, layers per block) on the layer axis of the leaf at `path`."""
        seg, name = self.seg, _last_key(path)
        if name == "kv":
            return seg.first_layer, len(seg.pattern)
        if name == "index_keys":
            return seg.first_full, full_count(seg.pattern)
        raise ValueError(f"no layer axis known for a state field {name!r}")

    def at(self, tree, b):
        def one(path, a):
            first, size = self._rows(path)
            return jax.lax.dynamic_slice_in_dim(a, first + b * size, size, axis=0)
        return jax.tree_util.tree_map_with_path(one, tree)

    def set_at(self, tree, b, sub):
        def one(path, a, x):
            first, size = self._rows(path)
            return jax.lax.dynamic_update_slice_in_dim(a, x.astype(a.dtype), first + b * size, axis=0)
        return jax.tree_util.tree_map_with_path(one, tree, sub)

    def stacked(self, entries):
        def one(path, a):
            first, size = self._rows(path)
            return a[first : first + self.num_blocks * size].reshape((self.num_blocks, size) + a.shape[1:])
        return jax.tree_util.tree_map_with_path(one, entries)


@dataclasses.dataclass(frozen=True)
class GlmBlocks(layerwise.Forwarding):
    """What `layerwise` needs of GLM-5.x besides its stages (inner: the `Glm52`): the block carry is (h, selected),
    selected starting as -1 (layer 0 is a full layer: it selects before any layer reads). `visible`: the key positions
    before the tokens that the top-k width covers, k = min(index_topk, visible + T) (one device: the state's capacity,
    as `decoder_chunk`). Everything else is the model's."""

    visible: int

    def embed(self, params: dict, tokens: jax.Array):
        k = min(self.inner.config.index_topk, self.visible + tokens.shape[0])
        return params["embed"][tokens], jnp.full((tokens.shape[0], k), -1, jnp.int32)

    def final_norm(self, params: dict, carry) -> jax.Array:
        return rms_norm(carry[0], params["final_norm"], self.inner.config.rms_norm_eps)
