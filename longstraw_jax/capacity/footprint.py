"""Bytes of abstract arrays and compiled programs: what one device holds of a sharded tree, a whole tree, a
compiled executable's `memory_analysis()`, and the largest layer as the decode gathers it."""
from __future__ import annotations

import math

import jax
import numpy as np

from longstraw_jax.sharding.rules import STACKED_ROOTS, expert_parallel
from longstraw_jax.sharding.tensor import applied_as_shard


def local_bytes(abstract_tree) -> int:
    """Bytes one device holds of a tree of sharded ShapeDtypeStructs (the largest shard of each leaf)."""
    total = 0
    for leaf in jax.tree.leaves(abstract_tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
        total += int(np.prod(shape)) * leaf.dtype.itemsize
    return total


def tree_bytes(tree) -> int:
    """Bytes of a whole (unsharded) tree of arrays or ShapeDtypeStructs."""
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def memory_total(compiled) -> dict[str, int]:
    """A compiled executable's memory_analysis(): {"arguments", "outputs", "temp", "total"} in bytes, total =
    arguments + outputs + temporaries - aliases (donated buffers counted once)."""
    m = compiled.memory_analysis()
    return dict(arguments=m.argument_size_in_bytes, outputs=m.output_size_in_bytes, temp=m.temp_size_in_bytes,
                total=m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                - m.alias_size_in_bytes)


def largest_layer_bytes(params) -> int:
    """Bytes of the largest single layer as `rules.gather_layer` holds it right before using it: whole, except the
    routed-expert weights (and their adapters) that expert parallelism splits by expert index
    (`rules.expert_parallel`: never all-gathered; this device's experts only). `params`: ShapeDtypeStructs, sharded
    (`sharding`: the mesh's specs decide what is expert-parallel) or not (everything counted whole). Stacked leaves
    (under `blocks` / `layers`, [stack, per_stack, ...]) are grouped by their kind (the path up to the stacked
    leaves: Qwen3.6 `blocks/linear`, GLM-5.x `layers/<segment>/<group>`); one layer of a kind is the sum of its
    leaves with both stacked axes indexed away. LoRA nodes count base + a + b."""
    def held(path, leaf):
        sharding = getattr(leaf, "sharding", None)
        if sharding is not None and expert_parallel(path, sharding.spec, 2):
            return sharding.shard_shape(leaf.shape)  # this device's experts stay local
        return leaf.shape

    return _largest_layer(params, held)


def _largest_layer(params, held) -> int:
    """Bytes of the largest layer: stacked leaves (under `blocks` / `layers`, [stack, per_stack, ...]) grouped by
    kind (the path up to the stacked leaves), each counted at `held(path, leaf)` (a shape with the two stacked axes
    still leading, or None: not held) with both stacked axes indexed away."""
    kinds: dict[tuple, int] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        keys = tuple(getattr(k, "key", getattr(k, "idx", None)) for k in path)
        if keys and keys[0] in STACKED_ROOTS:
            kind = keys[:2] if keys[0] == "blocks" else keys[:3]
            shape = held(path, leaf)
            if shape is not None:
                kinds[kind] = kinds.get(kind, 0) + math.prod(shape[2:]) * leaf.dtype.itemsize
    return max(kinds.values(), default=0)


def decode_gathered_bytes(params, linear_leaves: frozenset) -> int:
    """Bytes of the largest layer as a decode step gathers it (`sharding/tensor.py:tensor_parallel_layer`): the
    leaves the layer code applies through `linear` (named in `linear_leaves`, a LoRA node's base included) stay
    this device's shards (counted in the params already), expert-parallel experts too; the rest is gathered whole.
    Stacked leaves grouped by kind as `largest_layer_bytes` does."""
    def held(path, leaf):
        sharding = getattr(leaf, "sharding", None)
        if (leaf.ndim == 4 and applied_as_shard(path, linear_leaves)) or \
                (sharding is not None and expert_parallel(path, sharding.spec, 2)):
            return None
        return leaf.shape

    return _largest_layer(params, held)
