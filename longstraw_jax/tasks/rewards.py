"""Rewards over text (TRL's convention), for datasets (`--data`, tasks/dataset.py):

    fn(prompts: list[str], completions: list[str], **columns) -> list[float | None]

called once per group of G completions of one prompt: `prompts` is that prompt's text G times (the rendered chat
template for chat messages; the kept part when the prompt was truncated), `completions` the G responses decoded with
the tokenizer (special tokens skipped), and each other column of the row is a keyword argument holding its value G
times. None means "this function does not apply to this completion" (e.g. a math reward for a row without a
parseable answer): it adds nothing to the total and is left out of the function's mean. Several functions combine as
sum_i weight_i * value_i over the functions that apply (0 when none does).

Built-ins (`BUILTINS`), reading the reference answer from one column (`answer` unless --answer-field says otherwise;
a string, a number, or a list of acceptable answers, scored against the best; None: the function does not apply):

- `exact_match`: 1 when the normalised completion equals a normalised answer, else 0;
- `contains`: 1 when a normalised answer occurs in the normalised completion as whole words, else 0;
- `f1`: the token F1 of LongBench's QA scoring (normalised whitespace tokens; the best over the answers);
- `math`: 1 when math-verify finds the completion's answer equivalent to the reference (LaTeX or plain
  expressions), else 0; None when the reference does not parse. Needs the optional package `math-verify`
  (`pip install 'longstraw-jax[math]'`).

Normalisation (LongBench's, for QA): lowercase, punctuation removed, the articles a / an / the removed, whitespace
runs collapsed.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import re
import string
import threading
from typing import Callable

import numpy as np

from longstraw_jax.tasks import RewardError, load_callable, reward_problem

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalise(text: str) -> str:
    """Lowercase, punctuation removed, articles (a, an, the) removed, whitespace runs -> one space, stripped."""
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split())


def _references(answer) -> list[str] | None:
    """A column value -> the acceptable answers as strings; None (does not apply) for None or an empty list."""
    if answer is None:
        return None
    answers = list(answer) if isinstance(answer, (list, tuple)) else [answer]
    answers = [str(a) for a in answers if a is not None]
    return answers or None


def token_f1(prediction: str, reference: str) -> float:
    """F1 of the normalised whitespace tokens (multiset overlap), as LongBench scores QA; 0 when either is empty."""
    pred, ref = normalise(prediction).split(), normalise(reference).split()
    common = sum((collections.Counter(pred) & collections.Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def _per_completion(score: Callable[[str, list[str]], float | None]):
    """A built-in from `score(completion, references) -> float | None` (applied to each completion)."""

    def reward(prompts: list[str], completions: list[str], answer=None, **columns) -> list[float | None]:
        answers = answer if answer is not None else [None] * len(completions)
        return [None if (refs := _references(a)) is None else score(c, refs) for c, a in zip(completions, answers)]

    return reward


def _exact(completion: str, references: list[str]) -> float:
    return float(any(normalise(completion) == normalise(r) for r in references))


def _contains(completion: str, references: list[str]) -> float | None:
    refs = [normalise(r) for r in references if normalise(r)]
    if not refs:
        return None  # an answer that normalises to nothing is contained in everything: not a test
    return float(any(f" {r} " in f" {normalise(completion)} " for r in refs))


def _f1(completion: str, references: list[str]) -> float:
    return max(token_f1(completion, r) for r in references)


def _math(completion: str, references: list[str]) -> float | None:
    try:
        from math_verify import parse, verify
    except ImportError:
        raise ImportError("the 'math' reward needs the package math-verify: pip install 'longstraw-jax[math]' (or "
                          "math-verify==0.9.0)") from None
    # math-verify's timeouts use SIGALRM, which only the main thread may set
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    golds = [g for g in (parse(r, parsing_timeout=timeout) for r in references) if g]
    if not golds:
        return None  # no reference parses: the function does not apply to this row
    answer = parse(completion, parsing_timeout=timeout)
    return float(any(verify(g, answer, timeout_seconds=timeout) for g in golds))


exact_match = _per_completion(_exact)
contains = _per_completion(_contains)
f1 = _per_completion(_f1)
math_equal = _per_completion(_math)
BUILTINS: dict[str, Callable] = {"exact_match": exact_match, "contains": contains, "f1": f1, "math": math_equal}


@dataclasses.dataclass(frozen=True)
class RewardFunction:
    """One --reward: its name in metrics (`reward/<name>`), the function, its weight, and for a built-in the column
    it reads the reference answer from (passed to it as `answer`)."""

    name: str
    fn: Callable
    weight: float = 1.0
    answer_field: str | None = None


def parse_weights(weights: str | None, count: int) -> list[float]:
    """--reward-weights "1,0.5" -> [1.0, 0.5] (default: 1 each). ValueError for a count other than `count` or a
    value that is not a finite number."""
    if weights is None:
        return [1.0] * count
    parts = [w.strip() for w in weights.split(",")]
    try:
        values = [float(w) for w in parts]
    except ValueError:
        raise ValueError(f"--reward-weights={weights!r} must be comma-separated numbers") from None
    if len(values) != count:
        raise ValueError(f"--reward-weights={weights!r} has {len(values)} weight(s); need one per --reward "
                         f"function ({count})")
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"--reward-weights={weights!r}: weights must be finite numbers")
    return values


def load_rewards(specs: str, weights: str | None, columns, answer_field: str = "answer") -> list[RewardFunction]:
    """--reward "exact_match,mypkg.rewards:judge" (built-in names or module:function, comma-separated) and
    --reward-weights -> the functions. `columns`: the data's columns passed as keyword arguments (a built-in needs
    `answer_field` among them). ValueError naming the option for an unknown name, a weight count mismatch, or a
    missing answer column."""
    names = [s.strip() for s in specs.split(",") if s.strip()]
    if not names:
        raise ValueError(f"--reward={specs!r} names no function")
    values = parse_weights(weights, len(names))
    functions = []
    for spec, weight in zip(names, values):
        if spec in BUILTINS:
            if answer_field not in columns:
                raise ValueError(f"--reward {spec} reads the reference answer from the column '{answer_field}' "
                                 f"(--answer-field), which the data does not have; its columns: {sorted(columns)}")
            functions.append(RewardFunction(spec, BUILTINS[spec], weight, answer_field))
        elif ":" in spec:
            functions.append(RewardFunction(spec.rpartition(":")[2].rpartition(".")[2], load_callable(spec), weight))
        else:
            raise ValueError(f"--reward {spec!r}: unknown; built-ins: {', '.join(BUILTINS)}, or 'module:function'")
    counts = collections.Counter(f.name for f in functions)
    return [dataclasses.replace(f, name=spec) if counts[f.name] > 1 else f for f, spec in zip(functions, names)]


def _check_values(name: str, values, count: int) -> tuple[np.ndarray, np.ndarray]:
    """A function's return -> (values float64 [G] with 0 where None, applies bool [G]); RewardError naming it for
    anything but a list of `count` real finite numbers (within float32) or None."""
    if isinstance(values, np.ndarray):
        values = values.tolist()
    if not isinstance(values, (list, tuple)):
        raise RewardError(f"reward function {name} returned a {type(values).__name__}; it must return a list of "
                          f"{count} numbers (or None), one per completion")
    if len(values) != count:
        raise RewardError(f"reward function {name} returned {len(values)} value(s) for {count} completions; it must "
                          "return one per completion")
    out, applies = np.zeros(count, np.float64), np.zeros(count, bool)
    for g, value in enumerate(values):
        if value is None:
            continue
        problem = reward_problem(value)
        if problem is not None:
            raise RewardError(f"reward function {name} returned {problem[0]} for completion {g}; {problem[1]} (or "
                              "None: does not apply)")
        out[g], applies[g] = float(np.asarray(value)), True
    return out, applies


class TextRewards:
    """The group scorer of text reward functions (`score_group`, as `tasks.TokenReward`'s): decodes the G responses
    with `tokenizer` (special tokens skipped) and calls each function once with the prompt's text and columns."""

    def __init__(self, functions: list[RewardFunction], tokenizer):
        self.functions, self.tokenizer = functions, tokenizer
        self.names = [f.name for f in functions]

    def completions(self, responses: np.ndarray, mask: np.ndarray) -> list[str]:
        """responses int [G, R], mask [G, R] -> the G real responses decoded (special tokens skipped)."""
        return self.tokenizer.batch_decode([np.asarray(r)[np.asarray(m) > 0].tolist() for r, m in zip(responses, mask)],
                                           skip_special_tokens=True)

    def score_group(self, prompt, responses: np.ndarray, mask: np.ndarray):
        """-> (rewards float32 [G]: the weighted sum over the functions that apply, {name: (values float64 [G], 0
        where None; applies bool [G])}). RewardError naming the function when one raises or returns a bad value."""
        completions = self.completions(responses, mask)
        count = len(completions)
        prompts = [prompt.text if prompt.text is not None else ""] * count
        columns = {k: [v] * count for k, v in prompt.info.items()}
        total, parts = np.zeros(count, np.float64), {}
        for f in self.functions:
            kwargs = dict(columns, answer=columns[f.answer_field]) if f.answer_field else columns
            try:
                values = f.fn(prompts, completions, **kwargs)
            except Exception as e:
                text = str(e).splitlines()[0] if str(e) else ""
                raise RewardError(f"reward function {f.name} raised {type(e).__name__}" + (f": {text}" if text else "")
                                  ) from e
            values, applies = _check_values(f.name, values, count)
            parts[f.name] = (values, applies)
            total += f.weight * values
        for g, value in enumerate(total):
            problem = reward_problem(float(value))
            if problem is not None:
                raise RewardError(f"the weighted reward of completion {g} is {problem[0]}; {problem[1]}")
        return total.astype(np.float32), parts
