"""Sampling G response branches from a captured prompt state: `branches` (one group on one device, and the token loop
every sampler runs), `mesh` (one group on a `data x seq` mesh, reading the seq-sharded cache in place), `groups`
(B groups side by side: the trainer's entry point)."""
from longstraw_jax.sampling.branches import Captured, Rollout, SamplingConfig, sample_group
from longstraw_jax.sampling.groups import sample_groups

__all__ = ["SamplingConfig", "Rollout", "Captured", "sample_group", "sample_groups"]
