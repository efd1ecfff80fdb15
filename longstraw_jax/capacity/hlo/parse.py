"""HLO module text -> instructions: the computations of a compiled program (`compiled.as_text()`), the attributes of
an instruction (`attr`, `called`, `trip_count`), the arrays of a type text (`array_shapes`, `shape_bytes`), and the
stack frames XLA records for each instruction (`stack_functions`)."""
from __future__ import annotations

import dataclasses
import math
import re

# bytes per element of HLO primitive types (sub-byte types count their fraction: s4 / u4 half a byte)
ITEMSIZE = {"pred": 1, "s2": 0.25, "u2": 0.25, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2,
            "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
            "token": 0}

_ARRAY = re.compile(r"([a-z]\w*)\[([^\]]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")


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


def split_top(text: str) -> list[str]:
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
        operands = tuple(o.split()[-1].lstrip("%") for o in split_top(inside) if o)
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
        if dtype not in ITEMSIZE:
            continue
        out.append((dtype, tuple(int(d.lstrip("<=")) for d in dims.split(",") if d.strip())))
    return out


def shape_bytes(shape: str) -> float:
    """Bytes of an array or tuple type (layouts `{..}` ignored)."""
    return float(sum(math.prod(dims) * ITEMSIZE[dtype] for dtype, dims in array_shapes(shape)))


def attr(attrs: str, key: str) -> str | None:
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


def called(instr: Instruction, key: str) -> list[str]:
    """The computations an instruction names under `key` (`calls`, `body`, `condition`, `to_apply`,
    `branch_computations`, ...): one name, or a `{a, b}` list; [] when absent."""
    value = attr(instr.attrs, key)
    if value is None:
        return []
    return [v.strip().lstrip("%") for v in value.strip("{}").split(",") if v.strip()]


def trip_count(instr: Instruction) -> int | None:
    """The `known_trip_count` XLA wrote into a while's backend_config, or None."""
    m = re.search(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)"?', instr.attrs)
    return int(m.group(1)) if m else None


def parameter_index(instr: Instruction) -> int:
    """The N of `parameter(N)`: the operand text of a parameter instruction is its index."""
    return int(instr.operands[0]) if instr.operands else 0
