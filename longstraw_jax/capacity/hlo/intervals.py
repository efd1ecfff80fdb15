"""Interval arithmetic over HLO's integer scalars: the values of loop bounds that XLA did not fold into a known trip
count (`values.Scalars` evaluates a program's instructions with it).

A value is an interval (lo, hi) of floats, exact when lo == hi; UNKNOWN = (-inf, inf). Truth values: (0, 0) false,
(1, 1) true, (0, 1) either. A small 1-D integer array (a scan's `arange` xs, up to MAX_VECTOR elements) is a
`Vector` of its exact values.
"""
from __future__ import annotations

import math
import re

from longstraw_jax.capacity.hlo.parse import Instruction, attr

INF = math.inf
UNKNOWN = (-INF, INF)
SCALAR_INT = re.compile(r"^(pred|[su]\d+)\[\]")
VECTOR_INT = re.compile(r"^(?:pred|[su]\d+)\[(\d+)\]")  # small 1-D integer arrays (e.g. a scan's xs = arange)
MAX_VECTOR = 4096


class Vector(tuple):
    """The known values of a small 1-D integer array (a scan over `jnp.arange(n)` indexes one per iteration)."""


def is_int(shape: str) -> bool:
    """An integer (or pred) scalar's type text, or a 1-D integer array's of at most MAX_VECTOR elements."""
    m = VECTOR_INT.match(shape)
    return bool(SCALAR_INT.match(shape)) or bool(m and int(m.group(1)) <= MAX_VECTOR)


def _mul(a: float, b: float) -> float:
    return 0.0 if a == 0 or b == 0 else a * b


def _logical(op: str, xs: list[tuple[float, float]]) -> tuple[float, float]:
    """`and` / `or` of truth values ((0, 0) false, (1, 1) true, (0, 1) either; UNKNOWN: a condition without a bound,
    e.g. `i < data`). A conjunction is false as soon as one operand is, so `(i < data) & (i < n)` is bounded by n:
    (0, 1) while i < n, then false; a disjunction with an unbounded operand stays unbounded."""
    sure = [x for x in xs if x in ((0.0, 0.0), (1.0, 1.0))]
    if op == "and":
        if (0.0, 0.0) in sure:
            return 0.0, 0.0
        if len(sure) == len(xs):
            return 1.0, 1.0
        return (0.0, 1.0) if any(0 <= x[0] and x[1] <= 1 for x in xs) else UNKNOWN
    if (1.0, 1.0) in sure:
        return 1.0, 1.0
    if len(sure) == len(xs):
        return 0.0, 0.0
    return (0.0, 1.0) if all(0 <= x[0] and x[1] <= 1 for x in xs) else UNKNOWN


def interval(op: str, xs: list[tuple[float, float]], instr: Instruction) -> tuple[float, float]:
    """Interval of a scalar integer op's result from its operands' intervals ([lo, hi], exact when lo == hi)."""
    if not xs:  # partition-id, replica-id, rng, ...: a value per device or per run
        return UNKNOWN
    exact = all(lo == hi for lo, hi in xs)
    v = [lo for lo, _ in xs]
    if op in ("copy", "convert", "bitcast", "reshape"):
        return xs[0]
    if op == "add":
        return xs[0][0] + xs[1][0], xs[0][1] + xs[1][1]
    if op == "subtract":
        return xs[0][0] - xs[1][1], xs[0][1] - xs[1][0]
    if op == "negate":
        return -xs[0][1], -xs[0][0]
    if op in ("minimum", "maximum"):
        f = min if op == "minimum" else max
        return f(xs[0][0], xs[1][0]), f(xs[0][1], xs[1][1])
    if op == "clamp":  # clamp(lo, x, hi) = min(max(x, lo), hi)
        low = max(xs[1][0], xs[0][0]), max(xs[1][1], xs[0][1])
        return min(low[0], xs[2][0]), min(low[1], xs[2][1])
    if op == "multiply":
        products = [_mul(a, b) for a in xs[0] for b in xs[1]]
        return min(products), max(products)
    if op == "select":
        if xs[0][0] == xs[0][1]:
            return xs[1] if xs[0][0] else xs[2]
        return min(xs[1][0], xs[2][0]), max(xs[1][1], xs[2][1])
    if op == "compare":
        direction = attr(instr.attrs, "direction")
        (alo, ahi), (blo, bhi) = xs
        sure = {"LT": (ahi < blo, alo >= bhi), "LE": (ahi <= blo, alo > bhi), "GT": (alo > bhi, ahi <= blo),
                "GE": (alo >= bhi, ahi < blo), "EQ": (exact and v[0] == v[1], ahi < blo or alo > bhi),
                "NE": (ahi < blo or alo > bhi, exact and v[0] == v[1])}.get(direction)
        if sure is None:
            return 0, 1
        if sure[0] or sure[1]:
            return (1, 1) if sure[0] else (0, 0)
        # uncertain: a loop condition that can never become false (an unbounded side) has no value at all
        endless = {"LT": bhi == INF or alo == -INF, "LE": bhi == INF or alo == -INF,
                   "GT": ahi == INF or blo == -INF, "GE": ahi == INF or blo == -INF}.get(direction, False)
        return UNKNOWN if endless else (0, 1)
    if op in ("and", "or") and instr.shape.startswith("pred"):
        return _logical(op, xs)
    if op in ("divide", "shift-right-logical", "shift-right-arithmetic") and xs[1][0] == xs[1][1] and xs[1][0] > 0 \
            and xs[0][0] >= 0:  # monotonic in a non-negative dividend
        d = xs[1][0] if op == "divide" else 2 ** xs[1][0]
        return xs[0][0] // d, (xs[0][1] // d if xs[0][1] < INF else INF)
    if not exact:
        return UNKNOWN
    a = int(v[0])
    b = int(v[1]) if len(v) > 1 else 0
    if op == "divide" and b:
        return (float(int(a / b)),) * 2  # truncation toward zero, as HLO
    if op == "remainder" and b:
        return (float(a - b * int(a / b)),) * 2
    table = {"and": lambda: a & b, "or": lambda: a | b, "xor": lambda: a ^ b, "not": lambda: int(not a)
             if instr.shape.startswith("pred") else ~a, "abs": lambda: abs(a), "sign": lambda: (a > 0) - (a < 0),
             "shift-left": lambda: a << b, "shift-right-arithmetic": lambda: a >> b,
             "shift-right-logical": lambda: (a % 2 ** 32) >> b}
    return (float(table[op]()),) * 2 if op in table else UNKNOWN

