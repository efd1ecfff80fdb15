"""Float values XLA:CPU widened from bf16, counted at bf16 (what a GPU program holds and moves).

XLA:CPU's float normalization runs bf16 arithmetic and collectives in float32, with converts around them (convert,
op, convert back). A float32 value converted up from bf16 (through bitcasts, copies, slices, data-moving collectives
and into a fusion's root) counts at the bf16's bytes per element: in the HBM bytes of the instructions that read or
produce it (`narrow_map`, `hbm.memory_bytes`), in a collective's bytes (`collective_narrowing`), and in an expert
loop's stacked weights (`experts.RoutedExperts.expert_matrix`).
"""
from __future__ import annotations

from collections.abc import Mapping

from longstraw_jax.capacity.hlo.parse import ITEMSIZE, Instruction, array_shapes, called


def widened_from(name: str, by_name: Mapping[str, Instruction], computations) -> float | None:
    """Bytes per element of the narrower float a value was converted up from (through bitcasts, copies and into a
    fusion's root), else None. XLA:CPU runs bf16 collectives in float32 (convert, collective, convert back): what a
    GPU moves is the bf16."""
    instr = by_name.get(name)
    passing = ("bitcast", "copy", "fusion", "transpose", "all-gather", "all-to-all", "collective-permute",
               "dynamic-slice", "slice")
    while instr is not None and instr.opcode in passing:
        if instr.opcode == "fusion":
            fused = computations.get((called(instr, "calls") or [""])[0], [])
            by_name = {i.name: i for i in fused}
            instr = next((i for i in fused if i.root), None)
        else:
            instr = by_name.get(instr.operands[0])
    if instr is None or instr.opcode != "convert" or instr.operands[0] not in by_name:
        return None
    (src, _), (dst, _) = array_shapes(by_name[instr.operands[0]].shape)[0], array_shapes(instr.shape)[0]
    floats = ("bf16", "f16", "f32", "f64")
    if src in floats and dst in floats and ITEMSIZE[src] < ITEMSIZE[dst]:
        return float(ITEMSIZE[src])
    return None


def narrow_map(computation: list[Instruction], by_name: Mapping[str, Instruction], computations) -> dict[str, float]:
    """{value name: bytes per element of its bf16 source / its own} for a computation's float values widened from
    bf16 by XLA:CPU (`widened_from`). by_name: the computation's instructions by name."""
    out = {}
    for instr in computation:
        arrays = array_shapes(instr.shape)
        if len(arrays) != 1 or arrays[0][0] not in ("f32", "f64"):
            continue
        source = widened_from(instr.name, by_name, computations)
        if source:
            out[instr.name] = source / ITEMSIZE[arrays[0][0]]
    return out


def collective_narrowing(instr: Instruction, by_name: Mapping[str, Instruction], computations) -> float:
    """A float32 collective of values widened from bf16 (XLA:CPU's float normalization) counts at bf16: the ratio
    of the source's bytes per element to the operand's, else 1. by_name: the instructions of the collective's
    computation by name."""
    operand = by_name.get(instr.operands[0]) if instr.operands else None
    if operand is None:
        return 1.0
    source = widened_from(operand.name, by_name, computations)
    arrays = array_shapes(operand.shape)
    return source / ITEMSIZE[arrays[0][0]] if source and arrays else 1.0
