"""A built-in agent task: two-hop retrieval through a tool (`--task lookup`, its environment `LookupEnvironment`).

Token layout (ids below `vocab_size`; nothing needs a tokenizer):

    PAD=0  STOP=1  TOOL=2 (starts a tool output in the log)  FACT=3  QUERY=4  CALL=5  RESULT=6
    answers: 7 .. 7+num_answers-1     ids: the next num_ids     keys: the next num_keys     filler: every id after

The prompt is an agent's log of exactly `prompt_len` tokens (TOOL followed by 8..32 filler tokens, repeated) with
`num_facts` facts "FACT key id" planted at random depths (distinct keys, distinct ids), and the question "QUERY key"
at the end. Which answer an id stands for is not in the prompt: each prompt has its own table id -> answer (random),
which only the tool reads. The policy must read the log (which id has the queried key), call the tool with it, and
answer with what the tool said:

    policy: CALL id STOP          tool: RESULT table[id]          policy: answer STOP

`LookupEnvironment.step` answers a turn "CALL id ..." (id an id token) with the observation [RESULT, table[id]],
reward 0; any other turn is the answer, and the episode ends: reward 1 when its first token is table[queried id]
and the tool was called before it, else 0 (a guess is not rewarded, even a lucky one: the table is only the tool's).
A policy that calls a random id scores 1/num_ids + (1 - 1/num_ids) / num_answers (`call_any_accuracy`), one that
calls one of the planted facts' ids at random 1/num_facts + (1 - 1/num_facts) / num_answers
(`call_any_fact_accuracy`); `chance_accuracy` is 1/num_answers (an answer drawn at random after any call).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from longstraw_jax.tasks.base import Prompt
from longstraw_jax.tasks.retrieval import MIN_FILLER, tool_log

PAD, STOP, TOOL, FACT, QUERY, CALL, RESULT = 0, 1, 2, 3, 4, 5, 6
FIRST_ANSWER = 7


@dataclasses.dataclass(frozen=True)
class LookupTask:
    prompt_len: int
    vocab_size: int
    seed: int = 0
    num_answers: int = 8
    num_ids: int = 8
    num_keys: int = 4
    num_facts: int = 2
    max_depth: float = 1.0
    name: str = "lookup"

    def __post_init__(self):
        errors = []
        if self.num_answers < 2:
            errors.append(f"num_answers={self.num_answers} must be >= 2")
        if not 1 <= self.num_facts <= min(self.num_keys, self.num_ids):
            errors.append(f"num_facts={self.num_facts} must be in [1, min(num_keys={self.num_keys}, "
                          f"num_ids={self.num_ids})]")
        need = self.first_filler + MIN_FILLER
        if self.vocab_size < need:
            errors.append(f"vocab_size={self.vocab_size} is too small: the lookup task needs >= {need} ids")
        need_len = 3 * self.num_facts + 2 + 2
        if self.prompt_len < need_len:
            errors.append(f"prompt_len={self.prompt_len} is too short: the lookup task needs >= {need_len} tokens")
        if not 0.0 < self.max_depth <= 1.0:
            errors.append(f"max_depth={self.max_depth} must be in (0, 1]")
        if errors:
            raise ValueError("invalid LookupTask: " + "; ".join(errors))

    @property
    def first_id(self) -> int:
        return FIRST_ANSWER + self.num_answers

    @property
    def first_key(self) -> int:
        return self.first_id + self.num_ids

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
    def call_any_accuracy(self) -> float:
        """Accuracy of calling a uniformly chosen id and answering what the tool says."""
        return 1 / self.num_ids + (1 - 1 / self.num_ids) / self.num_answers

    @property
    def call_any_fact_accuracy(self) -> float:
        """Accuracy of calling the id of a uniformly chosen planted fact and answering what the tool says."""
        return 1 / self.num_facts + (1 - 1 / self.num_facts) / self.num_answers

    def environment(self, vocab_size: int, seed: int) -> "LookupEnvironment":
        """The task's environment factory (the `--env` default of `--task lookup`)."""
        return LookupEnvironment(self)

    def prompt(self, index: int) -> Prompt:
        """Prompt number `index` (deterministic in seed and index). info: answer (table[id of the queried key]),
        id (that id), key, table (answer per id, a list of num_ids)."""
        rng = np.random.default_rng([self.seed, index])
        log_len = self.prompt_len - 2  # then QUERY key
        keys = rng.choice(self.num_keys, self.num_facts, replace=False) + self.first_key
        ids = rng.choice(self.num_ids, self.num_facts, replace=False) + self.first_id
        table = rng.integers(0, self.num_answers, self.num_ids) + FIRST_ANSWER
        log = tool_log(rng, log_len - 3 * self.num_facts, self.first_filler, self.vocab_size, TOOL)
        positions = np.sort(np.round(rng.uniform(0.0, self.max_depth, self.num_facts) * len(log)).astype(int))[::-1]
        for i, at in enumerate(positions):  # deepest first: earlier insertions do not shift later ones
            log = np.insert(log, at, [FACT, keys[i], ids[i]])
        tokens = np.concatenate([log, [QUERY, keys[0]]]).astype(np.int32)
        return Prompt(tokens, {"answer": int(table[ids[0] - self.first_id]), "id": int(ids[0]), "key": int(keys[0]),
                               "table": [int(v) for v in table]})

    def target(self, info: dict) -> tuple[np.ndarray, np.ndarray]:
        """The episode to imitate in a supervised warm-up, with its mask (the tool's reply is read, not imitated):
        [CALL, id, STOP, RESULT, answer, answer, STOP], mask [1, 1, 1, 0, 0, 1, 1]."""
        tokens = [CALL, info["id"], STOP, RESULT, info["answer"], info["answer"], STOP]
        return np.array(tokens, np.int32), np.array([1, 1, 1, 0, 0, 1, 1], np.float32)

    def reward(self, prompt_tokens: np.ndarray, response_tokens: np.ndarray, info: dict) -> float:
        """1.0 when the policy's answer turn (its tokens, mask 1) is right (`is_correct`), else 0; the environment
        gives the same reward during an episode."""
        return float(self.is_correct(response_tokens, info))

    def is_correct(self, response_tokens: np.ndarray, info: dict) -> bool:
        """The policy's tokens, split into turns at STOP (`turns_of`): `episode_correct`."""
        return self.episode_correct(turns_of(np.asarray(response_tokens)), info)

    def episode_correct(self, turns: list, info: dict) -> bool:
        """The policy's turns (as the episode split them: at STOP or at the turn length): the first that is not a
        tool call answers; right when a call came before it and its first token is the answer (what the environment
        rewards)."""
        called = False
        for turn in turns:
            turn = np.asarray(turn)
            if not self.is_call(turn):
                return called and len(turn) > 0 and int(turn[0]) == info["answer"]
            called = True
        return False

    def is_call(self, turn: np.ndarray) -> bool:
        return len(turn) >= 2 and int(turn[0]) == CALL and self.first_id <= int(turn[1]) < self.first_key


