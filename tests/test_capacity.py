"""The capacity planner as a package module: `python -m longstraw_jax.plan` reproduces the golden `--json` of the
planner as it was before it moved into the package, byte for byte; `--help` runs; the planner (`longstraw_jax.capacity`,
`longstraw_jax.plan`) is library-level: nothing it imports reaches the trainer app (`trainer/`) or `io/`.

The golden file tests/data/plan_qwen36_tiny_1x8.json was first written by tools/plan_capacity.py at commit 0bc9a5c
(the planner's last version under tools/) with GOLDEN_ARGS and GOLDEN_ENV below, from the repository root, and the
package module reproduced it byte for byte. It was regenerated once since, for a deliberate change of the programs
it sizes: Qwen3.6's sharded replay and exact backward through `layerwise` with the embedding's gradient added in
place (update "rest" 90,950,418 -> 90,634,162 bytes exact, 9,163,730 -> 9,147,346 detached; same code before and
after that merge otherwise). Normalised:
each row's "compile_s" (wall-clock seconds) is removed; nothing else in the JSON depends on the run (the jax version
and compile times are printed on stdout only). Every byte count comes from XLA's buffer assignment and analytic
shapes, deterministic for pinned versions (jax 0.10.2 here): after a JAX / XLA upgrade, or a deliberate change of
what the planner sizes, regenerate it with that command (then drop "compile_s" and write it with indent=1).
"""
import json
import os
import subprocess
import sys

import pytest

from tests.test_imports import PACKAGE, PACKAGE_DIR, import_graph, load_package

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
GOLDEN = os.path.join(ROOT, "tests", "data", "plan_qwen36_tiny_1x8.json")
GOLDEN_ARGS = ["--config", "configs/qwen3.6-tiny.json", "--mesh", "1x8", "-P", "4096", "-G", "2", "-R", "64",
               "--modes", "exact,detached"]
GOLDEN_ENV = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_cpu_use_fusion_emitters=false"}
RUN_DEPENDENT = ("compile_s",)  # per row


def _planner(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, **GOLDEN_ENV, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "longstraw_jax.plan", *args], capture_output=True, text=True,
                          timeout=1200, cwd=ROOT, env=env)


def normalised(plan: dict) -> str:
    """The planner's --json without its run-dependent fields, as the golden file is written."""
    rows = [{k: v for k, v in row.items() if k not in RUN_DEPENDENT} for row in plan["rows"]]
    return json.dumps(dict(plan, rows=rows), indent=1) + "\n"


@pytest.mark.slow  # a planner subprocess: AOT compiles of two whole update steps and a capture at P = 4096 (~50 s)
def test_plan_json_matches_the_golden_file(tmp_path):
    """Tiny Qwen3.6 on a simulated 1x8 mesh, P = 4096, G = 2, R = 64, exact and detached (bfloat16, one round):
    two AOT compiles of the trainer's update and one of the sharded capture; every byte as before the move."""
    result = _planner(*GOLDEN_ARGS, "--json", str(tmp_path / "plan.json"))
    assert result.returncode == 0, result.stderr[-3000:]
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert all(row["compile_s"] > 0 for row in plan["rows"])
    with open(GOLDEN) as f:
        golden = f.read()
    assert normalised(plan) == golden
    rows = json.loads(golden)["rows"]
    assert [(r["mode"], r["P"], r["G"]) for r in rows] == [("exact", 4096, 2), ("detached", 4096, 2)]
    assert rows[0]["update"]["cotangent"] > 0 and rows[0]["peak"] > rows[1]["peak"] > 0  # an exact step costs more
    assert "Update phase" in result.stdout and "(simulated, jax " in result.stdout


def test_plan_help_states_the_size_rule():
    result = _planner("--help")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "--prompt-len" in result.stdout and "K = 1024, M = 2^20" in result.stdout


def test_planner_does_not_import_the_trainer_or_io():
    """Everything `longstraw_jax.plan` and `longstraw_jax.capacity.*` import, transitively (module level and
    function-local imports, as tests/test_imports.py builds the graph), stays out of trainer/ and io/."""
    modules = load_package(PACKAGE_DIR, PACKAGE)
    graph = import_graph(modules, PACKAGE)
    roots = [name for name in modules if name == f"{PACKAGE}.plan" or name.startswith(f"{PACKAGE}.capacity")]
    assert f"{PACKAGE}.capacity.planner" in roots and f"{PACKAGE}.plan" in roots
    seen, todo = set(roots), list(roots)
    while todo:
        for target in graph[todo.pop()]:
            if target not in seen:
                seen.add(target)
                todo.append(target)
    forbidden = sorted(name for name in seen if name.split(".")[1:2] in (["trainer"], ["io"]))
    assert forbidden == [], forbidden
    assert f"{PACKAGE}.train" in seen and f"{PACKAGE}.sharding.prompt" in seen  # the graph does reach the library
