"""Per-device cost of a compiled program, with loop trip counts applied: FLOPs, HBM bytes and collective bytes.

    cost = program_cost(jax.jit(f).lower(...).compile())     # or hlo_cost(compiled.as_text())
    cost.flops, cost.hbm_bytes, cost.collective_bytes        # collective_bytes: {kind: bytes}

XLA's `compiled.cost_analysis()` counts a while loop's body once. This module parses the compiled (post-SPMD, per
device) HLO text instead and walks the computations from ENTRY, multiplying each loop body by its trip count:

* **while**: body x n and condition x (n + 1), n = the `known_trip_count` XLA writes into the while's
  backend_config (every `lax.scan` / `fori_loop` with static bounds has one), else `trip_counts[name]` from the
  caller (keyed by the while instruction's name). A loop with neither is counted once and listed in
  `Cost.unknown_loops`: the totals are then lower bounds, never silently exact.
* **conditional** (`lax.cond` / `switch`): each quantity is the largest over the branches (an upper bound of the
  branch actually taken).
* **call**, **async-start** (`calls=`): their computation, once per execution.
* **fusion**: FLOPs and collectives from inside the fused computation; HBM bytes from the fusion's own operands and
  result (what it reads and writes in memory; its internals live in registers / cache).

Per-device quantities (the HLO is the per-device SPMD program):

* `flops`: dot and convolution only, 2 x (result elements) x (contracted elements), batch dimensions included
  (dot: 2 * batch * M * N * K). Elementwise and reduction arithmetic is not counted (it is what XLA's
  cost_analysis adds on top: small next to the matmuls of a transformer; tests bound the difference).
* `hbm_bytes`: an estimate of memory traffic like XLA's "bytes accessed": the sum, over every executed top-level
  instruction (fusions, custom calls, copies, collectives, un-fused ops; not parameters, tuples,
  get-tuple-element, bitcasts, constants or control flow), of its operand bytes plus its result bytes, with XLA's
  in-place conventions: an operand only sliced (slice, dynamic-slice, gather; through bitcasts) counts the slices
  read, an operand updated in place (operand 0 of dynamic-update-slice / scatter) counts the update read and the
  update written instead of the whole buffer. No cache reuse across instructions is assumed.
* `collective_bytes[kind]`: bytes one device sends (= receives, for these symmetric patterns) per execution, from
  the operand shapes and n = the replica group's size (`replica_groups`, either `{{0,1,..},..}` or iota
  `[groups,n]<=[..]`; empty: every device of the module), ring / bandwidth-optimal algorithms:

      all-gather          (n - 1) x operand          = (n - 1)/n of the gathered result
      all-reduce          2 (n - 1)/n x operand      (reduce-scatter then all-gather)
      reduce-scatter      (n - 1)/n x operand        (the operand is the full, unscattered buffer)
      all-to-all          (n - 1)/n x operand
      ragged-all-to-all   (n - 1)/n x output buffer  (an upper bound: the buffer is sized for the worst case)
      collective-permute  operand                    (every device a source; a self-pair sends nothing)
      collective-broadcast operand

  Async pairs (`all-gather-start` / `-done`, ...) are counted at their start.
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "ragged-all-to-all",
               "collective-permute", "collective-broadcast")

# bytes per element of HLO primitive types (sub-byte types rounded up to whole bytes per element are not used:
# s4 / u4 count half a byte)
_ITEMSIZE = {"pred": 1, "s2": 0.25, "u2": 0.25, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2,
             "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
             "token": 0}
# instructions that move no data themselves (aliases, bookkeeping, control flow whose bodies are walked)
_FREE = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "while", "conditional", "call",
         "after-all", "opt-barrier", "partition-id", "replica-id", "iota", "add-dependency", "domain",
         "async-start", "async-update", "async-done", "all-gather-done", "all-reduce-done",
         "collective-permute-done", "copy-done", "send-done", "recv-done"}
_SLICING = {"slice", "dynamic-slice", "gather"}
_IN_PLACE = {"dynamic-update-slice": 1, "scatter": 2}  # opcode -> index of the update operand (scatter: the first)

_ARRAY = re.compile(r"([a-z]\w*)\[([^\]]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")


@dataclasses.dataclass(frozen=True)
class Cost:
    """Per-device totals of one program execution. collective_bytes: {kind: bytes sent per device} (module
    docstring); unknown_loops: names of while loops counted once for want of a trip count (the totals are then lower
    bounds)."""

    flops: float = 0.0
    hbm_bytes: float = 0.0
    collective_bytes: Mapping[str, float] = dataclasses.field(default_factory=dict)
    unknown_loops: tuple[str, ...] = ()

    @property
    def collective_total(self) -> float:
        return float(sum(self.collective_bytes.values()))

    def scaled(self, k: float) -> "Cost":
        """This cost executed k times."""
        return Cost(self.flops * k, self.hbm_bytes * k, {c: b * k for c, b in self.collective_bytes.items()},
                    self.unknown_loops)

    def __add__(self, other: "Cost") -> "Cost":
        kinds = dict(self.collective_bytes)
        for c, b in other.collective_bytes.items():
            kinds[c] = kinds.get(c, 0.0) + b
        return Cost(self.flops + other.flops, self.hbm_bytes + other.hbm_bytes, kinds,
                    tuple(dict.fromkeys(self.unknown_loops + other.unknown_loops)))

    def as_dict(self) -> dict:
        """JSON-ready: flops, hbm_bytes, collective_bytes (total), collectives ({kind: bytes}), unknown_loops."""
        return dict(flops=self.flops, hbm_bytes=self.hbm_bytes, collective_bytes=self.collective_total,
                    collectives=dict(sorted(self.collective_bytes.items())), unknown_loops=list(self.unknown_loops))


def _maximum(costs: list[Cost]) -> Cost:
    """Each quantity's largest value over `costs` (a conditional's branches)."""
    kinds = {k for c in costs for k in c.collective_bytes}
    return Cost(max(c.flops for c in costs), max(c.hbm_bytes for c in costs),
                {k: max(c.collective_bytes.get(k, 0.0) for c in costs) for k in kinds},
                tuple(dict.fromkeys(u for c in costs for u in c.unknown_loops)))


# ----- parsing ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One HLO instruction: `shape` its result's type text, `operands` the operand names, `attrs` the text after the
    operand list (attributes, metadata, backend_config)."""

    name: str
    shape: str
    opcode: str
    operands: tuple[str, ...]
    attrs: str
    root: bool


