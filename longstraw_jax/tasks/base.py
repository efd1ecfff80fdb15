"""What a task is: `Prompt` (tokens + the reward's info) and the `Task` protocol. Its own module so that the
built-in tasks (tasks/retrieval.py) and the task loader (tasks/__init__.py) both import it without importing each
other."""
from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np


@dataclasses.dataclass(frozen=True)
class Prompt:
    """tokens: int32 [P]; info: whatever the reward needs (e.g. the answer), JSON-serialisable values; text: the
    prompt as text, for rewards over text (tasks/rewards.py; None for token-only tasks)."""

    tokens: np.ndarray
    info: dict
    text: str | None = None


class Task(Protocol):
    name: str

    def prompt(self, index: int) -> Prompt: ...

    def reward(self, prompt_tokens: np.ndarray, response_tokens: np.ndarray, info: dict) -> float: ...
