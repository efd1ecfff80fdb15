"""A step's prompts as arrays and its groups' scores: the one place where prompts become arrays (prompts of one
length stacked as they are; prompts of a dataset left-padded to a bucket length, sampling/padding.py: the models
mask the pads, so the results are the unpadded prompts'), and where sampled groups are rewarded (each by the process
that owns its data slice). Used by every data source (trainer/components.py, trainer/episodes.py) and the held-out
evaluation."""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from longstraw_jax.sampling.padding import bucket_length, pad_left
from longstraw_jax.tasks import as_scorer
from longstraw_jax.trainer import distributed


def score_groups(task, reward_fn, prompts, responses: np.ndarray, mask: np.ndarray, mesh=None):
    """(rewards float32 [B, G], correctness float32 [B, G] when the task has `is_correct` else None, parts) of
    responses [B, G, R] (mask [B, G, R]) to `prompts` [B]. reward_fn: a token-level reward function or a group scorer
    (`tasks.as_scorer`); parts: {function name: (values float64 [B, G], 0 where it does not apply; applies float64
    [B, G])} of a scorer of several text rewards, else {}. Each group is scored by the process that owns its data
    slice (`distributed.group_owners`); the rows are summed over processes, so every process gets every value. A
    reward function raising on one process stops all of them (`distributed.agreed`)."""
    owners, me = distributed.group_owners(mesh, len(prompts)), distributed.process_index()
    judged, scorer = hasattr(task, "is_correct"), as_scorer(reward_fn)
    shape = mask.shape[:2]
    rewards, correct = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
    parts = {name: (np.zeros(shape), np.zeros(shape)) for name in getattr(scorer, "names", ())}
    with distributed.agreed("reward", (Exception,)):
        for b in (b for b in range(len(prompts)) if owners[b] == me):
            rewards[b], group_parts = scorer.score_group(prompts[b], responses[b], mask[b])
            for name, (values, applies) in group_parts.items():
                parts[name][0][b], parts[name][1][b] = values, applies
            if judged:
                correct[b] = [task.is_correct(r[m > 0], prompts[b].info) for r, m in zip(responses[b], mask[b])]
    rewards, correct, parts = distributed.sum_over_processes((rewards, correct, parts))
    return rewards, (correct if judged else None), parts


def part_means(parts: dict, prefix: str = "reward/") -> dict:
    """{name: (values, applies)} of `score_groups` -> {prefix + name: mean over the completions the function
    applies to}; a function that applied to none is left out."""
    return {prefix + name: float(values.sum() / applies.sum()) for name, (values, applies) in parts.items()
            if applies.sum() > 0}


@dataclasses.dataclass(frozen=True)
class PromptBuckets:
    """How a dataset's prompts are padded: bucket lengths multiple * 2^i (multiple: the capture chunk), the largest
    max_length (--max-prompt-len; None: the next such power of two above the longest prompt of the batch), at most
    max_buckets of them (--prompt-buckets), pads of id pad_id (masked: any id gives the same results)."""

    multiple: int
    max_length: int | None = None
    max_buckets: int | None = None
    pad_id: int = 0

    def bucket(self, n: int) -> int:
        """The length a prompt of n tokens is padded to."""
        top = self.max_length or self.multiple * 2 ** max(0, math.ceil(math.log2(n / self.multiple)))
        return bucket_length(n, self.multiple, top, self.max_buckets)


def stack_prompts(prompts, buckets: PromptBuckets | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """Prompts (tasks.Prompt) -> (int32 [B, L], left_pad int32 [B] or None): with `buckets`, every prompt
    left-padded to the bucket of the longest; without, prompts of one length side by side (left_pad None: the
    unpadded programs) and prompts of different lengths left-padded to the longest."""
    lengths = [len(p.tokens) for p in prompts]
    if buckets is None and len(set(lengths)) == 1:
        return np.stack([np.asarray(p.tokens, np.int32) for p in prompts]), None
    length = buckets.bucket(max(lengths)) if buckets is not None else max(lengths)
    pad_id = buckets.pad_id if buckets is not None else 0
    padded, left_pad = zip(*(pad_left(np.asarray(p.tokens), length, pad_id) for p in prompts))
    return np.stack(padded), np.array(left_pad, np.int32)


def prompt_batches(prompts, buckets: PromptBuckets | None = None, data_size: int = 1):
    """Prompts -> [(their indices int [k], tokens int32 [k, L], left_pad int32 [k] or None)]: one batch per bucket
    length on one device (prompts of one bucket answered together), one batch of all on a mesh whose data size is
    > 1 (a batch there holds a multiple of the data size)."""
    if data_size > 1 or (buckets is None and len({len(p.tokens) for p in prompts}) == 1):
        return [(np.arange(len(prompts)), *stack_prompts(prompts, buckets))]
    key = (lambda p: buckets.bucket(len(p.tokens))) if buckets is not None else (lambda p: len(p.tokens))
    keys = np.array([key(p) for p in prompts])
    return [(idx, *stack_prompts([prompts[i] for i in idx], buckets))
            for idx in (np.flatnonzero(keys == k) for k in sorted(set(keys.tolist())))]
