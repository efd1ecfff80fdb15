"""Token log-probs and entropies from final hidden states, `chunk` tokens at a time.

The vocabulary projection of T tokens is a [T, V] array (at T = 8k, V = 248k: 8 GB in float32). Here the tokens
are visited in chunks (a `lax.scan`, plus one static tail chunk when chunk does not divide T), and each chunk is
under `jax.checkpoint`, so neither the forward nor the backward pass ever holds more than a [chunk, V] block.
"""
import operator

import jax
import jax.numpy as jnp

from longstraw_jax.ops.dtypes import accum_dtype


def _chunk_logprobs(hidden: jax.Array, head: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """hidden [W, D], head [V, D], targets [W] -> (log p(target) [W], entropy [W]), accumulated in float32."""
    logits = jnp.einsum("wd,yd->wy", hidden, head, preferred_element_type=accum_dtype(hidden.dtype))
    lse = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[:, None], axis=-1)[:, 0]
    probs = jnp.exp(logits - lse[:, None])
    entropy = lse - jnp.sum(probs * logits, axis=-1)
    return target_logit - lse, entropy


def token_logprobs(hidden: jax.Array, head: jax.Array, targets: jax.Array, chunk: int) -> tuple[jax.Array, jax.Array]:
    """hidden [T, D] (final-normed), head [V, D] (LM head / tied embedding), targets int [T], chunk tokens per step.

    Returns (logp [T], entropy [T]) in float32 (float64 for float64 inputs): logp[t] = log_softmax(h_t W^T)[y_t],
    entropy[t] = -sum_y p log p. Differentiable w.r.t. hidden and head; peak memory O(chunk * V), not O(T * V).
    Targets must lie in [0, V) (gathers clamp silently; validate ids on the host).
    """
    if isinstance(chunk, bool) or not hasattr(chunk, "__index__") or operator.index(chunk) < 1:
        raise ValueError(f"chunk must be a positive int, got {chunk!r}")
    chunk = operator.index(chunk)
    if hidden.ndim != 2 or head.ndim != 2 or hidden.shape[1] != head.shape[1]:
        raise ValueError(f"need hidden [T, D] and head [V, D] with the same D, got {hidden.shape} and {head.shape}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must have shape [T] = {hidden.shape[:1]}, got {targets.shape}")
    length, dim = hidden.shape
    num_full, tail = divmod(length, chunk)
    one = jax.checkpoint(_chunk_logprobs)
    parts = []
    if num_full:
        body = lambda _, xs: (None, one(xs[0], head, xs[1]))
        _, (logp, entropy) = jax.lax.scan(body, None, (hidden[: num_full * chunk].reshape(num_full, chunk, dim),
                                                       targets[: num_full * chunk].reshape(num_full, chunk)))
        parts.append((logp.reshape(-1), entropy.reshape(-1)))
    if tail:
        parts.append(one(hidden[num_full * chunk :], head, targets[num_full * chunk :]))
    if len(parts) == 1:
        return parts[0]
    return tuple(jnp.concatenate(xs) for xs in zip(*parts))
