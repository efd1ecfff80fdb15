"""The benchmark and planning tools: tools/bench_step.py (smoke), the capacity planner (`longstraw_jax.capacity`: the
whole trainer step's phases, per device: from the CLI, tools/plan_capacity.py, in-process against its own parts, and
its sampling phase against the compiled one-device sampler), tools/bench_device.py (--tiny, on CPU),
tools/bench_sampling.py (--quick, --group-ratio)."""
import importlib.util
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longstraw_jax import capacity
from tests.helpers import ROOT, triton_calls


def _tool(name):
    """tools/<name>.py as a module (tools/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "tools", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # a benchmark's smoke run (its compiles)
def test_bench_step_quick_prints_a_table():
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "bench_step.py"), "--quick", "--modes", "detached", "--reps", "1",
         "--no-snapshot"], capture_output=True, text=True, timeout=600, cwd=ROOT, env=dict(os.environ))
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line.split() for line in result.stdout.splitlines() if line.startswith("detached ")]
    assert rows, result.stdout[-2000:]
    row = " ".join(rows[-1])
    assert "MiB" in row and row.count(" s") >= 1, row  # compiled memory and a measured step time


@pytest.mark.slow  # a subprocess compiling the sampler twice
def test_bench_sampling_quick_draws_the_same_tokens_one_at_a_time_and_together():
    """tools/bench_sampling.py --quick on one device (tiny Qwen3.6, G 4): both decode batches in the table, the
    same tokens, R (not G x R) decode steps per group when the branches decode together; the agent table: episodes
    of 2 turns x 4 tokens with one observation of 4 (12 positions) against 12 positions without turns, and the
    split of the episodes' time."""
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "bench_sampling.py"), "--quick", "--families", "qwen36",
         "--mesh", "", "--reps", "1"], capture_output=True, text=True, timeout=600, cwd=ROOT, env=dict(os.environ))
    assert result.returncode == 0, result.stderr[-2000:] + result.stdout[-2000:]
    plain, _, agents = result.stdout.partition("agent branches")
    rows = [line.split() for line in plain.splitlines() if line.lstrip().startswith("qwen36")]
    assert [(r[3], r[4]) for r in rows] == [("1", "32"), ("4", "8")], result.stdout  # batch, steps (R = 8)
    assert all(r[-1] == "yes" for r in rows) and rows[0][-2] == "1.00x", result.stdout
    (row,) = [line.split() for line in agents.splitlines() if line.lstrip().startswith("qwen36")]
    assert row[1:3] == ["12", "4"] and row[5].endswith("x"), result.stdout  # positions, observation tokens
    assert float(row[5][:-1]) == pytest.approx(float(row[4]) / float(row[3]), rel=0.02), result.stdout


@pytest.mark.slow  # five compiles of the tiny sampler
def test_bench_sampling_group_ratio_times_a_group_of_g_against_a_group_of_one():
    """tools/bench_sampling.py --group-ratio, in-process at a small point (tiny Qwen3.6, P 64, G 2, R 4): the
    trainer's sampler, the decode alone and the capture alone, the ratios G / 1 of the medians, and the two groups
    agreeing where they must (the same first-token log-probs up to round-off; the group of one is branch 0 of the
    group of G: the same tokens)."""
    bench = _tool("bench_sampling")
    args = bench.parse_args(["--group-ratio", "--families", "qwen36", "-P", "64", "-G", "2", "-R", "4",
                             "--chunk-size", "32", "--reps", "1", "--width", "32"])
    for family, wide in (("qwen36", "intermediate_size"), ("glm52", "moe_intermediate_size")):  # --width D
        config = bench._model(family, 32)[0].config
        assert (config.hidden_size, getattr(config, wide)) == (32, 64 if family == "qwen36" else 16)
    from longstraw_jax import models

    assert bench._model("qwen36")[0].config == models.Qwen36Config.tiny(vocab_size=512)  # the default: the preset
    row = bench.measure_group_ratio("qwen36", args)
    assert row["same_first"] and row["same_branch"], row
    assert row["ratio_total"] == pytest.approx(row["total_2"] / row["total_1"])
    assert row["ratio_decode"] == pytest.approx(row["decode_2"] / row["decode_1"])
    head, line = bench.format_group_ratio([row], args, markdown=False).splitlines()
    assert "G 2 / G 1" in head and "decode G 2 / G 1" in head, head
    cells = line.split()
    assert cells[:2] == ["qwen36", "32"] and cells[5] == f"{row['ratio_total']:.2f}x" and cells[-1] == "yes", line
    assert float(cells[-2]) == pytest.approx(row["first_diff"], rel=0.1, abs=1e-12), line
    markdown = bench.format_group_ratio([row], args, markdown=True).splitlines()
    assert len(markdown) == 3 and markdown[2].startswith("| qwen36 |"), markdown


def _plan(*args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plan_capacity.py"), *args],
                          capture_output=True, text=True, timeout=900, cwd=ROOT,
                          env=dict(os.environ, XLA_FLAGS="--xla_cpu_use_fusion_emitters=false"))


