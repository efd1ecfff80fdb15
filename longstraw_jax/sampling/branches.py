"""Sampling G response branches from one captured prompt state (never re-running the prompt per branch).

    rollout = sample_group(model, params, prompt, group_size=G, sampling=SamplingConfig(...), key=key,
                           chunk_size=C)
    rollout.responses [G, R] int32, rollout.mask [G, R] float32, rollout.logprobs [G, R] float32

Layout of the computation (one jitted function; no per-token Python dispatch):

    state = capture(prompt[:-1])                                        once (the engine's capture, read-only after)
    tail  = init_tail(state, R)        room for R decoded positions P-1.. and the prompt's carried part (GDN state)
    h, tail = decode(prompt[-1]) at position P - 1 -> first-token logits     once, shared by all branches
    for each batch of N = decode_batch branches (default all G):            lax.scan (one batch when N = G)
        tails = N copies of tail                                            [N, ...]: R positions each
        while t < R and some branch has not stopped:                        lax.while_loop
            sample token t of every branch; h, tails = vmap(decode)(tails, tokens) at position P + t

`decode` reads the prompt state (a vmap constant: one read of each layer's prompt cache per step for all N
branches) and writes only the branch's tail, so a group needs R sequential decode steps, not G x R, and nothing of
the prompt's size is copied per branch. A branch that has stopped keeps being computed with the others (its
results are discarded) until every branch of the batch has stopped. Replay convention: the engine captures
prompt[:-1] and replays [prompt[-1]] + response, so at temperature 1 the recorded log-probs are the ones
`grpo_grads` computes for the same tokens (up to float round-off).

Stop tokens (`SamplingConfig.stops`: `stop_token` and `stop_tokens`, e.g. a chat model's end-of-turn and EOS ids):
the stop token itself is a real token (mask 1); after it the branch is padded with `pad_token` and mask 0.

keep_capture=True also returns `Captured`: the capture of prompt[:-1] (length P - 1) and its chunk boundaries, so
a training step captures its prompt once. `sample_after_prompt` is the branch loop every sampler runs (one device:
`sample_traced` below; on a mesh: `sampling/mesh.py`, over the family's sharded `decode`).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from longstraw_jax.common import progress
from longstraw_jax.common.validation import check_left_pad, check_size, check_tokens, is_int, is_real
from longstraw_jax.engine.capture import capture_chunks, chunk_layout
from longstraw_jax.sharding.groups import any_slice


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How branches are sampled (frozen, hashable: a `jax.jit` static argument).

    temperature: >= 0; logits are divided by it before sampling; 0 is greedy decoding (the most likely token, the
    first one on ties; top_p then plays no part). top_p: in (0, 1]; nucleus sampling keeps the smallest set of most
    likely tokens whose probability reaches top_p (the most likely token is always kept).
    response_len: R, the response length (the arrays are [G, R]). stop_token: None or a token id that ends a
    branch (it is kept, with mask 1). stop_tokens: more ids that end a branch the same way (a tuple; a list is
    turned into one): `stops` is the union. pad_token: written after the stop token (mask 0). decode_batch: how many
    branches decode together (None: all G of a group; N must divide G: G / N batches one after another, each R
    steps). The tokens do not depend on it; memory does (N tails live at once, docs/architecture.md 6).
    """

    response_len: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token: int | None = None
    pad_token: int = 0
    decode_batch: int | None = None
    stop_tokens: tuple[int, ...] = ()

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
        if not isinstance(self.stop_tokens, (tuple, list)) or any(not is_int(t) or t < 0 for t in self.stop_tokens):
            errors.append(f"stop_tokens={self.stop_tokens!r} must be a tuple of non-negative int token ids")
        if self.decode_batch is not None and (not is_int(self.decode_batch) or self.decode_batch < 1):
            errors.append(f"decode_batch={self.decode_batch!r} must be a positive int (branches decoded together) "
                          "or None (all G)")
        if not errors:  # numpy scalars -> Python numbers: one hash and one compiled sampler per setting
            for name, kind in (("response_len", int), ("temperature", float), ("top_p", float),
                               ("stop_token", int), ("pad_token", int), ("decode_batch", int)):
                if getattr(self, name) is not None:
                    object.__setattr__(self, name, kind(getattr(self, name)))
            object.__setattr__(self, "stop_tokens", tuple(int(t) for t in self.stop_tokens))
        if errors:
            raise ValueError("invalid SamplingConfig: " + "; ".join(errors))

    @property
    def stops(self) -> tuple[int, ...]:
        """Every id that ends a branch: stop_token (if any), then stop_tokens, without repeats."""
        return tuple(dict.fromkeys(((self.stop_token,) if self.stop_token is not None else ()) + self.stop_tokens))


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


