"""Partition rules: where each array lives on the ("data", "seq") mesh (docs/architecture.md 5).

- Parameters (FSDP): every leaf is split over all devices of the mesh along one of its *own* dimensions. Stacked
  layer leaves `blocks/...` are [num_blocks, per_block, ...]; the stacked axes stay whole, so that the layer scan
  can slice one layer locally and all-gather just that layer (`gather_layer`) right before using it: at most one
  layer is ever resident whole. The dimension chosen is the largest one divisible by the device count; a leaf with
  no such dimension (e.g. a per-head vector of 6 entries) stays replicated.
- Optimizer state follows the parameters leaf for leaf (AdamW moments have the parameters' structure); scalars
  (step counts) are replicated.
- Prompt tokens and the prompt state: position axes are split along `seq` (`SEQ_AXES`: Qwen3.6 KV caches, GLM-5.x
  latent rows and indexer keys); carried recurrent parts (GDN conv tails and matrices) are replicated.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

FSDP = ("data", "seq")  # parameter shards: the whole mesh
# prompt-state field -> its position axis: Qwen3.6 KV caches [nb, nf, P, Hkv, hd]; GLM-5.x latent rows [layers, P, Dk]
# and indexer keys [F, P, Di]
SEQ_AXES = {"keys": 2, "values": 2, "kv": 1, "index_keys": 1}


STACKED_ROOTS = ("blocks", "layers")  # Qwen3.6 [num_blocks, per_block, ...]; GLM-5.x [repeats, per_pattern, ...]


def stacked_dims(path: tuple) -> int:
    """Leading stacked (layer) axes of a parameter leaf (a key path): 2 under `blocks` / `layers`, else 0."""
    return 2 if path and getattr(path[0], "key", None) in STACKED_ROOTS else 0


def fsdp_dim(shape: tuple, skip: int, devices: int) -> int | None:
    """The dimension of a leaf of `shape` that FSDP splits over `devices` (None: replicated): the largest of its
    dimensions from `skip` on that `devices` divides, the first on ties."""
    candidates = [d for d in range(skip, len(shape)) if shape[d] % devices == 0]
    if devices == 1 or not candidates:
        return None
    return max(candidates, key=lambda d: (shape[d], -d))


def _leaf_spec(shape: tuple, skip: int, devices: int) -> P:
    dim = fsdp_dim(shape, skip, devices)
    return P() if dim is None else P(*([None] * dim + [FSDP]))


def param_specs(params, mesh: Mesh, stacked: Callable[[tuple], int] = stacked_dims):
    """PartitionSpec per parameter leaf (same tree as params; works on arrays or `jax.ShapeDtypeStruct`s)."""
    devices = mesh.size
    return jax.tree_util.tree_map_with_path(lambda path, x: _leaf_spec(x.shape, stacked(path), devices), params)


def like_params_specs(tree, params, specs):
    """Specs for a tree that contains copies of the parameter tree (optax states): each params-shaped subtree gets
    `specs`, any other leaf (a step count) is replicated."""
    structure = jax.tree.structure(params)
    is_params = lambda node: jax.tree.structure(node) == structure and not isinstance(node, (jax.Array, np.ndarray))
    return jax.tree.map(lambda node: specs if is_params(node) else P(), tree,
                        is_leaf=lambda node: is_params(node) or node is None)


def prompt_state_specs(state, seq_axes: dict = SEQ_AXES):
    """Specs for a PromptState (a flax struct dataclass): fields in `seq_axes` split along `seq` at that axis,
    everything else replicated."""
    arrays = [f.name for f in dataclasses.fields(state) if f.metadata.get("pytree_node", True)]
    return state.replace(**{name: P(*([None] * seq_axes[name] + ["seq"])) if name in seq_axes else P()
                            for name in arrays})


def named(specs, mesh: Mesh):
    """PartitionSpec tree -> NamedSharding tree on `mesh`."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P))


def block_slice_specs(block_specs):
    """Specs of one block's parameters ([per_block, ...]: the leading num_blocks axis indexed away) from the specs of
    the stacked `blocks` leaves."""
    return jax.tree.map(lambda s: P(*tuple(s)[1:]), block_specs, is_leaf=lambda s: isinstance(s, P))


def gather_layer(layer, layer_specs, skip: int = 2):
    """Inside `shard_map`: all-gather one layer's parameter shards (leaves with the `skip` stacked axes already
    indexed away) into whole arrays. `layer_specs` are the full leaves' specs from `param_specs`."""
    def gather(spec, x):
        for dim, axes in enumerate(spec):
            if axes is not None:
                return jax.lax.all_gather(x, axes, axis=dim - skip, tiled=True)
        return x

    return jax.tree.map(gather, layer_specs, layer, is_leaf=lambda s: isinstance(s, P))
