"""Smoke test of tools/bench_step.py: one mode, tiny sizes, compiled and run in its own child process."""
import json
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


def _plan(*args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plan_capacity.py"), *args],
                          capture_output=True, text=True, timeout=900, cwd=ROOT,
                          env=dict(os.environ, XLA_FLAGS="--xla_cpu_use_fusion_emitters=false"))


def test_plan_capacity_prints_per_device_components(tmp_path):
    """tools/plan_capacity.py: one AOT compile of the sharded train step on a simulated 2x4 mesh (tiny Qwen3.6,
    float32, detached) and one on 1x8 (tiny GLM-5.2, exact): the per-device components and the compiled total."""
    result = _plan("--config", "configs/qwen3.6-tiny.json", "--mesh", "2x4", "-P", "200", "-G", "2", "-R", "8",
                   "--modes", "detached", "--dtype", "float32", "--chunk", "64", "--device-gb", "0.001",
                   "--unit", "MiB", "--json", str(tmp_path / "plan.json"))
    assert result.returncode == 0, result.stderr[-3000:]
    row = [line.split() for line in result.stdout.splitlines() if line.strip().startswith("detached ")][-1]
    params, optimizer, grads, state, cotangent, rest, total = map(float, row[3:10])
    plan = json.loads((tmp_path / "plan.json").read_text())  # --json: the same row in bytes, with "fits"
    assert plan["setup"]["mesh"] == "2x4" and len(plan["rows"]) == 1
    (cell,) = plan["rows"]
    assert (cell["mode"], cell["G"], cell["P"], cell["fits"]) == ("detached", 2, 200, False)
    assert abs(cell["total"] / 2**20 - total) <= 0.005 and abs(cell["params"] / 2**20 - params) <= 0.005
    # AdamW moments and grads: float32, sharded like the params
    assert params > 0 and abs(optimizer - 2 * params) <= 0.02 and abs(grads - params) <= 0.01
    assert state > 0 and cotangent == 0 and total >= params + optimizer + grads + state and row[-1] == "no"
    glm = _plan("--config", "configs/glm-5.2-tiny.json", "--mesh", "1x8", "-P", "200", "-G", "2", "-R", "4",
                "--modes", "exact", "--dtype", "float32", "--chunk", "64", "--unit", "MiB")
    assert glm.returncode == 0, glm.stderr[-3000:]
    row = [line.split() for line in glm.stdout.splitlines() if line.strip().startswith("exact ")][-1]
    params, optimizer, grads, state, cotangent, rest, total = map(float, row[3:10])
    # float32 state: its float32 cotangent is the same size; the latent rows and indexer keys are split 8 ways
    assert state > 0 and cotangent == state and total >= params + optimizer + grads + state + cotangent