def first_argmax(x: jax.Array) -> jax.Array:
    """int32 argmax over the last axis, exactly `jnp.argmax`'s (the first index on ties, a NaN counted as the
    largest), as two plain reductions (a max, then the least index holding it): XLA:CPU runs argmax's (value, index)
    reduce about 10x slower than a max, and the sampler takes one per branch and token."""
    top = jnp.max(x, axis=-1, keepdims=True)
    index = jnp.arange(x.shape[-1], dtype=jnp.int32)
    return jnp.min(jnp.where((x == top) | jnp.isnan(x), index, x.shape[-1]), axis=-1)


def next_token(key: jax.Array, t, logits: jax.Array, sampling: SamplingConfig):
    """One branch's response token t after the policy's logits [V] (float32) -> (token int32 [], log pi(token) under
    the policy at temperature 1, its log-prob under the distribution sampled from (`sampling_logits`; 0 when
    greedy)). token ~ categorical(fold_in(key, t), sampling_logits): the same token as `jax.random.categorical` for
    that key (the argmax of the logits plus its Gumbel noise, by `first_argmax`); greedy (temperature 0): the first
    argmax of the logits. Every sampler's branch loop draws its tokens here."""
    shaped = sampling_logits(logits, sampling.temperature, sampling.top_p)
    if sampling.temperature == 0:
        token = first_argmax(logits)
    else:
        token = first_argmax(shaped + jax.random.gumbel(jax.random.fold_in(key, t), shaped.shape, shaped.dtype))
    policy = jax.nn.log_softmax(logits)[token]
    if sampling.temperature == 0:  # a point mass
        return token, policy, jnp.zeros((), policy.dtype)
    if sampling.temperature == 1 and sampling.top_p >= 1:  # the policy is the distribution sampled from
        return token, policy, policy
    return token, policy, jax.nn.log_softmax(shaped)[token]


@struct.dataclass
class Captured:
    """The sampler's capture of prompt[:-1], kept for the update (`sample_group(..., keep_capture=True)`), so that a
    training step captures its prompt once.

    state: the model's state of prompt[:-1] (length P-1): exactly what `capture_chunks(model, params, prompt[:-1],
    chunk_size, dtype)` computes (decoding only reads it; the branches write their own tails). boundaries: what
    `capture_chunks(..., keep_boundaries=True)` returns with the state (the carried part before each chunk), for
    exact mode's prompt backward.
    """

    state: Any
    boundaries: Any


def check_sampling_inputs(model, prompt, group_size, sampling: SamplingConfig):
    """The host-side checks of every sampler: prompt token ids (int [P], P >= 2), G >= 1, stop/pad ids inside the
    vocabulary, decode_batch dividing G. Returns (prompt as an int32 array, G as a Python int)."""
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
    for value in sampling.stop_tokens:
        if value >= vocab:
            raise ValueError(f"SamplingConfig.stop_tokens holds {value}, out of range: ids must be in [0, "
                             f"vocab_size={vocab})")
    decode_batch(sampling, group_size)
    return prompt, int(group_size)


def decode_batch(sampling: SamplingConfig, group_size: int) -> int:
    """N, the branches decoded together: sampling.decode_batch, or G when None. ValueError unless N divides G."""
    n = group_size if sampling.decode_batch is None else sampling.decode_batch
    if group_size % n:
        raise ValueError(f"SamplingConfig.decode_batch={n} must divide the group size G={group_size} "
                         f"(G / decode_batch batches of branches decode one after another)")
    return n


