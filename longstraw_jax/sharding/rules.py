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

Groups side by side (`sharding/groups.py`): the engines may run inside a region that is already manual over `data`
(each data slice its own groups). There the helpers below adapt: `shard_map` is manual over the remaining axes,
`named` drops the manual axes from specs, and `param_specs` answers for the *global* parameter shapes (the region
registers them with `global_param_shapes`), so one family code serves both cases.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from longstraw_jax.adapters.trainable import split_like
from longstraw_jax.ops.lora import LoRA, is_lora

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


# routed-expert weights [stacked..., E, out, in]: split by expert index over the whole mesh when the devices divide E
# (expert parallelism, `sharding/experts.py`: never all-gathered, their gradients stay on their devices)
EXPERT_LEAVES = ("experts_gate", "experts_up", "experts_down")


def _split_dim(shape: tuple, skip: int, devices: int, expert: bool) -> int | None:
    """The dimension a parameter leaf is split along: a routed-expert weight's expert axis when the devices divide
    it, else FSDP's choice (`fsdp_dim`)."""
    if expert and devices > 1 and len(shape) > skip and shape[skip] % devices == 0:
        return skip
    return fsdp_dim(shape, skip, devices)


def _leaf_spec(shape: tuple, skip: int, devices: int, expert: bool = False) -> P:
    return _split_at(_split_dim(shape, skip, devices, expert))


def _is_expert(path: tuple) -> bool:
    """A routed-expert weight, or a part (base, a, b) of a LoRA node over one."""
    return any(getattr(k, "key", None) in EXPERT_LEAVES for k in path[-2:])


def expert_parallel(path: tuple, spec: P, skip: int) -> bool:
    """Whether the leaf at `path` with `spec` is a routed-expert weight (or its adapter) split by expert index (its
    first unstacked dimension, after `skip` stacked ones)."""
    return _is_expert(path) and len(spec) > skip and spec[skip] is not None


def _split_at(dim: int | None) -> P:
    return P() if dim is None else P(*([None] * dim + [FSDP]))


def _lora_specs(node: LoRA, skip: int, devices: int, expert: bool = False) -> LoRA:
    """Specs of a LoRA node consistent with its base matrix [..., out, in]: the base by the FSDP rule; when that
    splits a leading (expert) axis, a [..., r, in] and b [..., out, r] are split there too (each device holds its
    experts' adapters); otherwise a along `in` and b along `out` when the device count divides them (the rank axis
    is never split)."""
    shape = node.shape
    n, dim = len(shape), _split_dim(shape, skip, devices, expert)
    if dim is not None and dim < n - 2:
        a_dim = b_dim = dim
    else:
        a_dim = n - 1 if devices > 1 and shape[-1] % devices == 0 else None
        b_dim = n - 2 if devices > 1 and shape[-2] % devices == 0 else None
    hole = lambda x, spec: None if x is None else spec
    return LoRA(hole(node.base, _split_at(dim)), hole(node.a, _split_at(a_dim)), hole(node.b, _split_at(b_dim)),
                node.scale)


_GLOBAL_PARAMS = contextvars.ContextVar("longstraw_global_params", default=None)


@contextlib.contextmanager
def global_param_shapes(params):
    """While tracing inside a data-manual region, where the parameter arrays are one data slice's pieces: make
    `param_specs` of a tree with this structure answer for these (global) shapes."""
    token = _GLOBAL_PARAMS.set(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params))
    try:
        yield
    finally:
        _GLOBAL_PARAMS.reset(token)


