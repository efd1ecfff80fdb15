"""Smoke test of tools/bench_step.py: one mode, tiny sizes, compiled and run in its own child process."""
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..")


def test_bench_step_quick_prints_a_table():
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "bench_step.py"), "--quick", "--modes", "detached", "--reps", "1",
         "--no-snapshot"], capture_output=True, text=True, timeout=600, cwd=ROOT, env=dict(os.environ))
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line.split() for line in result.stdout.splitlines() if line.startswith("detached ")]
    assert rows, result.stdout[-2000:]
    row = " ".join(rows[-1])
    assert "MiB" in row and row.count(" s") >= 1, row  # compiled memory and a measured step time
