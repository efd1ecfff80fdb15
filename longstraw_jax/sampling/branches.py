"""Sampling G response branches from one captured prompt state (never re-running the prompt per branch).

    rollout = sample_group(model, params, prompt, group_size=G, sampling=SamplingConfig(...), key=key,
                           chunk_size=C)
    rollout.responses [G, R] int32, rollout.mask [G, R] float32, rollout.logprobs [G, R] float32

Layout of the computation (one jitted function; no per-token Python dispatch):

    state  = capture(prompt[:-1]) into a cache with room for P + R - 1 positions    once (the engine's capture)
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

keep_capture=True also returns `Captured`: the capture of prompt[:-1] (length P - 1, its carried part as right after
prompt[:-1]) and its chunk boundaries, so a training step captures its prompt once. `sample_branches` is the branch
loop; `sampling/mesh.py` (sampling on a mesh) runs the same one over its own decoding step.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from longstraw_jax.models.base import capture_chunks, chunk_layout
from longstraw_jax.parallel.groups import DATA
from longstraw_jax.parallel.rules import manual_axes
from longstraw_jax.validation import check_size, check_tokens, is_int, is_real


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How branches are sampled (frozen, hashable: a `jax.jit` static argument).

    temperature: >= 0; logits are divided by it before sampling; 0 is greedy decoding (the most likely token, the
    first one on ties; top_p then plays no part). top_p: in (0, 1]; nucleus sampling keeps the smallest set of most
    likely tokens whose probability reaches top_p (the most likely token is always kept).
    response_len: R, the response length (the arrays are [G, R]). stop_token: None or a token id that ends a
    branch (it is kept, with mask 1). pad_token: written after the stop token (mask 0).
    """

    response_len: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token: int | None = None
    pad_token: int = 0

    def __post_init__(self):
        errors = []
        if not is_int(self.response_len) or self.response_len < 1:
            errors.append(f"response_len={self.response_len!r} must be a positive int")
        temperature = self.temperature
        if not (is_real(temperature) and math.isfinite(temperature) and temperature >= 0):
            errors.append(f"temperature={self.temperature!r} must be a finite number >= 0 (0: greedy)")
        if not (is_real(self.top_p) and 0 < self.top_p <= 1):
            errors.append(f"top_p={self.top_p!r} must be in (0, 1]")
        for name in ("stop_token", "pad_token"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 0):
                errors.append(f"{name}={value!r} must be a non-negative int token id")
        if not errors:  # numpy scalars -> Python numbers: one hash and one compiled sampler per setting
            for name, kind in (("response_len", int), ("temperature", float), ("top_p", float),
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
    The two are equal when temperature = 1 and top_p = 1; greedy decoding (temperature 0) samples from a point
    mass: sample_logprobs 0. Padded positions hold 0. first_logprobs float32 [V]: the policy's log-probabilities of
    response token 0 (log_softmax of the logits after the prompt, temperature 1; one row for all G branches, which
    share it), e.g. for the held-out evaluation's entropy and KL (trainer/evaluate.py)."""

    responses: jax.Array
    mask: jax.Array
    logprobs: jax.Array
    sample_logprobs: jax.Array
    first_logprobs: jax.Array


def sampling_logits(logits: jax.Array, temperature: float, top_p: float) -> jax.Array:
    """logits [V] (float32) -> the logits of the sampling distribution: divided by temperature, and with tokens
    outside the top-p nucleus set to -inf. The nucleus is the shortest prefix of tokens sorted by probability
    whose total reaches top_p (ties at the boundary are kept). Greedy (temperature 0): the logits unchanged (the
    sampler takes their argmax)."""
    if temperature == 0:
        return logits
    logits = logits / temperature
    if top_p >= 1.0:
        return logits
    sorted_logits = jnp.sort(logits)[::-1]
    probs = jax.nn.softmax(sorted_logits)
    before = jnp.cumsum(probs) - probs  # probability mass strictly before each sorted token
    kept = before < top_p  # the first token always (before = 0 < top_p)
    threshold = jnp.min(jnp.where(kept, sorted_logits, jnp.inf))
    return jnp.where(logits >= threshold, logits, -jnp.inf)


@struct.dataclass
class Captured:
    """The sampler's capture of prompt[:-1], kept for the update (`sample_group(..., keep_capture=True)`), so that a
    training step captures its prompt once.

    state: the model's state of prompt[:-1]: length P-1, room for P+R-1 positions; positions < P-1 hold exactly what
    `capture_chunks(model, params, prompt[:-1], chunk_size, dtype)` computes, the carried part (Qwen3.6's GDN conv
    tails and recurrent matrices) is the one right after prompt[:-1] (saved before prompt[-1] was advanced).
    Positions >= P-1 hold the last branch's tokens: nothing reads them (every reader of a whole state stops at its
    length). boundaries: what `capture_chunks(..., keep_boundaries=True)` returns with the state (the carried part
    before each chunk), for exact mode's prompt backward.
    """

    state: Any
    boundaries: Any


def check_sampling_inputs(model, prompt, group_size, sampling: SamplingConfig):
    """The host-side checks of every sampler: prompt token ids (int [P], P >= 2), G >= 1, stop/pad ids inside the
    vocabulary. Returns (prompt as an int32 array, G as a Python int)."""
    vocab = model.config.vocab_size
    prompt = check_tokens(prompt, vocab, name="prompt")
    if prompt.shape[0] < 2:
        raise ValueError(f"prompt has {prompt.shape[0]} token(s); need at least 2 (prompt[:-1] is captured)")
    if not is_int(group_size) or group_size < 1:
        raise ValueError(f"group_size (G) = {group_size!r}; need G >= 1")
    for name in ("stop_token", "pad_token"):
        value = getattr(sampling, name)
        if value is not None and value >= vocab:
            raise ValueError(f"SamplingConfig.{name}={value} is out of range: ids must be in [0, vocab_size={vocab})")
    return prompt, int(group_size)


def sample_group(model, params, prompt, group_size: int, sampling: SamplingConfig, key: jax.Array,
                 chunk_size: int = 2048, keep_capture: bool = False):
    """Sample `group_size` responses after `prompt` (int [P], P >= 2) from one capture of the prompt.

    Host-side checks (token ids, G >= 1, chunk_size, stop/pad ids inside the vocabulary), then one jitted call
    (`sample_traced`) with model, G, sampling, chunk_size and keep_capture static. The key is split per branch; the
    result is deterministic in it. Returns the Rollout, or with keep_capture (Rollout, Captured): the capture of
    prompt[:-1] that the update can reuse instead of capturing the prompt again.
    """
    prompt, group_size = check_sampling_inputs(model, prompt, group_size, sampling)
    chunk_size = check_size(chunk_size, "chunk_size")
    chunk_layout(prompt.shape[0] - 1, chunk_size)
    if keep_capture:
        return _sample_group(model, params, prompt, key, group_size, sampling, chunk_size, True)
    return _sample_group(model, params, prompt, key, group_size, sampling, chunk_size)


def sample_traced(model, params, prompt, key, group_size: int, sampling: SamplingConfig, chunk_size: int,
                  keep_capture: bool = False):
    """The one-device sampler without host checks (jittable; `jax.vmap`-able over a leading group axis of prompt
    [N, P] and key [N]): Rollout, or with keep_capture (Rollout, Captured). model, group_size, sampling,
    chunk_size and keep_capture are static; prompt int32 [P] must be valid (`check_sampling_inputs`)."""
    length = sampling.response_len
    p = prompt.shape[0]
    dtype = model.lm_head(params).dtype
    # the engine's capture (same chunks), into a cache with room for the responses: positions P-1 .. P+R-2
    captured = capture_chunks(model, params, prompt[:-1], chunk_size, dtype, keep_boundaries=keep_capture,
                              capacity=p + length - 1)
    state, boundaries = captured if keep_capture else (captured, None)
    before_last = model.carried(state)  # right after prompt[:-1]: what the update's replay starts from
    hidden, state = model.advance(params, state, prompt[-1:], p - 1)
    after_prompt = model.carried(state)  # right after prompt[-1]: what every branch starts from

    def step(state, token, position):
        hidden, state = model.advance(params, state, token[None], position)
        return state, model.logits(params, hidden)[0]

    state, rollout = sample_branches(step, state, model.logits(params, hidden)[0],
                                     lambda state: model.with_carried(state, after_prompt), key, group_size,
                                     sampling, p)
    if keep_capture:
        return rollout, Captured(state=model.with_carried(state, before_last), boundaries=boundaries)
    return rollout


_sample_group = jax.jit(sample_traced, static_argnums=(0, 4, 5, 6, 7))


def sample_branches(step, state, first_logits, restore, key, group_size: int, sampling: SamplingConfig,
                    start) -> tuple[Any, Rollout]:
    """The G-branch loop of every sampler (one device: `sample_traced`; on a mesh: `sampling/mesh.py`).

    step(state, token int32 [], position) -> (state, float32 logits [V] of the next token): one decoding step at
    `position`. state: the decoder's state after the prompt, whose next-token logits are first_logits [V].
    restore(state) -> the state a branch starts from (each branch overwrites the positions start.. of the one
    before it: restoring the carried part is enough). start: the position of response token 0 (P).

    Branches run in a `lax.scan` (the state is the carry, updated in place); each samples in a `lax.while_loop`
    over t < R that stops after the stop token: token t ~ categorical(fold_in(branch key, t), sampling_logits),
    branch keys = jax.random.split(key, G); at temperature 0 token t = argmax(logits) (every branch the same).
    Returns (the state after the last branch, Rollout).
    """
    length = sampling.response_len
    stop = -1 if sampling.stop_token is None else sampling.stop_token
    # Inside `parallel/groups.over_data` each data slice samples its own group, but a decode step's collectives (the
    # FSDP all-gather of a layer over ("data", "seq")) need every slice: the loops then run in lockstep, as long as
    # any slice's branch is still sampling, and a slice whose branch has stopped discards what it computes.
    lockstep = DATA in manual_axes()
    anywhere = (lambda x: jax.lax.psum(x.astype(jnp.int32), DATA) > 0) if lockstep else (lambda x: x)

    def branch(state, branch_key):
        state = restore(state)

        def cond(c):
            t, _, _, done, *_ = c
            return (t < length) & anywhere(~done)

        def body(c):
            t, state, logits, done, count, tokens, logp, sample_logp = c
            live = ~done  # this branch has not stopped (always true outside lockstep)
            shaped = sampling_logits(logits, sampling.temperature, sampling.top_p)
            if sampling.temperature == 0:  # greedy (static): a point mass on the argmax
                token = jnp.argmax(logits).astype(jnp.int32)
            else:
                token = jax.random.categorical(jax.random.fold_in(branch_key, t), shaped).astype(jnp.int32)
            keep = lambda new, old: jnp.where(live, new, old)
            tokens = keep(tokens.at[t].set(token), tokens)
            logp = keep(logp.at[t].set(jax.nn.log_softmax(logits)[token]), logp)
            point = jnp.float32(0.0) if sampling.temperature == 0 else jax.nn.log_softmax(shaped)[token]
            sample_logp = keep(sample_logp.at[t].set(point), sample_logp)
            done = done | (live & (token == stop))
            # the last token (or a stop) needs no successor: skip its forward step
            need = ~done & (t + 1 < length)

            def forward(state):
                stepped, next_logits = step(state, token, start + t)
                if not lockstep:
                    return stepped, next_logits
                return jax.tree.map(lambda a, b: jnp.where(need, a, b), (stepped, next_logits), (state, logits))

            state, logits = jax.lax.cond(anywhere(need), forward, lambda s: (s, logits), state)
            return t + 1, state, logits, done, count + live.astype(jnp.int32), tokens, logp, sample_logp

        zeros = jnp.zeros(length, jnp.float32)
        init = (jnp.int32(0), state, first_logits, jnp.bool_(False), jnp.int32(0),
                jnp.full(length, sampling.pad_token, jnp.int32), zeros, zeros)
        _, state, _, _, count, tokens, logp, sample_logp = jax.lax.while_loop(cond, body, init)
        mask = (jnp.arange(length) < count).astype(jnp.float32)
        return state, (tokens, mask, logp, sample_logp)

    state, (tokens, mask, logp, sample_logp) = jax.lax.scan(branch, state, jax.random.split(key, group_size))
    return state, Rollout(responses=tokens, mask=mask, logprobs=logp, sample_logprobs=sample_logp,
                          first_logprobs=jax.nn.log_softmax(first_logits.astype(jnp.float32)))
