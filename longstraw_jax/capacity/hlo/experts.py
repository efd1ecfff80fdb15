"""Routed experts (MoE models), costed as a GPU's grouped matmul would run them (`ExpertModel`) or as compiled.

XLA:CPU has no grouped GEMM, so `ops/moe._grouped_scan` runs every row of a block through each expert in turn (a scan
over the L experts of the device: L times the FLOPs of a GPU's `ragged_dot`, which runs each row through its own
expert), and the gathered exchange (`sharding/experts.py`, `local_experts`) runs the rows of all n devices in fixed
blocks, skipped at run time past the device's own rows but counted here at their bound (a conditional's costliest
branch). The instructions are recognised by the functions in their stack frames (the module's FunctionNames /
StackFrames tables, `parse.stack_functions`): an *expert loop* is a while loop with dots under
`EXPERT_LOOP_FUNCTIONS` (`ops/moe.py:_grouped`: one grouped matmul, forward or backward), an *expert call* a while
loop of `EXPERT_CALL_FUNCTIONS` (`local_experts`: one MoE layer's block loop). Without a model they are counted as
compiled, and `Cost.expert_flops` / `expert_hbm_bytes` say how much of the totals they are (the calls' bytes, or a
bare expert loop's). With `ExpertModel(routed=E, row_fraction=f)` they are costed as a GPU's grouped matmul would
run them, assuming balanced routing (every device's experts receive the same share of the rows):

      FLOPs      compiled expert FLOPs x f / E      (each real row through its own expert once, this device's
                                                     share L / E of the gathered rows; on one device L = E)
      rows       those FLOPs / (2 x out x in x dots per step)      (the rows each grouped matmul multiplies)
      HBM bytes  per grouped matmul: rows x (out + in) x bytes per dot (rows read, results written), plus per call
                 (one MoE layer's experts, all its blocks) the matrices of the experts hit, min(L, rows) of them,
                 once per dot (read, or its gradient written); the call's own traffic (gathering rows into blocks,
                 adding them to their tokens, at every block's bound) is replaced by this
      collectives as compiled (the gathered exchange's all-gather / reduce-scatter of the tokens, about n / k
                 times the rows a GPU's ragged all-to-all sends: an upper bound)

Everything outside the expert loops and calls is unchanged (tests/capacity/test_cost.py: a tiny GLM forward and
gradient and the gathered exchange on 8 devices, against the analytic count). f: padding rows a GPU sends nowhere
(the planner's decode step: 1 / seq, `Planner.expert_model`). min(L, rows) is an upper bound of the experts hit by
few rows (each row a new expert). The decode step vmaps its N branches; the model reads each hit matrix once per call
for all N, as the GPU's grouped matmul does (`ops/moe._shared_weights` merges the N branches' rows into one call).
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping

from longstraw_jax.capacity.hlo.parse import ITEMSIZE, Instruction, array_shapes, called
from longstraw_jax.capacity.hlo.program import Program
from longstraw_jax.capacity.hlo.totals import Cost
from longstraw_jax.capacity.hlo.widening import widened_from

# The routed experts' CPU lowering, recognised by the functions in an instruction's stack frames (the module's
# FileNames / FunctionNames / FileLocations / StackFrames tables), as "file:function" suffixes. `ops/moe.py:_grouped`
# (the backend's grouped matmul) runs it on XLA:CPU as a scan over the experts, each step multiplying every row
# (`_grouped_scan`; its backward `_grouped_scan_bwd`; under autodiff the frames below `_grouped` are not recorded):
# its while loops are *expert loops*. `sharding/experts.py:local_experts` runs the gathered exchange's rows through
# them in fixed blocks: its while loops are *expert calls*.
EXPERT_LOOP_FUNCTIONS = ("ops/moe.py:_grouped",)
EXPERT_CALL_FUNCTIONS = ("sharding/experts.py:local_experts",)


@dataclasses.dataclass(frozen=True)
class ExpertModel:
    """Cost the routed experts as a GPU's grouped matmul instead of as compiled (module docstring). routed:
    E, a MoE layer's routed experts (all devices together); row_fraction: the share of the rows entering the
    experts that are real tokens (the rest padding that a GPU's ragged exchange sends nowhere), in (0, 1]."""

    routed: int
    row_fraction: float = 1.0

    def __post_init__(self):
        if isinstance(self.routed, bool) or not isinstance(self.routed, int) or self.routed < 1:
            raise ValueError(f"ExpertModel.routed {self.routed!r} must be a positive integer (experts per layer)")
        if not 0 < self.row_fraction <= 1:
            raise ValueError(f"ExpertModel.row_fraction {self.row_fraction!r} must be in (0, 1]")


class RoutedExperts:
    """The expert loops and calls of `program` (by the stack frames `frames`, `parse.stack_functions`), and their
    cost: as compiled (`model` None) or as a GPU's grouped matmul (`model`: an ExpertModel)."""

    def __init__(self, program: Program, frames: Mapping[int, tuple[str, ...]], model: ExpertModel | None = None):
        self.program = program
        self.frames = frames
        self.model = model
        self.loops: dict[str, tuple[str, Instruction]] = {}  # expert loops by name, with their computation
        self.in_call = program.reachable([called(i, "body")[0] for instrs in program.computations.values()
                                          for i in instrs if self._expert_call(i)])

    def functions(self, instr: Instruction) -> tuple[str, ...]:
        """"file:function" of `instr`'s stack frame and its callers (empty without stack frames)."""
        m = re.search(r"stack_frame_id=(\d+)", instr.attrs)
        return self.frames.get(int(m.group(1)), ()) if m else ()

    def _in_stack(self, instr: Instruction, names: tuple[str, ...]) -> bool:
        return any(f == n or f.endswith("/" + n) for f in self.functions(instr) for n in names)

    def _expert_loop(self, instr: Instruction) -> bool:
        """A while loop under `EXPERT_LOOP_FUNCTIONS` that multiplies (its body has dots; the lowering's integer
        bookkeeping loops are counted as compiled)."""
        return instr.opcode == "while" and self._in_stack(instr, EXPERT_LOOP_FUNCTIONS) and self._dots(instr) > 0

    def _dots(self, instr: Instruction) -> int:
        """Dot instructions in a while loop's body (fusions and nested calls included)."""
        body = self.program.reachable(called(instr, "body"))
        return sum(i.opcode == "dot" for c in body for i in self.program.computations.get(c, []))

    def _expert_call(self, instr: Instruction) -> bool:
        return instr.opcode == "while" and not self._expert_loop(instr) and \
            self._in_stack(instr, EXPERT_CALL_FUNCTIONS)

    def expert_matrix(self, comp: str, instr: Instruction) -> tuple[int, int, int, float, int]:
        """(L, out, in, bytes per element, dots per step) of an expert loop's expert matrices: the stacked
        weights [..., L, out, in] are the largest array of its carried tuple whose third-last dimension is the
        trip count L (bytes per element: of the bf16 they were widened from, where XLA:CPU converted them to
        float32 first); the dots are those of its body (a forward step multiplies by the matrix, a backward step
        also forms its gradient)."""
        trips = self.program.fixed_trips(instr)
        arrays = array_shapes(instr.shape)
        stacks = [(math.prod(dims), j) for j, (_, dims) in enumerate(arrays) if len(dims) >= 3 and dims[-3] == trips]
        if trips is None or not stacks:
            raise ValueError(f"expert loop {instr.name}: no stacked expert weights [..., L, out, in] with L = its "
                             f"trip count {trips} in its carried tuple {instr.shape[:200]}")
        j = max(stacks)[1]
        dtype, dims = arrays[j]
        itemsize = float(ITEMSIZE[dtype])
        carried = self.program.by_name[comp].get(instr.operands[0])
        if carried is not None and carried.opcode == "tuple" and j < len(carried.operands):
            by_name = self.program.by_name[comp]
            itemsize = widened_from(carried.operands[j], by_name, self.program.computations) or itemsize
        return int(trips), dims[-2], dims[-1], itemsize, self._dots(instr)

    def _weights(self, rows: Mapping[str, float]) -> float:
        """Bytes of the expert matrices one call touches: per expert loop, each dot reads (or writes the gradient
        of) the matrices of the experts its rows hit, min(L, rows) of them (every row a different expert: an upper
        bound for few rows, all L for many)."""
        total = 0.0
        for name, r in rows.items():
            trips, out, in_, itemsize, dots = self.expert_matrix(*self.loops[name])
            total += dots * min(trips, r) * out * in_ * itemsize
        return total

    def _expert_loop_cost(self, comp: str, instr: Instruction, cpu: Cost) -> Cost:
        """An expert loop's cost. As compiled (no ExpertModel): unchanged, its FLOPs marked as the experts' (and
        its bytes, where no expert call encloses it). As a GPU's grouped matmul: FLOPs = compiled x row_fraction /
        E (each real row through its own expert, once, instead of through each of the loop's L experts, the
        gathered exchange's L / E share of the rows being this device's), rows = those FLOPs / (2 x matrix x
        dots), HBM = the rows read and written ((out + in) elements per dot and row) plus, where no expert call
        encloses the loop, the matrices touched (`_weights`); inside one the rows are charged there."""
        inside = comp in self.in_call
        if self.model is None:
            return dataclasses.replace(cpu, expert_flops=cpu.flops, expert_hbm_bytes=0.0 if inside else cpu.hbm_bytes)
        _, out, in_, itemsize, dots = self.expert_matrix(comp, instr)
        flops = cpu.flops * self.model.row_fraction / self.model.routed
        rows = flops / (2.0 * out * in_ * dots)
        hbm = rows * dots * (out + in_) * itemsize
        self.loops[instr.name] = (comp, instr)
        if not inside:
            hbm += self._weights({instr.name: rows})
        return Cost(flops, hbm, cpu.collective_bytes, cpu.unknown_loops, cpu.bounded_loops, flops, hbm,
                    {instr.name: rows} if inside else {})

    def _expert_call_cost(self, cpu: Cost) -> Cost:
        """An expert call's cost (its expert loops already costed). As compiled: its bytes marked as the experts'.
        As a GPU's: its HBM bytes are its expert loops' rows plus the matrices their rows hit in this call
        (`_weights`; the call's own traffic, gathering rows into blocks and adding them to their tokens at every
        block's bound, is not a GPU's and is dropped); FLOPs and collectives as counted."""
        if self.model is None:
            return dataclasses.replace(cpu, expert_hbm_bytes=cpu.hbm_bytes)
        hbm = cpu.expert_hbm_bytes + self._weights(cpu.expert_rows)
        return dataclasses.replace(cpu, hbm_bytes=hbm, expert_hbm_bytes=hbm, expert_rows={})

    def loop_cost(self, comp: str, instr: Instruction, compiled: Cost) -> Cost:
        """The cost of while loop `instr` of `comp` given its cost as compiled: re-costed by `_expert_loop_cost`
        for an expert loop, by `_expert_call_cost` for an expert call, else `compiled` itself."""
        if self._expert_loop(instr):
            return self._expert_loop_cost(comp, instr, compiled)
        if self._expert_call(instr):
            return self._expert_call_cost(compiled)
        return compiled
