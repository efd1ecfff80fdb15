"""What one trainer step updates from: the groups kept by --drop-uniform-groups, and the metrics of its
--updates-per-batch updates (or of none).

A group whose G rewards are all equal has zero advantage on every branch: its surrogate gradient is zero and it adds
only tokens to the loss's normaliser (and its KL term, with --kl-coef). Dropping it makes the step's loss an average
over the groups that carry a signal and skips their replay and backward. With --refill-batches K (DAPO's dynamic
sampling) a step short of -B such groups samples up to K more batches and updates from the first -B (`refilled`).
"""
from __future__ import annotations

import jax
import numpy as np

from longstraw_jax.grpo import GroupBatch


def uniform_groups(rewards: np.ndarray, valid: np.ndarray | None = None) -> np.ndarray:
    """rewards [B, G] (valid [B, G] or None: the branches that count, `GroupBatch.valid`) -> bool [B]: the groups
    whose (valid) rewards are all equal, or that have fewer than 2 valid branches."""
    rewards = np.asarray(rewards)
    if valid is None:
        return np.all(rewards == rewards[:, :1], axis=1)
    keep = np.asarray(valid) > 0
    high = np.where(keep, rewards, -np.inf).max(axis=1)
    low = np.where(keep, rewards, np.inf).min(axis=1)
    return (keep.sum(axis=1) < 2) | (high == low)


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
    uniform = uniform_groups(batch.rewards, batch.valid)
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


def left_padded_to(batch: GroupBatch, length: int, pad_id: int = 0) -> GroupBatch:
    """batch with prompts [B, P] left-padded to [B, length] (pad_id; left_pad grows by length - P): the same groups
    (padding changes nothing, docs/architecture.md 4.6). A batch without left_pad gets one when it is padded."""
    prompt = np.asarray(batch.prompt)
    extra = length - prompt.shape[-1]
    if extra == 0:
        return batch
    base = np.zeros(prompt.shape[0], np.int32) if batch.left_pad is None else np.asarray(batch.left_pad, np.int32)
    padded = np.concatenate([np.full(prompt.shape[:-1] + (extra,), pad_id, prompt.dtype), prompt], axis=-1)
    return batch.replace(prompt=padded, left_pad=base + np.int32(extra))


def pooled(batches: list[GroupBatch]) -> GroupBatch:
    """Sampled batches [B_i, P_i, ...] -> one batch [sum B_i, max P_i, ...], prompts left-padded to the longest."""
    length = max(np.shape(b.prompt)[-1] for b in batches)
    padded = [left_padded_to(b, length) for b in batches]
    if any(b.left_pad is None for b in padded) and not all(b.left_pad is None for b in padded):
        padded = [b if b.left_pad is not None else b.replace(left_pad=np.zeros(len(b.rewards), np.int32))
                  for b in padded]
    return jax.tree.map(lambda *xs: np.concatenate([np.asarray(x) for x in xs]), *padded)


def refilled(batches: list[GroupBatch], groups: int, data_size: int = 1) -> tuple[GroupBatch | None, int]:
    """The update's batch from a step's sampled batches (--refill-batches): the first `groups` groups, in sampling
    order, whose rewards are not uniform; fewer when fewer were sampled (then rounded up to a multiple of
    `data_size` with uniform ones, as `kept_groups`); None when every group is uniform. -> (batch, uniform groups
    sampled)."""
    pool = pooled(batches)
    uniform = uniform_groups(pool.rewards, pool.valid)
    signal = np.flatnonzero(~uniform)
    kept = signal[:groups] if signal.size >= groups else kept_groups(uniform, data_size)
    chosen = None if kept.size == 0 else jax.tree.map(lambda x: np.asarray(x)[kept], pool)
    return chosen, int(uniform.sum())


def reward_metrics(batch: GroupBatch) -> dict:
    """reward_mean / reward_std over every branch of every sampled group (population std), and signal_groups: the
    share of the sampled groups whose rewards differ (the others have zero advantage: no gradient)."""
    rewards = np.asarray(batch.rewards, np.float64)
    valid = None if batch.valid is None else np.asarray(batch.valid).reshape(-1, rewards.shape[-1])
    signal = ~uniform_groups(rewards.reshape(-1, rewards.shape[-1]), valid)
    return {"reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()),
            "signal_groups": float(signal.mean())}


def no_update_metrics(batch: GroupBatch) -> dict:
    """A step that makes no update (every group uniform): its rewards and response lengths; loss, KL, clip fraction,
    gradient norm, update size and advantages 0; updates 0."""
    mask = np.asarray(batch.mask, np.float64)
    return {**reward_metrics(batch), "loss": 0.0, "kl": 0.0, "clip_frac": 0.0, "grad_norm": 0.0, "update_norm": 0.0,
            "update_ratio": 0.0, "skipped": 0.0, "adv_mean": 0.0, "adv_abs_mean": 0.0,
            "response_len_mean": float(mask.sum(-1).mean()), "updates": 0}


def mean_metrics(per_update: list[dict]) -> dict:
    """The metrics of a step's updates: each the mean over its updates (skipped: the number of skipped updates),
    with `updates` = how many."""
    names = per_update[0].keys()
    out = {k: float(np.mean([float(m[k]) for m in per_update])) for k in names}
    if "skipped" in out:
        out["skipped"] = float(sum(float(m["skipped"]) for m in per_update))
    return {**out, "updates": len(per_update)}