def _rows(stdout: str, title: str, mode: str) -> list[list[str]]:
    """The rows of one of the planner's three tables (after the line `title`) of `mode` (the column after train)."""
    lines = stdout.splitlines()
    start = lines.index(title)
    block = []
    for line in lines[start + 2:]:
        if not line.strip():
            break
        block.append(line.split())
    return [row for row in block if row[1] == mode]


@pytest.mark.slow  # planner subprocesses, AOT compiles of whole steps
def test_plan_capacity_prints_per_device_components(tmp_path):
    """tools/plan_capacity.py (the shim of `python -m longstraw_jax.plan`): one AOT compile of the sharded train step
    and one of the sharded capture on a simulated 2x4 mesh (tiny Qwen3.6, float32, detached, B = 4 groups: 2 per
    data slice) and on 1x8 (tiny GLM-5.2, exact): the per-device components of both phases, the step's peak and
    --json."""
    result = _plan("--config", "configs/qwen3.6-tiny.json", "--mesh", "2x4", "-P", "200", "-G", "2", "-R", "8",
                   "--modes", "detached", "--dtype", "float32", "--chunk-size", "64", "--device-gb", "0.001",
                   "--unit", "MiB", "--groups-per-step", "4", "--json", str(tmp_path / "plan.json"))
    assert result.returncode == 0, result.stderr[-3000:]
    (update,) = _rows(result.stdout, "Update phase", "detached")
    params, optimizer, grads, state, cotangent, rest, others, total = map(float, update[5:13])
    plan = json.loads((tmp_path / "plan.json").read_text())  # --json: the same rows in bytes, with "fits"
    assert plan["setup"]["mesh"] == "2x4" and plan["setup"]["groups_per_step"] == 4 and len(plan["rows"]) == 1
    (cell,) = plan["rows"]
    assert (cell["mode"], cell["G"], cell["P"], cell["B"], cell["fits"]) == ("detached", 2, 200, 4, False)
    assert cell["decode_steps"] == 8  # R: the G = 2 branches decode together
    assert abs(cell["update"]["total"] / 2**20 - total) <= 0.005
    assert abs(cell["update"]["params"] / 2**20 - params) <= 0.005
    # AdamW moments and grads: float32, sharded like the params
    assert params > 0 and abs(optimizer - 2 * params) <= 0.02 and abs(grads - params) <= 0.01
    assert state > 0 and cotangent == 0 and total >= params + optimizer + grads + state
    assert others == state  # the slice's second group's state, held while the first is updated (detached: no aux)
    sampling = cell["sampling"]
    assert sampling["state"] == 2 * cell["update"]["state"] and sampling["boundaries"] == 0  # 2 groups per slice
    assert sampling["tail"] > 0 and sampling["capture"] > 0 and sampling["decode"] > 0
    assert cell["peak"] == max(sampling["total"], cell["update"]["total"])
    (step,) = _rows(result.stdout, "Step (per device)", "detached")
    assert step[0] == "full" and cell["train"] == "full" and plan["setup"]["train"] == "full"
    assert step[-1] == "no" and step[8] == cell["peak_phase"] and abs(float(step[7]) - cell["peak"] / 2**20) <= 0.005
    glm = _plan("--config", "configs/glm-5.2-tiny.json", "--mesh", "1x8", "-P", "200", "-G", "2", "-R", "4",
                "--modes", "exact", "--dtype", "float32", "--chunk-size", "64", "--unit", "MiB")
    assert glm.returncode == 0, glm.stderr[-3000:]
    (update,) = _rows(glm.stdout, "Update phase", "exact")
    params, optimizer, grads, state, cotangent, rest, others, total = map(float, update[5:13])
    # float32 state: its float32 cotangent is the same size; the latent rows and indexer keys are split 8 ways
    assert state > 0 and cotangent == state and total >= params + optimizer + grads + state + cotangent
    assert others == 0  # B defaults to the data size (1): one group per slice
    (sampling,) = _rows(glm.stdout, "Sampling phase", "exact")
    assert float(sampling[7]) == state and float(sampling[8]) == 0  # GLM keeps nothing else from its capture


def test_plan_capacity_groups_per_step_must_divide_over_data():
    result = _plan("--config", "configs/qwen3.6-tiny.json", "--mesh", "2x4", "-P", "200", "--groups-per-step", "3")
    assert result.returncode == 2 and "--groups-per-step 3" in result.stderr and "data size 2" in result.stderr
    assert result.stdout == ""


@pytest.mark.slow  # AOT compiles of two updates
def test_planner_replay_batch():
    """--replay-batch K in the planner: the update compiled with K branches replayed together holds more (their
    activations at once), the sampling phase is unchanged; K must divide every G."""
    cfg_path = os.path.join(ROOT, "configs", "qwen3.6-tiny.json")
    rows = {k: capacity.Planner(cfg_path, "1x1", "float32", 16, 64, devices=jax.devices()[:1], replay_batch=k).plan(
        128, 4, "detached", 1, limit=1e12) for k in (1, 4)}
    assert rows[4]["update"]["total"] > rows[1]["update"]["total"]
    assert rows[4]["sampling"] == rows[1]["sampling"]
    with pytest.raises(ValueError, match="--replay-batch 3 must divide the group size G=4"):
        capacity.Planner(cfg_path, "1x1", "float32", 16, 64, devices=jax.devices()[:1],
                         replay_batch=3).branches_together(4)


