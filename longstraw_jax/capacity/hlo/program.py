"""`Program`: a parsed HLO module and its call structure: which computations an instruction runs, which loops have a
fixed trip count, which computations need the values of their parameters to be costed (`dynamic`)."""
from __future__ import annotations

from collections.abc import Mapping

from longstraw_jax.capacity.hlo.parse import Instruction, called, parse_module, trip_count


class Program:
    """An HLO module's computations ({name: instructions}, `by_name`: {name: {instruction name: instruction}}), its
    ENTRY computation and its device count (`parse_module`), with the caller's trip counts ({while instruction
    name: n}, overriding XLA's `known_trip_count`)."""

    def __init__(self, text: str, trip_counts: Mapping[str, float]):
        self.computations, self.entry, self.devices = parse_module(text)
        self.by_name = {c: {i.name: i for i in instrs} for c, instrs in self.computations.items()}
        self.trip_counts = trip_counts
        self._dynamic: dict[str, bool] = {}

    def fixed_trips(self, instr: Instruction) -> float | None:
        """A while loop's trip count when known without running it: the caller's, else XLA's, else None."""
        return self.trip_counts.get(instr.name, trip_count(instr))

    @staticmethod
    def control_calls(instr: Instruction) -> list[str]:
        """The computations a control-flow instruction runs: a while's body and condition, a conditional's branches
        (in branch order; true, false for a predicate), a call's or an async start's callee. Fusions are not control
        flow (their computation is named by `called(instr, "calls")`)."""
        op = instr.opcode
        if op == "while":
            return called(instr, "body") + called(instr, "condition")
        if op == "conditional":
            return called(instr, "branch_computations") or \
                called(instr, "true_computation") + called(instr, "false_computation")
        if op in ("call", "async-start") or (op.endswith("-start") and called(instr, "calls")):
            return called(instr, "to_apply") + called(instr, "calls")
        return []

    def dynamic(self, comp: str) -> bool:
        """Whether costing `comp` needs the values of its parameters: a while loop in it, or in a computation it
        runs, has no fixed trip count."""
        if comp not in self._dynamic:
            self._dynamic[comp] = False  # recursion guard
            out = False
            for instr in self.computations.get(comp, []):
                if instr.opcode == "while" and self.fixed_trips(instr) is None:
                    out = True
                out = out or any(self.dynamic(c) for c in self.control_calls(instr))
            self._dynamic[comp] = out
        return self._dynamic[comp]

    def reachable(self, roots: list[str]) -> set[str]:
        """The computations `roots` call, transitively (control flow and fusions), roots included."""
        seen, todo = set(), list(roots)
        while todo:
            comp = todo.pop()
            if comp in seen:
                continue
            seen.add(comp)
            for instr in self.computations.get(comp, []):
                todo += self.control_calls(instr) + called(instr, "calls")
        return seen
