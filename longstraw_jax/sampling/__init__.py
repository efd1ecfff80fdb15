"""Sampling G response branches from a captured prompt state: `branches` (one group on one device, and the token loop
every sampler runs), `mesh` (one group on a `data x seq` mesh, reading the seq-sharded cache in place), `groups`
(B groups side by side: the trainer's entry point), `padding` (prompts of different lengths: left padding to
bucket lengths)."""
from longstraw_jax.sampling.branches import Captured, Rollout, SamplingConfig, sample_group
from longstraw_jax.sampling.groups import sample_groups
from longstraw_jax.sampling.padding import bucket_length, bucket_lengths, pad_batch, pad_left

__all__ = ["SamplingConfig", "Rollout", "Captured", "sample_group", "sample_groups", "bucket_length",
           "bucket_lengths", "pad_batch", "pad_left"]
