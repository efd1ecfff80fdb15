"""HBM bytes one top-level instruction reads and writes, per device (the HLO is the per-device SPMD program).

`Cost.hbm_bytes`: an estimate of memory traffic like XLA's "bytes accessed": the sum, over every executed top-level
instruction (fusions, custom calls, copies, collectives, un-fused ops; not parameters, tuples, get-tuple-element,
bitcasts, constants or control flow), of its operand bytes plus its result bytes, with XLA's in-place conventions:
an operand only sliced (slice, dynamic-slice, gather; through bitcasts) counts the slices read, an operand updated
in place (operand 0 of dynamic-update-slice / scatter) counts the update read and the update written instead of the
whole buffer. A fusion counts its own operands and result (what it reads and writes in memory; its internals live
in registers / cache). No cache reuse across instructions is assumed. Float32 values that XLA:CPU widened from bf16
(its float normalization: convert, op, convert back) count at bf16, what a GPU program holds (`widening.py`);
XLA:CPU's unfused attention still writes its score blocks to memory (an overestimate against a GPU's fused
attention).
"""
from __future__ import annotations

from collections.abc import Mapping

from longstraw_jax.capacity.hlo.parse import ITEMSIZE, Instruction, array_shapes, called, parameter_index, shape_bytes

# instructions that move no data themselves (aliases, bookkeeping, control flow whose bodies are walked)
_FREE = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "while", "conditional", "call",
         "after-all", "opt-barrier", "partition-id", "replica-id", "iota", "add-dependency", "domain",
         "async-start", "async-update", "async-done", "all-gather-done", "all-reduce-done",
         "collective-permute-done", "copy-done", "send-done", "recv-done"}
_SLICING = {"slice", "dynamic-slice", "gather"}
_IN_PLACE = {"dynamic-update-slice": 1, "scatter": 2}  # opcode -> index of the update operand (scatter: the first)


def _operand_reads(computation: list[Instruction]) -> dict[int, float]:
    """A fused computation's parameter index -> bytes it reads of that parameter, where less than the whole: a
    parameter only sliced (through bitcasts, copies and converts: a fusion computes the elements its slice needs)
    reads its slices; operand 0 of an in-place update reads (and the fusion writes) only the update."""
    by_name = {i.name: i for i in computation}
    users: dict[str, list[Instruction]] = {}
    for instr in computation:
        for o in instr.operands:
            users.setdefault(o, []).append(instr)
    itemsize = lambda shape: ITEMSIZE[array_shapes(shape)[0][0]] if array_shapes(shape) else 1

    def read(name: str) -> float | None:
        """Bytes read of `name`'s value, in its own element type."""
        total = 0.0
        for user in users.get(name, []):
            if user.opcode in ("bitcast", "copy", "convert") and len(user.operands) == 1:
                sub = read(user.name)
                if sub is None:
                    return None
                total += sub * itemsize(by_name[name].shape) / max(itemsize(user.shape), 1e-9)
            elif user.opcode in _SLICING and user.operands[0] == name:
                total += shape_bytes(user.shape)
            elif user.opcode in _IN_PLACE and user.operands[0] == name:
                total += shape_bytes(by_name[user.operands[_IN_PLACE[user.opcode]]].shape)
            else:
                return None
        return total

    out = {}
    for instr in computation:
        if instr.opcode == "parameter":
            r = read(instr.name)
            if r is not None:
                out[parameter_index(instr)] = r
    return out


def _written(computation: list[Instruction], result: str) -> float:
    """Bytes a fused computation writes: its root's, except an in-place update writes only its update (per tuple
    element)."""
    by_name = {i.name: i for i in computation}
    root = next((i for i in computation if i.root), None)
    if root is None:
        return shape_bytes(result)

    def written(instr: Instruction) -> float:
        if instr.opcode == "bitcast":
            return written(by_name[instr.operands[0]]) if instr.operands[0] in by_name else shape_bytes(instr.shape)
        if instr.opcode == "tuple":
            return sum(written(by_name[o]) for o in instr.operands if o in by_name)
        if instr.opcode in _IN_PLACE:
            return shape_bytes(by_name[instr.operands[_IN_PLACE[instr.opcode]]].shape)
        return shape_bytes(instr.shape)

    return written(root)


def memory_bytes(instr: Instruction, shapes: Mapping[str, str], computations,
                 narrow: Mapping[str, float] | None = None) -> float:
    """Bytes a top-level instruction reads and writes (module docstring). narrow: {value name: factor} for values
    XLA:CPU widened from bf16 (counted at bf16: `widening.narrow_map`), the instruction's own result included."""
    if instr.opcode in _FREE:
        return 0.0
    narrow = narrow or {}
    operand_bytes = [shape_bytes(shapes[o]) * narrow.get(o, 1.0) if o in shapes else 0.0 for o in instr.operands]
    own = narrow.get(instr.name, 1.0)
    if instr.opcode == "fusion":
        fused = computations.get((called(instr, "calls") or [""])[0], [])
        for index, r in _operand_reads(fused).items():
            if index < len(operand_bytes):
                operand_bytes[index] = min(operand_bytes[index], r)
        return sum(operand_bytes) + _written(fused, instr.shape) * own
    if instr.opcode in _SLICING:
        return shape_bytes(instr.shape) * 2 * own + sum(operand_bytes[1:])
    if instr.opcode in _IN_PLACE:
        update = operand_bytes[_IN_PLACE[instr.opcode]]
        return 2 * update + sum(b for i, b in enumerate(operand_bytes) if i not in (0, _IN_PLACE[instr.opcode]))
    result = shape_bytes(instr.shape)
    if instr.opcode.endswith("-start"):  # async collective: its result tuple holds (operands, outputs)
        result = max(0.0, result - sum(shape_bytes(shapes[o]) for o in instr.operands if o in shapes))
    return sum(operand_bytes) + result * own
