"""Sharded `grpo_grads(..., mesh=...)` == one device, for both families and modes, on 1x8 and 2x4, with B groups side
by side on `data` and left-padded prompts: one table of cases, each one mesh program against the one-device engine
on the same batch (float32, tiny models at O(1) scale, 8 simulated CPU devices; 4x8 runs in the 32-device
subprocesses of models/test_qwen36_mesh.py and models/test_glm52_mesh.py).

Every case's prompts have P - 1 = 45 positions, which divide evenly over neither mesh, captured in rounds of 16 (full
rounds and a shorter last one: the exact backward walks them all; Qwen3.6 on 1x8 in one round). Groups have ragged
masks, KL on and old log-probs (NaN at pads), so every term of the loss reaches the sharded backward. A padded group
has 19 random pad tokens (`left_pad` 19): GLM's round 0 (16 positions) is all pads and its round 1 mixes pads and
real tokens, Qwen3.6's first round (24 positions) mixes them; the 2x4 cases put an unpadded and a padded group side
by side. One-device padded == unpadded is checked in float64 (engine/test_float64.py) and below for groups stacked with
different pads.

Each case also checks where things run: every group is computed once, by its own data slice (a debug callback in
the engines' group loop); the gradient comes back FSDP-sharded like the parameters; GLM's routed experts' gradients
stay expert-parallel (one expert per device). GLM on 1x8 in rounds of 16 reads earlier rounds' selected rows around
the ring and sends their cotangents home (2 queries per shard x k 16 = 32 rows < the layer's 48).
"""
import dataclasses
import functools

import jax
import numpy as np
import pytest

from longstraw_jax import GroupBatch, GRPOConfig, grpo_grads, models, naive_grpo_grads, sharding
from longstraw_jax.engine import capture as engine_capture
from longstraw_jax.models.base import CausalLM
from longstraw_jax.models.glm52 import mesh_forward as glm52_mesh
from longstraw_jax.sharding import groups as groups_lib, rules
from tests.helpers import assert_metrics_equal, random_groups, rel_err, tiny_model

P, R, G, CHUNK = 46, 6, 3, 16
CFG = GRPOConfig(kl_coef=0.1, loss_agg="seq-mean-token-mean")  # the batch loss is the mean of the groups' losses


@dataclasses.dataclass(frozen=True)
class Case:
    family: str
    spec: str
    mode: str
    pads: int | tuple[int, ...]  # a tuple: one per group, B = len(pads) stacked; an int: one unstacked group
    in_rounds: bool = True  # whether CHUNK splits the capture into rounds on this mesh (else one round)
    kernels: str = "xla"  # the mesh program's attention ("pallas": interpreted kernels); one device runs XLA


CASES = {
    "qwen36-1x8-detached": Case("qwen36", "1x8", "detached", 0, in_rounds=False),
    "qwen36-2x4-exact": Case("qwen36", "2x4", "exact", (0, 19)),
    "qwen36-2x4-detached": Case("qwen36", "2x4", "detached", (19, 0, 30, 5)),  # two groups per data slice
    "glm52-2x4-exact": Case("glm52", "2x4", "exact", (19, 0)),
    "glm52-1x8-exact": Case("glm52", "1x8", "exact", 19),  # reads around the ring
    "glm52-2x4-detached": Case("glm52", "2x4", "detached", (0, 19)),
    # the Pallas kernels inside shard_map: the ring and the rounds' cache (kv_index, kv_positions, left pads) ...
    "qwen36-2x4-exact-pallas": Case("qwen36", "2x4", "exact", (0, 19), kernels="pallas"),
    # ... and the selected rows read around the ring, their cotangents sent home
    "glm52-1x8-exact-pallas": Case("glm52", "1x8", "exact", 19, kernels="pallas"),
}
FAST = {"qwen36-1x8-detached"}  # the rest compile a mesh engine each (1-3 min on 2 busy cores): slow


@functools.cache
def batch_of(name: str) -> GroupBatch:
    case = CASES[name]
    return random_groups(tiny_model(case.family)[0].config.vocab_size, case.pads, P, R, G, seed=list(CASES).index(name))


@functools.cache
def one_device(name: str):
    """The case's one-device (loss, grads, metrics), computed once per module (also the subject of the one-device
    tests below)."""
    case = CASES[name]
    model, params, _ = tiny_model(case.family)
    return grpo_grads(model, params, batch_of(name), CFG, case.mode, chunk_size=CHUNK)


@pytest.fixture(scope="module", autouse=True)
def _fresh_results():
    """The cached one-device results belong to this module (conftest.py clears the compiled programs per module)."""
    yield
    batch_of.cache_clear()
    one_device.cache_clear()


@pytest.mark.parametrize("name", [name if name in FAST else pytest.param(name, marks=pytest.mark.slow)
                                  for name in CASES])
