"""Agent branches: each branch a multi-turn episode after one captured prompt (docs/architecture.md 11).

    episodes = sample_episodes(model, params, prompts, keys, G, sampling, turns, environments)
    episodes.responses [B, G, R]: the transcript, policy and observation tokens in order (pad_token after it)
    episodes.mask [B, G, R]: 1 on the policy's tokens only (observations are read, never trained on)
    episodes.rewards [B, G]: each branch's sum of the environment's rewards; episodes.transcripts[b][g]

A host loop over turns drives three jitted programs over all B x G branches at once (on a mesh each runs per data
slice, `Place`):

    capture prompt[:-1] (every group), decode prompt[-1] at P - 1                    `_start`, once
    for turn k < max_turns, while a branch is running:
        policy turn: every running branch samples until its stop token, turn_len    `_policy_turn`
                     tokens or the response length; each token is decoded (its tail
                     written) so that what follows it can be appended
        the environment's step(turn) for every branch that ended a turn           host threads, `call_all`
        the observations appended to their branches' tails, one token position     `_observe`
        after another for all branches together, padded to a bucket length
        (`TurnConfig.bucket`: no recompilation per length)

Transcript token j of a branch sits at position P + j (tail slot j + 1; slot 0 is prompt[-1]). Branches are at
different positions (their observations differ in length), so decoding is vmapped over per-branch positions. A
padded slot of `_observe` (i >= the branch's observation length) leaves that branch's tail, logits and length
exactly as they were (a select, not a masked write), so the bucket length cannot change any result. Tokens are
ids in and out: nothing the policy produced is decoded to text and re-encoded.

Keys: branch g of group b samples token t of turn k with fold_in(fold_in(split(keys[b], G)[g], k), t), so a turn's
draws depend on (step, group, branch, turn) and not on the other branches or the bucket lengths; a transcript is
replayed without its environment by `agents.environment.ScriptedEnvironment`.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from longstraw_jax.agents.environment import DONE, ERROR, LENGTH, MAX_TURNS, Transcript, call_owned, check_step_result
from longstraw_jax.common.validation import check_left_pad, check_size, is_int, is_real
from longstraw_jax.engine.capture import chunk_layout, round_layout
from longstraw_jax.sampling import branches, mesh as mesh_sampling
from longstraw_jax.sampling.branches import SamplingConfig, batched_step, next_token
from longstraw_jax.sharding.groups import DATA, any_slice, check_groups, over_data
from longstraw_jax.sharding.hosts import to_host
from longstraw_jax.sharding.rules import manual_axes


@dataclasses.dataclass(frozen=True)
class TurnConfig:
    """How episodes run (frozen, hashable).

    max_turns: policy turns per episode (the environment answers each). turn_len: tokens per policy turn at most
    (None: the response length). max_observation: observation tokens appended per turn at most (None: whatever fits
    in the response length); a longer one is cut at the end and counted. timeout: seconds an environment call may
    take. min_bucket: the smallest padded observation length; buckets double from it.
    """

    max_turns: int = 4
    turn_len: int | None = None
    max_observation: int | None = None
    timeout: float = 60.0
    min_bucket: int = 8

    def __post_init__(self):
        errors = []
        for name, minimum in (("max_turns", 1), ("turn_len", 1), ("max_observation", 0), ("min_bucket", 1)):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < minimum):
                errors.append(f"{name}={value!r} must be an int >= {minimum}")
        if not (is_real(self.timeout) and self.timeout > 0):
            errors.append(f"timeout={self.timeout!r} must be a number of seconds > 0")
        if errors:
            raise ValueError("invalid TurnConfig: " + "; ".join(errors))

    def bucket(self, n: int) -> int:
        """The padded length of observations of at most n tokens: min_bucket * 2^i >= n."""
        size = self.min_bucket
        while size < n:
            size *= 2
        return size


@struct.dataclass
class Branches:
    """The device state of B x G episodes. tails: each branch's decoding state (leaves [B, G, ...], room for R
    positions after prompt[-1]); logits float32 [B, G, V]: the next token's; length int32 [B, G]: transcript tokens
    so far; tokens int32 [B, G, R] (pad after length); mask float32 [B, G, R]: 1 on policy tokens; logp /
    sample_logp float32 [B, G, R]: the policy's log-prob of each policy token (temperature 1; as sampled), 0
    elsewhere."""

    tails: Any
    logits: jax.Array
    length: jax.Array
    tokens: jax.Array
    mask: jax.Array
    logp: jax.Array
    sample_logp: jax.Array


@struct.dataclass
class Episodes:
    """What `sample_episodes` returns. responses / mask / logprobs / sample_logprobs: as in `Branches` ([B, G, R],
    numpy); rewards float32 [B, G]; first_logprobs float32 [B, V]: the policy's log-probs of every branch's first
    token (temperature 1); transcripts[b][g]: `agents.environment.Transcript`; captured: the prompts' capture (as
    `sample_groups(keep_capture=True)` returns it); timings: seconds spent capturing the prompts (and decoding
    prompt[-1]), decoding policy turns, in the environment, appending observations."""

    responses: np.ndarray
    mask: np.ndarray
    logprobs: np.ndarray
    sample_logprobs: np.ndarray
    rewards: np.ndarray
    first_logprobs: np.ndarray
    transcripts: list = struct.field(pytree_node=False)
    captured: Any = None
    timings: dict = struct.field(pytree_node=False, default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Place:
    """Where episodes run (static): one device (mesh None; the capture in chunks of chunk_size), or a ("data",
    "seq") mesh (the groups split over `data`, each captured sequence-parallel in `layout`'s rounds)."""

    chunk_size: int | None = None
    mesh: Any = None
    layout: Any = None

    def decoder(self, model, params, state, left_pad):
        """decode(tail, token, position) -> (hidden [1, D], tail) after one group's captured prompt, and the empty
        tail of R positions."""
        if self.mesh is None:
            return functools.partial(model.decode, params, state, left_pad=left_pad), model.init_tail
        family = model.mesh_adapter()
        return functools.partial(family.decode, params, state, mesh=self.mesh, left_pad=left_pad), family.init_tail

    def capture(self, model, params, prompt, left_pad):
        """One group's capture of prompt[:-1], as the update wants it (`Captured` / `ShardedCaptured`)."""
        if self.mesh is None:
            return branches.capture_prompt(model, params, prompt, self.chunk_size, True, left_pad)
        return mesh_sampling.capture_prompt(model, params, prompt, self.mesh, self.layout, left_pad=left_pad)

    def state(self, captured):
        return captured.state if self.mesh is None else captured.sstate

    def run(self, fn, params, per_group):
        """fn(params, per_group) on one device, or over the mesh's data slices (each its groups, in lockstep)."""
        if self.mesh is None:
            return fn(params, per_group)
        return over_data(self.mesh, fn, params, per_group, summed=False)


def step_all(model, params, place: Place, states, left_pad, tails, tokens, positions):
    """One decoding step of every branch: tokens int32 [B, G] at positions int32 [B, G] after group b's prompt state
    (leaves [B, ...]; read once for its G branches) -> (tails, logits float32 [B, G, V])."""
    def group(state, pad, tails, tokens, positions):
        decode, _ = place.decoder(model, params, state, pad)
        tails, logits = batched_step(model, params, decode, per_branch_positions=True)(tails, tokens, positions)
        return tails, logits.astype(jnp.float32)

    return jax.vmap(group)(states, left_pad, tails, tokens, positions)


def _select(where, new, old):
    """Per branch (where bool [B, G]): new where true, old elsewhere, for every leaf [B, G, ...]."""
    pick = lambda a, b: jnp.where(jnp.reshape(where, where.shape + (1,) * (a.ndim - where.ndim)), a, b)
    return jax.tree.map(pick, new, old)


@functools.partial(jax.jit, static_argnums=(0, 5, 6, 7))
def _start(model, params, prompts, left_pad, keys, group_size: int, sampling: SamplingConfig, place: Place):
    """Capture every group's prompt[:-1] and decode prompt[-1] -> (Branches with G copies per group, the captures,
    the branches' keys [B, G]: split(keys[b], G), the first token's log-probs float32 [B, V] (temperature 1))."""
    length, p = sampling.response_len, prompts.shape[1]

    def slice_start(params, local):
        prompts, left_pad = local
        captured = jax.lax.map(lambda x: place.capture(model, params, x[0], x[1]), (prompts, left_pad))

        def first(state, prompt, pad):
            decode, init_tail = place.decoder(model, params, state, pad)
            hidden, tail = decode(init_tail(params, state, length), prompt[-1], p - 1)
            return tail, model.logits(params, hidden)[0].astype(jnp.float32)

        tails, logits = jax.vmap(first)(place.state(captured), prompts, left_pad)
        many = lambda x: jnp.broadcast_to(x[:, None], (x.shape[0], group_size) + x.shape[1:])
        shape = (prompts.shape[0], group_size, length)
        zeros = jnp.zeros(shape, jnp.float32)
        state = Branches(tails=jax.tree.map(many, tails), logits=many(logits),
                         length=jnp.zeros(shape[:2], jnp.int32), tokens=jnp.full(shape, sampling.pad_token, jnp.int32),
                         mask=zeros, logp=zeros, sample_logp=zeros)
        return state, captured

    state, captured = place.run(slice_start, params, (prompts, left_pad))
    return (state, captured, jax.vmap(lambda k: jax.random.split(k, group_size))(keys),
            jax.nn.log_softmax(state.logits[:, 0]))


def _write(buffer, index, value, where):
    """buffer [B, G, R] with value [B, G] written at index [B, G] where `where` [B, G]."""
    hit = (jnp.arange(buffer.shape[-1]) == index[..., None]) & where[..., None]
    return jnp.where(hit, jnp.asarray(value, buffer.dtype)[..., None], buffer)


@functools.partial(jax.jit, static_argnums=(0, 2, 9, 10, 11), donate_argnums=(5,))
def _policy_turn(model, params, place: Place, states, left_pad, br: Branches, keys, turn, active,
                 sampling: SamplingConfig, turn_len: int, p: int):
    """One policy turn of every branch with `active` [B, G]: sample until its stop token, `turn_len` tokens or the
    response length R, decoding each token it keeps (none at index R - 1). keys [B, G] (the branches'), turn int32
    [B, G] (their turn numbers); p: the prompt length P. -> the Branches after the turn."""
    r = sampling.response_len
    stops = jnp.asarray(sampling.stops or (-1,), jnp.int32)

    def slice_turn(params, local):
        states, left_pad, br, keys, turn, active = local
        turn_keys = jax.vmap(jax.vmap(jax.random.fold_in))(keys, turn)

        def cond(c):
            t, _, live = c
            return (t < turn_len) & any_slice(live)

        def body(c):
            t, br, live = c
            draw = lambda key, row: next_token(key, t, row, sampling)
            token, policy_logp, point = jax.vmap(jax.vmap(draw))(turn_keys, br.logits)
            index = br.length
            br = br.replace(tokens=_write(br.tokens, index, token, live), mask=_write(br.mask, index, 1.0, live),
                            logp=_write(br.logp, index, policy_logp, live),
                            sample_logp=_write(br.sample_logp, index, point, live))
            need = live & (index + 1 < r)  # a token at R - 1 has no successor
            decoded = lambda: step_all(model, params, place, states, left_pad, br.tails, token, p + index)
            tails, logits = jax.lax.cond(any_slice(need), decoded, lambda: (br.tails, br.logits))
            new = _select(need, (tails, logits), (br.tails, br.logits))
            ended = jnp.any(token[..., None] == stops, axis=-1) | (t + 1 >= turn_len) | (index + 1 >= r)
            br = br.replace(tails=new[0], logits=new[1], length=br.length + live.astype(jnp.int32))
            return t + 1, br, live & ~ended

        return jax.lax.while_loop(cond, body, (jnp.int32(0), br, active))[1]

    return place.run(slice_turn, params, (states, left_pad, br, keys, turn, active))


@functools.partial(jax.jit, static_argnums=(0, 2, 8), donate_argnums=(5,))
def _observe(model, params, place: Place, states, left_pad, br: Branches, observations, count, p: int):
    """Append observations int32 [B, G, K] (the first count[b, g] of each row; the rest padding) to the branches:
    one decoding step per position i < max(count) for all branches, a branch with i >= its count left exactly as
    it was. The appended tokens keep mask 0; p: the prompt length P. -> Branches with length + count."""
    def slice_observe(params, local):
        states, left_pad, br, observations, count = local
        longest = jnp.max(count)
        if DATA in manual_axes():
            longest = jax.lax.pmax(longest, DATA)

        def body(c):
            i, br = c
            real = i < count
            token = jax.lax.dynamic_index_in_dim(observations, i, axis=2, keepdims=False)
            index = br.length + i
            tails, logits = step_all(model, params, place, states, left_pad, br.tails, token, p + index)
            tails, logits = _select(real, (tails, logits), (br.tails, br.logits))
            return i + 1, br.replace(tails=tails, logits=logits, tokens=_write(br.tokens, index, token, real))

        br = jax.lax.while_loop(lambda c: c[0] < longest, body, (jnp.int32(0), br))[1]
        return br.replace(length=br.length + count)

    return place.run(slice_observe, params, (states, left_pad, br, observations, count))


def settle(transcript: Transcript, reply, turn: int, length: int, r: int, turns: TurnConfig) -> np.ndarray:
    """Record the environment's reply to turn `turn` of a branch whose transcript holds `length` tokens (of R) ->
    the observation ids to append (empty when the episode is over). The status becomes "error" (the reply's error),
    "done", "max_turns" (the last turn: its observation is not appended) or "length" (no position left for another
    policy token); otherwise the observation is cut to the room left (and --max-observation-len), counted in the
    reply's "truncated"."""
    if reply.error is not None:
        transcript.status, transcript.error = ERROR, f"turn {turn}: {reply.error}"
        transcript.turns.append({"role": "tool", "tokens": np.zeros(0, np.int32), "reward": 0.0, "done": True,
                                 "truncated": 0, "error": reply.error})
        return transcript.turns[-1]["tokens"]
    free = r - 1 - length  # positions left once one is kept for the policy's next turn
    keep, cut = reply.observation[:0], 0
    if reply.done:
        transcript.status = DONE
    elif turn + 1 == turns.max_turns:
        transcript.status = MAX_TURNS
    elif free <= 0:
        transcript.status, cut = LENGTH, len(reply.observation)
    else:
        keep = reply.fit(free if turns.max_observation is None else min(free, turns.max_observation))
        cut = len(reply.observation) - len(keep)
    transcript.turns.append({"role": "tool", "tokens": keep, "reward": reply.reward, "done": reply.done,
                             "truncated": cut})
    return keep


def sample_episodes(model, params, prompts, keys, group_size: int, sampling: SamplingConfig, turns: TurnConfig,
                    environments, chunk_size: int | None = 2048, left_pad=None, infos=None, mesh=None) -> Episodes:
    """B groups of G episodes, on one device or on `mesh` (B split over its `data` axis, each group captured and
    decoded sequence-parallel over `seq` as `sampling.groups.sample_groups` does; chunk_size the round length, None:
    one round; one process). prompts int [B, P] (P >= 2; left_pad None or int [B]: group b's pads);
    keys: B PRNG keys; environments: B x G environments (nested [B][G] or flat, branch g of group b at b * G + g),
    each reset with (the unpadded prompt, infos[b] or {}, g) before its episode. Host-side checks first (token ids,
    G, stop / pad ids, chunk_size, left_pad), then the turn loop of the module docstring. The response length R is
    the transcript's: policy and observation tokens together.

    Several processes (a mesh spanning them): every process calls this with the same arguments, except that its
    `environments` hold None where another process holds the environment (each slot on exactly one process, e.g.
    the process owning the group's data slice); the replies are exchanged after every round of calls
    (`agents.environment.call_owned`), so every process returns the same Episodes."""
    prompts = np.asarray(prompts)
    if prompts.ndim != 2:
        raise ValueError(f"prompts must be [B, P] (one row per group), got shape {prompts.shape}")
    if jnp.shape(keys)[:1] != prompts.shape[:1]:
        raise ValueError(f"keys has shape {jnp.shape(keys)}; need one key per group: [B] = [{prompts.shape[0]}]")
    for row in prompts:
        _, group_size = branches.check_sampling_inputs(model, row, group_size, sampling)
    left_pad = check_left_pad(left_pad, prompts.shape[1] - 2, "left_pad", prompts.shape[0])
    if mesh is None:
        chunk_size = check_size(chunk_size, "chunk_size")
        chunk_layout(prompts.shape[1] - 1, chunk_size)
        place = Place(chunk_size)
    else:
        model.mesh_adapter()  # a family without a sharded path says so before any work
        check_groups(prompts.shape[0], mesh)
        place = Place(mesh=mesh, layout=round_layout(model, prompts.shape[1] - 1, mesh.shape["seq"], chunk_size))
    b_count, g_count, r, p = prompts.shape[0], group_size, sampling.response_len, prompts.shape[1]
    envs = [list(row) for row in environments] if isinstance(environments[0], (list, tuple)) else [
        list(environments[b * g_count:(b + 1) * g_count]) for b in range(b_count)]
    if len(envs) != b_count or any(len(row) != g_count for row in envs):
        raise ValueError(f"environments: need B x G = {b_count} x {g_count}, got {[len(row) for row in envs]}")
    infos = [{} for _ in range(b_count)] if infos is None else list(infos)
    turn_len = turns.turn_len or r
    timings = {"capture_s": 0.0, "decode_s": 0.0, "env_s": 0.0, "observe_s": 0.0}
    transcripts = [[Transcript() for _ in range(g_count)] for _ in range(b_count)]
    slots = [(b, g) for b in range(b_count) for g in range(g_count)]
    vocab = model.config.vocab_size

    def env_round(calls, check=lambda value: check_step_result(value, vocab)):
        """calls {(b, g): (method name, arguments)} -> {(b, g): Reply}, each environment called where it lives."""
        started = time.perf_counter()
        bound = lambda env, name, args: None if env is None else functools.partial(getattr(env, name), *args)
        replies = call_owned({(b, g): bound(envs[b][g], *call) for (b, g), call in calls.items()}, turns.timeout, check)
        timings["env_s"] += time.perf_counter() - started
        return replies

    unpadded = [prompts[b, (0 if left_pad is None else int(left_pad[b])):] for b in range(b_count)]
    resets = env_round({(b, g): ("reset", (unpadded[b].copy(), infos[b], g)) for b, g in slots}, check=None)
    for (b, g), reply in resets.items():
        if reply.error is not None:
            transcripts[b][g].status, transcripts[b][g].error = ERROR, "reset: " + reply.error

    started = time.perf_counter()
    # host arrays in (equal on every process), `to_host` out (gathered from the other processes' data slices)
    pads = None if left_pad is None else np.asarray(left_pad, np.int32)
    br, captured, branch_keys, first_logprobs = _start(model, params, prompts.astype(np.int32), pads, keys, g_count,
                                                       sampling, place)
    states = place.state(captured)
    jax.block_until_ready(br.length)
    timings["capture_s"] = time.perf_counter() - started
    length = np.zeros((b_count, g_count), np.int32)  # the transcripts' lengths, as on the device
    for turn in range(turns.max_turns):
        running = np.array([[t.status == "running" for t in row] for row in transcripts])
        if not running.any():
            break
        before = length
        started = time.perf_counter()
        br = _policy_turn(model, params, place, states, pads, br, branch_keys,
                          np.full((b_count, g_count), turn, np.int32), running, sampling, turn_len, p)
        tokens, length = to_host((br.tokens, br.length))
        timings["decode_s"] += time.perf_counter() - started
        acted = {(b, g): tokens[b, g, before[b, g]:length[b, g]] for b, g in slots if running[b, g]}
        for (b, g), said in acted.items():
            transcripts[b][g].turns.append({"role": "assistant", "tokens": said})
        replies = env_round({(b, g): ("step", (said.copy(),)) for (b, g), said in acted.items()})
        appended = {}
        for (b, g), reply in replies.items():
            keep = settle(transcripts[b][g], reply, turn, int(length[b, g]), r, turns)
            if len(keep):
                appended[(b, g)] = keep
        if appended:
            width = turns.bucket(max(len(k) for k in appended.values()))
            observations = np.full((b_count, g_count, width), sampling.pad_token, np.int32)
            count = np.zeros((b_count, g_count), np.int32)
            for (b, g), keep in appended.items():
                observations[b, g, :len(keep)], count[b, g] = keep, len(keep)
            started = time.perf_counter()
            br = _observe(model, params, place, states, pads, br, observations, count, p)
            jax.block_until_ready(br.length)
            timings["observe_s"] += time.perf_counter() - started
            length = length + count
    responses, mask, logp, sample_logp, first_logprobs = to_host(
        (br.tokens, br.mask, br.logp, br.sample_logp, first_logprobs))
    rewards = np.array([[t.reward for t in row] for row in transcripts], np.float32)
    return Episodes(responses=responses, mask=mask, logprobs=logp, sample_logprobs=sample_logp, rewards=rewards,
                    first_logprobs=first_logprobs, transcripts=transcripts, captured=captured,
                    timings=timings)
