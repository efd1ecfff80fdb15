"""Per-device cost of a compiled program, with loop trip counts applied: FLOPs, HBM bytes and collective bytes.

    cost = program_cost(jax.jit(f).lower(...).compile())     # or hlo_cost(compiled.as_text())
    cost.flops, cost.hbm_bytes, cost.collective_bytes        # collective_bytes: {kind: bytes}

XLA's `compiled.cost_analysis()` counts a while loop's body once. This module parses the compiled (post-SPMD, per
device) HLO text instead and walks the computations from ENTRY, multiplying each loop body by its trip count:

* **while**: body x n and condition x (n + 1), n = `trip_counts[name]` from the caller (keyed by the while
  instruction's name) if given, else the `known_trip_count` XLA writes into the while's backend_config (every
  `lax.scan` / `fori_loop` with static bounds has one), else n is found by running the loop's scalar control: the
  carried integer scalars (and small integer vectors, e.g. a scan's `arange` xs) are evaluated from the loop's
  initial tuple, as intervals, the condition is evaluated, the body's root tuple advances them, until the condition
  is false (a flash-attention loop over the key blocks a round can see: its bound is a function of the outer
  round index, so every outer iteration is walked with its own values). Where the condition depends on data but its
  bound does not (`i < min(num_blocks, f(data))`, or `(i < f(data)) & (i < num_blocks)`), the loop runs to the
  bound: counted there and listed in `Cost.bounded_loops` (those totals are upper bounds). A loop with no bound at
  all is counted once and listed in `Cost.unknown_loops`: the totals are then lower bounds, never silently exact.
  Each walk of a computation is cached by the values of the parameter slots it can read (`_Module.relevant`: those
  reaching a simulated loop's condition or carried state, a conditional's predicate, a callee's relevant slots),
  and a simulated loop tracks only those slots of its state: a layer loop whose block loops are bounded by the
  round index alone is walked once per round, not once per round and layer (`hlo_cost(..., project=False)`: every
  walk keyed by all known values, the brute force the tests compare with).
* **conditional** (`lax.cond` / `switch`): the branch taken where the predicate / index evaluates (as above), else
  each quantity is the largest over the branches (an upper bound of the branch actually taken).
* **call**, **async-start** (`calls=`): their computation, once per execution.
* **fusion**: FLOPs and collectives from inside the fused computation; HBM bytes from the fusion's own operands and
  result (what it reads and writes in memory; its internals live in registers / cache).

Per-device quantities (the HLO is the per-device SPMD program):

* `flops`: dot, convolution and cuBLAS GEMM custom calls (XLA:GPU's dots) only, 2 x (result elements) x
  (contracted elements), batch dimensions included (dot: 2 * batch * M * N * K); other custom calls (e.g. fused
  attention kernels) count none. Elementwise and reduction arithmetic is not counted (it is what XLA's
  cost_analysis adds on top: small next to the matmuls of a transformer; tests bound the difference).
* `hbm_bytes`: an estimate of memory traffic like XLA's "bytes accessed": the sum, over every executed top-level
  instruction (fusions, custom calls, copies, collectives, un-fused ops; not parameters, tuples,
  get-tuple-element, bitcasts, constants or control flow), of its operand bytes plus its result bytes, with XLA's
  in-place conventions: an operand only sliced (slice, dynamic-slice, gather; through bitcasts) counts the slices
  read, an operand updated in place (operand 0 of dynamic-update-slice / scatter) counts the update read and the
  update written instead of the whole buffer. No cache reuse across instructions is assumed. Float32 values that
  XLA:CPU widened from bf16 (its float normalization: convert, op, convert back) count at bf16, what a GPU program
  holds; XLA:CPU's unfused attention still writes its score blocks to memory (an overestimate against a GPU's
  fused attention).
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

  Async pairs (`all-gather-start` / `-done`, ...) are counted at their start. A float32 collective whose operand
  was converted up from bf16 (XLA:CPU's float normalization runs bf16 collectives in float32, with converts around
  them) counts at bf16, what a GPU moves.

**Routed experts** (`ExpertModel`; MoE models). XLA:CPU has no grouped GEMM, so `ops/moe._grouped_scan` runs every
row of a block through each expert in turn (a scan over the L experts of the device: L times the FLOPs of a GPU's
`ragged_dot`, which runs each row through its own expert), and the gathered exchange (`sharding/experts.py`,
`local_experts`) runs the rows of all n devices in fixed blocks, skipped at run time past the device's own rows but
counted here at their bound (a conditional's costliest branch). The instructions are recognised by the functions in
their stack frames (the module's FunctionNames / StackFrames tables, `stack_functions`): an *expert loop* is a
while loop with dots under `EXPERT_LOOP_FUNCTIONS` (`ops/moe.py:_grouped`: one grouped matmul, forward or
backward), an *expert call* a while loop of `EXPERT_CALL_FUNCTIONS` (`local_experts`: one MoE layer's block loop).
Without a model they are counted as compiled, and
`Cost.expert_flops` / `expert_hbm_bytes` say how much of the totals they are (the calls' bytes, or a bare expert
loop's). With `ExpertModel(routed=E, row_fraction=f)` they are costed as a GPU's grouped matmul would run them,
assuming balanced routing (every device's experts receive the same share of the rows):

      FLOPs      compiled expert FLOPs x f / E      (each real row through its own expert once, this device's
                                                     share L / E of the gathered rows; on one device L = E)
      rows       those FLOPs / (2 x out x in x dots per step)      (the rows each grouped matmul multiplies)
      HBM bytes  per grouped matmul: rows x (out + in) x bytes per dot (rows read, results written), plus per call
                 (one MoE layer's experts, all its blocks) the matrices of the experts hit, min(L, rows) of them,
                 once per dot (read, or its gradient written); the call's own traffic (gathering rows into blocks,
                 adding them to their tokens, at every block's bound) is replaced by this
      collectives as compiled (the gathered exchange's all-gather / reduce-scatter of the tokens, about n / k
                 times the rows a GPU's ragged all-to-all sends: an upper bound)

Everything outside the expert loops and calls is unchanged (tests/capacity/test_cost.py: a tiny GLM forward and gradient
and the gathered exchange on 8 devices, against the analytic count). f: padding rows a GPU sends nowhere (the planner's
decode step: 1 / seq, `Planner.expert_model`). min(L, rows) is an upper bound of the experts hit by few rows (each
row a new expert). The decode step vmaps its N branches and XLA:CPU broadcasts the expert matrices to them
(`ops/moe._broadcast_batched`); the model reads each hit matrix once per call for all N.
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "ragged-all-to-all",
               "collective-permute", "collective-broadcast")

# bytes per element of HLO primitive types (sub-byte types count their fraction: s4 / u4 half a byte)
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

# The routed experts' CPU lowering, recognised by the functions in an instruction's stack frames (the module's
# FileNames / FunctionNames / FileLocations / StackFrames tables), as "file:function" suffixes. `ops/moe.py:_grouped`
# (the backend's grouped matmul) runs it on XLA:CPU as a scan over the experts, each step multiplying every row
# (`_grouped_scan`; its backward `_grouped_scan_bwd`; under autodiff the frames below `_grouped` are not recorded):
# its while loops are *expert loops*. `sharding/experts.py:local_experts` runs the gathered exchange's rows through
# them in fixed blocks: its while loops are *expert calls*.
EXPERT_LOOP_FUNCTIONS = ("ops/moe.py:_grouped",)
EXPERT_CALL_FUNCTIONS = ("sharding/experts.py:local_experts",)

_ARRAY = re.compile(r"([a-z]\w*)\[([^\]]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")


@dataclasses.dataclass(frozen=True)
class Cost:
    """Per-device totals of one program execution. collective_bytes: {kind: bytes sent per device} (module
    docstring); unknown_loops: names of while loops counted once for want of a trip count (the totals are then lower
    bounds); bounded_loops: names of data-dependent loops counted at their bound (upper bounds for those)."""

    flops: float = 0.0
    hbm_bytes: float = 0.0
    collective_bytes: Mapping[str, float] = dataclasses.field(default_factory=dict)
    unknown_loops: tuple[str, ...] = ()
    bounded_loops: tuple[str, ...] = ()
    expert_flops: float = 0.0       # the routed experts' part of flops (module docstring, "Routed experts")
    expert_hbm_bytes: float = 0.0   # ... and of hbm_bytes
    expert_rows: Mapping[str, float] = dataclasses.field(default_factory=dict)  # internal: rows per expert loop
    # whose weight reads are charged at the enclosing expert call (`ExpertModel`)

    @property
    def collective_total(self) -> float:
        return float(sum(self.collective_bytes.values()))

    def scaled(self, k: float) -> "Cost":
        """This cost executed k times."""
        return Cost(self.flops * k, self.hbm_bytes * k, {c: b * k for c, b in self.collective_bytes.items()},
                    self.unknown_loops, self.bounded_loops, self.expert_flops * k, self.expert_hbm_bytes * k,
                    {n: r * k for n, r in self.expert_rows.items()})

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(self.flops + other.flops, self.hbm_bytes + other.hbm_bytes,
                    _merge(self.collective_bytes, other.collective_bytes, combine=sum),
                    tuple(dict.fromkeys(self.unknown_loops + other.unknown_loops)),
                    tuple(dict.fromkeys(self.bounded_loops + other.bounded_loops)),
                    self.expert_flops + other.expert_flops, self.expert_hbm_bytes + other.expert_hbm_bytes,
                    _merge(self.expert_rows, other.expert_rows, combine=sum))

    def as_dict(self) -> dict:
        """JSON-ready: flops, hbm_bytes, collective_bytes (total), collectives ({kind: bytes}), unknown_loops,
        bounded_loops, expert_flops, expert_hbm_bytes."""
        return dict(flops=self.flops, hbm_bytes=self.hbm_bytes, collective_bytes=self.collective_total,
                    collectives=dict(sorted(self.collective_bytes.items())), unknown_loops=list(self.unknown_loops),
                    bounded_loops=list(self.bounded_loops), expert_flops=self.expert_flops,
                    expert_hbm_bytes=self.expert_hbm_bytes)


@dataclasses.dataclass(frozen=True)
class ExpertModel:
    """Cost the routed experts as a GPU's grouped matmul instead of as compiled (module docstring, "Routed
    experts"). routed: E, a MoE layer's routed experts (all devices together); row_fraction: the share of the rows
    entering the experts that are real tokens (the rest padding that a GPU's ragged exchange sends nowhere), in
    (0, 1]."""

    routed: int
    row_fraction: float = 1.0

    def __post_init__(self):
        if isinstance(self.routed, bool) or not isinstance(self.routed, int) or self.routed < 1:
            raise ValueError(f"ExpertModel.routed {self.routed!r} must be a positive integer (experts per layer)")
        if not 0 < self.row_fraction <= 1:
            raise ValueError(f"ExpertModel.row_fraction {self.row_fraction!r} must be in (0, 1]")


def _merge(*maps, combine) -> dict:
    """{key: combine(the maps' values for key, 0 where absent)}."""
    return {k: combine([m.get(k, 0.0) for m in maps]) for k in dict.fromkeys(k for m in maps for k in m)}


def _maximum(costs: list[Cost]) -> Cost:
    """Each quantity's largest value over `costs` (a conditional's branches)."""
    return Cost(max(c.flops for c in costs), max(c.hbm_bytes for c in costs),
                _merge(*(c.collective_bytes for c in costs), combine=max),
                tuple(dict.fromkeys(u for c in costs for u in c.unknown_loops)),
                tuple(dict.fromkeys(u for c in costs for u in c.bounded_loops)),
                max(c.expert_flops for c in costs), max(c.expert_hbm_bytes for c in costs),
                _merge(*(c.expert_rows for c in costs), combine=max))


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
    """Index just past the bracket group opening at text[start] ('(', '{' or '['), nesting counted."""
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
    inside = rest[op.end():close - 1]
    if op.group(1) == "constant":  # the literal, whole: 3, true, {0, 1, 2}
        operands = (inside.strip(),)
    else:
        operands = tuple(o.split()[-1].lstrip("%") for o in _split_top(inside) if o)
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


def stack_functions(text: str) -> dict[int, tuple[str, ...]]:
    """{stack_frame_id: "file:function" of that frame and its callers, innermost first} from an HLO module's
    FileNames / FunctionNames / FileLocations / StackFrames tables (XLA prints them before the computations; a
    frame's `parent_frame_id` is its caller's id + 1, 0 for none). Empty when the text has no tables."""
    tables: dict[str, dict[int, str]] = {"FileNames": {}, "FunctionNames": {}, "FileLocations": {}, "StackFrames": {}}
    section = None
    for line in text.splitlines():
        if line in tables:
            section = line
            continue
        m = re.match(r"^(\d+) (.*)$", line)
        if m is None:
            if _HEADER.match(line):
                break  # the computations start
            section = None if not line.strip() or section is None else section
            continue
        if section is not None:
            tables[section][int(m.group(1))] = m.group(2)
    field = lambda text, key: int(re.search(rf"{key}=(\d+)", text).group(1))
    name = {i: v.strip('"') for i, v in tables["FunctionNames"].items()}
    file = {i: v.strip('"') for i, v in tables["FileNames"].items()}
    location = {i: f'{file.get(field(v, "file_name_id"), "")}:{name.get(field(v, "function_name_id"), "")}'
                for i, v in tables["FileLocations"].items()}
    frames = {i: (location.get(field(v, "file_location_id"), ""), field(v, "parent_frame_id") - 1)
              for i, v in tables["StackFrames"].items()}
    out: dict[int, tuple[str, ...]] = {}

    def stack(i: int) -> tuple[str, ...]:
        if i not in out:
            out[i] = ()  # recursion guard
            function, parent = frames[i]
            out[i] = (function,) + (stack(parent) if parent in frames else ())
        return out[i]

    for i in frames:
        stack(i)
    return out


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


def gemm_flops(instr: Instruction, shapes: Mapping[str, str]) -> float:
    """A GPU library GEMM (`custom-call` to `__cublas$gemm` / `__cublas$lt$matmul`, as XLA:GPU rewrites dots):
    2 x output elements x contracted elements, the contraction from its backend_config's dot_dimension_numbers;
    0 for any other custom call (their FLOPs are not counted)."""
    target = _attr(instr.attrs, "custom_call_target") or ""
    if "cublas" not in target or not instr.operands:
        return 0.0
    m = re.search(r'"lhs_contracting_dimensions"\s*:\s*\[([^\]]*)\]', instr.attrs)
    lhs = array_shapes(shapes.get(instr.operands[0], ""))
    if m is None or not lhs:
        return 0.0
    contracted = math.prod(lhs[0][1][int(d.strip().strip('"'))] for d in m.group(1).split(",") if d.strip())
    return 2.0 * math.prod(array_shapes(instr.shape)[0][1]) * contracted  # the output (a tuple's first: + workspace)


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


def _widened_from(name: str, by_name: Mapping[str, Instruction], computations) -> float | None:
    """Bytes per element of the narrower float a value was converted up from (through bitcasts, copies and into a
    fusion's root), else None. XLA:CPU runs bf16 collectives in float32 (convert, collective, convert back): what a
    GPU moves is the bf16."""
    instr = by_name.get(name)
    passing = ("bitcast", "copy", "fusion", "transpose", "all-gather", "all-to-all", "collective-permute",
               "dynamic-slice", "slice")
    while instr is not None and instr.opcode in passing:
        if instr.opcode == "fusion":
            fused = computations.get((_called(instr, "calls") or [""])[0], [])
            by_name = {i.name: i for i in fused}
            instr = next((i for i in fused if i.root), None)
        else:
            instr = by_name.get(instr.operands[0])
    if instr is None or instr.opcode != "convert" or instr.operands[0] not in by_name:
        return None
    (src, _), (dst, _) = array_shapes(by_name[instr.operands[0]].shape)[0], array_shapes(instr.shape)[0]
    floats = ("bf16", "f16", "f32", "f64")
    if src in floats and dst in floats and _ITEMSIZE[src] < _ITEMSIZE[dst]:
        return float(_ITEMSIZE[src])
    return None


def _operand_reads(computation: list[Instruction]) -> dict[int, float]:
    """A fused computation's parameter index -> bytes it reads of that parameter, where less than the whole: a
    parameter only sliced (through bitcasts, copies and converts: a fusion computes the elements its slice needs)
    reads its slices; operand 0 of an in-place update reads (and the fusion writes) only the update."""
    by_name = {i.name: i for i in computation}
    users: dict[str, list[Instruction]] = {}
    for instr in computation:
        for o in instr.operands:
            users.setdefault(o, []).append(instr)
    itemsize = lambda shape: _ITEMSIZE[array_shapes(shape)[0][0]] if array_shapes(shape) else 1

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


def _memory_bytes(instr: Instruction, shapes: Mapping[str, str], computations,
                  narrow: Mapping[str, float] | None = None) -> float:
    """Bytes a top-level instruction reads and writes (module docstring). narrow: {value name: factor} for values
    XLA:CPU widened from bf16 (counted at bf16: `_widened_from`), the instruction's own result included."""
    if instr.opcode in _FREE:
        return 0.0
    narrow = narrow or {}
    operand_bytes = [shape_bytes(shapes[o]) * narrow.get(o, 1.0) if o in shapes else 0.0 for o in instr.operands]
    own = narrow.get(instr.name, 1.0)
    if instr.opcode == "fusion":
        fused = computations.get((_called(instr, "calls") or [""])[0], [])
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


# ----- scalar evaluation: loop bounds that XLA did not fold into a known trip count ------------------------------

INF = math.inf
UNKNOWN = (-INF, INF)
MAX_SIMULATED_TRIPS = 1 << 16
_SCALAR_INT = re.compile(r"^(pred|[su]\d+)\[\]")
_VECTOR_INT = re.compile(r"^(?:pred|[su]\d+)\[(\d+)\]")  # small 1-D integer arrays (e.g. a scan's xs = arange)
MAX_VECTOR = 4096


class _Vector(tuple):
    """The known values of a small 1-D integer array (a scan over `jnp.arange(n)` indexes one per iteration)."""


def _is_int(shape: str) -> bool:
    m = _VECTOR_INT.match(shape)
    return bool(_SCALAR_INT.match(shape)) or bool(m and int(m.group(1)) <= MAX_VECTOR)


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


def _interval(op: str, xs: list[tuple[float, float]], instr: Instruction) -> tuple[float, float]:
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
        direction = _attr(instr.attrs, "direction")
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


class _Module:
    """A parsed HLO module and the walk of `hlo_cost` over it (module docstring)."""

    def __init__(self, text: str, trip_counts: Mapping[str, float], experts: ExpertModel | None = None,
                 project: bool = True):
        self.computations, self.entry, self.devices = parse_module(text)
        self.project = project  # False: every walk keyed by all its known arguments (the brute-force reference)
        self.by_name = {c: {i.name: i for i in instrs} for c, instrs in self.computations.items()}
        self.trip_counts = trip_counts
        self.experts = experts
        self.loops: dict[str, tuple[str, Instruction]] = {}  # expert loops by name, with their computation
        self.frames = stack_functions(text)
        self.in_call = self._reachable([_called(i, "body")[0] for instrs in self.computations.values()
                                        for i in instrs if self._expert_call(i)])
        self._static: dict[tuple[str, bool], Cost] = {}
        self._dynamic: dict[str, bool] = {}
        self._walks: dict[tuple, Cost] = {}
        self._values: dict[tuple, tuple[float, float]] = {}
        self._reads: dict[tuple, frozenset] = {}
        self._relevant: dict[str, frozenset] = {}
        self._loop_slots: dict[tuple[str, str], frozenset] = {}

    # -- which computations need the values of their parameters (a loop below has no known trip count)

    def dynamic(self, comp: str) -> bool:
        if comp not in self._dynamic:
            self._dynamic[comp] = False  # recursion guard
            out = False
            for instr in self.computations.get(comp, []):
                if instr.opcode == "while" and self._fixed_trips(instr) is None:
                    out = True
                out = out or any(self.dynamic(c) for c in self._control_calls(instr))
            self._dynamic[comp] = out
        return self._dynamic[comp]

    def _fixed_trips(self, instr: Instruction) -> float | None:
        return self.trip_counts.get(instr.name, trip_count(instr))

    @staticmethod
    def _control_calls(instr: Instruction) -> list[str]:
        op = instr.opcode
        if op == "while":
            return _called(instr, "body") + _called(instr, "condition")
        if op == "conditional":
            return _called(instr, "branch_computations") or \
                _called(instr, "true_computation") + _called(instr, "false_computation")
        if op in ("call", "async-start") or (op.endswith("-start") and _called(instr, "calls")):
            return _called(instr, "to_apply") + _called(instr, "calls")
        return []

    # -- which parameter slots a walk reads: walks are cached by those values only

    def relevant(self, comp: str) -> frozenset:
        """The parameter slots (param, tuple index or -1) whose values a walk of `comp` can read: those reaching a
        loop's condition or carried state that the walk simulates, a conditional's predicate, or a dynamic callee's
        relevant slots. A walk's Cost is a function of these values alone, so `walk` caches it by them (e.g. a
        layer loop's body is walked once per round, not once per layer, when only the round index bounds its
        block loops). Empty for a computation that is not `dynamic` (walked without arguments)."""
        if comp not in self._relevant:
            self._relevant[comp] = frozenset()  # recursion guard (HLO computations do not recurse)
            out: set = set()
            if self.dynamic(comp):
                for instr in self.computations.get(comp, []):
                    out |= self._sink_reads(comp, instr)
            self._relevant[comp] = frozenset(out)
        return self._relevant[comp]

    def _sink_reads(self, comp: str, instr: Instruction) -> set:
        """The slots of `comp` that `walk` reads for control-flow instruction `instr` (`relevant`)."""
        op, out = instr.opcode, set()
        if op == "while":
            body = _called(instr, "body")[0]
            if self._fixed_trips(instr) is None or self.dynamic(body):
                for k in self.loop_slots(comp, instr):
                    out |= self._slot_reads(comp, instr.operands[0], k)
        elif op == "conditional":
            out |= self.reads(comp, instr.operands[0])
            for b, branch in enumerate(self._control_calls(instr)):
                out |= self._callee_reads(comp, branch, [instr.operands[1 + b]])
        else:
            for callee in self._control_calls(instr):
                out |= self._callee_reads(comp, callee, instr.operands)
        return out

    def _callee_reads(self, comp: str, callee: str, operands) -> set:
        """Slots of `comp` that the relevant slots of `callee` (called with `operands`) read."""
        out = set()
        if self.dynamic(callee):
            for p, k in self.relevant(callee):
                if p < len(operands):
                    out |= self._slot_reads(comp, operands[p], k)
        return out

    def loop_slots(self, comp: str, instr: Instruction) -> frozenset:
        """Tuple indices (or -1 for an array state) of a while loop's carried state that `_loop_cost` tracks: those
        its condition reads (where it is evaluated), those its body's walk reads, and, to a fixpoint, those the body
        computes them from."""
        key = (comp, instr.name)
        if key not in self._loop_slots:
            body, cond = _called(instr, "body")[0], _called(instr, "condition")[0]
            wanted = set(k for _, k in self.relevant(body))
            if self._fixed_trips(instr) is None:
                root = next(i for i in self.computations[cond] if i.root)
                wanted |= set(k for _, k in self.reads(cond, root.name))
            root = next(i for i in self.computations[body] if i.root)
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
        """Slots read by `element(comp, name, k)` (k >= 0) or `value(comp, name)` (k = -1)."""
        if k < 0:
            return self.reads(comp, name)
        instr = self.by_name[comp].get(name)
        if instr is None:
            return frozenset()
        if instr.opcode == "tuple" and k < len(instr.operands):
            return self.reads(comp, instr.operands[k])
        if instr.opcode == "parameter":
            return frozenset([(_parameter_index(instr), k)])
        return frozenset()

    def reads(self, comp: str, name: str) -> frozenset:
        """The parameter slots `value(comp, name, ...)` reads (an over-approximation of what it depends on),
        following `_value`'s cases."""
        key = (comp, name)
        if key in self._reads:
            return self._reads[key]
        self._reads[key] = frozenset()  # recursion guard
        instr = self.by_name[comp].get(name)
        out: frozenset = frozenset()
        if instr is None:
            pass
        elif instr.opcode == "get-tuple-element":
            out = self._slot_reads(comp, instr.operands[0], int(_attr(instr.attrs, "index")))
        elif not _is_int(instr.shape) or instr.opcode in ("constant", "iota"):
            pass
        elif instr.opcode == "parameter":
            out = frozenset([(_parameter_index(instr), -1)])
        elif instr.opcode in ("fusion", "call"):
            callee = (_called(instr, "calls") or _called(instr, "to_apply") or [""])[0]
            root = next((i for i in self.computations.get(callee, []) if i.root), None)
            if root is not None:
                out = frozenset().union(*(self._slot_reads(comp, instr.operands[p], k)
                                          for p, k in self.reads(callee, root.name) if p < len(instr.operands)))
        else:
            out = frozenset().union(*(self.reads(comp, o) for o in instr.operands))
        self._reads[key] = out
        return out

    # -- scalar values (intervals) of instructions, given known parameter values `args`

    def value(self, comp: str, name: str, args: tuple) -> tuple[float, float]:
        """Interval of scalar instruction `name` of `comp`; args: ((param, tuple index or -1), interval) pairs."""
        key = (comp, name, args)
        if key in self._values:
            return self._values[key]
        self._values[key] = UNKNOWN  # recursion guard
        instr = self.by_name[comp].get(name)
        out = UNKNOWN if instr is None else self._value(comp, instr, args)
        self._values[key] = out
        return out

    def element(self, comp: str, name: str, index: int, args: tuple) -> tuple[float, float]:
        """Interval of element `index` of tuple-valued instruction `name`."""
        instr = self.by_name[comp].get(name)
        if instr is None:
            return UNKNOWN
        if instr.opcode == "tuple" and index < len(instr.operands):
            return self.value(comp, instr.operands[index], args)
        if instr.opcode == "parameter":
            return dict(args).get((_parameter_index(instr), index), UNKNOWN)
        return UNKNOWN

    def _value(self, comp: str, instr: Instruction, args: tuple):
        op = instr.opcode
        if op == "get-tuple-element":
            return self.element(comp, instr.operands[0], int(_attr(instr.attrs, "index")), args)
        if not _is_int(instr.shape):
            return UNKNOWN
        if op == "parameter":
            return dict(args).get((_parameter_index(instr), -1), UNKNOWN)
        if op == "constant":
            words = (instr.operands[0] if instr.operands else "").strip("{}").replace(",", " ").split()
            try:
                values = [1.0 if w == "true" else 0.0 if w == "false" else float(int(w)) for w in words]
            except ValueError:
                return UNKNOWN
            if _SCALAR_INT.match(instr.shape):
                return (values[0],) * 2 if len(values) == 1 else UNKNOWN
            return _Vector(values)
        if not _SCALAR_INT.match(instr.shape):
            return self._vector(comp, instr, args)
        if op in ("fusion", "call"):
            callee = (_called(instr, "calls") or _called(instr, "to_apply") or [""])[0]
            root = next((i for i in self.computations.get(callee, []) if i.root), None)
            if root is None:
                return UNKNOWN
            return self.value(callee, root.name, self.arguments(comp, instr.operands, args))
        xs = [self.value(comp, o, args) for o in instr.operands]
        if op in ("bitcast", "reshape", "copy", "convert") and xs and isinstance(xs[0], _Vector):
            return (xs[0][0],) * 2 if len(xs[0]) == 1 else UNKNOWN
        if op == "reduce" and len(xs) == 2 and isinstance(xs[0], _Vector) and xs[1][0] == xs[1][1]:
            return self._reduce(instr, list(xs[0]) + [xs[1][0]])
        if any(isinstance(x, _Vector) for x in xs):
            return UNKNOWN
        return _interval(op, xs, instr)

    def _reduce(self, instr: Instruction, values: list[float]):
        """A reduce of known values (the vector's and the init) whose combiner is max, min or add (e.g. a causal
        block's `max(q_positions)`), else UNKNOWN."""
        combiner = (_called(instr, "to_apply") or [""])[0]
        root = next((i for i in self.computations.get(combiner, []) if i.root), None)
        f = {"maximum": max, "minimum": min, "add": sum}.get(root.opcode if root else "")
        return (float(f(values)),) * 2 if f else UNKNOWN

    def _vector(self, comp: str, instr: Instruction, args: tuple):
        """A small 1-D integer array's values (iota, a constant, a slice, a broadcast scalar), else UNKNOWN."""
        op = instr.opcode
        n = int(_VECTOR_INT.match(instr.shape).group(1))
        if op == "iota":
            return _Vector(float(i) for i in range(n))
        if op in ("fusion", "call"):
            callee = (_called(instr, "calls") or _called(instr, "to_apply") or [""])[0]
            root = next((i for i in self.computations.get(callee, []) if i.root), None)
            return UNKNOWN if root is None else \
                self.value(callee, root.name, self.arguments(comp, instr.operands, args))
        xs = [self.value(comp, o, args) for o in instr.operands]
        if op in ("copy", "bitcast", "reshape", "convert") and isinstance(xs[0], _Vector) and len(xs[0]) == n:
            return xs[0]
        if op in ("add", "subtract", "multiply", "minimum", "maximum") and len(xs) == 2 and \
                all(isinstance(x, _Vector) and len(x) == n for x in xs):
            f = {"add": lambda a, b: a + b, "subtract": lambda a, b: a - b, "multiply": lambda a, b: a * b,
                 "minimum": min, "maximum": max}[op]
            return _Vector(f(a, b) for a, b in zip(*xs))
        if op == "broadcast" and not isinstance(xs[0], _Vector) and xs[0][0] == xs[0][1] and \
                _attr(instr.attrs, "dimensions") in ("{}", None):
            return _Vector([xs[0][0]] * n)
        if op == "slice" and isinstance(xs[0], _Vector):
            m = re.match(r"\{\[(\d+):(\d+)(?::(\d+))?\]\}", _attr(instr.attrs, "slice") or "")
            if m:
                return _Vector(xs[0][int(m.group(1)):int(m.group(2)):int(m.group(3) or 1)])
        if op == "dynamic-slice" and isinstance(xs[0], _Vector) and len(xs) == 2 and xs[1][0] == xs[1][1]:
            start = min(max(int(xs[1][0]), 0), len(xs[0]) - n)  # HLO clamps the start into range
            return _Vector(xs[0][start:start + n])
        return UNKNOWN

    def arguments(self, comp: str, operands, args: tuple, slots: frozenset | None = None) -> tuple:
        """Known scalar values of a callee's parameters: ((param, tuple index or -1), interval) pairs; slots: only
        those (None: all)."""
        out = []
        for p, name in enumerate(operands):
            instr = self.by_name[comp].get(name)
            if instr is None:
                continue
            if instr.shape.startswith("("):
                for k, element in enumerate(_split_top(instr.shape[1:-1])):
                    if slots is not None and (p, k) not in slots:
                        continue
                    if _is_int(element):
                        v = self.element(comp, name, k, args)
                        if v != UNKNOWN:
                            out.append(((p, k), v))
            elif _is_int(instr.shape) and (slots is None or (p, -1) in slots):
                v = self.value(comp, name, args)
                if v != UNKNOWN:
                    out.append(((p, -1), v))
        return tuple(out)

    # -- costs

    def static(self, comp: str, fused: bool) -> Cost:
        """Cost of `comp`'s instructions other than control flow (fusions: FLOPs from inside)."""
        key = (comp, fused)
        if key not in self._static:
            instrs = self.computations.get(comp, [])
            shapes = {i.name: i.shape for i in instrs}
            flops, hbm, kinds = 0.0, 0.0, {}
            narrow = {} if fused else self._narrow_map(comp)
            for instr in instrs:
                if instr.opcode == "dot":
                    flops += dot_flops(instr, shapes)
                elif instr.opcode == "custom-call":
                    flops += gemm_flops(instr, shapes)
                elif instr.opcode == "convolution":
                    flops += conv_flops(instr, shapes)
                elif instr.opcode == "fusion":
                    for c in _called(instr, "calls"):
                        inner = self.static(c, True)
                        flops += inner.flops
                        for k, b in inner.collective_bytes.items():
                            kinds[k] = kinds.get(k, 0.0) + b
                moved = collective_bytes(instr, shapes, self.devices)
                if moved is not None:
                    kinds[moved[0]] = kinds.get(moved[0], 0.0) + moved[1] * self._narrowing(comp, instr)
                if not fused:
                    hbm += _memory_bytes(instr, shapes, self.computations, narrow)
            self._static[key] = Cost(flops, hbm, kinds)
        return self._static[key]

    def _narrow_map(self, comp: str) -> dict[str, float]:
        """{value name: bytes per element of its bf16 source / its own} for `comp`'s float values widened from bf16
        by XLA:CPU (`_widened_from`)."""
        out = {}
        by_name = self.by_name[comp]
        for instr in self.computations.get(comp, []):
            arrays = array_shapes(instr.shape)
            if len(arrays) != 1 or arrays[0][0] not in ("f32", "f64"):
                continue
            source = _widened_from(instr.name, by_name, self.computations)
            if source:
                out[instr.name] = source / _ITEMSIZE[arrays[0][0]]
        return out

    def _narrowing(self, comp: str, instr: Instruction) -> float:
        """A float32 collective of values widened from bf16 (XLA:CPU's float normalization) counts at bf16: the ratio
        of the source's bytes per element to the operand's, else 1."""
        operand = self.by_name[comp].get(instr.operands[0]) if instr.operands else None
        if operand is None:
            return 1.0
        source = _widened_from(operand.name, self.by_name[comp], self.computations)
        arrays = array_shapes(operand.shape)
        return source / _ITEMSIZE[arrays[0][0]] if source and arrays else 1.0

    def walk(self, comp: str, fused: bool, args: tuple = ()) -> Cost:
        """One execution of `comp` given its known scalar parameter values."""
        if not self.dynamic(comp):
            args = ()
        elif self.project:
            relevant = self.relevant(comp)
            args = tuple(a for a in args if a[0] in relevant)
        key = (comp, fused, args)
        if key not in self._walks:
            total = self.static(comp, fused)
            for instr in self.computations.get(comp, []):
                if instr.opcode == "while":
                    total = total + self._loop(comp, instr, fused, args)
                elif instr.opcode == "conditional":
                    total = total + self._conditional(comp, instr, fused, args)
                else:
                    for c in self._control_calls(instr):
                        total = total + self.walk(c, fused, self._args(c, comp, instr.operands, args))
            self._walks[key] = total
        return self._walks[key]

    def _args(self, callee: str, comp: str, operands, args: tuple) -> tuple:
        """`arguments`, evaluated only when the callee needs them."""
        if not self.dynamic(callee):
            return ()
        return self.arguments(comp, operands, args, self.relevant(callee) if self.project else None)

    def _conditional(self, comp: str, instr: Instruction, fused: bool, args: tuple) -> Cost:
        """The branch taken when the predicate / index is known, else each quantity's maximum over the branches.
        Branch b's operand is the conditional's operand 1 + b (true / false: branches 0 / 1)."""
        branches = self._control_calls(instr)
        index = self.value(comp, instr.operands[0], args)
        cost = lambda b: self.walk(branches[b], fused, self._args(branches[b], comp, [instr.operands[1 + b]], args))
        if index[0] != index[1]:
            return _maximum([cost(b) for b in range(len(branches))])
        i = int(index[0])
        if _called(instr, "true_computation"):
            return cost(0 if i else 1)
        return cost(i if 0 <= i < len(branches) else len(branches) - 1)

    # -- routed experts (module docstring, "Routed experts")

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
        body = self._reachable(_called(instr, "body"))
        return sum(i.opcode == "dot" for c in body for i in self.computations.get(c, []))

    def _expert_call(self, instr: Instruction) -> bool:
        return instr.opcode == "while" and not self._expert_loop(instr) and \
            self._in_stack(instr, EXPERT_CALL_FUNCTIONS)

    def _reachable(self, roots: list[str]) -> set[str]:
        """The computations `roots` call, transitively (control flow and fusions), roots included."""
        seen, todo = set(), list(roots)
        while todo:
            comp = todo.pop()
            if comp in seen:
                continue
            seen.add(comp)
            for instr in self.computations.get(comp, []):
                todo += self._control_calls(instr) + _called(instr, "calls")
        return seen

    def expert_matrix(self, comp: str, instr: Instruction) -> tuple[int, int, int, float, int]:
        """(L, out, in, bytes per element, dots per step) of an expert loop's expert matrices: the stacked
        weights [..., L, out, in] are the largest array of its carried tuple whose third-last dimension is the
        trip count L (bytes per element: of the bf16 they were widened from, where XLA:CPU converted them to
        float32 first); the dots are those of its body (a forward step multiplies by the matrix, a backward step
        also forms its gradient)."""
        trips = self._fixed_trips(instr)
        arrays = array_shapes(instr.shape)
        stacks = [(math.prod(dims), j) for j, (_, dims) in enumerate(arrays) if len(dims) >= 3 and dims[-3] == trips]
        if trips is None or not stacks:
            raise ValueError(f"expert loop {instr.name}: no stacked expert weights [..., L, out, in] with L = its "
                             f"trip count {trips} in its carried tuple {instr.shape[:200]}")
        j = max(stacks)[1]
        dtype, dims = arrays[j]
        itemsize = float(_ITEMSIZE[dtype])
        carried = self.by_name[comp].get(instr.operands[0])
        if carried is not None and carried.opcode == "tuple" and j < len(carried.operands):
            itemsize = _widened_from(carried.operands[j], self.by_name[comp], self.computations) or itemsize
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
        if self.experts is None:
            return dataclasses.replace(cpu, expert_flops=cpu.flops, expert_hbm_bytes=0.0 if inside else cpu.hbm_bytes)
        _, out, in_, itemsize, dots = self.expert_matrix(comp, instr)
        flops = cpu.flops * self.experts.row_fraction / self.experts.routed
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
        if self.experts is None:
            return dataclasses.replace(cpu, expert_hbm_bytes=cpu.hbm_bytes)
        hbm = cpu.expert_hbm_bytes + self._weights(cpu.expert_rows)
        return dataclasses.replace(cpu, hbm_bytes=hbm, expert_hbm_bytes=hbm, expert_rows={})

    def _loop(self, comp: str, instr: Instruction, fused: bool, args: tuple) -> Cost:
        """`_loop_cost`, routed experts costed by `_expert_loop_cost` / `_expert_call_cost`."""
        cost = self._loop_cost(comp, instr, fused, args)
        if self._expert_loop(instr):
            return self._expert_loop_cost(comp, instr, cost)
        if self._expert_call(instr):
            return self._expert_call_cost(cost)
        return cost

    def _loop_cost(self, comp: str, instr: Instruction, fused: bool, args: tuple) -> Cost:
        """A while loop: body x trips + condition x (trips + 1). Trips: the caller's override, XLA's known trip
        count, else simulated from the carried scalars (exact, or an upper bound where the condition's value is
        uncertain: the loop is then listed in `bounded_loops`), else unknown (counted once, `unknown_loops`)."""
        body, cond = _called(instr, "body")[0], _called(instr, "condition")[0]
        fixed = self._fixed_trips(instr)
        if fixed is not None and not self.dynamic(body):
            return self.walk(body, fused).scaled(fixed) + self.walk(cond, fused).scaled(fixed + 1)
        slots = frozenset((0, k) for k in self.loop_slots(comp, instr)) if self.project else None
        state = self.arguments(comp, instr.operands[:1], args, slots)
        root = next(i for i in self.computations[body] if i.root)
        cond_root = next(i for i in self.computations[cond] if i.root)
        total, trips, bounded = Cost(), 0, False
        while True:
            if fixed is not None:
                if trips >= fixed:
                    break
            else:
                go = self.value(cond, cond_root.name, state)
                if go == (0.0, 0.0):
                    break
                if trips >= MAX_SIMULATED_TRIPS or go[0] < 0:  # not a truth value, or no bound in sight
                    once = total if trips else self.walk(body, fused, state)
                    return once + Cost(unknown_loops=(instr.name,))
                bounded = bounded or go != (1.0, 1.0)
            total = total + self.walk(body, fused, state)
            trips += 1
            state = self.arguments(body, [root.name], state, slots) if root.opcode == "tuple" else ()
        total = total + self.walk(cond, fused).scaled(trips + 1)
        return total + Cost(bounded_loops=(instr.name,)) if bounded else total


def hlo_cost(text: str, trip_counts: Mapping[str, float] | None = None, experts: ExpertModel | None = None,
             project: bool = True) -> Cost:
    """Per-device Cost of one execution of an HLO module's text (`compiled.as_text()`), loops multiplied by their
    trip counts (module docstring). trip_counts: {while instruction name: n} for loops XLA has no
    `known_trip_count` for (overrides it where both exist; for a body without data-dependent loops of its own, a
    mean over the enclosing loops' iterations gives exact totals). experts: cost the routed experts as a GPU's
    grouped matmul (`ExpertModel`); None: as compiled (`Cost.expert_flops` / `expert_hbm_bytes` still say how much
    of the totals they are). project: False keys every walk by all known scalar values (the brute-force reference
    of the relevance caching, module docstring; same totals, slower)."""
    module = _Module(text, dict(trip_counts or {}), experts, project)
    cost = module.walk(module.entry, False)
    if cost.expert_rows:  # every expert loop inside a call is charged by that call: never reached
        raise ValueError(f"expert loops {sorted(cost.expert_rows)} were not charged by an expert call")
    return cost


def program_cost(compiled, trip_counts: Mapping[str, int] | None = None, experts: ExpertModel | None = None) -> Cost:
    """`hlo_cost` of a compiled JAX program (`jax.jit(f).lower(...).compile()`): its per-device HLO."""
    return hlo_cost(compiled.as_text(), trip_counts, experts)


def xla_cost(compiled) -> dict[str, float]:
    """XLA's own `cost_analysis()` (loop bodies counted once): {"flops", "bytes accessed"} of the first device."""
    analysis = compiled.cost_analysis()
    if isinstance(analysis, (list, tuple)):
        analysis = analysis[0]
    return {k: float(analysis.get(k, 0.0)) for k in ("flops", "bytes accessed")}


__all__ = ["COLLECTIVES", "Cost", "EXPERT_CALL_FUNCTIONS", "EXPERT_LOOP_FUNCTIONS", "ExpertModel", "array_shapes",
           "group_size", "hlo_cost", "parse_module", "program_cost", "shape_bytes", "stack_functions", "trip_count",
           "xla_cost"]