def test_on_the_mesh_equal_one_device(name, monkeypatch):
    case = CASES[name]
    model, params, _ = tiny_model(case.family)
    if case.kernels != model.config.kernels:
        model = models.build(dataclasses.replace(model.config, kernels=case.kernels))
    batch = batch_of(name)
    want_loss, want_grads, want_metrics = one_device(name)  # before the callback below (it names the mesh's axis)
    mesh = sharding.make_mesh(case.spec)
    layout = engine_capture.round_layout(model, P - 1, mesh.shape["seq"], CHUNK)
    assert (layout.full >= 1) == case.in_rounds  # full rounds and a last one, or one round
    if name == "glm52-1x8-exact":
        assert glm52_mesh.reads_around_ring("ring", 2 * model.config.index_topk, layout)
    seen = []
    if isinstance(case.pads, tuple):  # groups on `data`: who computes which
        monkeypatch.setattr(groups_lib, "observe", lambda index: jax.debug.callback(
            lambda d, g: seen.append((int(d), int(g))), jax.lax.axis_index("data"), index))
    specs = rules.param_specs(params, mesh)
    placed = jax.device_put(params, rules.named(specs, mesh))
    loss, grads, metrics = grpo_grads(model, placed, batch, CFG, case.mode, chunk_size=CHUNK, mesh=mesh)
    jax.effects_barrier()
    assert abs(float(loss) - float(want_loss)) <= 1e-5 * max(1.0, abs(float(want_loss)))
    err = rel_err(grads, want_grads)
    print(f"{name}: grad rel err {err:.2e}")
    assert err <= 1e-4
    assert_metrics_equal(metrics, want_metrics)
    if isinstance(case.pads, tuple):
        per_slice = len(case.pads) // mesh.shape["data"]
        assert sorted(seen) == [(g // per_slice, g) for g in range(len(case.pads))]  # once each, by its own slice
    # the gradient comes back FSDP-sharded like the parameters: each device holds 1/8 of a split leaf
    embed = grads["embed"]
    assert specs["embed"] != jax.sharding.PartitionSpec()
    assert embed.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, specs["embed"]), embed.ndim)
    assert {s.data.size for s in embed.addressable_shards} == {embed.size // 8}
    if case.family == "glm52":  # each routed expert's gradient on its own device
        experts = grads["layers"]["0"]["full_sparse"]["mlp"]["experts_gate"]  # [repeats, per_pattern, E, I, D]
        assert {s.data.shape[2] for s in experts.addressable_shards} == {1}


@pytest.mark.slow  # naive's compile, and the exact engine's for each group alone
def test_stacked_groups_with_different_pads_equal_naive_and_each_alone():
    """qwen36-2x4-exact's batch on one device: an unpadded and a padded group stacked [2, P] == the naive full graph
    on the same batch, and == the mean of each group's own loss and gradient, each alone and unpadded
    (seq-mean-token-mean)."""
    model, params, _ = tiny_model("qwen36")
    batch = batch_of("qwen36-2x4-exact")
    loss, grads, metrics = one_device("qwen36-2x4-exact")
    want_loss, want_grads, want_metrics = naive_grpo_grads(model, params, batch, CFG)
    assert abs(float(loss) - float(want_loss)) <= 1e-5 * max(1.0, abs(float(want_loss)))
    assert rel_err(grads, want_grads) <= 1e-4
    assert_metrics_equal(metrics, want_metrics)
    alone = []
    for b, pad in enumerate(batch.left_pad.tolist()):
        group = jax.tree.map(lambda x: x[b], batch)
        group = group.replace(prompt=group.prompt[pad:], left_pad=None)
        alone.append(grpo_grads(model, params, group, CFG, "exact", chunk_size=CHUNK))
    assert abs(float(loss) - (float(alone[0][0]) + float(alone[1][0])) / 2) <= 1e-5
    assert rel_err(grads, jax.tree.map(lambda a, b: (a + b) / 2, alone[0][1], alone[1][1])) <= 1e-4


def test_groups_must_split_over_data():
    model, params, _ = tiny_model("qwen36")
    with pytest.raises(ValueError, match="3 groups do not split over the mesh.s data axis of size 2"):
        grpo_grads(model, params, random_groups(model.config.vocab_size, (0, 0, 0), P), CFG, "detached", chunk_size=8,
                   mesh=sharding.make_mesh("2x4"))


def test_unsupported_model_is_refused_by_name():
    class Other(CausalLM):  # a family without a mesh adapter
        config = models.Qwen36Config.tiny()

    batch = GroupBatch(prompt=np.zeros(8, np.int32), responses=np.zeros((1, 2), np.int32),
                       mask=np.ones((1, 2), np.float32), rewards=np.zeros(1, np.float32))
    with pytest.raises(NotImplementedError, match="Other has no sequence-parallel path"):
        grpo_grads(Other(), None, batch, CFG, "exact", mesh=sharding.make_mesh("1x8"))