@pytest.mark.slow  # AOT compiles of the update and the capture
def test_planner_phases():
    """In-process, tiny Qwen3.6 on a 2x1 mesh (data 2): the sampling phase grows with R (exactly by the tail's KV
    rows) and with B / data (states, tails, capture transients); the update phase is unchanged by R beyond the
    [G, R] response tensors and grows with B / data by the other groups' states; the peak is the larger phase."""
    with pytest.raises(ValueError, match="--groups-per-step 3 .* data size 2"):
        capacity.local_groups(3, 2)
    cfg_path = os.path.join(ROOT, "configs", "qwen3.6-tiny.json")
    planner = capacity.Planner(cfg_path, "2x1", "float32", 8, 64, devices=jax.devices()[:2])
    c = planner.model.config
    prompt_len, group = 256, 2
    b2 = planner.plan(prompt_len, group, "detached", 2, limit=1e12)
    b4 = planner.plan(prompt_len, group, "detached", 4, limit=1e12)
    s2, s4 = b2["sampling"], b4["sampling"]
    for name in ("state", "tail", "capture"):
        assert s4[name] == 2 * s2[name] > 0, name
    assert s4["params"] == s2["params"] and s4["optimizer"] == s2["optimizer"] and s4["total"] > s2["total"]
    state = b2["update"]["state"]
    assert s2["state"] == state and b2["update"]["others"] == 0 and b4["update"]["others"] == state
    assert b4["update"]["total"] == b2["update"]["total"] + state
    for row in (b2, b4):
        assert row["peak"] == max(row["sampling"]["total"], row["update"]["total"])
        assert row["peak_phase"] == ("update" if row["update"]["total"] >= row["sampling"]["total"] else "sampling")
    assert planner.plan(prompt_len, group, "detached", 2, limit=b2["peak"])["fits"]
    assert not planner.plan(prompt_len, group, "detached", 2, limit=b2["peak"] - 1)["fits"]
    # exact mode keeps Qwen's GDN round boundaries from the capture: (rounds on this shard + 1 scratch) x carried
    exact = planner.sampling(prompt_len, group, "exact", 1)
    carried = 4 * c.num_blocks * c.linear_per_block * (
        c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim
        + (c.linear_conv_kernel_dim - 1) * c.conv_dim)
    full_rounds = (prompt_len - 1 - 1) // 64
    assert abs(exact["boundaries"] - (full_rounds + 2) * carried) <= 0.01 * exact["boundaries"]
    # R 8 -> 16: each of the G + 1 tails (the G branches decoding together, and the one after prompt[-1] they start
    # from) holds 8 more KV rows per full-attention layer (replicated), nothing else changes
    kv_row = 2 * 4 * c.num_blocks * c.full_per_block * c.num_key_value_heads * c.head_dim
    planner.response_len = 16
    r16 = planner.plan(prompt_len, group, "detached", 2, limit=1e12)
    assert r16["sampling"]["tail"] - s2["tail"] == (group + 1) * 8 * kv_row  # B / data = 1 group
    assert r16["sampling"]["total"] >= s2["total"] and r16["decode_steps"] == 2 * b2["decode_steps"]
    for name in ("params", "optimizer", "grads", "state", "cotangent", "others"):
        assert r16["update"][name] == b2["update"][name], name
    # what does grow: the [G, R] response tensors and one branch's replay activations (O(R); +2.9% measured here)
    assert 0 < r16["update"]["total"] - b2["update"]["total"] <= 0.1 * b2["update"]["total"]


def test_planner_lora_sizes_adapters_and_expert_parallel_layers():
    """No compile: --train lora (tiny GLM-5.2, 1x8) holds base + adapters but float32 grads and AdamW moments for
    the adapters only; with 8 experts on 8 devices the decode's gathered layer keeps each device's expert local."""
    cfg, devices = os.path.join(ROOT, "configs", "glm-5.2-tiny.json"), jax.devices()[:8]
    full = capacity.Planner(cfg, "1x8", "float32", 4, 64, devices=devices)
    lora = capacity.Planner(cfg, "1x8", "float32", 4, 64, devices=devices, train_mode="lora", lora_rank=4)
    f, a = full.components(200, "exact"), lora.components(200, "exact")
    assert lora.num_trainable == lora.num_params - full.num_params > 0 and full.num_trainable == full.num_params
    assert a["params"] > f["params"] and 0 < a["grads"] < f["grads"] / 2 and a["state"] == f["state"]
    assert abs(a["optimizer"] - 2 * a["grads"]) <= 64  # two float32 moments (+ step counts)
    whole = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), full.params)
    assert full.layer_bytes < capacity.largest_layer_bytes(whole)
    # GPUs' ragged expert exchange, added analytically: 2 n T (min(k, E / n) - 1) D elements for T tokens per device
    assert full.ragged_extra("exact") == dict(sampling=0, update=0)  # 8 experts on 8 devices: one each, as gathered
    extra = lambda **kw: capacity.ragged_exchange_bytes(**dict(dict(devices=8, experts=32, top_k=2, hidden=4,
                                                                    itemsize=2, tokens=3), **kw))
    assert extra() == 2 * 8 * 3 * (2 - 1) * 4 * 2 and extra(top_k=8) == 2 * 8 * 3 * (4 - 1) * 4 * 2
    assert extra(experts=12) == 0 and extra(experts=0, top_k=1) == 0
    assert capacity.ragged_exchange_bytes(devices=8, experts=0, top_k=1, hidden=4, itemsize=2, tokens=3) == 0


