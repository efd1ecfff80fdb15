"""The trainer's sampler: B groups per step, each group's G branches sampled from one capture of its prompt, and the
captures kept for the update, so that a training step captures every prompt once.

    rollouts, captured = sample_groups(model, params, prompts, keys, G, sampling, chunk_size, mesh=None)
    rollouts.responses [B, G, R] (likewise mask, logprobs, sample_logprobs; first_logprobs [B, V]); captured:
    `sampling.branches.Captured` (one device) or `sampling.mesh.ShardedCaptured` (mesh), every leaf stacked [B, ...]:
    pass it to `train.train_step(..., captured=captured)` / `engine.grpo_grads(..., captured=captured)`.

One device: the groups one after another (`lax.map` over `sampling.branches.sample_traced`). On a mesh: B is split over
`data` (`parallel/groups.py`); each data slice samples its own groups, one after another, with the mesh sampler
(`sampling.mesh.sample_traced`: the prompt captured in rounds of about chunk_size positions into seq-sharded caches,
decoded with a replicated tail). Group b uses keys[b]; its tokens are those `sampling.branches.sample_group` draws with
that key.
"""
from __future__ import annotations

import functools

import jax
import numpy as np

from longstraw_jax.models.base import chunk_layout
from longstraw_jax.parallel.groups import check_groups, over_data
from longstraw_jax.sampling import branches as rollout, mesh as mesh_sampling
from longstraw_jax.sampling.branches import SamplingConfig
from longstraw_jax.sharding.prompt import round_layout
from longstraw_jax.validation import check_size


def sample_groups(model, params, prompts, keys: jax.Array, group_size: int, sampling: SamplingConfig,
                  chunk_size: int, mesh=None, keep_capture: bool = True):
    """prompts int [B, P] (P >= 2), keys: B PRNG keys -> (Rollout with leaves [B, G, R], the captures [B, ...]);
    without keep_capture only the Rollout. Host-side checks first (token ids, G, the sampling ids, chunk_size; on a
    mesh B a multiple of the data size), then one jitted call."""
    prompts = np.asarray(prompts)
    if prompts.ndim != 2:
        raise ValueError(f"prompts must be [B, P] (one row per group), got shape {prompts.shape}")
    if jax.numpy.shape(keys)[:1] != prompts.shape[:1]:
        raise ValueError(f"keys has shape {jax.numpy.shape(keys)}; need one key per group: [B] = [{prompts.shape[0]}]")
    for row in prompts:
        _, group_size = rollout.check_sampling_inputs(model, row, group_size, sampling)
    chunk_size = check_size(chunk_size, "chunk_size")
    chunk_layout(prompts.shape[1] - 1, chunk_size)
    prompts = prompts.astype(np.int32)
    if mesh is None:
        return _one_device(model, params, prompts, keys, group_size, sampling, chunk_size, keep_capture)
    model.sequence_parallel()  # a family without a sharded path says so before any work
    check_groups(prompts.shape[0], mesh)
    layout = round_layout(model, prompts.shape[1] - 1, mesh.shape["seq"], chunk_size)
    return _on_mesh(model, params, prompts, keys, group_size, sampling, mesh, layout, keep_capture)


@functools.partial(jax.jit, static_argnums=(0, 4, 5, 6, 7))
def _one_device(model, params, prompts, keys, group_size, sampling, chunk_size, keep_capture):
    one = lambda x: rollout.sample_traced(model, params, x[0], x[1], group_size, sampling, chunk_size, keep_capture)
    return jax.lax.map(one, (prompts, keys))


@functools.partial(jax.jit, static_argnums=(0, 4, 5, 6, 7, 8))
def _on_mesh(model, params, prompts, keys, group_size, sampling, mesh, layout, keep_capture):
    def slice_groups(params, local):
        one = lambda x: mesh_sampling.sample_traced(model, params, x[0], x[1], group_size, sampling, mesh, layout,
                                                  keep_capture=keep_capture)
        return jax.lax.map(one, local)

    return over_data(mesh, slice_groups, params, (prompts, keys), summed=False)
