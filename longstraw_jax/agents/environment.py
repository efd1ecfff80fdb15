"""The environment protocol of agent branches (docs/architecture.md 11) and the host side of calling it.

An environment answers one branch's policy turns:

    env = FACTORY(vocab_size=V, seed=S, **env_kwargs)          once per branch slot, at start (`make_environments`)
    env.reset(prompt_tokens, info, branch)                     before each episode (the group's prompt, unpadded)
    observation, reward, done = env.step(turn)                 after each policy turn

`turn` is the turn's token ids (int32 [n], its stop token included). `observation` is a sequence of token ids in
[0, V) that the policy reads next (mask 0: never trained on); `reward` a real number or None (0); `done` ends the
episode (its observation is then not appended). The branch's reward is the sum of its rewards.

Every call runs in a daemon thread with a timeout (`call_all`), so a `step` that never returns costs `timeout`
seconds and is abandoned, never a hang. In a multi-process run each environment lives on one process (the one that
owns its group's data slice) and the replies are exchanged after each round of calls (`call_owned`), so every
process records the same transcripts. A call that raises, times out or returns something malformed ends that
branch with status "error" and the first error's text (`Reply.error`); the sampler keeps the other branches going.
`Transcript` is what a branch did (its turns, the environment's replies, its status); `ScriptedEnvironment` replays
one without the environment (a flaky tool's run reproduced; tests script an environment).
"""
from __future__ import annotations

import dataclasses
import math
import threading
import time
from typing import Any, Callable, NamedTuple, Protocol, Sequence

import jax
import numpy as np

from longstraw_jax.common.callables import load_callable
from longstraw_jax.common.validation import is_real
from longstraw_jax.sharding.hosts import gather_objects

# a branch's status once its episode is over
DONE, LENGTH, MAX_TURNS, ERROR = "done", "length", "max_turns", "error"


class Environment(Protocol):
    def reset(self, prompt_tokens: np.ndarray, info: dict, branch: int) -> None: ...

    def step(self, turn: np.ndarray) -> tuple[Sequence[int], float | None, bool]: ...


class FactoryError(RuntimeError):
    """A factory that cannot be loaded or built (raised at start, before any work)."""


def make_environments(spec_or_factory, count: int, vocab_size: int, seed: int, env_kwargs: dict | None = None,
                      what: str = "--env") -> list:
    """`count` environments from a factory (a callable, or "module:function" as `--env` names it), each built with
    FACTORY(vocab_size=..., seed=..., **env_kwargs). A factory that cannot be found, raises, or builds something
    without reset/step: FactoryError naming it (one line)."""
    name = spec_or_factory if isinstance(spec_or_factory, str) else getattr(spec_or_factory, "__qualname__",
                                                                            repr(spec_or_factory))
    try:
        factory = load_callable(spec_or_factory) if isinstance(spec_or_factory, str) else spec_or_factory
    except ValueError as e:
        raise FactoryError(f"{what} {name}: {e}") from None
    envs = []
    for _ in range(count):
        try:
            env = factory(vocab_size=vocab_size, seed=seed, **(env_kwargs or {}))
        except Exception as e:
            raise FactoryError(f"{what} {name} failed at start: {type(e).__name__}: {first_line(e)}") from None
        missing = [m for m in ("reset", "step") if not callable(getattr(env, m, None))]
        if missing:
            raise FactoryError(f"{what} {name} returned {type(env).__name__}, which has no "
                                    f"{' / '.join(missing)} method (an environment needs reset and step)")
        envs.append(env)
    return envs


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else ""


class Framed(NamedTuple):
    """An observation whose content sits in a wrapper (a chat template's tool message: agents/text.py): token ids
    prefix + content + suffix. When it does not fit, the content is cut, never the wrapper."""

    prefix: list
    content: list
    suffix: list

    @property
    def ids(self) -> list:
        return list(self.prefix) + list(self.content) + list(self.suffix)


