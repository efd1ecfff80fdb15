"""`Walk`: one execution of an HLO module, walked from ENTRY with every loop body multiplied by its trip count
(XLA's `compiled.cost_analysis()` counts a while loop's body once):

* **while**: body x n and condition x (n + 1), n = `trip_counts[name]` from the caller (keyed by the while
  instruction's name) if given, else the `known_trip_count` XLA writes into the while's backend_config (every
  `lax.scan` / `fori_loop` with static bounds has one), else n is found by running the loop's scalar control: the
  carried integer scalars (and small integer vectors, e.g. a scan's `arange` xs) are evaluated from the loop's
  initial tuple, as intervals (`values.Scalars`), the condition is evaluated, the body's root tuple advances them,
  until the condition is false (a flash-attention loop over the key blocks a round can see: its bound is a function
  of the outer round index, so every outer iteration is walked with its own values). Where the condition depends on
  data but its bound does not (`i < min(num_blocks, f(data))`, or `(i < f(data)) & (i < num_blocks)`), the loop
  runs to the bound: counted there and listed in `Cost.bounded_loops` (those totals are upper bounds). A loop with
  no bound at all is counted once and listed in `Cost.unknown_loops`: the totals are then lower bounds, never
  silently exact. Each walk of a computation is cached by the values of the parameter slots it can read
  (`relevance.Relevance.relevant`: those reaching a simulated loop's condition or carried state, a conditional's
  predicate, a callee's relevant slots), and a simulated loop tracks only those slots of its state: a layer loop
  whose block loops are bounded by the round index alone is walked once per round, not once per round and layer
  (`hlo_cost(..., project=False)`: every walk keyed by all known values, the brute force the tests compare with).
  Routed experts' loops are re-costed by `experts.RoutedExperts`, with a `kernels.Kernels` the XLA paths'
  softmax attention, chunked GDN and sparse latent attention loops by `kernels.FlashKernels` (as the Pallas kernels
  would run them).
* **conditional** (`lax.cond` / `switch`): the branch taken where the predicate / index evaluates (as above), else
  each quantity is the largest over the branches (an upper bound of the branch actually taken).
* **call**, **async-start** (`calls=`): their computation, once per execution.
* **fusion**: FLOPs and collectives from inside the fused computation; HBM bytes from the fusion's own operands and
  result (what it reads and writes in memory; its internals live in registers / cache).

Each instruction's own quantities: `flops.py`, `hbm.py`, `collectives.py` (bf16 widened by XLA:CPU: `widening.py`).
"""
from __future__ import annotations

from collections.abc import Mapping

from longstraw_jax.capacity.hlo.collectives import collective_bytes
from longstraw_jax.capacity.hlo.experts import ExpertModel, RoutedExperts
from longstraw_jax.capacity.hlo.flops import conv_flops, dot_flops, gemm_flops
from longstraw_jax.capacity.hlo.hbm import memory_bytes
from longstraw_jax.capacity.hlo.kernels import FlashKernels, KernelModel, Kernels
from longstraw_jax.capacity.hlo.parse import Instruction, called, stack_functions
from longstraw_jax.capacity.hlo.program import Program
from longstraw_jax.capacity.hlo.relevance import Relevance
from longstraw_jax.capacity.hlo.totals import Cost, maximum
from longstraw_jax.capacity.hlo.values import Scalars
from longstraw_jax.capacity.hlo.widening import collective_narrowing, narrow_map

MAX_SIMULATED_TRIPS = 1 << 16  # a simulated loop still running after this many trips counts as unbounded


