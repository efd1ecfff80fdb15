"""The capacity planner as a package module: `python -m longstraw_jax.plan` reproduces the golden `--json` of the
planner as it was before it moved into the package, byte for byte; `--help` runs; the planner (`longstraw_jax.capacity`,
`longstraw_jax.plan`) is library-level: nothing it imports reaches the trainer app (`trainer/`) or `io/`.

The golden file tests/data/plan_qwen36_tiny_1x8.json was first written by tools/plan_capacity.py at commit 0bc9a5c
(the planner's last version under tools/) with GOLDEN_ARGS and GOLDEN_ENV below, from the repository root, and the
package module reproduced it byte for byte. It was regenerated once since, for a deliberate change of the programs
it sizes: Qwen3.6's sharded replay and exact backward through `layerwise` with the embedding's gradient added in
place (update "rest" 90,950,418 -> 90,634,162 bytes exact, 9,163,730 -> 9,147,346 detached; same code before and
after that merge otherwise); and again for the sampler decoding its G branches together with the weights in place
(issue 25: "decode_steps" G x R = 128 -> R = 64; sampling "tail" 118,016 -> 226,176 bytes: G + 1 tails instead of
one and a saved carried part; "decode" 188,800 -> 83,512: no layer gathered, only its non-matrix leaves, and G
[vocab] rows; nothing else changed); and for `train_step`'s `update_norm` metric (issue 39: update "rest" +908
bytes in both modes, the scalar and its reduction; nothing else changed); and for the Gated DeltaNet's short inputs
run as one unpadded chunk without a loop (ops/gated_delta.py: the R = 64 replay was a one-step scan over a 64-row
chunk; update "rest" 90,635,070 -> 90,634,942 bytes exact, 9,148,254 -> 9,002,174 detached; nothing else changed);
and for exact mode's prompt backward not running the last block forward and differentiating it through its entries
alone (engine/layerwise.py, a lax.cond in the reverse scan: update "rest" 90,634,942 -> 91,007,422 bytes exact;
nothing else changed), written at the same time with the setup's "kernels" entry that the planner reports since
--kernels (xla here); and for the XLA path's GDN chunk of 16 tokens (`Qwen36Config.gdn_chunk_for`, was 64: smaller
[Cg, Cg] temporaries; update "rest" 91,007,422 -> 58,848,062 bytes exact, 9,002,174 -> 5,974,230 detached; nothing
else changed).
Normalised:
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

from tests.helpers import ROOT
from tests.test_imports import PACKAGE, PACKAGE_DIR, import_graph, load_package

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


def test_plan_names_a_missing_config():
    result = _planner("--config", "configs/no-such-model.json", "--mesh", "1x8", "-P", "4096")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.stderr.strip() == "error: configs/no-such-model.json: no such file or directory"


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
    assert f"{PACKAGE}.train" in seen and f"{PACKAGE}.engine.capture" in seen  # the graph does reach the library


@pytest.mark.slow  # a planner subprocess compiling the capture, a decode step and two updates
def test_plan_time_reports_each_phase_and_the_decode_step(tmp_path):
    """--time --hardware h200 on the golden's configuration (detached only): every phase has positive seconds, the
    decode step's per-device FLOPs, HBM bytes and collective bytes are positive and sit under the new "time" key with
    the decode steps per group (timing.decode_steps_per_group), and the memory rows are the golden's, unchanged.
    --hlo-dir writes the three costed programs' HLO, which capacity/hlo costs again to the JSON's figures."""
    from longstraw_jax.capacity.hlo import hlo_cost
    from longstraw_jax.capacity.timing import PHASES, decode_steps_per_group

    modes = GOLDEN_ARGS.index("--modes")
    args = GOLDEN_ARGS[:modes] + ["--modes", "detached", "--time", "--hardware", "h200"]
    result = _planner(*args, "--json", str(tmp_path / "plan.json"), "--hlo-dir", str(tmp_path / "hlo"))
    assert result.returncode == 0, result.stderr[-3000:]
    plan = json.loads((tmp_path / "plan.json").read_text())
    timing = plan.pop("time")
    files = {"capture": "capture_P4096", "decode_step": "decode_step_P4096_N2", "update": "update_P4096_G2_detached"}
    assert sorted(os.listdir(tmp_path / "hlo")) == sorted(f"{name}.hlo.txt" for name in files.values())
    for program, name in files.items():
        again = hlo_cost((tmp_path / "hlo" / f"{name}.hlo.txt").read_text()).as_dict()
        assert again == timing["rows"][0]["programs"][program]
    with open(GOLDEN) as f:
        golden = json.load(f)
    assert json.loads(normalised(plan))["rows"] == [r for r in golden["rows"] if r["mode"] == "detached"]
    assert timing["hardware"]["name"] == "h200" and "datasheet" in timing["hardware"]["source"]
    (row,) = timing["rows"]
    assert (row["mode"], row["G"], row["P"]) == ("detached", 2, 4096)
    assert row["decode_steps_per_group"] == decode_steps_per_group(2, 64)
    step = row["decode_step"]
    assert step["flops"] > 0 and step["hbm_bytes"] > 0 and step["collective_bytes"] > 0
    assert step["collectives"]["all-gather"] > 0  # FSDP: the layers are gathered every step
    assert step["unknown_loops"] == []
    for phase in PHASES:
        seconds = row["seconds"][phase]
        assert seconds["total"] > 0
        assert seconds["total"] == pytest.approx(max(seconds["compute"], seconds["memory"]) + seconds["collectives"])
    assert row["seconds"]["step"]["total"] == pytest.approx(sum(row["seconds"][p]["total"] for p in PHASES))
    # sampling = decode steps per group x one decode step (B / data = 1)
    assert row["phases"]["sampling"]["flops"] == pytest.approx(row["decode_steps_per_group"] * step["flops"])
    assert "Time per step (per device, h200" in result.stdout and "decode steps / group" in result.stdout


def test_the_planner_costs_routed_experts_as_a_gpus_grouped_matmul():
    """`Planner.expert_model`: None for Qwen3.6 (no routed experts); GLM-5.x's E routed experts, with 1 / seq of the
    decode step's rows real where the experts are expert-parallel (each seq shard sends a padded 1 / seq slice of a
    branch's one token), all of them in the capture and the update and where the experts are not expert-parallel."""
    import jax

    from longstraw_jax.capacity.hlo import ExpertModel
    from longstraw_jax.capacity.planner import Planner
    from longstraw_jax.models.glm52 import Glm52Config

    qwen = Planner(os.path.join(ROOT, "configs", "qwen3.6-tiny.json"), "1x8", "bfloat16", 8, 64,
                   devices=jax.devices()[:8])
    assert qwen.expert_model("decode_step") is None and qwen.expert_model("update") is None
    for mesh, experts, decode in (("2x4", 8, ExpertModel(8, 1 / 4)), ("1x8", 8, ExpertModel(8, 1 / 8)),
                                  ("2x2", 6, ExpertModel(6, 1.0))):  # 4 devices do not divide 6 experts
        glm = Planner(Glm52Config.tiny(n_routed_experts=experts, n_group=1, topk_group=1), mesh, "bfloat16", 8, 64,
                      devices=jax.devices()[:8 if mesh != "2x2" else 4])
        assert glm.expert_model("decode_step") == decode
        assert glm.expert_model("capture") == glm.expert_model("update") == ExpertModel(experts, 1.0)