@dataclasses.dataclass
class Reply:
    """One environment call's outcome: observation int32 [n] (empty when done), reward (float, 0 for None), done, or
    error (one line: the exception, a timeout, a malformed value); seconds: the call's wall time. frame: (prefix,
    content) lengths of a `Framed` observation (the content is what a cut may shorten), None for plain ids."""

    observation: np.ndarray
    reward: float = 0.0
    done: bool = False
    error: str | None = None
    seconds: float = 0.0
    frame: tuple | None = None

    def as_json(self) -> dict:
        return {"observation": [int(x) for x in self.observation], "reward": self.reward, "done": self.done,
                "error": self.error, "seconds": self.seconds, "frame": None if self.frame is None else list(self.frame)}

    @classmethod
    def from_json(cls, row: dict) -> "Reply":
        frame = row["frame"]
        return cls(np.asarray(row["observation"], np.int32), row["reward"], row["done"], row["error"], row["seconds"],
                   None if frame is None else tuple(frame))

    def fit(self, room: int) -> np.ndarray:
        """The observation cut to at most `room` tokens: a framed one loses content first (its wrapper kept whole
        while it fits), a plain one its end."""
        ids = self.observation
        if len(ids) <= room:
            return ids
        if self.frame is not None:
            prefix, content = self.frame
            wrapper = len(ids) - content
            if wrapper <= room:
                keep = room - wrapper
                return np.concatenate([ids[:prefix + keep], ids[prefix + content:]])
        return ids[:max(room, 0)]


def check_step_result(value, vocab_size: int) -> Reply:
    """`step`'s return value -> a Reply, or a Reply with `error` saying what is wrong (a tuple of 3, token ids in
    [0, vocab_size), a finite real reward or None, a bool done)."""
    if not isinstance(value, tuple) or len(value) != 3:
        return Reply(np.zeros(0, np.int32), error=f"step returned {type(value).__name__}, not a tuple (observation, "
                                                  "reward, done)")
    observation, reward, done = value
    frame = None
    if isinstance(observation, Framed):
        frame = (len(observation.prefix), len(observation.content))
        observation = observation.ids
    if observation is None:
        observation = ()
    ids = np.asarray(observation)
    if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
        return Reply(np.zeros(0, np.int32), error=f"step's observation must be a 1-D sequence of token ids, got "
                                                  f"{type(observation).__name__} of shape {ids.shape}")
    bad = np.flatnonzero((ids < 0) | (ids >= vocab_size))
    if bad.size:
        return Reply(np.zeros(0, np.int32), error=f"step's observation[{bad[0]}] = {int(ids[bad[0]])} is out of "
                                                  f"range: token ids must be in [0, vocab_size={vocab_size})")
    if reward is not None and not (is_real(reward) and math.isfinite(reward)):
        return Reply(np.zeros(0, np.int32), error=f"step's reward {reward!r} must be a finite real number or None")
    if not isinstance(done, (bool, np.bool_)):
        return Reply(np.zeros(0, np.int32), error=f"step's done {done!r} must be a bool")
    return Reply(ids.astype(np.int32) if not done else np.zeros(0, np.int32), float(reward or 0.0), bool(done),
                 frame=None if done else frame)


def call_all(calls: list[Callable[[], Any]], timeout: float, check: Callable[[Any], Reply] | None = None) -> list:
    """Run every call in its own daemon thread, all at once; wait for each at most until `timeout` seconds after the
    start. Returns, per call, check(its value) (default: a Reply holding nothing), or a Reply with the error
    (the exception's type and first line, or "timed out after T s"): a call still running is abandoned."""
    results: list = [None] * len(calls)  # written by each call's thread when it is done

    def run(i):
        started = time.perf_counter()
        try:
            value = calls[i]()
            reply = check(value) if check is not None else Reply(np.zeros(0, np.int32))
        except Exception as e:  # the environment's own error: the observation-free reply that ends the branch
            reply = Reply(np.zeros(0, np.int32), error=f"{type(e).__name__}: {first_line(e)}".rstrip(": "))
        reply.seconds = time.perf_counter() - started
        results[i] = reply

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(calls))]
    deadline = time.perf_counter() + timeout
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(0.0, deadline - time.perf_counter()))
    late = lambda: Reply(np.zeros(0, np.int32), error=f"timed out after {timeout:g} s", seconds=timeout)  # noqa: E731
    # a new list: an abandoned call that finishes later writes only into `results`
    return [late() if reply is None else reply for reply in list(results)]