def _balanced(text: str, start: int) -> int:
    """Index just past the bracket group opening at text[start] ('(' or '{'), nesting counted."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack = []
    for i in range(start, len(text)):
        ch = text[i]
        if ch in pairs:
            stack.append(pairs[ch])
        elif stack and ch == stack[-1]:
            stack.pop()
            if not stack:
                return i + 1
    raise ValueError(f"unbalanced brackets in HLO: {text[start:start + 200]!r}")


def _split_top(text: str) -> list[str]:
    """`text` split at commas outside brackets."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        parts.append("".join(cur).strip())
    return parts


def parse_instruction(line: str) -> Instruction | None:
    """`[ROOT] %name = TYPE opcode(operands), attrs` -> Instruction; None for other lines."""
    m = _INSTR.match(re.sub(r"/\*.*?\*/", "", line))  # drop /*index=5*/ comments
    if m is None:
        return None
    root, name, rest = bool(m.group(1)), m.group(2), m.group(3)
    end = _balanced(rest, 0) if rest.startswith("(") else rest.index(" ")
    shape, rest = rest[:end], rest[end:].lstrip()
    op = re.match(r"([\w\-]+)\(", rest)
    if op is None:
        return None
    close = _balanced(rest, op.end() - 1)
    operands = tuple(o.split()[-1].lstrip("%") for o in _split_top(rest[op.end():close - 1]) if o)
    return Instruction(name, shape, op.group(1), operands, rest[close:], root)


def parse_module(text: str) -> tuple[dict[str, list[Instruction]], str, int]:
    """HLO module text -> ({computation name: instructions}, the ENTRY computation's name, the module's device
    count: num_partitions x replica_count from the header, 1 when absent)."""
    computations: dict[str, list[Instruction]] = {}
    entry, current = None, None
    devices = 1
    for line in text.splitlines():
        if line.startswith("HloModule"):
            for key in ("num_partitions", "replica_count"):
                m = re.search(rf"{key}=(\d+)", line)
                devices *= int(m.group(1)) if m else 1
            continue
        if current is None:
            m = _HEADER.match(line)
            if m:
                current = m.group(2)
                computations[current] = []
                if m.group(1):
                    entry = current
            continue
        if line.strip() == "}":
            current = None
            continue
        instr = parse_instruction(line)
        if instr is not None:
            computations[current].append(instr)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return computations, entry, devices


