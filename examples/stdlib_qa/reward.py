"""The stdlib example's rewards (TRL's convention, one call per group of G completions of one prompt):

    python -m longstraw_jax.run ... --reward examples.stdlib_qa.reward:exact_literal   # default, next_name
    python -m longstraw_jax.run ... --reward examples.stdlib_qa.reward:first_name      # complete

`exact_literal`: 1.0 when the completion, stripped of surrounding whitespace, is exactly the default as the source
writes it (`None`, `'strict'`, `-1`), else 0.0. Exact on purpose: the built-in `exact_match` normalises as LongBench
does (punctuation and case dropped), under which `''` and `'...'` both become the empty string, so an empty
completion would score on them, and `-1` would equal `1`.
"""
from __future__ import annotations

import re

NAME = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)")


def exact_literal(prompts: list[str], completions: list[str], answer: list[str], **columns) -> list[float]:
    """completions: G decoded responses; answer: the row's answer G times -> G rewards in {0.0, 1.0}."""
    return [float(c.strip() == a) for c, a in zip(completions, answer)]


def first_name(prompts: list[str], completions: list[str], answer: list[str], **columns) -> list[float]:
    """The `complete` question's reward: 1.0 when the completion (whitespace first allowed: ` load` after `import`)
    starts with the answer as a whole identifier (`kwargs)` scores for `kwargs`; `kwargs_list` and `kw` do not),
    else 0.0."""
    names = [NAME.match(c) for c in completions]
    return [float(m is not None and m.group(1) == a) for m, a in zip(names, answer)]