def sample_group(model, params, prompt, group_size: int, sampling: SamplingConfig, key: jax.Array,
                 chunk_size: int = 2048, keep_capture: bool = False, left_pad=None):
    """Sample `group_size` responses after `prompt` (int [P], P >= 2) from one capture of the prompt.

    left_pad (int in [0, P-2] or None): prompt[:left_pad] are pads (`sampling.padding.pad_left`); the tokens and
    log-probs are those of the unpadded prompt[left_pad:] with the same key (up to float round-off).

    Host-side checks (token ids, G >= 1, chunk_size, stop/pad ids inside the vocabulary), then one jitted call
    (`sample_traced`) with model, G, sampling, chunk_size and keep_capture static. The key is split per branch; the
    result is deterministic in it. Returns the Rollout, or with keep_capture (Rollout, Captured): the capture of
    prompt[:-1] that the update can reuse instead of capturing the prompt again.
    """
    prompt, group_size = check_sampling_inputs(model, prompt, group_size, sampling)
    chunk_size = check_size(chunk_size, "chunk_size")
    chunk_layout(prompt.shape[0] - 1, chunk_size)
    left_pad = check_left_pad(left_pad, prompt.shape[0] - 2)
    if left_pad is not None:
        return _sample_group(model, params, prompt, key, group_size, sampling, chunk_size, keep_capture, left_pad)
    if keep_capture:
        return _sample_group(model, params, prompt, key, group_size, sampling, chunk_size, True)
    return _sample_group(model, params, prompt, key, group_size, sampling, chunk_size)


def sample_traced(model, params, prompt, key, group_size: int, sampling: SamplingConfig, chunk_size: int,
                  keep_capture: bool = False, left_pad=None):
    """The one-device sampler without host checks (jittable; `jax.vmap`-able over a leading group axis of prompt
    [N, P], key [N] and left_pad [N]): Rollout, or with keep_capture (Rollout, Captured). model, group_size,
    sampling, chunk_size and keep_capture are static; prompt int32 [P] must be valid (`check_sampling_inputs`),
    left_pad None or int32 [] in [0, P-2]."""
    captured = capture_prompt(model, params, prompt, chunk_size, keep_capture, left_pad)
    rollout = sample_captured(model, params, captured.state, prompt, key, group_size, sampling, left_pad)
    return (rollout, captured) if keep_capture else rollout


def capture_prompt(model, params, prompt, chunk_size: int, keep_boundaries: bool = False, left_pad=None) -> Captured:
    """The engine's capture of prompt[:-1] (chunks of chunk_size), with its chunk boundaries if asked (else None);
    prompt[:left_pad] are pads (None: none)."""
    dtype = model.lm_head(params).dtype
    captured = capture_chunks(model, params, prompt[:-1], chunk_size, dtype, keep_boundaries=keep_boundaries,
                              left_pad=left_pad)
    state, boundaries = captured if keep_boundaries else (captured, None)
    return Captured(state=state, boundaries=boundaries)


def sample_captured(model, params, state, prompt, key, group_size: int, sampling: SamplingConfig,
                    left_pad=None) -> Rollout:
    """G branches after `state`, the capture of prompt[:-1] (one device; its pads < left_pad hidden). Under
    `jax.vmap` over groups (state, prompt, key, left_pad batched) the groups' branches decode together: one decode
    step per token position for all."""
    return sample_after_prompt(model, params, functools.partial(model.decode, params, state, left_pad=left_pad),
                               model.init_tail(params, state, sampling.response_len), prompt, key, group_size,
                               sampling)


_sample_group = jax.jit(sample_traced, static_argnums=(0, 4, 5, 6, 7))


def batched_step(model, params, decode, per_branch_positions: bool = False):
    """One decode step of N branches: (tails [N, ...], tokens int32 [N], position: int32 [] shared, or [N] with
    per_branch_positions) -> (tails, logits [N, V] (`model.logits`)), `decode` (as `sample_after_prompt` takes it)
    vmapped over the tails and tokens; what is closed over in decode (the prompt state, params) is read once for all
    N."""
    def step(tail, token, position):
        hidden, tail = decode(tail, token, position)
        return tail, model.logits(params, hidden)[0]

    return jax.vmap(step, in_axes=(0, 0, 0 if per_branch_positions else None))


