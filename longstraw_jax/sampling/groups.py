"""The trainer's sampler: B groups per step, each group's G branches sampled from one capture of its prompt, and the
captures kept for the update, so that a training step captures every prompt once.

    rollouts, captured = sample_groups(model, params, prompts, keys, G, sampling, chunk_size, mesh=None)
    rollouts.responses [B, G, R] (likewise mask, logprobs, sample_logprobs; first_logprobs [B, V]); captured:
    `sampling.branches.Captured` (one device) or `sampling.mesh.ShardedCaptured` (mesh), every leaf stacked [B, ...]:
    pass it to `train.train_step(..., captured=captured)` / `engine.grpo_grads(..., captured=captured)`.

With keep_capture (the trainer's step, which keeps every group's state for the update anyway) the prompts are
captured one after another (`lax.map`: one capture's activations live at a time), then every group's branches decode
together (`decode_together`: `jax.vmap` of the branch loop over groups, one decode step per response position for
all B x G branches, each group reading its own prompt cache; a single group without the vmap). Without it
(held-out evaluation: many prompts, nothing kept) the groups are sampled one after another, so only one prompt
state lives at a time. On a mesh B is split over `data` (`sharding/groups.py`): each data slice does the same with
its own groups, captured in rounds into seq-sharded caches (`sampling.mesh`). Group b uses keys[b]; its tokens are
those `sampling.branches.sample_group` draws with that key.
"""
from __future__ import annotations

import functools

import jax
import numpy as np

from longstraw_jax.common.validation import check_left_pad, check_size
from longstraw_jax.engine.capture import chunk_layout, round_layout
from longstraw_jax.sampling import branches as rollout, mesh as mesh_sampling
from longstraw_jax.sampling.branches import SamplingConfig
from longstraw_jax.sharding.groups import GROUPS, check_groups, over_data


def sample_groups(model, params, prompts, keys: jax.Array, group_size: int, sampling: SamplingConfig,
                  chunk_size: int, mesh=None, keep_capture: bool = True, left_pad=None):
    """prompts int [B, P] (P >= 2), keys: B PRNG keys -> (Rollout with leaves [B, G, R], the captures [B, ...]);
    without keep_capture only the Rollout. left_pad: None, or int [B] in [0, P-2]: group b's prompt is left-padded,
    prompts[b, :left_pad[b]] are pads (`sampling.padding.pad_left`; pass the same left_pad to the update's
    `GroupBatch.left_pad`). Host-side checks first (token ids, G, the sampling ids, chunk_size, left_pad; on a mesh B
    a multiple of the data size), then one jitted call."""
    prompts = np.asarray(prompts)
    if prompts.ndim != 2:
        raise ValueError(f"prompts must be [B, P] (one row per group), got shape {prompts.shape}")
    if jax.numpy.shape(keys)[:1] != prompts.shape[:1]:
        raise ValueError(f"keys has shape {jax.numpy.shape(keys)}; need one key per group: [B] = [{prompts.shape[0]}]")
    for row in prompts:
        _, group_size = rollout.check_sampling_inputs(model, row, group_size, sampling)
    chunk_size = check_size(chunk_size, "chunk_size")
    chunk_layout(prompts.shape[1] - 1, chunk_size)
    left_pad = check_left_pad(left_pad, prompts.shape[1] - 2, "left_pad", prompts.shape[0])
    prompts = prompts.astype(np.int32)
    if mesh is None:
        return _one_device(model, params, prompts, keys, group_size, sampling, chunk_size, keep_capture, left_pad)
    model.mesh_adapter()  # a family without a sharded path says so before any work
    check_groups(prompts.shape[0], mesh)
    layout = round_layout(model, prompts.shape[1] - 1, mesh.shape["seq"], chunk_size)
    return _on_mesh(model, params, prompts, keys, group_size, sampling, mesh, layout, keep_capture, left_pad)


def decode_together(sample, *per_group):
    """sample(*one group's leaves) over the groups of `per_group` (every leaf [B, ...]; None leaves pass as None),
    all B groups' branches in one loop: `jax.vmap(sample, axis_name=GROUPS)`. One group (B = 1: one device's, or one
    data slice's on a mesh) runs unbatched, its results given the unit axis afterwards: the same values, without a
    unit batch axis in every decode op (XLA:CPU copies the prompt cache for an attention product batched over one
    group and runs the decoded token's conv as a slower library reduction)."""
    groups = {x.shape[0] for x in jax.tree.leaves(per_group)}
    if len(groups) != 1:
        raise ValueError(f"decode_together: the per-group leaves have leading axes {sorted(groups)}; need one B")
    if groups == {1}:
        one = sample(*jax.tree.map(lambda x: x[0], per_group))
        return jax.tree.map(lambda x: x[None], one)
    return jax.vmap(sample, axis_name=GROUPS)(*per_group)


@functools.partial(jax.jit, static_argnums=(0, 4, 5, 6, 7))
def _one_device(model, params, prompts, keys, group_size, sampling, chunk_size, keep_capture, left_pad=None):
    if not keep_capture:  # one group at a time: no group's state outlives its sampling
        one = lambda x: rollout.sample_traced(model, params, x[0], x[1], group_size, sampling, chunk_size,
                                              left_pad=x[2])
        return jax.lax.map(one, (prompts, keys, left_pad))
    captured = jax.lax.map(lambda x: rollout.capture_prompt(model, params, x[0], chunk_size, keep_capture, x[1]),
                           (prompts, left_pad))
    sample = lambda state, prompt, key, pad: rollout.sample_captured(model, params, state, prompt, key, group_size,
                                                                    sampling, pad)
    return decode_together(sample, captured.state, prompts, keys, left_pad), captured


@functools.partial(jax.jit, static_argnums=(0, 4, 5, 6, 7, 8))
def _on_mesh(model, params, prompts, keys, group_size, sampling, mesh, layout, keep_capture, left_pad=None):
    def slice_groups(params, local):
        prompts, keys, left_pad = local
        if not keep_capture:  # one group at a time: no group's state outlives its sampling
            one = lambda x: mesh_sampling.sample_traced(model, params, x[0], x[1], group_size, sampling, mesh, layout,
                                                        left_pad=x[2])
            return jax.lax.map(one, (prompts, keys, left_pad))
        captured = jax.lax.map(lambda x: mesh_sampling.capture_prompt(model, params, x[0], mesh, layout,
                                                                      left_pad=x[1]), (prompts, left_pad))
        sample = lambda sstate, prompt, key, pad: mesh_sampling.sample_captured(model, params, sstate, prompt, key,
                                                                               group_size, sampling, mesh, pad)
        rollouts = decode_together(sample, captured.sstate, prompts, keys, left_pad)
        return rollouts, captured

    return over_data(mesh, slice_groups, params, (prompts, keys, left_pad), summed=False)
