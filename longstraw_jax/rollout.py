"""Sampling G response branches from one captured prompt state (never re-running the prompt per branch).

    rollout = sample_group(model, params, prompt, num_branches=G, sampling=SamplingConfig(...), key=key,
                           chunk_size=C)
    rollout.responses [G, R] int32, rollout.mask [G, R] float32, rollout.logprobs [G, R] float32

Layout of the computation (one jitted function; no per-token Python dispatch):

    state  = capture(prompt[:-1]) into a cache with room for P + R positions        once
    h, state = advance(prompt[-1]) at position P - 1 -> first-token logits             once, shared by all branches
    for g in range(G):                                  lax.scan, the state is the carry (updated in place)
        restore the carried part (GDN conv tails + recurrent matrices) saved after the prompt
        while t < R and not stopped:                    lax.while_loop
            sample token t from the logits; h, state = advance(token t) at position P + t
            (writes positions P.., overwriting the previous branch's tail; attention at position P + t reads only
             positions < P + t: the prompt and this branch's own earlier tokens)

The prompt's KV cache is written once and never copied: each branch only restores the small carried part. This
matches the engine's replay convention (capture prompt[:-1], then [prompt[-1]] + response), so at temperature 1
the recorded log-probs are the ones `grpo_grads` computes for the same tokens (up to float round-off).

Stop token: the stop token itself is a real token (mask 1); after it the branch is padded with `pad_token` and
mask 0, and no more tokens are computed for it.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import struct

from longstraw_jax.models.base import capture_chunks, chunk_layout
from longstraw_jax.validation import check_size, check_tokens, is_int, is_real


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How branches are sampled (frozen, hashable: a `jax.jit` static argument).

    temperature: > 0; logits are divided by it before sampling. top_p: in (0, 1]; nucleus sampling keeps the
    smallest set of most likely tokens whose probability reaches top_p (the most likely token is always kept).
    max_new_tokens: R, the response length (the arrays are [G, R]). stop_token: None or a token id that ends a
    branch (it is kept, with mask 1). pad_token: written after the stop token (mask 0).
    """

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token: int | None = None
    pad_token: int = 0

    def __post_init__(self):
        errors = []
        if not is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            errors.append(f"max_new_tokens={self.max_new_tokens!r} must be a positive int")
        temperature = self.temperature
        if not (is_real(temperature) and math.isfinite(temperature) and temperature > 0):
            errors.append(f"temperature={self.temperature!r} must be a finite number > 0")
        if not (is_real(self.top_p) and 0 < self.top_p <= 1):
            errors.append(f"top_p={self.top_p!r} must be in (0, 1]")
        for name in ("stop_token", "pad_token"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 0):
                errors.append(f"{name}={value!r} must be a non-negative int token id")
        if not errors:  # numpy scalars -> Python numbers: one hash and one compiled sampler per setting
            for name, kind in (("max_new_tokens", int), ("temperature", float), ("top_p", float),
                               ("stop_token", int), ("pad_token", int)):
                if getattr(self, name) is not None:
                    object.__setattr__(self, name, kind(getattr(self, name)))
        if errors:
            raise ValueError("invalid SamplingConfig: " + "; ".join(errors))


@struct.dataclass
class Rollout:
    """G sampled branches. responses int32 [G, R] (pad_token after a stop), mask float32 [G, R] (1 = real token,
    the stop token included), logprobs float32 [G, R]: log pi(token) under the unmodified policy (log_softmax of
    the logits at temperature 1, no top-p; what the trainer's ratio compares against: use as old_logprobs),
    sample_logprobs float32 [G, R]: log-prob under the distribution actually sampled from (temperature, top-p).
    The two are equal when temperature = 1 and top_p = 1. Padded positions hold 0."""

    responses: jax.Array
    mask: jax.Array
    logprobs: jax.Array
    sample_logprobs: jax.Array


