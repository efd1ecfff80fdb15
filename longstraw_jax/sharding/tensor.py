"""Decoding with the weights where they are: a matrix's FSDP shard applied as a tensor-parallel linear.

FSDP (`rules.py`) splits every matrix `w [out, in]` along one of its dimensions over all devices of the mesh. The
capture and the update all-gather one layer at a time (`rules.gather_layer`): many positions share the gathered
layer. A decode step has a handful of tokens, so moving the layer would cost more than the step's arithmetic; here
each device multiplies by its own shard and only activations cross devices:

    w split along `out` (dim 0): y = all_gather(x @ w_shard^T)                  [..., out / n] -> [..., out]
    w split along `in`  (dim 1): y = psum(x[..., shard's in-slice] @ w_shard^T)  partial products summed

`x` must be the same on every device of the shard's axes. Inside `groups.over_data` (each data slice decodes its
own groups, so x differs across `data`), the slices' rows are gathered first and each slice keeps its own rows of
the result (`varying`): still activations only. Leaves the layer code does not apply through `ops.mlp.linear` (norm
vectors, conv kernels, GLM's per-head kv_b_proj and the indexer / router weights read by einsum) are gathered as
before: `tensor_parallel_layer` takes the family's list of linear leaves.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from longstraw_jax.sharding.rules import expert_parallel, manual_axes


@jax.tree_util.register_pytree_node_class
class ShardedMatrix:
    """Inside `shard_map`: this device's shard `local` of a matrix [out, in] split along `dim` (0 or 1) over the mesh
    axes `axes` (in FSDP's order), applied by `linear` without gathering it. varying: the mesh axes over which the
    inputs differ (their rows are exchanged instead of the weights); () when x is replicated."""

    def __init__(self, local, dim: int, axes: tuple, varying: tuple = ()):
        self.local, self.dim, self.axes, self.varying = local, dim, axes, varying

    def tree_flatten(self):
        return (self.local,), (self.dim, self.axes, self.varying)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0], *aux)

    @property
    def shape(self) -> tuple:
        shape = list(self.local.shape)
        shape[self.dim] *= jax.lax.psum(1, self.axes)
        return tuple(shape)

    @property
    def dtype(self):
        return self.local.dtype

    def linear(self, x: jax.Array, precision=None) -> jax.Array:
        """x [..., in] (the same on every device of `axes` apart from `varying`) -> x @ w^T [..., out]."""
        if self.varying:  # every slice's rows: [n_varying, ..., in]
            x = jax.lax.all_gather(x, self.varying, axis=0, tiled=False)
        if self.dim == 0:
            y = jnp.einsum("...i,oi->...o", x, self.local, precision=precision)
            y = jax.lax.all_gather(y, self.axes, axis=y.ndim - 1, tiled=True)
        else:
            width = self.local.shape[1]
            mine = jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(self.axes) * width, width, axis=x.ndim - 1)
            y = jax.lax.psum(jnp.einsum("...i,oi->...o", mine, self.local, precision=precision), self.axes)
        return y[jax.lax.axis_index(self.varying)] if self.varying else y


def applied_as_shard(path, linear_leaves: frozenset) -> bool:
    """Whether the parameter leaf at `path` (a key path) is a matrix decoding applies as a `ShardedMatrix`: named in
    `linear_leaves`, or the base of a LoRA node that is."""
    names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
    return names[-1] in linear_leaves or (names[-1] == "base" and len(names) > 1 and names[-2] in linear_leaves)


def varying_axes() -> tuple:
    """The mesh axes over which a decode step's tokens differ where it is traced: ("data",) inside
    `groups.over_data` (each slice decodes its own groups), else ()."""
    return tuple(a for a in ("data",) if a in manual_axes())


def tensor_parallel_layer(layer, layer_specs, linear_leaves: frozenset, varying: tuple = (), skip: int = 2):
    """Inside `shard_map`: one layer's parameter shards (the `skip` stacked axes indexed away) for a decode step:
    leaves named in `linear_leaves` (a LoRA node's base included) that FSDP splits become `ShardedMatrix`es, the
    rest is all-gathered as `rules.gather_layer` does (expert-parallel experts stay this device's)."""
    def place(path, spec, x):
        if expert_parallel(path, spec, skip):
            return x
        split = [(d - skip, axes) for d, axes in enumerate(spec) if axes is not None]
        if not split:
            return x
        dim, axes = split[0]
        axes = axes if isinstance(axes, tuple) else (axes,)
        if x.ndim == 2 and applied_as_shard(path, linear_leaves):
            return ShardedMatrix(x, dim, axes, varying)
        return jax.lax.all_gather(x, axes, axis=dim, tiled=True)

    return jax.tree_util.tree_map_with_path(place, layer_specs, layer, is_leaf=lambda s: isinstance(s, P))