class Walk:
    """The walk of `hlo_cost` over an HLO module's text (module docstring): `walk(program.entry, False)` is the
    Cost of one execution. trip_counts: {while instruction name: n} (overrides XLA's known trip counts); experts:
    how to cost the routed experts (`ExpertModel`; None: as compiled); project: False keys every walk by all its
    known arguments (the brute-force reference of the relevance caching); kernels: cost the kernels' loops as the
    Pallas kernels (`Kernels`, or a `KernelModel` for softmax attention alone; None: as compiled)."""

    def __init__(self, text: str, trip_counts: Mapping[str, float], experts: ExpertModel | None = None,
                 project: bool = True, kernels: Kernels | KernelModel | None = None):
        self.program = Program(text, trip_counts)
        self.project = project
        self.scalars = Scalars(self.program)
        self.relevance = Relevance(self.program)
        frames = stack_functions(text)
        self.experts = RoutedExperts(self.program, frames, experts)
        self.kernels = FlashKernels(self.program, frames, kernels)
        self._static: dict[tuple[str, bool], Cost] = {}
        self._walks: dict[tuple, Cost] = {}

    def static(self, comp: str, fused: bool) -> Cost:
        """Cost of `comp`'s instructions other than control flow (fusions: FLOPs from inside)."""
        key = (comp, fused)
        if key not in self._static:
            instrs = self.program.computations.get(comp, [])
            shapes = {i.name: i.shape for i in instrs}
            flops, hbm, kinds = 0.0, 0.0, {}
            narrow = {} if fused else narrow_map(instrs, self.program.by_name[comp], self.program.computations)
            for instr in instrs:
                if instr.opcode == "dot":
                    flops += dot_flops(instr, shapes)
                elif instr.opcode == "custom-call":
                    flops += gemm_flops(instr, shapes)
                elif instr.opcode == "convolution":
                    flops += conv_flops(instr, shapes)
                elif instr.opcode == "fusion":
                    for c in called(instr, "calls"):
                        inner = self.static(c, True)
                        flops += inner.flops
                        for k, b in inner.collective_bytes.items():
                            kinds[k] = kinds.get(k, 0.0) + b
                moved = collective_bytes(instr, shapes, self.program.devices)
                if moved is not None:
                    narrowing = collective_narrowing(instr, self.program.by_name[comp], self.program.computations)
                    kinds[moved[0]] = kinds.get(moved[0], 0.0) + moved[1] * narrowing
                if not fused:
                    hbm += memory_bytes(instr, shapes, self.program.computations, narrow)
            self._static[key] = Cost(flops, hbm, kinds)
        return self._static[key]

    def walk(self, comp: str, fused: bool, args: tuple = ()) -> Cost:
        """One execution of `comp` given its known scalar parameter values."""
        if not self.program.dynamic(comp):
            args = ()
        elif self.project:
            relevant = self.relevance.relevant(comp)
            args = tuple(a for a in args if a[0] in relevant)
        key = (comp, fused, args)
        if key not in self._walks:
            total = self.static(comp, fused)
            for instr in self.program.computations.get(comp, []):
                if instr.opcode == "while":
                    total = total + self._loop(comp, instr, fused, args)
                elif instr.opcode == "conditional":
                    total = total + self._conditional(comp, instr, fused, args)
                else:
                    for c in self.program.control_calls(instr):
                        total = total + self.walk(c, fused, self._args(c, comp, instr.operands, args))
            self._walks[key] = total
        return self._walks[key]

    def _args(self, callee: str, comp: str, operands, args: tuple) -> tuple:
        """`Scalars.arguments`, evaluated only when the callee needs them."""
        if not self.program.dynamic(callee):
            return ()
        slots = self.relevance.relevant(callee) if self.project else None
        return self.scalars.arguments(comp, operands, args, slots)

    def _conditional(self, comp: str, instr: Instruction, fused: bool, args: tuple) -> Cost:
        """The branch taken when the predicate / index is known, else each quantity's maximum over the branches.
        Branch b's operand is the conditional's operand 1 + b (true / false: branches 0 / 1)."""
        branches = self.program.control_calls(instr)
        index = self.scalars.value(comp, instr.operands[0], args)
        cost = lambda b: self.walk(branches[b], fused, self._args(branches[b], comp, [instr.operands[1 + b]], args))
        if index[0] != index[1]:
            return maximum([cost(b) for b in range(len(branches))])
        i = int(index[0])
        if called(instr, "true_computation"):
            return cost(0 if i else 1)
        return cost(i if 0 <= i < len(branches) else len(branches) - 1)

    def _loop(self, comp: str, instr: Instruction, fused: bool, args: tuple) -> Cost:
        """`_loop_cost`, routed experts re-costed by `RoutedExperts.loop_cost`, the kernels' loops by
        `FlashKernels.loop_cost`."""
        return self.kernels.loop_cost(instr, self.experts.loop_cost(comp, instr, self._loop_cost(comp, instr, fused,
                                                                                                  args)))

    def _loop_cost(self, comp: str, instr: Instruction, fused: bool, args: tuple) -> Cost:
        """A while loop: body x trips + condition x (trips + 1). Trips: the caller's override, XLA's known trip
        count, else simulated from the carried scalars (exact, or an upper bound where the condition's value is
        uncertain: the loop is then listed in `bounded_loops`), else unknown (counted once, `unknown_loops`)."""
        body, cond = called(instr, "body")[0], called(instr, "condition")[0]
        fixed = self.program.fixed_trips(instr)
        if fixed is not None and not self.program.dynamic(body):
            return self.walk(body, fused).scaled(fixed) + self.walk(cond, fused).scaled(fixed + 1)
        slots = frozenset((0, k) for k in self.relevance.loop_slots(comp, instr)) if self.project else None
        state = self.scalars.arguments(comp, instr.operands[:1], args, slots)
        root = next(i for i in self.program.computations[body] if i.root)
        cond_root = next(i for i in self.program.computations[cond] if i.root)
        total, trips, bounded = Cost(), 0, False
        while True:
            if fixed is not None:
                if trips >= fixed:
                    break
            else:
                go = self.scalars.value(cond, cond_root.name, state)
                if go == (0.0, 0.0):
                    break
                if trips >= MAX_SIMULATED_TRIPS or go[0] < 0:  # not a truth value, or no bound in sight
                    once = total if trips else self.walk(body, fused, state)
                    return once + Cost(unknown_loops=(instr.name,))
                bounded = bounded or go != (1.0, 1.0)
            total = total + self.walk(body, fused, state)
            trips += 1
            state = self.scalars.arguments(body, [root.name], state, slots) if root.opcode == "tuple" else ()
        total = total + self.walk(cond, fused).scaled(trips + 1)
        return total + Cost(bounded_loops=(instr.name,)) if bounded else total
