"""`Relevance`: which parameter slots of a computation its walk can read, so that `walk.Walk` caches each walk by
those values alone and a simulated loop tracks only those slots of its carried state. A slot is (parameter index,
tuple index or -1 for a non-tuple parameter)."""
from __future__ import annotations

from longstraw_jax.capacity.hlo.intervals import is_int
from longstraw_jax.capacity.hlo.parse import Instruction, attr, called, parameter_index
from longstraw_jax.capacity.hlo.program import Program


class Relevance:
    """The relevance analysis of `program`'s scalar data flow, cached per computation, instruction and loop."""

    def __init__(self, program: Program):
        self.program = program
        self._reads: dict[tuple, frozenset] = {}
        self._relevant: dict[str, frozenset] = {}
        self._loop_slots: dict[tuple[str, str], frozenset] = {}

    def relevant(self, comp: str) -> frozenset:
        """The parameter slots (param, tuple index or -1) whose values a walk of `comp` can read: those reaching a
        loop's condition or carried state that the walk simulates, a conditional's predicate, or a dynamic callee's
        relevant slots. A walk's Cost is a function of these values alone, so `Walk.walk` caches it by them (e.g. a
        layer loop's body is walked once per round, not once per layer, when only the round index bounds its
        block loops). Empty for a computation that is not `dynamic` (walked without arguments)."""
        if comp not in self._relevant:
            self._relevant[comp] = frozenset()  # recursion guard (HLO computations do not recurse)
            out: set = set()
            if self.program.dynamic(comp):
                for instr in self.program.computations.get(comp, []):
                    out |= self._sink_reads(comp, instr)
            self._relevant[comp] = frozenset(out)
        return self._relevant[comp]

    def _sink_reads(self, comp: str, instr: Instruction) -> set:
        """The slots of `comp` that `Walk.walk` reads for control-flow instruction `instr` (`relevant`)."""
        op, out = instr.opcode, set()
        if op == "while":
            body = called(instr, "body")[0]
            if self.program.fixed_trips(instr) is None or self.program.dynamic(body):
                for k in self.loop_slots(comp, instr):
                    out |= self._slot_reads(comp, instr.operands[0], k)
        elif op == "conditional":
            out |= self.reads(comp, instr.operands[0])
            for b, branch in enumerate(self.program.control_calls(instr)):
                out |= self._callee_reads(comp, branch, [instr.operands[1 + b]])
        else:
            for callee in self.program.control_calls(instr):
                out |= self._callee_reads(comp, callee, instr.operands)
        return out

    def _callee_reads(self, comp: str, callee: str, operands) -> set:
        """Slots of `comp` that the relevant slots of `callee` (called with `operands`) read."""
        out = set()
        if self.program.dynamic(callee):
            for p, k in self.relevant(callee):
                if p < len(operands):
                    out |= self._slot_reads(comp, operands[p], k)
        return out

    def loop_slots(self, comp: str, instr: Instruction) -> frozenset:
        """Tuple indices (or -1 for an array state) of a while loop's carried state that `Walk._loop_cost` tracks: those
        its condition reads (where it is evaluated), those its body's walk reads, and, to a fixpoint, those the body
        computes them from."""
        key = (comp, instr.name)
        if key not in self._loop_slots:
            body, cond = called(instr, "body")[0], called(instr, "condition")[0]
            wanted = set(k for _, k in self.relevant(body))
            if self.program.fixed_trips(instr) is None:
                root = next(i for i in self.program.computations[cond] if i.root)
                wanted |= set(k for _, k in self.reads(cond, root.name))
            root = next(i for i in self.program.computations[body] if i.root)
            todo = list(wanted)
            while todo:
                k = todo.pop()
                for _, j in self._slot_reads(body, root.name, k) if root.opcode == "tuple" else ():
                    if j not in wanted:
                        wanted.add(j)
                        todo.append(j)
            self._loop_slots[key] = frozenset(wanted)
        return self._loop_slots[key]

    def _slot_reads(self, comp: str, name: str, k: int) -> frozenset:
        """Slots read by `Scalars.element(comp, name, k)` (k >= 0) or `Scalars.value(comp, name)` (k = -1)."""
        if k < 0:
            return self.reads(comp, name)
        instr = self.program.by_name[comp].get(name)
        if instr is None:
            return frozenset()
        if instr.opcode == "tuple" and k < len(instr.operands):
            return self.reads(comp, instr.operands[k])
        if instr.opcode == "parameter":
            return frozenset([(parameter_index(instr), k)])
        return frozenset()

    def reads(self, comp: str, name: str) -> frozenset:
        """The parameter slots `Scalars.value(comp, name, ...)` reads (an over-approximation of what it depends
        on), following `Scalars._value`'s cases."""
        key = (comp, name)
        if key in self._reads:
            return self._reads[key]
        self._reads[key] = frozenset()  # recursion guard
        instr = self.program.by_name[comp].get(name)
        out: frozenset = frozenset()
        if instr is None:
            pass
        elif instr.opcode == "get-tuple-element":
            out = self._slot_reads(comp, instr.operands[0], int(attr(instr.attrs, "index")))
        elif not is_int(instr.shape) or instr.opcode in ("constant", "iota"):
            pass
        elif instr.opcode == "parameter":
            out = frozenset([(parameter_index(instr), -1)])
        elif instr.opcode in ("fusion", "call"):
            callee = (called(instr, "calls") or called(instr, "to_apply") or [""])[0]
            root = next((i for i in self.program.computations.get(callee, []) if i.root), None)
            if root is not None:
                out = frozenset().union(*(self._slot_reads(comp, instr.operands[p], k)
                                          for p, k in self.reads(callee, root.name) if p < len(instr.operands)))
        else:
            out = frozenset().union(*(self.reads(comp, o) for o in instr.operands))
        self._reads[key] = out
        return out