def call_owned(calls: dict, timeout: float, check: Callable[[Any], Reply] | None = None) -> dict:
    """calls {slot: callable, or None where another process holds that slot's environment} -> {slot: Reply} for
    every slot, on every process. Each process runs its own calls (`call_all`, in parallel threads, `timeout` each);
    in a multi-process run the replies are then exchanged (`sharding.hosts.gather_objects`: a collective, so every
    process calls this at the same point with the same slots), and every process records the same transcripts.
    Slots are tuples of ints, e.g. (group, branch). A slot that no process or more than one process called:
    ValueError."""
    own = {slot: call for slot, call in calls.items() if call is not None}
    replies = dict(zip(own, call_all(list(own.values()), timeout, check)))
    if jax.process_count() > 1:
        shared = gather_objects([[list(slot), reply.as_json()] for slot, reply in replies.items()])
        replies, callers = {}, {}
        for process, rows in enumerate(shared):
            for slot, row in rows:
                slot = tuple(slot)
                if slot in replies:
                    raise ValueError(f"environment slot {slot}: called by processes {callers[slot]} and {process}; "
                                     "each slot's environment must live on one process")
                replies[slot], callers[slot] = Reply.from_json(row), process
    missing = [slot for slot in calls if slot not in replies]
    if missing:
        raise ValueError(f"environment slot {missing[0]}: no process holds its environment (None on every process)")
    return {slot: replies[slot] for slot in calls}


@dataclasses.dataclass
class Transcript:
    """What one branch did: turns alternate {"role": "assistant", "tokens": [...]} (a policy turn) and {"role": "tool",
    "tokens": [...], "reward": r, "done": d, "truncated": n} (the environment's reply: the observation as appended,
    cut by n tokens; after the last turn tokens is empty). status: "running", then one of "done", "length" (the
    response length was reached), "max_turns", "error"; error: the first error's text."""

    turns: list = dataclasses.field(default_factory=list)
    status: str = "running"
    error: str | None = None

    @property
    def reward(self) -> float:
        return float(sum(t.get("reward", 0.0) for t in self.turns if t["role"] == "tool"))

    @property
    def policy_turns(self) -> int:
        return sum(t["role"] == "assistant" for t in self.turns)

    @property
    def observation_tokens(self) -> int:
        return sum(len(t["tokens"]) for t in self.turns if t["role"] == "tool")

    def as_json(self) -> dict:
        return {"turns": [dict(t, tokens=[int(x) for x in t["tokens"]]) for t in self.turns], "status": self.status,
                "error": self.error, "reward": self.reward}


class ScriptedEnvironment:
    """Replays a recorded transcript (a `Transcript` or its `as_json`) instead of calling an environment: each `step`
    returns the recorded reply (the observation as it was appended: it fits again). A turn that differs from the
    recorded one raises, which ends the branch with status "error" (the replay diverged: other params or keys)."""

    def __init__(self, transcript: Transcript | dict):
        turns = transcript.turns if isinstance(transcript, Transcript) else transcript["turns"]
        self.actions = [np.asarray(t["tokens"]) for t in turns if t["role"] == "assistant"]
        self.replies = [t for t in turns if t["role"] == "tool"]
        self.index = 0

    def reset(self, prompt_tokens, info, branch) -> None:
        self.index = 0

    def step(self, turn):
        i = self.index
        if i >= len(self.replies):
            raise RuntimeError(f"the scripted transcript has {len(self.replies)} replies; turn {i} has none")
        if not np.array_equal(np.asarray(turn), self.actions[i]):
            raise RuntimeError(f"turn {i} differs from the recorded one: the replay diverged")
        self.index += 1
        reply = self.replies[i]
        return list(reply["tokens"]), reply.get("reward"), bool(reply["done"])
