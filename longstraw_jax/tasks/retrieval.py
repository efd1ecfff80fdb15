"""Synthetic long-context retrieval over an agent's tool log: find the fact planted at a chosen depth.

Token layout (ids below `vocab_size`; nothing needs a tokenizer):

    PAD=0  STOP=1  TOOL=2 (starts a tool output)  FACT=3  QUERY=4
    answers: 5 .. 5+num_answers-1         keys: the next num_keys ids          filler: every id after those

A prompt of exactly `prompt_len` tokens is a log of tool outputs (TOOL followed by 8..32 random filler tokens,
repeated), with `num_facts` facts "FACT key value" planted in it (distinct keys, random values) and the question
"QUERY key" at the end. The queried fact sits at `depth` (0 = the start of the log, 1 = just before the question;
None = uniform per prompt); the others are distractors at random depths (default 2 facts: one distractor). The answer
is the queried fact's value. `max_depth` < 1 keeps every fact in the first `max_depth` of the log (random depths are
uniform in [0, max_depth]): with 0.1 the question is at least 90 % of the prompt away from every fact.

Reward: 1.0 when the first response token is the answer, `format_reward` when it is another answer token (a
well-formed but wrong answer), else 0. A policy that always answers but guesses uniformly scores
1/num_answers + (1 - 1/num_answers) * format_reward: `chance_reward`. `accuracy` (first token correct) is what the
learning benchmark reports next to its chance level 1/num_answers. A policy that finds the facts but not the one
with the queried key (it copies a random fact's value) scores `copy_any_fact_accuracy` = 1/F + (1 - 1/F)/A with F
facts and A answers (0.625 for 2 facts and 4 answers): accuracy above that needs the key matched.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from longstraw_jax.tasks.base import Prompt

PAD, STOP, TOOL, FACT, QUERY = 0, 1, 2, 3, 4
FIRST_ANSWER = 5
MIN_FILLER = 16


@dataclasses.dataclass(frozen=True)
class RetrievalTask:
    prompt_len: int
    vocab_size: int
    seed: int = 0
    num_answers: int = 4
    num_keys: int = 4
    num_facts: int = 2
    depth: float | None = None
    max_depth: float = 1.0
    format_reward: float = 0.1
    name: str = "retrieval"

    def __post_init__(self):
        errors = []
        if self.num_answers < 2:
            errors.append(f"num_answers={self.num_answers} must be >= 2")
        if not 1 <= self.num_facts <= self.num_keys:
            errors.append(f"num_facts={self.num_facts} must be in [1, num_keys={self.num_keys}]")
        need = self.first_filler + MIN_FILLER
        if self.vocab_size < need:
            errors.append(f"vocab_size={self.vocab_size} is too small: the retrieval task needs >= {need} ids")
        need_len = 3 * self.num_facts + 2 + 2
        if self.prompt_len < need_len:
            errors.append(f"prompt_len={self.prompt_len} is too short: the retrieval task needs >= {need_len} tokens")
        if self.depth is not None and not 0.0 <= self.depth <= 1.0:
            errors.append(f"depth={self.depth} must be in [0, 1] (or None: random)")
        if not 0.0 < self.max_depth <= 1.0:
            errors.append(f"max_depth={self.max_depth} must be in (0, 1]")
        elif self.depth is not None and self.depth > self.max_depth:
            errors.append(f"depth={self.depth} must be <= max_depth={self.max_depth}")
        if errors:
            raise ValueError("invalid RetrievalTask: " + "; ".join(errors))

    @property
    def first_key(self) -> int:
        return FIRST_ANSWER + self.num_answers

    @property
    def first_filler(self) -> int:
        return self.first_key + self.num_keys

    @property
    def stop_token(self) -> int:
        return STOP

    @property
    def pad_token(self) -> int:
        return PAD

    @property
    def chance_accuracy(self) -> float:
        return 1 / self.num_answers

    @property
    def copy_any_fact_accuracy(self) -> float:
        """Accuracy of copying a uniformly chosen fact's value (values are independent uniform answers)."""
        return 1 / self.num_facts + (1 - 1 / self.num_facts) / self.num_answers

    @property
    def chance_reward(self) -> float:
        return 1 / self.num_answers + (1 - 1 / self.num_answers) * self.format_reward

    def prompt(self, index: int) -> Prompt:
        """Prompt number `index` (deterministic in seed and index). info: answer, key, depth (the planted
        fact's position / the log length)."""
        rng = np.random.default_rng([self.seed, index])
        log_len = self.prompt_len - 2  # then QUERY key
        keys = rng.choice(self.num_keys, self.num_facts, replace=False) + self.first_key
        values = rng.integers(0, self.num_answers, self.num_facts) + FIRST_ANSWER
        log = tool_log(rng, log_len - 3 * self.num_facts, self.first_filler, self.vocab_size, TOOL)
        depth = rng.uniform(0.0, self.max_depth) if self.depth is None else self.depth
        depths = np.concatenate([[depth], rng.uniform(0.0, self.max_depth, size=self.num_facts - 1)])
        # insert facts deepest-first so that earlier insertions do not shift later ones' positions
        positions = np.round(depths * len(log)).astype(int)
        for i in np.argsort(-positions, kind="stable"):
            log = np.insert(log, positions[i], [FACT, keys[i], values[i]])
        tokens = np.concatenate([log, [QUERY, keys[0]]]).astype(np.int32)
        fact_at = int(positions[0] + 3 * np.sum(positions[1:] <= positions[0]))
        return Prompt(tokens, {"answer": int(values[0]), "key": int(keys[0]), "depth": fact_at / log_len})

    def reward(self, prompt_tokens: np.ndarray, response_tokens: np.ndarray, info: dict) -> float:
        if len(response_tokens) == 0:
            return 0.0
        first = int(response_tokens[0])
        if first == info["answer"]:
            return 1.0
        return self.format_reward if FIRST_ANSWER <= first < self.first_key else 0.0

    def target(self, info: dict) -> np.ndarray:
        """The response to imitate in a supervised warm-up (trainer/warmup.py): [answer, STOP]."""
        return np.array([info["answer"], STOP], np.int32)

    def is_correct(self, response_tokens: np.ndarray, info: dict) -> bool:
        return len(response_tokens) > 0 and int(response_tokens[0]) == info["answer"]


def tool_log(rng, length: int, first_filler: int, vocab_size: int, tool: int) -> np.ndarray:
    """`length` tokens of tool outputs: `tool` followed by 8..32 filler ids in [first_filler, vocab_size), repeated
    (the last one cut)."""
    parts, total = [], 0
    while total < length:
        n = int(rng.integers(8, 33))
        parts.append(np.concatenate([[tool], rng.integers(first_filler, vocab_size, n)]))
        total += n + 1
    return np.concatenate(parts)[:length]
