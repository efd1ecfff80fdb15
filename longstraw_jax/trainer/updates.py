"""What one trainer step updates from: the groups kept by --drop-uniform-groups, and the metrics of its
--updates-per-batch updates (or of none).

A group whose G rewards are all equal has zero advantage on every branch: its surrogate gradient is zero and it adds
only tokens to the loss's normaliser (and its KL term, with --kl-coef). Dropping it (DAPO's dynamic sampling without the
refill) makes the step's loss an average over the groups that carry a signal and skips their replay and backward.
"""
from __future__ import annotations

import jax
import numpy as np

from longstraw_jax.grpo import GroupBatch


def uniform_groups(rewards: np.ndarray) -> np.ndarray:
    """rewards [B, G] -> bool [B]: the groups whose rewards are all equal."""
    rewards = np.asarray(rewards)
    return np.all(rewards == rewards[:, :1], axis=1)


def kept_groups(uniform: np.ndarray, data_size: int = 1) -> np.ndarray:
    """Indices of the groups to update from: the non-uniform ones, rounded up to a multiple of `data_size` (the
    groups are split evenly over the mesh's data slices) with the first uniform ones; empty when every group is
    uniform."""
    kept = np.flatnonzero(~uniform)
    if kept.size == 0:
        return kept
    short = -kept.size % data_size
    return np.sort(np.concatenate([kept, np.flatnonzero(uniform)[:short]]))


def without_uniform_groups(batch: GroupBatch, captured, mesh=None):
    """(batch [B, ...], the sampler's captures [B, ...] or None) -> (the kept groups' batch [B', ...] and captures,
    or (None, None) when every group is uniform; the number of uniform groups left out). On a mesh the kept
    captures keep their sharding (B' is a multiple of the data size)."""
    uniform = uniform_groups(batch.rewards)
    kept = kept_groups(uniform, 1 if mesh is None else mesh.shape["data"])
    if kept.size == 0:
        return None, None, int(uniform.sum())
    left_out = int(uniform.sum()) - int(uniform[kept].sum())
    if kept.size == uniform.size:
        return batch, captured, left_out
    batch = jax.tree.map(lambda x: np.asarray(x)[kept], batch)
    if captured is not None:
        # an eager gather (cached per shape, not a new jit per step), placed back as it was (on a mesh: split
        # over `data` like the sampler's, B' being a multiple of the data size)
        take = lambda x: jax.device_put(x[kept], x.sharding) if isinstance(x, jax.Array) else np.asarray(x)[kept]
        captured = jax.tree.map(take, captured)
    return batch, captured, left_out


def reward_metrics(batch: GroupBatch) -> dict:
    """reward_mean / reward_std over every branch of every sampled group (population std)."""
    rewards = np.asarray(batch.rewards, np.float64)
    return {"reward_mean": float(rewards.mean()), "reward_std": float(rewards.std())}


def no_update_metrics(batch: GroupBatch) -> dict:
    """A step that makes no update (every group uniform): its rewards and response lengths; loss, KL, clip fraction,
    gradient norm and advantages 0; updates 0."""
    mask = np.asarray(batch.mask, np.float64)
    return {**reward_metrics(batch), "loss": 0.0, "kl": 0.0, "clip_frac": 0.0, "grad_norm": 0.0, "skipped": 0.0,
            "adv_mean": 0.0, "adv_abs_mean": 0.0, "response_len_mean": float(mask.sum(-1).mean()), "updates": 0}


def mean_metrics(per_update: list[dict]) -> dict:
    """The metrics of a step's updates: each the mean over its updates (skipped: the number of skipped updates),
    with `updates` = how many."""
    names = per_update[0].keys()
    out = {k: float(np.mean([float(m[k]) for m in per_update])) for k in names}
    if "skipped" in out:
        out["skipped"] = float(sum(float(m["skipped"]) for m in per_update))
    return {**out, "updates": len(per_update)}