def sampling_logits(logits: jax.Array, temperature: float, top_p: float) -> jax.Array:
    """logits [V] (float32) -> the logits of the sampling distribution: divided by temperature, and with tokens
    outside the top-p nucleus set to -inf. The nucleus is the shortest prefix of tokens sorted by probability
    whose total reaches top_p (ties at the boundary are kept)."""
    logits = logits / temperature
    if top_p >= 1.0:
        return logits
    sorted_logits = jnp.sort(logits)[::-1]
    probs = jax.nn.softmax(sorted_logits)
    before = jnp.cumsum(probs) - probs  # probability mass strictly before each sorted token
    kept = before < top_p  # the first token always (before = 0 < top_p)
    threshold = jnp.min(jnp.where(kept, sorted_logits, jnp.inf))
    return jnp.where(logits >= threshold, logits, -jnp.inf)


def sample_group(model, params, prompt, num_branches: int, sampling: SamplingConfig, key: jax.Array,
                 chunk_size: int = 2048) -> Rollout:
    """Sample `num_branches` responses after `prompt` (int [P], P >= 2) from one capture of the prompt.

    Host-side checks (token ids, G >= 1, chunk_size, stop/pad ids inside the vocabulary), then one jitted call with
    model, G, sampling and chunk_size static. The key is split per branch; the result is deterministic in it.
    """
    vocab = model.config.vocab_size
    prompt = check_tokens(prompt, vocab, name="prompt")
    if prompt.shape[0] < 2:
        raise ValueError(f"prompt has {prompt.shape[0]} token(s); need at least 2 (prompt[:-1] is captured)")
    if not is_int(num_branches) or num_branches < 1:
        raise ValueError(f"num_branches (G) = {num_branches!r}; need G >= 1")
    num_branches = int(num_branches)
    for name in ("stop_token", "pad_token"):
        value = getattr(sampling, name)
        if value is not None and value >= vocab:
            raise ValueError(f"SamplingConfig.{name}={value} is out of range: ids must be in [0, vocab_size={vocab})")
    chunk_size = check_size(chunk_size, "chunk_size")
    chunk_layout(prompt.shape[0] - 1, chunk_size)
    return _sample_group(model, params, prompt, key, num_branches, sampling, chunk_size)


@functools.partial(jax.jit, static_argnums=(0, 4, 5, 6))
def _sample_group(model, params, prompt, key, num_branches, sampling, chunk_size):
    length = sampling.max_new_tokens
    p = prompt.shape[0]
    dtype = model.lm_head(params).dtype
    state = capture_chunks(model, params, prompt[:-1], chunk_size, dtype, capacity=p + length - 1)
    hidden, state = model.advance(params, state, prompt[-1:], p - 1)
    first_logits = model.logits(params, hidden)[0]
    prompt_carried = model.carried(state)
    stop = -1 if sampling.stop_token is None else sampling.stop_token

    def branch(state, branch_key):
        state = model.with_carried(state, prompt_carried)

        def cond(c):
            t, _, _, done, *_ = c
            return (t < length) & ~done

        def body(c):
            t, state, logits, done, tokens, logp, sample_logp = c
            shaped = sampling_logits(logits, sampling.temperature, sampling.top_p)
            token = jax.random.categorical(jax.random.fold_in(branch_key, t), shaped).astype(jnp.int32)
            tokens = tokens.at[t].set(token)
            logp = logp.at[t].set(jax.nn.log_softmax(logits)[token])
            sample_logp = sample_logp.at[t].set(jax.nn.log_softmax(shaped)[token])
            done = token == stop

            def step(state):
                hidden, state = model.advance(params, state, token[None], p + t)
                return state, model.logits(params, hidden)[0]

            # the last token (or a stop) needs no successor: skip its forward step
            state, logits = jax.lax.cond((t + 1 < length) & ~done, step, lambda s: (s, logits), state)
            return t + 1, state, logits, done, tokens, logp, sample_logp

        zeros = jnp.zeros(length, jnp.float32)
        init = (jnp.int32(0), state, first_logits, jnp.bool_(False), jnp.full(length, sampling.pad_token, jnp.int32),
                zeros, zeros)
        t, state, _, _, tokens, logp, sample_logp = jax.lax.while_loop(cond, body, init)
        mask = (jnp.arange(length) < t).astype(jnp.float32)
        return state, (tokens, mask, logp, sample_logp)

    _, (tokens, mask, logp, sample_logp) = jax.lax.scan(branch, state, jax.random.split(key, num_branches))
    return Rollout(responses=tokens, mask=mask, logprobs=logp, sample_logprobs=sample_logp)

