"""`Scalars`: the values of a program's integer instructions, as intervals (`intervals.py`), given the known values
of their computation's parameters: what decides a loop's trip count or a conditional's branch when XLA wrote no
`known_trip_count` (the carried counters and bounds of a data-dependent loop, a scan's `arange` of round indices).

`args`, the known parameter values, are ((param, tuple index or -1 for a non-tuple parameter), interval) pairs.
"""
from __future__ import annotations

import re

from longstraw_jax.capacity.hlo.intervals import SCALAR_INT, UNKNOWN, VECTOR_INT, Vector, interval, is_int
from longstraw_jax.capacity.hlo.parse import Instruction, attr, called, parameter_index, split_top
from longstraw_jax.capacity.hlo.program import Program


class Scalars:
    """Interval evaluation of `program`'s integer scalars (and small integer vectors), cached by (computation,
    instruction, known parameter values)."""

    def __init__(self, program: Program):
        self.program = program
        self._values: dict[tuple, tuple[float, float]] = {}

    def value(self, comp: str, name: str, args: tuple) -> tuple[float, float]:
        """Interval of scalar instruction `name` of `comp`; args: ((param, tuple index or -1), interval) pairs."""
        key = (comp, name, args)
        if key in self._values:
            return self._values[key]
        self._values[key] = UNKNOWN  # recursion guard
        instr = self.program.by_name[comp].get(name)
        out = UNKNOWN if instr is None else self._value(comp, instr, args)
        self._values[key] = out
        return out

    def element(self, comp: str, name: str, index: int, args: tuple) -> tuple[float, float]:
        """Interval of element `index` of tuple-valued instruction `name`."""
        instr = self.program.by_name[comp].get(name)
        if instr is None:
            return UNKNOWN
        if instr.opcode == "tuple" and index < len(instr.operands):
            return self.value(comp, instr.operands[index], args)
        if instr.opcode == "parameter":
            return dict(args).get((parameter_index(instr), index), UNKNOWN)
        return UNKNOWN

    def _value(self, comp: str, instr: Instruction, args: tuple):
        """`value` of `instr`, uncached: an interval, a Vector for a small integer array, UNKNOWN otherwise."""
        op = instr.opcode
        if op == "get-tuple-element":
            return self.element(comp, instr.operands[0], int(attr(instr.attrs, "index")), args)
        if not is_int(instr.shape):
            return UNKNOWN
        if op == "parameter":
            return dict(args).get((parameter_index(instr), -1), UNKNOWN)
        if op == "constant":
            words = (instr.operands[0] if instr.operands else "").strip("{}").replace(",", " ").split()
            try:
                values = [1.0 if w == "true" else 0.0 if w == "false" else float(int(w)) for w in words]
            except ValueError:
                return UNKNOWN
            if SCALAR_INT.match(instr.shape):
                return (values[0],) * 2 if len(values) == 1 else UNKNOWN
            return Vector(values)
        if not SCALAR_INT.match(instr.shape):
            return self._vector(comp, instr, args)
        if op in ("fusion", "call"):
            callee = (called(instr, "calls") or called(instr, "to_apply") or [""])[0]
            root = next((i for i in self.program.computations.get(callee, []) if i.root), None)
            if root is None:
                return UNKNOWN
            return self.value(callee, root.name, self.arguments(comp, instr.operands, args))
        xs = [self.value(comp, o, args) for o in instr.operands]
        if op in ("bitcast", "reshape", "copy", "convert") and xs and isinstance(xs[0], Vector):
            return (xs[0][0],) * 2 if len(xs[0]) == 1 else UNKNOWN
        if op == "reduce" and len(xs) == 2 and isinstance(xs[0], Vector) and xs[1][0] == xs[1][1]:
            return self._reduce(instr, list(xs[0]) + [xs[1][0]])
        if any(isinstance(x, Vector) for x in xs):
            return UNKNOWN
        return interval(op, xs, instr)

    def _reduce(self, instr: Instruction, values: list[float]):
        """A reduce of known values (the vector's and the init) whose combiner is max, min or add (e.g. a causal
        block's `max(q_positions)`), else UNKNOWN."""
        combiner = (called(instr, "to_apply") or [""])[0]
        root = next((i for i in self.program.computations.get(combiner, []) if i.root), None)
        f = {"maximum": max, "minimum": min, "add": sum}.get(root.opcode if root else "")
        return (float(f(values)),) * 2 if f else UNKNOWN

    def _vector(self, comp: str, instr: Instruction, args: tuple):
        """A small 1-D integer array's values (iota, a constant, a slice, a broadcast scalar), else UNKNOWN."""
        op = instr.opcode
        n = int(VECTOR_INT.match(instr.shape).group(1))
        if op == "iota":
            return Vector(float(i) for i in range(n))
        if op in ("fusion", "call"):
            callee = (called(instr, "calls") or called(instr, "to_apply") or [""])[0]
            root = next((i for i in self.program.computations.get(callee, []) if i.root), None)
            return UNKNOWN if root is None else \
                self.value(callee, root.name, self.arguments(comp, instr.operands, args))
        xs = [self.value(comp, o, args) for o in instr.operands]
        if op in ("copy", "bitcast", "reshape", "convert") and isinstance(xs[0], Vector) and len(xs[0]) == n:
            return xs[0]
        if op in ("add", "subtract", "multiply", "minimum", "maximum") and len(xs) == 2 and \
                all(isinstance(x, Vector) and len(x) == n for x in xs):
            f = {"add": lambda a, b: a + b, "subtract": lambda a, b: a - b, "multiply": lambda a, b: a * b,
                 "minimum": min, "maximum": max}[op]
            return Vector(f(a, b) for a, b in zip(*xs))
        if op == "broadcast" and not isinstance(xs[0], Vector) and xs[0][0] == xs[0][1] and \
                attr(instr.attrs, "dimensions") in ("{}", None):
            return Vector([xs[0][0]] * n)
        if op == "slice" and isinstance(xs[0], Vector):
            m = re.match(r"\{\[(\d+):(\d+)(?::(\d+))?\]\}", attr(instr.attrs, "slice") or "")
            if m:
                return Vector(xs[0][int(m.group(1)):int(m.group(2)):int(m.group(3) or 1)])
        if op == "dynamic-slice" and isinstance(xs[0], Vector) and len(xs) == 2 and xs[1][0] == xs[1][1]:
            start = min(max(int(xs[1][0]), 0), len(xs[0]) - n)  # HLO clamps the start into range
            return Vector(xs[0][start:start + n])
        return UNKNOWN

    def arguments(self, comp: str, operands, args: tuple, slots: frozenset | None = None) -> tuple:
        """Known scalar values of a callee's parameters: ((param, tuple index or -1), interval) pairs; slots: only
        those (None: all)."""
        out = []
        for p, name in enumerate(operands):
            instr = self.program.by_name[comp].get(name)
            if instr is None:
                continue
            if instr.shape.startswith("("):
                for k, element in enumerate(split_top(instr.shape[1:-1])):
                    if slots is not None and (p, k) not in slots:
                        continue
                    if is_int(element):
                        v = self.element(comp, name, k, args)
                        if v != UNKNOWN:
                            out.append(((p, k), v))
            elif is_int(instr.shape) and (slots is None or (p, -1) in slots):
                v = self.value(comp, name, args)
                if v != UNKNOWN:
                    out.append(((p, -1), v))
        return tuple(out)
