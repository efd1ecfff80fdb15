"""The stdlib example's reward (TRL's convention, one call per group of G completions of one prompt):

    python -m longstraw_jax.run ... --reward examples.stdlib_qa.reward:exact_literal

1.0 when the completion, stripped of surrounding whitespace, is exactly the default as the source writes it (`None`,
`'strict'`, `-1`), else 0.0. Exact on purpose: the built-in `exact_match` normalises as LongBench does (punctuation
and case dropped), under which `''` and `'...'` both become the empty string, so an empty completion would score on
them, and `-1` would equal `1`.
"""
from __future__ import annotations


def exact_literal(prompts: list[str], completions: list[str], answer: list[str], **columns) -> list[float]:
    """completions: G decoded responses; answer: the row's answer G times -> G rewards in {0.0, 1.0}."""
    return [float(c.strip() == a) for c, a in zip(completions, answer)]
