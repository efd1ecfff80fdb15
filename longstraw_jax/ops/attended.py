"""The result of softmax attention over one set of keys, and the exact merge of two such results.

Attention over several disjoint key sets (a captured prompt cache, then the new tokens; the shards of a
sequence-parallel cache) merges exactly by log-sum-exp, under autodiff too: both the XLA path (`ops.attention`) and
the Pallas kernels (`ops.flash_attention`) return the LSE with its gradient.
"""
from typing import NamedTuple

import jax
import jax.numpy as jnp

MASKED = -1e30  # finite "minus infinity": exp(MASKED - x) == 0 and (MASKED) - (MASKED) is not NaN


class Attended(NamedTuple):
    """out: [T, H, value_dim] normalised output over the visited keys (value_dim: hd for `attend`, kv_lora_rank for
    `ops.mla`); lse: [T, H] log-sum-exp of their scores (MASKED when a query saw no key, with out = 0). Both in the
    accumulation dtype (float32)."""

    out: jax.Array
    lse: jax.Array


def merge(a: Attended, b: Attended) -> Attended:
    """Exact softmax attention over the union of two disjoint key sets."""
    lse = jnp.logaddexp(a.lse, b.lse)
    wa, wb = jnp.exp(a.lse - lse)[..., None], jnp.exp(b.lse - lse)[..., None]
    return Attended(a.out * wa + b.out * wb, lse)


def merge_all(parts: Attended) -> Attended:
    """`merge` of N disjoint key sets' results stacked on a leading axis (out [N, T, H, Dv], lse [N, T, H]): one
    log-sum-exp over the N, a part that saw no key (MASKED) weighing 0."""
    lse = jax.nn.logsumexp(parts.lse, axis=0)
    return Attended(jnp.sum(parts.out * jnp.exp(parts.lse - lse)[..., None], axis=0), lse)
