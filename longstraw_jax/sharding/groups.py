"""B GRPO groups side by side on the mesh's `data` axis: data slice d computes groups [d * B/D, (d + 1) * B/D) (D =
the data size), each with sequence parallelism over its own `seq` devices, and no device touches another slice's
groups.

`over_data(mesh, fn, params, per_group)` runs fn inside a `shard_map` that is manual over `data` only: every leaf of
`per_group` has a leading group axis [B, ...] split over `data` (fn sees its slice's B/D groups), and the parameters
enter FSDP-sharded as they rest:
- stacked layer leaves (`blocks/...`, `layers/...`) stay split over `data` (each slice holds its part of the
  ("data", "seq") FSDP split); they are only read inside the families' own `shard_map`s, whose per-layer all-gather
  over ("data", "seq") assembles the layer, and whose transpose (a reduce-scatter over ("data", "seq")) hands each
  device its shard of the gradient summed over *all* slices' groups;
- the other leaves (embedding, LM head, final norm: read outside those `shard_map`s) enter whole over `data` (still
  split over `seq`), and their gradients are summed over the slices on the way out; so is every leaf with no FSDP
  split, and the loss and metric sums.
Inside, `rules.shard_map` / `rules.named` / `rules.param_specs` adapt the families' code to the manual `data` axis
(docs/architecture.md, "groups side by side").
"""
from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from longstraw_jax.sharding import rules

DATA = "data"


GROUPS = "groups"  # the vmap axis of the groups one device samples together (`sampling/groups.py`)


def any_slice(x) -> jax.Array:
    """jnp.any(x) over this data slice's values, over every group decoding with it (inside `jax.vmap(...,
    axis_name=GROUPS)`) and, inside `over_data`, over every slice's: a loop whose body holds collectives (e.g. the
    FSDP all-gather of a layer over ("data", "seq")) must run in lockstep on all slices, as long as any slice still
    has work. Over the vmapped groups the loop's condition stays one scalar: a condition batched over groups would
    make JAX's while-loop batching select every carried tail (KV tails, GDN states) between old and new at every
    step, and run both sides of a `lax.cond`; a group whose branches have stopped runs on in lockstep instead, its
    results discarded by the loop (`sampling.branches.sample_after_prompt`)."""
    local = x if jax.numpy.ndim(x) == 0 else jax.numpy.any(x)  # a scalar as it is: no op added to the program
    if _bound(GROUPS):
        local = jax.lax.psum(local.astype(jax.numpy.int32), GROUPS) > 0
    if DATA in rules.manual_axes():
        return jax.lax.psum(local.astype(jax.numpy.int32), DATA) > 0
    return local


def _bound(axis_name: str) -> bool:
    """Whether a vmap (or shard_map) axis of this name is bound where this is traced."""
    try:
        jax.lax.axis_size(axis_name)
    except NameError:
        return False
    return True


def observe(group_index) -> None:
    """Called once per group inside the engines' group loop with the group's index in the batch (a traced int32).
    A no-op: a test seam (tests replace it with a `jax.debug.callback` to see which device computes which group)."""


def region_specs(params, mesh):
    """The parameters' specs at the region's boundary (manual over `data` only): stacked layer leaves keep the
    `data` part of their FSDP split at its dimension; every other leaf is whole over `data`."""
    def spec(path, s):
        if not rules.stacked_dims(path):
            return P()
        return P(*(DATA if e is not None and DATA in (e if isinstance(e, tuple) else (e,)) else None for e in s))
    return jax.tree_util.tree_map_with_path(spec, rules.param_specs(params, mesh), is_leaf=lambda s: isinstance(s, P))


def _split(spec: P) -> bool:
    return any(e is not None for e in spec)


def check_groups(groups_per_step: int, mesh) -> None:
    """B groups must split evenly over the mesh's data axis."""
    data = mesh.shape[DATA]
    if groups_per_step % data:
        raise ValueError(f"{groups_per_step} groups do not split over the mesh's data axis of size {data}: the "
                         f"number of groups per step (--groups-per-step) must be a multiple of {data}")


def over_data(mesh, fn, params, per_group, summed=True, like=None):
    """fn(params, local) with `local` one data slice's groups of `per_group` (leaves [B/D, ...]).

    summed=True: fn returns (loss, grads, sums), each summed over its slice's groups (grads float32 like params);
    the result is summed over all groups, grads sharded like the parameters at rest. summed=False: fn returns a
    pytree of per-group outputs (leading axis [B/D]); the result has them for all B groups ([B, ...], split over
    `data`). With one data slice, fn(params, per_group) directly. like: the structure and global shapes of the
    gradients when they are not params' (the trainable part, with holes: `adapters/trainable.py`).
    """
    check_groups(jax.tree.leaves(per_group)[0].shape[0], mesh)
    if mesh.shape[DATA] == 1:
        return fn(params, per_group)
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    boundary = region_specs(params, mesh)
    grads_boundary = boundary if like is None else region_specs(like, mesh)

    def body(params, local):
        with rules.global_param_shapes(shapes):
            out = fn(params, local)
        if not summed:
            return out
        loss, grads, sums = out
        total = lambda x: jax.lax.psum(x, DATA)
        grads = jax.tree.map(lambda s, g: g if _split(s) else total(g), grads_boundary, grads,
                             is_leaf=lambda s: isinstance(s, P))
        return total(loss), grads, jax.tree.map(total, sums)

    out_specs = (P(), grads_boundary, P()) if summed else P(DATA)
    return jax.shard_map(body, mesh=mesh, in_specs=(boundary, P(DATA)), out_specs=out_specs, axis_names={DATA},
                         check_vma=False)(params, per_group)
