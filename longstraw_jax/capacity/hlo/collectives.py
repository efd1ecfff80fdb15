"""Bytes one device sends in a collective instruction.

`Cost.collective_bytes[kind]`: bytes one device sends (= receives, for these symmetric patterns) per execution, from
the operand shapes and n = the replica group's size (`replica_groups`, either `{{0,1,..},..}` or iota
`[groups,n]<=[..]`; empty: every device of the module), ring / bandwidth-optimal algorithms:

    all-gather          (n - 1) x operand          = (n - 1)/n of the gathered result
    all-reduce          2 (n - 1)/n x operand      (reduce-scatter then all-gather)
    reduce-scatter      (n - 1)/n x operand        (the operand is the full, unscattered buffer)
    all-to-all          (n - 1)/n x operand
    ragged-all-to-all   (n - 1)/n x output buffer  (an upper bound: the buffer is sized for the worst case)
    collective-permute  operand                    (every device a source; a self-pair sends nothing)
    collective-broadcast operand

Async pairs (`all-gather-start` / `-done`, ...) are counted at their start. A float32 collective whose operand was
converted up from bf16 (XLA:CPU's float normalization runs bf16 collectives in float32, with converts around them)
counts at bf16, what a GPU moves (`widening.collective_narrowing`).
"""
from __future__ import annotations

import re
from collections.abc import Mapping

from longstraw_jax.capacity.hlo.parse import Instruction, attr, shape_bytes

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "ragged-all-to-all",
               "collective-permute", "collective-broadcast")


def group_size(attrs: str, devices: int) -> int:
    """n of a collective: the size of its first replica group (`{{0,1},{2,3}}` or iota `[2,2]<=[4]`); every device
    of the module when the groups are empty or absent."""
    groups = attr(attrs, "replica_groups")
    if groups is None or groups in ("{}", "{{}}"):
        return devices
    if groups.startswith("["):
        dims = [int(d) for d in groups[1:groups.index("]")].split(",")]
        return dims[-1]
    first = re.match(r"\{\{([^}]*)\}", groups)
    return len(first.group(1).split(",")) if first and first.group(1).strip() else devices


def collective_bytes(instr: Instruction, shapes: Mapping[str, str], devices: int) -> tuple[str, float] | None:
    """(kind, bytes one device sends) of a collective instruction (module docstring), else None."""
    kind = instr.opcode.removesuffix("-start")
    if kind not in COLLECTIVES:
        return None
    n = group_size(instr.attrs, devices)
    operand = sum(shape_bytes(shapes[o]) for o in instr.operands if o in shapes)
    if kind == "collective-permute":
        pairs = attr(instr.attrs, "source_target_pairs") or ""
        moved = re.findall(r"\{(\d+),(\d+)\}", pairs)
        return kind, 0.0 if moved and all(a == b for a, b in moved) else shape_bytes(shapes[instr.operands[0]])
    if kind == "collective-broadcast":
        return kind, operand
    if kind == "all-gather":
        return kind, (n - 1) * operand
    if kind == "all-reduce":
        return kind, 2.0 * (n - 1) / n * operand
    if kind == "ragged-all-to-all":  # operands: input, output buffer, offsets / sizes
        return kind, (n - 1) / n * shape_bytes(shapes[instr.operands[1]])
    return kind, (n - 1) / n * operand  # reduce-scatter, all-to-all