def test_planner_sampling_matches_the_compiled_sampler():
    """The planner's sampling phase on one device (a 1x1 mesh, B = 1, less the optimizer the sampler does not hold)
    against `memory_analysis()` of `sampling.branches.sample_group` AOT-compiled at the same shapes (tiny Qwen3.6,
    float32, P = 4096 so the state is a large part): within 0.9x-1.25x. The planner is meant to err high: its capture is
    the sharded one, which embeds the whole prompt at once where the one-device sampler embeds chunk by chunk."""
    from longstraw_jax.sampling import branches as rollout

    prompt_len, group, response_len, chunk = 4096, 2, 16, 256
    planner = capacity.Planner(os.path.join(ROOT, "configs", "qwen3.6-tiny.json"), "1x1", "float32", response_len,
                           chunk, devices=jax.devices()[:1])
    estimate = planner.sampling(prompt_len, group, "detached", 1)
    estimate = estimate["total"] - estimate["optimizer"]
    params = jax.eval_shape(lambda key: planner.model.init(key, jnp.float32), jax.random.key(0))
    compiled = rollout._sample_group.lower(
        planner.model, params, jax.ShapeDtypeStruct((prompt_len,), jnp.int32), jax.eval_shape(jax.random.key, 0),
        group, rollout.SamplingConfig(response_len=response_len), chunk).compile()
    measured = capacity.memory_total(compiled)["total"]
    assert 0.9 <= estimate / measured <= 1.25, (estimate, measured)
    assert np.isfinite(estimate / measured)


def test_model_flops_match_cost_analysis_on_a_loop_free_config():
    """tools/bench_device.py's analytic FLOP count against XLA's cost_analysis() of `model.forward` on a loop-free
    config (one full-attention layer: the layer scan, the attention key-block loop and the GDN chunk loop have one
    iteration each, so XLA's count-a-loop-body-once is exact): within 3% (XLA also counts elementwise work and the
    masked half of the causal tile). The GDN layer's weight count is checked against its parameters."""
    from longstraw_jax import models
    from longstraw_jax.models.qwen36.config import FULL, LINEAR, Qwen36Config

    bench = _tool("bench_device")
    tokens = 32
    cfg = Qwen36Config.tiny(hidden_size=256, intermediate_size=1024, num_hidden_layers=1, layer_types=(FULL,))
    model = models.build(cfg)
    params = jax.eval_shape(model.init, jax.random.key(0))
    compiled = jax.jit(model.forward).lower(params, jax.ShapeDtypeStruct((tokens,), jnp.int32)).compile()
    cost = compiled.cost_analysis()
    xla = (cost[0] if isinstance(cost, list) else cost)["flops"]
    ours = bench.qwen36_flops(cfg, tokens, logits=True)
    assert ours["attention"] == 4 * cfg.num_attention_heads * cfg.head_dim * tokens * (tokens + 1) // 2
    assert 0.97 <= ours["total"] / xla <= 1.03, (ours, xla)
    # the GDN layer: dense FLOPs = 2 x its weight matrices (every blocks/ leaf of rank >= 2 per layer) per token
    cfg = Qwen36Config.tiny(hidden_size=256, intermediate_size=1024, num_hidden_layers=1, layer_types=(LINEAR,))
    params = jax.eval_shape(models.build(cfg).init, jax.random.key(0))
    matrices = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params["blocks"]) if x.ndim >= 4)
    assert bench.qwen36_flops(cfg, tokens)["dense"] == 2 * matrices * tokens
    assert bench.qwen36_flops(cfg, tokens, cached=100)["gdn"] == bench.qwen36_flops(cfg, tokens)["gdn"] > 0
    assert bench.peak_flops("NVIDIA H200") == 989e12 and bench.peak_flops("NVIDIA H20") == 148e12
    assert bench.peak_flops("NVIDIA H100 80GB HBM3") == 989e12 and bench.peak_flops("cpu") is None