def sample_after_prompt(model, params, decode, tail, prompt, key, group_size: int, sampling: SamplingConfig) -> Rollout:
    """The branch loop of every sampler (one device: `sample_traced`; on a mesh: `sampling/mesh.py`).

    decode(tail, token int32 [], position) -> (final-normed hidden [1, D], tail): one decoding step of one branch
    after the captured prompt[:-1] (a constant of decode: under `jax.vmap` over tails it is read once for all
    branches). tail: the empty decoding state (room for R positions from P - 1). prompt int32 [P].

    prompt[-1] is decoded once at P - 1; then batches of N = `decode_batch(sampling, G)` branches (a `lax.scan`
    over G / N batches) each run a `lax.while_loop` over t < R that stops when every branch of the batch has
    stopped: token t of branch g ~ categorical(fold_in(keys[g], t), sampling_logits), keys = jax.random.split(key,
    G); at temperature 0 token t = argmax(logits) (every branch the same). A branch is decoded at position P + t for
    token t unless t is its last (t = R - 1, or one of its stop tokens `sampling.stops`).
    """
    length, p = sampling.response_len, prompt.shape[0]
    stops = jnp.asarray(sampling.stops or (-1,), jnp.int32)  # [S]; -1: no token stops a branch
    n = decode_batch(sampling, group_size)
    hidden, tail = decode(tail, prompt[-1], p - 1)
    first_logits = model.logits(params, hidden)[0]

    step_all = batched_step(model, params, decode)
    # Inside `sharding/groups.over_data` each data slice samples its own group, but a decode step's collectives
    # need every slice: the loops run in lockstep (`any_slice`), as long as any slice's branch is still sampling,
    # and a slice whose branches have stopped discards its results.

    def batch(_, branch_keys):
        def cond(c):
            t, _, _, done, *_ = c
            return (t < length) & any_slice(~jnp.all(done))

        def body(c):
            t, tails, logits, done, count, tokens, logp, sample_logp = c
            live = ~done  # [N]: the branches that have not stopped
            draw = lambda key, row: next_token(key, t, row, sampling)
            token, policy_logp, point = jax.vmap(draw)(branch_keys, logits)
            keep = lambda new, old: jnp.where(live[:, None], new, old)
            tokens = keep(tokens.at[:, t].set(token), tokens)
            logp = keep(logp.at[:, t].set(policy_logp), logp)
            sample_logp = keep(sample_logp.at[:, t].set(point), sample_logp)
            done = done | (live & jnp.any(token[:, None] == stops[None, :], axis=-1))
            # the last token (or a stop) needs no successor: no step once no branch needs one
            need = jnp.any(~done) & (t + 1 < length)
            tails, logits = jax.lax.cond(any_slice(need), lambda: step_all(tails, token, p + t),
                                         lambda: (tails, logits))
            progress.tick("sampling", t + 1, length, n, after=logits)
            return t + 1, tails, logits, done, count + live.astype(jnp.int32), tokens, logp, sample_logp

        zeros = jnp.zeros((n, length), jnp.float32)
        init = (jnp.int32(0), jax.tree.map(lambda a: jnp.broadcast_to(a, (n,) + a.shape), tail),
                jnp.broadcast_to(first_logits, (n,) + first_logits.shape), jnp.zeros(n, jnp.bool_),
                jnp.zeros(n, jnp.int32), jnp.full((n, length), sampling.pad_token, jnp.int32), zeros, zeros)
        _, _, _, _, count, tokens, logp, sample_logp = jax.lax.while_loop(cond, body, init)
        mask = (jnp.arange(length) < count[:, None]).astype(jnp.float32)
        return None, (tokens, mask, logp, sample_logp)

    keys = jax.random.split(key, group_size)
    _, out = jax.lax.scan(batch, None, keys.reshape(group_size // n, n))
    tokens, mask, logp, sample_logp = (x.reshape((group_size, length)) for x in out)
    return Rollout(responses=tokens, mask=mask, logprobs=logp, sample_logprobs=sample_logp,
                   first_logprobs=jax.nn.log_softmax(first_logits.astype(jnp.float32)))