def turns_of(tokens: np.ndarray) -> list[np.ndarray]:
    """Policy tokens -> their turns, each ending at (and holding) its STOP; a last turn without one too."""
    ends = np.flatnonzero(tokens == STOP)
    starts = np.concatenate([[0], ends + 1])
    stops = np.concatenate([ends + 1, [len(tokens)]])
    return [tokens[a:b] for a, b in zip(starts, stops) if b > a]


class LookupEnvironment:
    """The lookup task's tool (see the module docstring). One per branch; reset reads the prompt's table."""

    def __init__(self, task: LookupTask):
        self.task = task

    def reset(self, prompt_tokens, info: dict, branch: int) -> None:
        self.table, self.answer, self.called = info["table"], info["answer"], False

    def step(self, turn):
        turn = np.asarray(turn)
        if self.task.is_call(turn):
            self.called = True
            return [RESULT, self.table[int(turn[1]) - self.task.first_id]], None, False
        return [], float(self.called and len(turn) > 0 and int(turn[0]) == self.answer), True


def environment(vocab_size: int, seed: int, prompt_len: int = 32, **options) -> LookupEnvironment:
    """`--env longstraw_jax.tasks.lookup:environment`: the lookup tool (it needs only the ids' layout)."""
    return LookupEnvironment(LookupTask(prompt_len=prompt_len, vocab_size=vocab_size, seed=seed, **options))