@pytest.mark.slow  # the device benchmark end to end on CPU
@pytest.mark.parametrize("train", ["full", "lora"])
def test_bench_device_tiny(tmp_path, train):
    """tools/bench_device.py --tiny on CPU (one train_step mode and one capture length, to stay fast; the step trains
    every parameter, or LoRA adapters as the GPU day's full-size run does): the table and
    the JSON hold the capture and detached rows with positive times, throughputs, compiled and planner bytes; the
    CPU has no peak memory statistics and no peak FLOP/s ("n/a"). The time-model table holds both programs, costed
    on the rough `cpu` entry: a positive estimate from positive model FLOPs and bytes, and measured / estimated =
    the measured median over the estimate (the JSON, and the table to its printed digits)."""
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "bench_device.py"), "--tiny", "--modes", "detached", "--train",
         train, "--capture-len", "256", "--measure", "capture,steps", "--json", str(tmp_path / "bench.json")],
        capture_output=True, text=True,
        timeout=600, cwd=ROOT, env=dict(os.environ, XLA_FLAGS="--xla_cpu_use_fusion_emitters=false "
                                                              "--xla_backend_optimization_level=0"))
    assert result.returncode == 0, result.stderr[-3000:]
    first, _, second = result.stdout.partition("Time model")
    parse = lambda text: {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
                          for line in text.splitlines() if line.startswith("| ") and "---" not in line}
    table, model = parse(first), parse(second)
    assert set(table) == {"measurement", "capture", "detached"}, result.stdout
    assert set(model) == {"measurement", "capture", "detached"}, result.stdout
    assert model["measurement"][-3:] == ["estimate s", "measured s", "measured / estimate"]
    for name in ("capture", "detached"):
        hw, gflop, hbm_gb, estimate, measured, ratio = (model[name][0], float(model[name][1]), float(model[name][2]),
                                                         float(model[name][5]), float(model[name][6]),
                                                         float(model[name][7]))
        assert hw == "cpu" and gflop > 0 and hbm_gb > 0 and estimate > 0 and model[name][4] in ("compute", "memory")
        assert ratio == pytest.approx(measured / estimate, rel=0.02)  # three printed digits each
    for name in ("capture", "detached"):
        median_s, tokens_per_s = float(table[name][2]), float(table[name][4].replace(",", ""))
        assert median_s > 0 and tokens_per_s > 0 and table[name][7] == "n/a"  # no peak_bytes_in_use on CPU
    assert table["capture"][6] == "n/a" and float(table["capture"][5]) > 0  # TFLOP/s, but no MFU on CPU
    bench = json.loads((tmp_path / "bench.json").read_text())
    assert bench["platform"] == "cpu" and bench["peak_flops"] is None
    rows = {row["name"]: row for row in bench["rows"]}
    assert set(rows) == {"capture", "detached"} and rows["capture"]["tokens"] == 256
    for row in rows.values():
        assert row["seconds"] > 0 and row["tokens_per_s"] > 0 and len(row["times"]) == 2
        assert row["compiled_bytes"] > 0 and row["planner_bytes"] > 0 and row["peak_bytes"] is None
    assert rows["capture"]["flops"] > 0 and rows["detached"]["G"] == 2 and rows["detached"]["train"] == train
    cpu = capacity.HARDWARE["cpu"]
    for row in rows.values():
        cost = row["model_cost"]
        assert row["model_hardware"] == "cpu" and cost["flops"] > 0 and cost["hbm_bytes"] > 0
        assert row["model_s"] == pytest.approx(max(cost["flops"] / cpu.flops_per_s, cost["hbm_bytes"] / cpu.hbm_per_s)
                                               + cost["collective_bytes"] / cpu.link_per_s, rel=1e-12)
        assert row["model_s"] == row["model_terms"]["total"] > 0
        assert row["model_ratio"] == pytest.approx(row["seconds"] / row["model_s"], rel=1e-12)


def test_bench_device_keeps_what_it_measured_when_killed(tmp_path, monkeypatch):
    """--json is rewritten after each measurement: a run stopped from outside (here the third child's start raises
    KeyboardInterrupt) leaves a JSON with the rows measured so far and the failed measurement (the second), with
    "complete": false."""
    bench = _tool("bench_device")
    monkeypatch.setattr(bench, "_has_accelerator", lambda: False)
    row = dict(kernel="attention", case="a chunk", kind="forward", device="cpu", platform="cpu", jax=jax.__version__)
    calls = []

    def child(opts, timeout):
        calls.append(opts["item"])
        if len(calls) == 2:
            raise bench.ChildFailed("out of memory", [])
        if len(calls) == 3:
            raise KeyboardInterrupt
        return [row]

    monkeypatch.setattr(bench, "_run_child", child)
    path = tmp_path / "bench.json"
    with pytest.raises(KeyboardInterrupt):
        bench.main(["--tiny", "--measure", "kernels,capture,steps", "--json", str(path)])
    out = json.loads(path.read_text())
    assert out["complete"] is False and out["kernel_table"] == [row] and out["device"] == "cpu"
    assert calls == ["kernels", "capture", "detached"]
    assert [f["item"] for f in out["failed"]] == ["capture"] and "out of memory" in out["failed"][0]["error"]
    assert not os.path.exists(str(path) + ".partial")


