"""Tasks: where prompts come from and how responses are rewarded.

A task has `prompt(index) -> Prompt` (deterministic in the data position `index`, so a resumed run sees the same
prompts as an uninterrupted one) and `reward(prompt_tokens, response_tokens, info) -> float`. Reward functions are
plain Python callables with that signature; `load_callable("package.module:function")` loads one (the CLI's
`--reward`), and `load_callable` also loads task factories (`--task module:function`, called with the keyword
arguments prompt_len, vocab_size, seed and returning a task).

Built-ins (`BUILTIN_TASKS`): `retrieval` (tasks/retrieval.py: a synthetic agent log with a fact planted at a chosen
depth) and `lookup` (tasks/lookup.py: an agent task, two-hop retrieval through a tool; its `environment`).
`Prompt` and the `Task` protocol live in tasks/base.py.
Externally generated rollouts (JSONL, e.g. from vLLM or SGLang) are read by tasks/rollout_file.py.
Datasets of text prompts or chat messages (`--data`): tasks/dataset.py, with the checkpoint's tokenizer
(tasks/tokenizer.py) and rewards over text (tasks/rewards.py).

A group scorer has `score_group(prompt, responses [G, R], mask [G, R]) -> (rewards float32 [G], parts)`, parts
{function name: (values float64 [G], applies bool [G])} for per-function metrics: `TokenReward` wraps a token-level
reward function (no parts), `rewards.TextRewards` several text ones; `as_scorer` gives either.
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np

from longstraw_jax.common.callables import load_callable
from longstraw_jax.grpo import FLOAT32_MAX
from longstraw_jax.tasks.base import Prompt, Task
from longstraw_jax.tasks.lookup import LookupTask
from longstraw_jax.tasks.retrieval import RetrievalTask

BUILTIN_TASKS = {"retrieval": RetrievalTask, "lookup": LookupTask}


class RewardError(ValueError):
    """The reward function raised, or returned something that is not a reward; the message names the function."""


def callable_name(fn) -> str:
    """"module:qualname" of a function or method (the form `load_callable` takes), else its repr."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    return f"{module}:{qualname}" if module and qualname else repr(fn)


def reward_problem(value) -> tuple[str, str] | None:
    """None for a real number (int or float, numpy scalars and 0-d arrays included; not bool, str or anything else)
    that is finite and within float32 range; else (the value as shown in an error, what is wrong with it)."""
    if isinstance(value, np.ndarray) or type(value).__module__.startswith("jax"):  # 0-d arrays -> their scalar
        value = np.asarray(value)[()] if np.shape(value) == () else value
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        return f"{shown} ({type(value).__name__})", "a reward must be a real number (int or float, not bool or str)"
    if isinstance(value, (float, np.floating)) and not math.isfinite(value):
        return shown, "rewards must be finite"
    if abs(int(value) if isinstance(value, (int, np.integer)) else float(value)) > FLOAT32_MAX:  # exact, no casts
        return shown, f"rewards must be within float32 range (|r| <= {FLOAT32_MAX:.6g})"
    return None


def score(reward_fn: Callable, prompt: Prompt, responses: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Rewards [G] float32 for responses [G, R] (only the real tokens, mask 1, are passed to `reward_fn`).

    Raises RewardError (a ValueError) naming the function ("module:qualname") and the branch when the function
    raises, whatever the exception, or returns something other than a finite real number within float32 range.
    """
    name = callable_name(reward_fn)
    rewards = []
    for g, (response, real) in enumerate(zip(responses, mask)):
        try:
            value = reward_fn(prompt.tokens, response[real > 0], prompt.info)
        except Exception as e:
            text = str(e).splitlines()[0] if str(e) else ""
            raise RewardError(f"reward function {name} raised {type(e).__name__} on branch {g}"
                              + (f": {text}" if text else "")) from e
        problem = reward_problem(value)
        if problem is not None:
            raise RewardError(f"reward function {name} returned {problem[0]} for branch {g}; {problem[1]}")
        rewards.append(float(np.asarray(value)))
    return np.asarray(rewards, np.float32)


class TokenReward:
    """The group scorer of one token-level reward function `fn(prompt_tokens, response_tokens, info) -> float`."""

    def __init__(self, fn: Callable):
        self.fn = fn

    def score_group(self, prompt: Prompt, responses: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, dict]:
        """-> (rewards float32 [G] from `score`, no per-function parts)."""
        return score(self.fn, prompt, responses, mask), {}


def as_scorer(reward):
    """A group scorer (anything with `score_group`) as it is; a plain token-level reward function wrapped."""
    return reward if hasattr(reward, "score_group") else TokenReward(reward)


def make_task(spec: str, prompt_len: int, vocab_size: int, seed: int, **options) -> Task:
    """A built-in task by name ("retrieval") or a factory "module:function" called with keyword arguments
    prompt_len, vocab_size, seed and any `options` (e.g. the retrieval task's depth)."""
    factory = BUILTIN_TASKS.get(spec) or (load_callable(spec) if ":" in spec else None)
    if factory is None:
        raise ValueError(f"--task {spec!r}: unknown task; built-ins: {', '.join(BUILTIN_TASKS)}, or 'module:function'")
    return factory(prompt_len=prompt_len, vocab_size=vocab_size, seed=seed, **options)


__all__ = ["BUILTIN_TASKS", "Prompt", "RewardError", "Task", "TokenReward", "as_scorer", "callable_name",
           "load_callable", "make_task", "reward_problem", "score"]
