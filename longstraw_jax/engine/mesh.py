"""`grpo_grads` on a ("data", "seq") mesh: the engine's algorithm with the family's sequence-parallel capture,
replay and prompt backward (`model.mesh_adapter()`: `models/qwen36/mesh.py`, `models/glm52/mesh.py`).

    capture   sstate = capture(prompt[:-1]) on the mesh, in rounds    seq-sharded caches, replicated GDN state
              (or the sampler's capture, passed in: one capture per step)
    replay    for g in branches (lax.scan): parameter gradients (FSDP-sharded, float32) and, in exact mode, the
              state cotangent (sharded like the state; only `model.differentiable_state`'s leaves). Both families
              block by block (`layerwise.branch_grads`, each block in its own shard_map; GLM-5.x one stage per
              segment), the cotangent added in place one block slice at a time
    prompt    exact mode: rounds in reverse and blocks in reverse (models/qwen36_mesh.prompt_backward,
              models/glm52_mesh.prompt_backward)

Gradients flow through `shard_map` by JAX's transposes of the collectives: the layers' `all_gather` becomes a
reduce-scatter (each device receives only its own shard of a layer's gradient), the log-sum-exp merge's `psum`
hands each shard the cotangent of its own partial, the ring's `ppermute` runs backwards, the GDN affine fold's
all-gather carries later segments' cotangents back to the segments that produced them, and GLM's all-gathered latent
rows send each gathered row's cotangent back to the shard that holds it.

Groups: a batch with a group axis (prompt [B, P], ...) is split over `data` (`sharding/groups.py`): each data slice
runs its B / D groups one after another (a scan), sequence-parallel over its `seq` devices, and the gradients are
reduced over the whole mesh. A one-group batch (no group axis) runs on the whole mesh, every data slice repeating it.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from longstraw_jax.adapters.trainable import merge, split_like
from longstraw_jax.engine.capture import round_layout
from longstraw_jax.engine.replay import replay_branches, scan_groups, zeros_f32
from longstraw_jax.grpo import GroupBatch, GRPOConfig, finalize_metrics, scored
from longstraw_jax.sharding import groups as groups_lib
from longstraw_jax.sharding.layout import RoundLayout
from longstraw_jax.sharding.rules import constrain, param_specs, prompt_state_specs


def grpo_grads(model, params, batch: GroupBatch, cfg: GRPOConfig, mode: str, mesh, chunk_size: int | None = None,
               attention: str = "ring", captured=None, frozen=None):
    """(loss, grads, metrics) as `engine.grpo_grads`, on `mesh`; grads are sharded like `rules.param_specs`.
    The batch must already be validated (engine.grpo_grads does it). The prompt is captured (and, in exact mode,
    backpropagated) in rounds of about `chunk_size` positions (None: one round). captured: the mesh sampler's
    `ShardedCaptured` of prompt[:-1] (with the batch's group axis when it has one), used instead of a capture.
    frozen: the parameters not trained (`adapters/trainable.py`); grads are then shaped like params, the trainable
    part."""
    if batch.groups_per_step is not None:
        groups_lib.check_groups(batch.groups_per_step, mesh)
    layout = round_layout(model, batch.prompt.shape[-1] - 1, mesh.shape["seq"], chunk_size)
    return jitted_grpo_grads(model, params, batch, cfg, mode, mesh, layout, attention, captured, frozen)


@functools.partial(jax.jit, static_argnums=(0, 3, 4, 5, 6, 7))
def jitted_grpo_grads(model, params, batch: GroupBatch, cfg: GRPOConfig, mode: str, mesh, layout: RoundLayout,
                      attention: str, captured, frozen=None):
    """`grpo_grads` on the mesh as one jitted program (model, cfg, mode, mesh, layout and attention static), without
    its checks: what ahead-of-time tools lower (tools/bench_glm_backward.py)."""
    trainable, params = params, merge(params, frozen)
    # the gradients' structure (the trainable part, holes allowed) and global shapes
    template = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), trainable)
    grouped = batch.as_groups()
    if captured is not None and batch.groups_per_step is None:
        captured = jax.tree.map(lambda x: x[None], captured)
    grouped, weights, advantages = scored(grouped, cfg)
    per_group = (grouped, weights, advantages, captured, jnp.arange(grouped.groups_per_step, dtype=jnp.int32))
    slice_grads = functools.partial(_slice_grads, model, cfg, mode, mesh, layout, attention, template)
    if batch.groups_per_step is None:  # one group on the whole mesh
        loss, grads, sums = slice_grads(params, per_group)
    else:
        loss, grads, sums = groups_lib.over_data(mesh, slice_grads, params, per_group, like=template)
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, trainable)
    grads = constrain(grads, param_specs(trainable, mesh), mesh)
    return loss, grads, finalize_metrics(sums, grouped.rewards, grouped.mask)


def _slice_grads(model, cfg, mode, mesh, layout, attention, template, params, local):
    """One data slice's groups (leaves [B/D, ...]) one after another -> (loss, float32 grads shaped like `template`
    (the trainable part), metric sums)."""
    trainable = split_like(params, template)[0]  # this slice's pieces of the trainable leaves
    specs = param_specs(trainable, mesh)
    like_params = lambda tree: constrain(tree, specs, mesh)

    def one_group(grads, xs):
        group, weights, advantages, captured, index = xs
        groups_lib.observe(index)
        return _group_grads(model, params, group, cfg, mode, mesh, layout, attention, weights, advantages, captured,
                            grads, like_params)

    return scan_groups(one_group, like_params(zeros_f32(trainable)), local)


def _group_grads(model, params, batch, cfg, mode, mesh, layout, attention, weights, advantages, captured, grads,
                 like_params):
    """One group: capture (unless `captured`), replay, and in exact mode the prompt's backward, adding into grads."""
    family = model.mesh_adapter()
    stored = layout.to_stored(batch.prompt[:-1].astype("int32"))
    if captured is None:
        sstate, capture_aux = family.capture(jax.lax.stop_gradient(params), stored, mesh, layout, attention,
                                              batch.left_pad)
    else:
        sstate, capture_aux = captured.sstate, captured.capture_aux
    state_specs = model.differentiable_state(sstate.replace(state=prompt_state_specs(sstate.state)))  # like the acc
    loss, grads, state_cot, sums = replay_branches(
        model, params, sstate, batch, cfg, with_state_grad=mode == "exact",
        branch_grads=family.branch_grads(mesh, layout, param_specs(params, mesh)), like_params=like_params,
        like_state=lambda tree: constrain(tree, state_specs, mesh), weights=weights, advantages=advantages,
        grads=grads)
    if mode == "exact":
        grads = family.prompt_backward(params, stored, mesh, layout, attention, sstate, capture_aux, state_cot.state,
                                       grads, batch.left_pad)
    return loss, grads, sums