def test_bench_device_kernel_table_tiny(tmp_path):
    """tools/bench_device.py --tiny --measure kernels on CPU: the flash-attention, GDN and sparse latent attention
    kernels (interpreted) against their XLA paths at the tiny shapes, each case forward and forward + backward:
    errors at float32 rounding, positive medians, the analytic FLOPs (attention: 4 x visible causal pairs x Hq x D,
    x 3.5 with the backward; the GDN's and the latent attention's: the time model's kernel counts), TFLOP/s = FLOPs
    / median, no peak on CPU, and the JSON's targets block "not-run" (no GPU, no capture)."""
    bench = _tool("bench_device")
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "bench_device.py"), "--tiny", "--measure", "kernels",
         "--json", str(tmp_path / "bench.json")], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    for title in ("Flash attention, Pallas vs XLA", "Chunked Gated DeltaNet, Pallas vs XLA",
                  "Sparse latent attention, Pallas vs XLA"):
        assert title in result.stdout
    out = json.loads((tmp_path / "bench.json").read_text())
    assert out["platform"] == "cpu" and out["jax"] == jax.__version__ and out["device"] and out["complete"] is True
    assert out["rows"] == [] and out["failed"] == [] and out["skipped"] == []
    passes = ("forward", "forward_backward")
    assert any(r.get("branches") for r in out["kernel_table"])  # a decode step of branches over one cache (vmap)
    tiles = bench.TILE_CANDIDATES["tiny"]
    assert [(r["kernel"], r["case"], r["kind"]) for r in out["kernel_table"]] == \
        [("attention", c[0], kind) for c in bench.KERNEL_SHAPES["tiny"]["cases"] for kind in passes] \
        + [("gated_delta", c[0], kind) for c in bench.GDN_SHAPES["tiny"]["cases"] for kind in passes] \
        + [("sparse_latent", c[0], kind) for c in bench.LATENT_SHAPES["tiny"]["cases"] for kind in passes] \
        + [("attention_tiles", bench.tile_label("forward", c), "forward") for c in tiles["forward"]] \
        + [("attention_tiles", bench.tile_label("decode", n), "forward") for n in tiles["decode"]] \
        + [("attention_tiles", bench.tile_label("backward", c), "forward_backward") for c in tiles["backward"]]
    swept = [r for r in out["kernel_table"] if r["kernel"] == "attention_tiles"]
    assert [(r["sweep"], r["tiles"], r["default"]) for r in swept] == \
        [("forward", dict(forward=list(c)), i == 0) for i, c in enumerate(tiles["forward"])] \
        + [("decode", dict(min_programs=n), i == 0) for i, n in enumerate(tiles["decode"])] \
        + [("backward", dict(dq=list(a), dkv=list(b)), i == 0) for i, (a, b) in enumerate(tiles["backward"])]
    assert {(r["T"], r["S"]) for r in swept if r["sweep"] == "decode"} == {(8, 256)}
    fastest = out["fastest_tiles"]
    assert set(fastest) == set(bench.TILE_SWEEPS)
    assert fastest["forward"]["tiles"]["forward"] in [list(c) for c in tiles["forward"]]
    for best in fastest.values():
        assert best["default_over_best"] >= 1.0 and best["error"] < 1e-5
    from longstraw_jax.capacity.hlo import GatedDeltaModel, SparseLatentModel

    for r in out["kernel_table"]:
        assert r["error"] < 1e-5 and r["xla_s"] > 0 and r["pallas_s"] > 0 and r["pallas_peak"] is None, r
        assert r["pallas_tflops"] == pytest.approx(r["flops"] / r["pallas_s"] / 1e12)
        if r["kernel"] == "gated_delta":  # the time model's count: stages A, B, C (and their vjps)
            model, chunks = GatedDeltaModel(r["key_dim"], r["value_dim"], r["chunk"]), -(-r["T"] // r["chunk"])
            backward = model.backward(chunks, r["heads"]).flops if r["kind"] == "forward_backward" else 0
            assert r["flops"] == model.forward(chunks, r["heads"]).flops + backward
            assert r["flops_recurrent"] == 6 * r["key_dim"] * r["value_dim"] * r["T"] * r["heads"]
        elif r["kernel"] == "sparse_latent":  # 2 T H k (2 Dl + Dr), + 2 T H k (5 Dl + 3 Dr) with the backward
            dl, dr, triples = r["latent_dim"], r["rope_dim"], r["T"] * r["heads"] * r["slots"]
            assert r["flops"] == 2 * triples * (2 * dl + dr + (5 * dl + 3 * dr if r["kind"] == "forward_backward"
                                                               else 0))
            assert SparseLatentModel(r["heads"], dl, dr).forward(r["T"], r["slots"]).flops == 2 * triples * (2 * dl
                                                                                                           + dr)
    shape = bench.KERNEL_SHAPES["tiny"]
    rows = [r for r in out["kernel_table"] if r["kernel"] == "attention"]
    for r in rows:
        assert r["error"] < 1e-5, r
        assert r["xla_s"] > 0 and r["pallas_s"] > 0 and r["speedup"] == pytest.approx(r["xla_s"] / r["pallas_s"])
        pairs = sum(min(r["S"] - r["T"] + t + 1, r["S"]) for t in range(r["T"])) * r.get("branches", 1)
        forward = 4 * pairs * shape["heads"] * shape["head_dim"]
        assert r["pairs"] == pairs and r["flops"] == forward * (1 if r["kind"] == "forward" else 3.5)
        assert r["pallas_tflops"] == pytest.approx(r["flops"] / r["pallas_s"] / 1e12)
        assert r["pallas_peak"] is None and r["xla_peak"] is None
    assert {name: t["status"] for name, t in out["targets"].items()} == {
        "attention_forward_peak": "not-run", "capture_speedup_64k": "not-run"}
    # the targets' arithmetic on made-up GPU figures
    fake = [dict(rows[0], pallas_peak=0.6, flops=1.0), dict(rows[0], pallas_peak=0.4, flops=2.0),
            dict(rows[0], kernel="gated_delta", pallas_peak=0.9, flops=9.0)]  # not attention: not the target's
    pairs = [dict(name="capture", tokens=65536, speedup=2.5)]
    goals = bench.targets(fake, pairs, "NVIDIA H100 80GB HBM3")
    assert goals["attention_forward_peak"]["status"] == "fail" and goals["attention_forward_peak"]["value"] == 0.4
    assert goals["capture_speedup_64k"]["status"] == "pass"
    assert "| 8K | - | failed: RuntimeError: boom |" in bench.format_kernel_table(
        [dict(case="8K", failed="RuntimeError: boom")], ("T",))


def test_bench_device_tile_candidates_lower_for_cuda():
    """Every launch shape the GPU day tries (TILE_CANDIDATES["full"], at the tiles table's case: 8K causal queries,
    Qwen3.6-27B's 24 / 4 heads of 256, bf16) lowers for CUDA on this CPU host with its tiles in the kernels'
    launches: the forward's grid of 8K / block_q query blocks, dQ's of 8K / its block_q, dK / dV's of 8K / its
    block_k, each with its warps and stages; the decode sweep's forward (8 tokens over 64K keys: one block of 48 rows
    x 4 key/value heads) with its keys in `key_splits` parts (1 for min_programs 1, 32 for 128); and each list's
    first candidate is what the library runs by default."""
    from longstraw_jax.ops import flash_attention as fa

    bench = _tool("bench_device")
    shape = bench.KERNEL_SHAPES["full"]
    _, t, s = shape["cases"][0]
    dtype = jnp.dtype(shape["dtype"])
    q = jax.ShapeDtypeStruct((t, shape["heads"], shape["head_dim"]), dtype)
    kv = jax.ShapeDtypeStruct((s, shape["kv_heads"], shape["head_dim"]), dtype)

    def lowered(tiles, t=t, s=s):
        def grads(q, k, v):
            def loss(q, k, v):
                r = fa.attend(q, k, v, q_positions=jnp.arange(t, dtype=jnp.int32) + s - t, k_offset=0, scale=0.0625,
                              causal=True, interpret=False, tiles=tiles)
                return jnp.sum(r.out) + jnp.sum(r.lse)
            return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
        shapes = (jax.ShapeDtypeStruct((t,) + q.shape[1:], dtype), jax.ShapeDtypeStruct((s,) + kv.shape[1:], dtype))
        calls = triton_calls(jax.jit(grads).trace(shapes[0], shapes[1], shapes[1]).lower(lowering_platforms=("cuda",)))
        return {c.name: (c.grid[0], c.grid[2], c.num_warps, c.num_stages) for c in calls}

    default_warps = 8 if shape["head_dim"] > 64 else 4
    candidates = bench.TILE_CANDIDATES["full"]
    tiles = fa.DEFAULT_TILES
    assert candidates["forward"][0] == (tiles.forward.block_q, tiles.forward.block_k, default_warps,
                                        tiles.forward.num_stages)
    assert candidates["backward"][0] == tuple((k.block_q, k.block_k, default_warps, k.num_stages)
                                              for k in (tiles.dq, tiles.dkv))
    assert candidates["decode"][0] == tiles.min_programs
    for c in candidates["forward"]:
        calls = lowered(fa.FlashTiles(forward=fa.KernelTiles(*c)))
        assert calls["flash_attention_forward"] == (t // c[0], 1, c[2], c[3]), (c, calls)
    for dq, dkv in candidates["backward"]:
        calls = lowered(fa.FlashTiles(dq=fa.KernelTiles(*dq), dkv=fa.KernelTiles(*dkv)))
        assert calls["flash_attention_dq"] == (t // dq[0], 1, dq[2], dq[3]), (dq, calls)
        assert calls["flash_attention_dkv"][0] == s // dkv[1] and calls["flash_attention_dkv"][2:] == dkv[2:]
    _, decode_t, decode_s = next(c for c in shape["cases"] if len(c) == 3 and c[1] <= 8)
    for n in candidates["decode"]:
        calls = lowered(fa.FlashTiles(min_programs=n), decode_t, decode_s)
        parts, _ = fa.key_splits(shape["kv_heads"], decode_s // 64, n)
        assert calls["flash_attention_forward"][:2] == (1, parts) and parts == {1: 1, 128: 32, 512: 128}[n], calls


def test_bench_device_plan_puts_the_tiles_after_the_target_capture():
    """The GPU day's order: the kernel table's three sets, the 64K captures (the capture target's), the tiles' sweep,
    the other captures, the steps; --tiny: one kernel child (the sweep inside it); without captures the sweep follows
    the kernel sets."""
    bench = _tool("bench_device")
    full = dict(bench.FULL_SIZE, tiny=False)
    plan = [(p["item"], p.get("kernel") or p.get("capture_len") or "") + ((p["impl"],) if "impl" in p else ())
            for p in bench.plan_measurements(full, ["kernels", "capture", "steps"], ["xla", "pallas"])]
    assert plan == [("kernels", "attention"), ("kernels", "gated_delta"), ("kernels", "sparse_latent"),
                    ("capture", 65536, "xla"), ("capture", 65536, "pallas"), ("kernels", "attention_tiles"),
                    ("capture", 32768, "xla"), ("capture", 32768, "pallas"), ("capture", 131072, "xla"),
                    ("capture", 131072, "pallas"), ("exact", "", "xla"), ("exact", "", "pallas")]
    assert [p.get("kernel") for p in bench.plan_measurements(full, ["kernels"], ["xla"])] == list(bench.KERNEL_SETS)
    tiny = dict(bench.TINY, tiny=True, capture_len=0)
    assert [p.get("kernel") for p in bench.plan_measurements(tiny, ["kernels", "capture"], ["xla"])] == ["all", None]


@pytest.mark.slow  # one short trainer run in a child process (~1 min of compiles)
def test_bench_demo_runs_a_setting_tabulates_it_and_reuses_it(tmp_path, capsys):
    bench = _tool("bench_demo")
    out = str(tmp_path / "bd")
    argv = ["--setting", "short=--steps 2 --sft-steps 2 --eval-every 2", "--seeds", "3", "--eval-prompts", "8",
            "--jobs", "1", "--out", out, "--reuse"]
    assert bench.main(argv) == 0
    text = capsys.readouterr().out
    run_dir = os.path.join(out, "short", "seed3")
    result = bench.summary(run_dir)
    assert result["steps"] == 2 and result["prompts"] == 8 and [s for s, _ in result["curve"]] == [0, 2]
    row = next(line for line in text.splitlines() if line.startswith("| short | 3 |"))
    assert f"| {result['init']:.3f} | {result['warm']:.3f} | {result['final']:.3f} |" in row
    assert "chance 0.250; copying a random fact's value 0.625" in text
    marker = os.path.join(run_dir, "bench_demo.json")
    written = os.path.getmtime(marker)
    assert bench.main(argv) == 0 and os.path.getmtime(marker) == written  # --reuse: the finished run is kept


def test_bench_peer_ours_side_without_trl(tmp_path, capsys):
    """tools/bench_peer.py's side of our engine at a tiny size, in process (TRL is never imported: it is an optional
    extra, never in CI): the shared checkpoint written with save_hf loads back, our detached update runs and reports a
    median, a loss and a gradient norm, and the table puts a TRL result next to ours as TRL / ours."""
    import bench_harness

    peer = _tool("bench_peer")
    ckpt = str(tmp_path / "tiny")
    assert peer.make_checkpoint(ckpt, 0) == {"vocab": 512}
    capsys.readouterr()
    peer.ours_child(dict(checkpoint=ckpt, P=[33], R=4, G=2, seed=0, reps=1, lr=1e-5, mode="detached", chunk=32,
                         replay_batch=1))
    (row,) = bench_harness.result_rows(capsys.readouterr().out)
    assert (row["side"], row["mode"], row["P"], row["chunk"]) == ("ours", "detached", 33, 32)
    assert row["median_s"] > 0 and np.isfinite(row["loss"]) and row["grad_norm"] > 0
    args = peer.parse_args(["-P", "33", "-R", "4", "-G", "2", "--modes", "detached"])
    trl = dict(row, side="trl", mode="full graph", median_s=3 * row["median_s"])
    head, rows = peer.table(args, [row, trl])
    assert head[1:4] == ["TRL update", "ours detached", "TRL / detached"] and rows[0][3] == "3.00x"
    assert "| TRL / detached |" in peer.render(head, rows, markdown=True)


def test_bench_gated_delta_times_each_chunk_against_the_largest(capsys):
    """tools/bench_gated_delta.py (what the XLA path's GDN chunk rule is measured by) at a tiny size: a row per
    (width, chunk) with positive times, the largest chunk at 1.00x of itself, and every chunk's outputs and
    gradients equal to the largest chunk's up to float32 round-off (the same recurrence, chunked differently)."""
    bench = _tool("bench_gated_delta")
    rows = bench.measure(bench.parse_args(["-T", "40", "--heads", "2", "--dims", "8", "--chunks", "8,16", "--reps",
                                           "1"]))
    assert [(r["dim"], r["chunk"]) for r in rows] == [(8, 8), (8, 16)]
    assert all(r["forward_s"] > 0 and r["gradient_s"] > 0 for r in rows)
    assert rows[1]["forward_ratio"] == rows[1]["gradient_ratio"] == 1.0 and rows[1]["max_diff"] == 0.0
    assert 0 < rows[0]["max_diff"] < 1e-4
    table = bench.render(rows, markdown=True)
    assert table.count("\n") == 3 and "| 8 | 16 |" in table and "1.00x" in table
