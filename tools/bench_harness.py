"""The child-process harness of the benchmarks that measure in fresh processes (tools/bench_step.py,
tools/bench_device.py): the parent runs `python TOOL --one SPEC` (SPEC: JSON) for each measurement, the child prints
one `BENCH_JSON {...}` line per result on stdout, and the parent reads those lines back.

Why children: a process's peak RSS and a device's `peak_bytes_in_use` then belong to one measurement alone, and a
crash or out-of-memory kill loses one measurement, not the run. The parent imports no JAX backend for the same reason.

A tool imports this module as `import bench_harness`: `python tools/TOOL.py` puts tools/ first on sys.path (and the
tests' pytest configuration does so too).
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

PREFIX = "BENCH_JSON "  # a result line: PREFIX + one JSON object


def emit(row: dict) -> None:
    """Print one result line for the parent (flushed, so that it survives a later crash of the child)."""
    print(PREFIX + json.dumps(row), flush=True)


def result_rows(stdout: str) -> list[dict]:
    """Every result line of a child's stdout, decoded, in the order printed (other lines are the child's own)."""
    return [json.loads(line[len(PREFIX):]) for line in stdout.splitlines() if line.startswith(PREFIX)]


@dataclasses.dataclass(frozen=True)
class ChildRun:
    """What one child left: its result rows, its exit status (None: killed at the timeout; negative: a signal) and
    its stderr."""

    rows: list[dict]
    returncode: int | None
    stderr: str


def run_child(script: str, spec: dict, timeout: float, env: dict | None = None, cwd: str | None = None) -> ChildRun:
    """Run `python SCRIPT --one JSON(spec)` to completion, or until `timeout` seconds (then the rows it printed
    before it was killed). `env`: the child's whole environment (default: this process's)."""
    cmd = [sys.executable, os.path.abspath(script), "--one", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    except subprocess.TimeoutExpired as e:
        return ChildRun(result_rows(_text(e.stdout)), None, _text(e.stderr))
    return ChildRun(result_rows(proc.stdout), proc.returncode, proc.stderr)


def _text(output: str | bytes | None) -> str:
    """A TimeoutExpired's captured output as text (it may hold bytes even with text=True)."""
    return output.decode(errors="replace") if isinstance(output, bytes) else (output or "")