def param_specs(params, mesh: Mesh, stacked: Callable[[tuple], int] = stacked_dims):
    """PartitionSpec per parameter leaf (same tree as params; works on arrays or `jax.ShapeDtypeStruct`s, and on a
    trainable or frozen part with holes, `trainable.split`). LoRA adapters are split consistently with their base
    matrix (`_lora_specs`). Inside a data-manual region, computed from the registered global shapes
    (`global_param_shapes`; also for a part of the registered tree)."""
    registered = _GLOBAL_PARAMS.get()
    if registered is not None:
        if jax.tree.structure(registered) == jax.tree.structure(params):
            params = registered
        else:
            try:  # a part (with holes) of the registered tree
                part = split_like(registered, params)[0]
            except (ValueError, TypeError):
                part = None
            if part is not None and jax.tree.structure(part) == jax.tree.structure(params):
                params = part
    devices = mesh.size

    def spec(path, x):
        if is_lora(x):
            return _lora_specs(x, stacked(path), devices, _is_expert(path))
        return _leaf_spec(x.shape, stacked(path), devices, _is_expert(path))

    return jax.tree_util.tree_map_with_path(spec, params, is_leaf=is_lora)


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


def manual_axes() -> frozenset:
    """The mesh axes that are manual where this is traced (inside a `shard_map` over them), e.g. {"data"} inside
    `groups.over_data`; empty at top level."""
    return frozenset(jax.sharding.get_abstract_mesh().manual_axes)


def without_axes(spec: P, axes) -> P:
    """`spec` with the mesh axes `axes` removed (an entry that names only removed axes becomes None)."""
    def entry(e):
        if e is None:
            return None
        kept = tuple(a for a in (e if isinstance(e, tuple) else (e,)) if a not in axes)
        return None if not kept else kept[0] if len(kept) == 1 else kept
    return P(*(entry(e) for e in spec))


def named(specs, mesh: Mesh):
    """PartitionSpec tree -> NamedSharding tree on `mesh` (where some axes are manual, on the context mesh, with
    those axes left out of the specs)."""
    drop = manual_axes()
    if drop:
        mesh = jax.sharding.get_abstract_mesh()
    return jax.tree.map(lambda s: NamedSharding(mesh, without_axes(s, drop)), specs,
                        is_leaf=lambda s: isinstance(s, P))


def constrain(tree, specs, mesh: Mesh):
    """`jax.lax.with_sharding_constraint` of every leaf of `tree` to its spec (a tree of PartitionSpecs like `tree`,
    or one spec for all leaves), on `mesh` (see `named`)."""
    if isinstance(specs, P):
        specs = jax.tree.map(lambda _: specs, tree)
    return jax.lax.with_sharding_constraint(tree, named(specs, mesh))


def shard_map(fn, mesh: Mesh, in_specs, out_specs):
    """`jax.shard_map` over the axes of `mesh` that are not already manual here (inside `groups.over_data`: `seq`
    only, on the context mesh, with `data` left out of the specs; a collective in fn may still name `data`, e.g. the
    FSDP all-gather of a layer over ("data", "seq")). Replication is not checked (`check_vma=False`)."""
    drop = manual_axes()
    if not drop:
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    strip = lambda specs: jax.tree.map(lambda s: without_axes(s, drop), specs, is_leaf=lambda s: isinstance(s, P))
    return jax.shard_map(fn, mesh=jax.sharding.get_abstract_mesh(), in_specs=strip(in_specs),
                         out_specs=strip(out_specs), axis_names=set(mesh.axis_names) - drop, check_vma=False)


def block_slice_specs(block_specs):
    """Specs of one block's parameters ([per_block, ...]: the leading num_blocks axis indexed away) from the specs of
    the stacked `blocks` leaves."""
    return jax.tree.map(lambda s: P(*tuple(s)[1:]), block_specs, is_leaf=lambda s: isinstance(s, P))


def gather_layer(layer, layer_specs, skip: int = 2):
    """Inside `shard_map`: all-gather one layer's parameter shards (leaves with the `skip` stacked axes already
    indexed away) into whole arrays. `layer_specs` are the full leaves' specs from `param_specs`. Expert-parallel
    routed-expert weights stay this device's experts ([E / devices, ...]; `sharding/experts.py`)."""
    def gather(path, spec, x):
        if expert_parallel(path, spec, skip):
            return x
        for dim, axes in enumerate(spec):
            if axes is not None:
                return jax.lax.all_gather(x, axes, axis=dim - skip, tiled=True)
        return x

    return jax.tree_util.tree_map_with_path(gather, layer_specs, layer, is_leaf=lambda s: isinstance(s, P))
