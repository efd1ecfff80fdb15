"""What the processes of one run must agree on before any work: `fingerprint(config)` lists everything that has to be
identical on every process (every option except the per-process ones, the contents of every input file or directory
the options name, the package's source and version, JAX's version), and `disagreement` turns the fingerprints of all
processes into one line naming each differing field and which process has which value (None when they agree).

The exchange itself goes through the coordinator's key-value store (trainer/distributed.py:check_agreement), right
after the processes join and before any device is used: processes started with different --mesh may not even agree
on their device counts.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import os

# options that differ between processes by design
PER_PROCESS = frozenset({"coordinator", "num_processes", "process_id"})
# options naming files or directories the run writes, not reads (their contents are not compared)
OUTPUTS = frozenset({"out", "export_hf", "export_peft"})
# options naming inputs; any other option whose metavar names a file, directory or path counts too (e.g. a dataset's)
INPUTS = frozenset({"model", "hf", "init_from", "ref_from", "rollouts", "tokenizer"})
_PATH_METAVARS = ("DIR", "FILE", "PATH", ".json")
HASHED_BYTES = 256 << 20  # a larger file is compared by its size and the sha256 of its first and last 16 MiB
_EDGE = 16 << 20
_SMALL_IN_DIR = 1 << 20  # files in a directory up to this size are hashed (config.json, tokenizer files, ...)
_SHOWN = 60  # characters of a value shown in the message


def _sha256_file(path: str) -> str:
    """sha256 of the whole file, or for one over HASHED_BYTES of its first and last 16 MiB (plus its size)."""
    size = os.path.getsize(path)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= HASHED_BYTES:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        else:
            h.update(f.read(_EDGE))
            f.seek(size - _EDGE)
            h.update(f.read(_EDGE))
            h.update(str(size).encode())
    return h.hexdigest()[:16]


def describe_path(path: str) -> str | None:
    """What must be equal about an input path: a file's size and sha256; a directory's file count, total size and a
    sha256 over every file's relative path and size and the contents of its small files (<= 1 MiB: configs,
    tokenizers). None when the path does not exist (the option's own check reports that)."""
    if os.path.isfile(path):
        return f"{os.path.getsize(path)} bytes, sha256 {_sha256_file(path)}"
    if not os.path.isdir(path):
        return None
    h, count, total = hashlib.sha256(), 0, 0
    for root, dirs, files in os.walk(path):
        dirs.sort()
        for name in sorted(files):
            full = os.path.join(root, name)
            size = os.path.getsize(full)
            count, total = count + 1, total + size
            h.update(f"{os.path.relpath(full, path)}\0{size}\0".encode())
            if size <= _SMALL_IN_DIR:
                with open(full, "rb") as f:
                    h.update(f.read())
    return f"{count} files, {total} bytes, sha256 {h.hexdigest()[:16]}"


def source_digest(package_dir: str | None = None) -> str:
    """sha256 (16 hex digits) of the longstraw_jax package's .py files: processes running different code differ.
    `package_dir`: a copy of the package to digest instead of the imported one (tools/bench_step.py's snapshot)."""
    root = package_dir or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    h = hashlib.sha256()
    for base, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(f for f in files if f.endswith(".py")):
            full = os.path.join(base, name)
            h.update(os.path.relpath(full, root).encode() + b"\0")
            with open(full, "rb") as f:
                h.update(f.read())
    return h.hexdigest()[:16]


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def is_input_path(field: dataclasses.Field) -> bool:
    """Whether a RunConfig field names an input file or directory (INPUTS, or a metavar like DIR, FILE.jsonl)."""
    metavar = str(field.metadata.get("argparse", {}).get("metavar", ""))
    return field.name not in OUTPUTS and (field.name in INPUTS or any(m in metavar for m in _PATH_METAVARS))


def fingerprint(config, explicit=frozenset(), environment: dict | None = None) -> dict[str, str]:
    """Field -> value (strings) of everything that must be identical on every process of a run:

    - every option of `config` (a RunConfig) except PER_PROCESS, keyed by its flag (`--steps`);
    - for each option naming an existing input file or directory (a --model config.json, --hf, --init-from,
      --rollouts, --tokenizer, a dataset path, ...): `describe_path` of it, keyed `--rollouts contents`;
    - on --resume, which options were given on the command line (they decide what the checkpoint's options override);
    - `environment`: the package's source digest and version and JAX's version (default: this process's).
    """
    from longstraw_jax.trainer.config import flag

    out = {}
    for field in dataclasses.fields(config):
        if field.name in PER_PROCESS:
            continue
        value = getattr(config, field.name)
        out[flag(field.name)] = str(value)
        if isinstance(value, str) and is_input_path(field):
            described = describe_path(value)
            if described is not None:
                out[f"{flag(field.name)} contents"] = described
    if config.resume:
        out["options given"] = " ".join(sorted(flag(n) for n in explicit if n not in PER_PROCESS)) or "none"
    if environment is None:
        environment = {"longstraw-jax source": source_digest(), "longstraw-jax version": _version("longstraw-jax"),
                       "jax version": _version("jax"), "jaxlib version": _version("jaxlib")}
    return {**out, **environment}


def process_list(ids: list[int]) -> str:
    """[0] -> "process 0"; [0, 1, 2, 5] -> "processes 0-2, 5"."""
    ids = sorted(ids)
    runs = []  # [first, last] of consecutive ids
    for i in ids:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    text = ", ".join(str(a) if a == b else f"{a}, {b}" if b == a + 1 else f"{a}-{b}" for a, b in runs)
    return ("process " if len(ids) == 1 else "processes ") + text


def _shown(value: str | None) -> str:
    if value is None:
        return "(missing)"
    return value if len(value) <= _SHOWN else value[:_SHOWN - 3] + "..."


def disagreement(fingerprints: list[dict[str, str]]) -> str | None:
    """The fingerprints of processes 0..N-1 -> None when all are equal, else one line: "processes disagree on --steps
    (process 0: 3, process 1: 4), --seed (...); every process must be started with the same options" (each
    differing field in process 0's order, the processes grouped by value: "processes 0-6: 3, process 7: 4")."""
    fields = list(dict.fromkeys(k for fp in fingerprints for k in fp))
    parts = []
    for field in fields:
        values = [fp.get(field) for fp in fingerprints]
        if len(set(values)) == 1:
            continue
        groups: dict[str | None, list[int]] = {}
        for p, v in enumerate(values):
            groups.setdefault(v, []).append(p)
        parts.append(f"{field} (" + ", ".join(f"{process_list(ps)}: {_shown(v)}" for v, ps in groups.items()) + ")")
    if not parts:
        return None
    return f"processes disagree on {', '.join(parts)}; every process must be started with the same options"