def array_shapes(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """Type text (array or tuple) -> [(dtype, dims)] of its arrays; dynamic dims `<=N` count N."""
    out = []
    for dtype, dims in _ARRAY.findall(re.sub(r"/\*.*?\*/", "", shape)):
        if dtype not in _ITEMSIZE:
            continue
        out.append((dtype, tuple(int(d.lstrip("<=")) for d in dims.split(",") if d.strip())))
    return out


def shape_bytes(shape: str) -> float:
    """Bytes of an array or tuple type (layouts `{..}` ignored)."""
    return float(sum(math.prod(dims) * _ITEMSIZE[dtype] for dtype, dims in array_shapes(shape)))


def _attr(attrs: str, key: str) -> str | None:
    """The value of `key=` in an attribute list: a bracket group whole, else up to the next comma."""
    m = re.search(rf"(?:^|[\s,]){re.escape(key)}=", attrs)
    if m is None:
        return None
    i = m.end()
    if i < len(attrs) and attrs[i] in "{[(":
        j = _balanced(attrs, i)
        if attrs[i] == "[" and j < len(attrs) and attrs[j:j + 2] == "<=":  # iota replica groups [a,b]<=[c]..
            k = _balanced(attrs, j + 2)
            t = re.match(r"T\([\d,]*\)", attrs[k:])
            return attrs[i:k + (t.end() if t else 0)]
        return attrs[i:j]
    return re.match(r"[^,\s]*", attrs[i:]).group(0)


def group_size(attrs: str, devices: int) -> int:
    """n of a collective: the size of its first replica group (`{{0,1},{2,3}}` or iota `[2,2]<=[4]`); every device
    of the module when the groups are empty or absent."""
    groups = _attr(attrs, "replica_groups")
    if groups is None or groups in ("{}", "{{}}"):
        return devices
    if groups.startswith("["):
        dims = [int(d) for d in groups[1:groups.index("]")].split(",")]
        return dims[-1]
    first = re.match(r"\{\{([^}]*)\}", groups)
    return len(first.group(1).split(",")) if first and first.group(1).strip() else devices


def trip_count(instr: Instruction) -> int | None:
    """The `known_trip_count` XLA wrote into a while's backend_config, or None."""
    m = re.search(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)"?', instr.attrs)
    return int(m.group(1)) if m else None


def _called(instr: Instruction, key: str) -> list[str]:
    value = _attr(instr.attrs, key)
    if value is None:
        return []
    return [v.strip().lstrip("%") for v in value.strip("{}").split(",") if v.strip()]


# ----- per-instruction quantities ----------------------------------------------------------------------------


def dot_flops(instr: Instruction, shapes: Mapping[str, str]) -> float:
    """2 x result elements x contracted elements of a dot (batch dims are in the result)."""
    result = array_shapes(instr.shape)[0][1]
    lhs = array_shapes(shapes[instr.operands[0]])[0][1]
    dims = _attr(instr.attrs, "lhs_contracting_dims")
    contracted = math.prod(lhs[int(d)] for d in dims.strip("{}").split(",") if d.strip()) if dims else 1
    return 2.0 * math.prod(result) * contracted


def conv_flops(instr: Instruction, shapes: Mapping[str, str]) -> float:
    """2 x output elements x (kernel elements / output features): each output multiplies a window of the kernel's
    spatial size times its (per feature group) input features."""
    out = array_shapes(instr.shape)[0][1]
    kernel = array_shapes(shapes[instr.operands[1]])[0][1]
    labels = _attr(instr.attrs, "dim_labels") or ""
    kernel_labels = labels.split("_")[1].split("->")[0] if "_" in labels else ""
    features = kernel[kernel_labels.index("o")] if "o" in kernel_labels else 1
    return 2.0 * math.prod(out) * math.prod(kernel) / max(features, 1)


def collective_bytes(instr: Instruction, shapes: Mapping[str, str], devices: int) -> tuple[str, float] | None:
    """(kind, bytes one device sends) of a collective instruction (module docstring), else None."""
    kind = instr.opcode.removesuffix("-start")
    if kind not in COLLECTIVES:
        return None
    n = group_size(instr.attrs, devices)
    operand = sum(shape_bytes(shapes[o]) for o in instr.operands if o in shapes)
    if kind == "collective-permute":
        pairs = _attr(instr.attrs, "source_target_pairs") or ""
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


def _operand_reads(computation: list[Instruction]) -> dict[int, float]:
    """A fused computation's parameter index -> bytes it reads of that parameter, where less than the whole: a
    parameter only sliced (through bitcasts) reads its slices; operand 0 of an in-place update reads (and the
    fusion writes) only the update."""
    by_name = {i.name: i for i in computation}
    users: dict[str, list[Instruction]] = {}
    for instr in computation:
        for o in instr.operands:
            users.setdefault(o, []).append(instr)

    def read(name: str) -> float | None:
        total = 0.0
        for user in users.get(name, []):
            if user.opcode == "bitcast":
                sub = read(user.name)
                if sub is None:
                    return None
                total += sub
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
                out[_parameter_index(instr)] = r
    return out


def _parameter_index(instr: Instruction) -> int:
    """The N of `parameter(N)`: the operand text of a parameter instruction is its index."""
    return int(instr.operands[0]) if instr.operands else 0


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


def _memory_bytes(instr: Instruction, shapes: Mapping[str, str], computations) -> float:
    """Bytes a top-level instruction reads and writes (module docstring)."""
    if instr.opcode in _FREE:
        return 0.0
    operand_bytes = [shape_bytes(shapes[o]) if o in shapes else 0.0 for o in instr.operands]
    if instr.opcode == "fusion":
        fused = computations.get((_called(instr, "calls") or [""])[0], [])
        for index, r in _operand_reads(fused).items():
            if index < len(operand_bytes):
                operand_bytes[index] = min(operand_bytes[index], r)
        return sum(operand_bytes) + _written(fused, instr.shape)
    if instr.opcode in _SLICING:
        return shape_bytes(instr.shape) * 2 + sum(operand_bytes[1:])
    if instr.opcode in _IN_PLACE:
        update = operand_bytes[_IN_PLACE[instr.opcode]]
        return 2 * update + sum(b for i, b in enumerate(operand_bytes) if i not in (0, _IN_PLACE[instr.opcode]))
    result = shape_bytes(instr.shape)
    if instr.opcode.endswith("-start"):  # async collective: its result tuple holds (operands, outputs)
        result = max(0.0, result - sum(operand_bytes))
    return sum(operand_bytes) + result


# ----- the walk ----------------------------------------------------------------------------------------------


def hlo_cost(text: str, trip_counts: Mapping[str, int] | None = None) -> Cost:
    """Per-device Cost of one execution of an HLO module's text (`compiled.as_text()`), loops multiplied by their
    trip counts (module docstring). trip_counts: {while instruction name: n} for loops XLA has no
    `known_trip_count` for (overrides it where both exist)."""
    computations, entry, devices = parse_module(text)
    trip_counts = dict(trip_counts or {})
    memo: dict[tuple[str, bool], Cost] = {}

    def walk(name: str, fused: bool) -> Cost:
        """One execution of computation `name`; fused: inside a fusion (no HBM bytes of its own)."""
        if (name, fused) in memo:
            return memo[(name, fused)]
        instrs = computations.get(name, [])
        shapes = {i.name: i.shape for i in instrs}
        flops, hbm, kinds, unknown = 0.0, 0.0, {}, []
        total = Cost()
        for instr in instrs:
            op = instr.opcode
            if op == "dot":
                flops += dot_flops(instr, shapes)
            elif op == "convolution":
                flops += conv_flops(instr, shapes)
            moved = collective_bytes(instr, shapes, devices)
            if moved is not None:
                kinds[moved[0]] = kinds.get(moved[0], 0.0) + moved[1]
            if not fused:
                hbm += _memory_bytes(instr, shapes, computations)
            if op == "while":
                n = trip_counts.get(instr.name, trip_count(instr))
                if n is None:
                    unknown.append(instr.name)
                    n = 1
                body = walk(_called(instr, "body")[0], fused)
                cond = walk(_called(instr, "condition")[0], fused)
                total = total + body.scaled(n) + cond.scaled(n + 1)
            elif op == "conditional":
                branches = _called(instr, "branch_computations") or \
                    _called(instr, "true_computation") + _called(instr, "false_computation")
                total = total + _maximum([walk(b, fused) for b in branches])
            elif op in ("call", "async-start") or (op.endswith("-start") and _called(instr, "calls")):
                for c in _called(instr, "to_apply") + _called(instr, "calls"):
                    total = total + walk(c, fused)
            elif op == "fusion":
                for c in _called(instr, "calls"):
                    inner = walk(c, True)
                    total = total + Cost(inner.flops, 0.0, inner.collective_bytes, inner.unknown_loops)
        memo[(name, fused)] = total + Cost(flops, hbm, kinds, tuple(unknown))
        return memo[(name, fused)]

    return walk(entry, False)


def program_cost(compiled, trip_counts: Mapping[str, int] | None = None) -> Cost:
    """`hlo_cost` of a compiled JAX program (`jax.jit(f).lower(...).compile()`): its per-device HLO."""
    return hlo_cost(compiled.as_text(), trip_counts)


def xla_cost(compiled) -> dict[str, float]:
    """XLA's own `cost_analysis()` (loop bodies counted once): {"flops", "bytes accessed"} of the first device."""
    analysis = compiled.cost_analysis()
    if isinstance(analysis, (list, tuple)):
        analysis = analysis[0]
    return {k: float(analysis.get(k, 0.0)) for k in ("flops", "bytes accessed")}


__all__ = ["COLLECTIVES", "Cost", "array_shapes", "group_size", "hlo_cost", "parse_module", "program_cost",
           "shape_bytes", "trip_count", "xla_cost"]