@pytest.mark.slow  # two planners' decode and update programs (R = 64 and 128)
def test_doubling_r_doubles_the_sampling_time():
    """Twice the response length: twice the decode steps per group, each step at least as costly (its tail holds R
    positions), so the sampling estimate doubles, plus the tail's share: a step reads its R-position tail (on this
    tiny model about 13 % of a step's HBM bytes at R = 64, read in R/4-position key blocks: measured 2.26; 2.19 when
    the tail was one block), well under the 4x that a step cost growing with R would give."""
    import jax

    from longstraw_jax.capacity.hardware import hardware
    from longstraw_jax.capacity.planner import Planner

    config = os.path.join(ROOT, "configs", "qwen3.6-tiny.json")
    rows = [Planner(config, "1x8", "bfloat16", r, 16384, devices=jax.devices()[:8]).timing(
        4096, 2, "detached", 1, hardware("h200")) for r in (64, 128)]
    assert rows[1]["decode_steps_per_group"] == 2 * rows[0]["decode_steps_per_group"]
    ratio = rows[1]["seconds"]["sampling"]["total"] / rows[0]["seconds"]["sampling"]["total"]
    assert 2.0 <= ratio < 2.35, ratio
    assert rows[1]["seconds"]["capture"]["total"] == pytest.approx(rows[0]["seconds"]["capture"]["total"])
