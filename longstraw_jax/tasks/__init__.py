"""Tasks: where prompts come from and how responses are rewarded.

A task has `prompt(index) -> Prompt` (deterministic in the data position `index`, so a resumed run sees the same
prompts as an uninterrupted one) and `reward(prompt_tokens, response_tokens, info) -> float`. Reward functions are
plain Python callables with that signature; `load_callable("package.module:function")` loads one (the CLI's
`--reward`), and `load_callable` also loads task factories (`--task module:function`, called with the keyword
arguments prompt_len, vocab_size, seed and returning a task).

Built-ins (`BUILTIN_TASKS`): `retrieval` (tasks/retrieval.py: a synthetic agent log with a fact planted at a chosen
depth). `Prompt` and the `Task` protocol live in tasks/base.py.
Externally generated rollouts (JSONL, e.g. from vLLM or SGLang) are read by tasks/rollout_file.py.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable

import numpy as np

from longstraw_jax.tasks.base import Prompt, Task
from longstraw_jax.tasks.retrieval import RetrievalTask

BUILTIN_TASKS = {"retrieval": RetrievalTask}


def load_callable(spec: str) -> Callable[..., Any]:
    """"package.module:function" -> the function (ValueError naming the spec if it cannot be found)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{spec!r} is not of the form 'module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot import module {module_name!r} of {spec!r}: {e}") from None
    target = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ValueError(f"module {module_name!r} has no attribute {attr!r} (from {spec!r})")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"{spec!r} is not callable")
    return target


def score(reward_fn: Callable, prompt: Prompt, responses: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Rewards [G] float32 for responses [G, R] (only the real tokens, mask 1, are passed to `reward_fn`).

    Raises ValueError naming the branch when a reward is not a finite number.
    """
    rewards = []
    for g, (response, real) in enumerate(zip(responses, mask)):
        value = reward_fn(prompt.tokens, response[real > 0], prompt.info)
        try:
            value = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"reward function returned {value!r} for branch {g}; expected a float") from None
        if not np.isfinite(value):
            raise ValueError(f"reward function returned {value} for branch {g}; rewards must be finite")
        rewards.append(value)
    return np.asarray(rewards, np.float32)


def make_task(spec: str, prompt_len: int, vocab_size: int, seed: int, **options) -> Task:
    """A built-in task by name ("retrieval") or a factory "module:function" called with keyword arguments
    prompt_len, vocab_size, seed and any `options` (e.g. the retrieval task's depth)."""
    factory = BUILTIN_TASKS.get(spec) or (load_callable(spec) if ":" in spec else None)
    if factory is None:
        raise ValueError(f"--task {spec!r}: unknown task; built-ins: {', '.join(BUILTIN_TASKS)}, or 'module:function'")
    return factory(prompt_len=prompt_len, vocab_size=vocab_size, seed=seed, **options)


__all__ = ["BUILTIN_TASKS", "Prompt", "Task", "load_callable", "make_task", "score"]
