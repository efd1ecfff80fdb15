"""Sequence-parallel GLM-5.x == one device (float32, tiny config: index_topk 16, so DSA selection is sparse over
these prompts; 8 CPU devices, 4x8 in a 32-device subprocess). The routed experts are expert-parallel on every mesh
here (8 experts on 8 devices; 32 on 32).

The prompt (45 positions) divides evenly by no mesh's 2 * seq segments; capture runs in one round and in rounds;
the sharded indexer (per-shard top-k + all_to_all merge) must pick the same positions as one device, or the
logits would differ. GLM's gradients on a mesh (2x4 exact and detached, 1x8 exact reading around the ring) are
cases of tests/engine/test_mesh.py; here, the GPU's ragged expert exchange and the 32-device check.
"""
import functools
import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longstraw_jax import GroupBatch, grpo_grads, models, sharding
from longstraw_jax.engine import capture as engine_capture
from longstraw_jax.engine.capture import capture_on_mesh, extend_on_mesh
from longstraw_jax.models.glm52 import Glm52Config
from longstraw_jax.sharding import experts, rules
from tests.helpers import (
    SHARDED_CFG,
    assert_sharded_grads_match,
    emulated_ragged_all_to_all,
    o1_params,
    rel_err,
    run_32_device_check,
)

PROMPT, TOTAL = 45, 56


def _model(**overrides):
    model = models.build(Glm52Config.tiny(**overrides))
    return model, o1_params(model.init(jax.random.key(0)), jax.random.key(1))


@pytest.fixture(scope="module")
def tiny():
    model, params = _model()
    tokens = jax.random.randint(jax.random.key(2), (TOTAL,), 0, model.config.vocab_size, dtype=jnp.int32)
    reference = model.capture(params, tokens[:PROMPT], chunk_size=16)
    return model, params, tokens, reference, model.extend(params, reference, tokens[PROMPT:])


@pytest.mark.parametrize("spec,chunk_size", [("2x4", None), ("1x8", 16),
                                             pytest.param("4x2", 12, marks=pytest.mark.slow)])
def test_sharded_capture_and_extend_equal_one_device(tiny, spec, chunk_size):
    """One round on 2x4; rounds on 1x8 (2 full rounds of 16 + 13; earlier rounds' rows read around the ring) and 4x2
    (3 full rounds of 12 + 9; 6 queries x k 16 per shard select more rows than the layer's 48: all-gathered)."""
    model, params, tokens, reference, logits = tiny
    mesh = sharding.make_mesh(spec)
    params = jax.device_put(params, rules.named(rules.param_specs(params, mesh), mesh))
    sstate = capture_on_mesh(model, params, tokens[:PROMPT], mesh, chunk_size=chunk_size)
    assert sstate.layout.full == {"2x4": 0, "1x8": 2, "4x2": 3}[spec]
    per_device = sstate.layout.padded // mesh.shape["seq"]
    for name in ("kv", "index_keys"):  # split along seq: each device holds 1/seq of the positions
        assert {s.data.shape[1] for s in getattr(sstate.state, name).addressable_shards} == {per_device}
        np.testing.assert_allclose(getattr(sstate.natural(), name), getattr(reference, name), atol=1e-4, err_msg=name)
    np.testing.assert_allclose(extend_on_mesh(model, params, sstate, tokens[PROMPT:], mesh), logits, atol=1e-4)


def test_parameters_are_sharded_over_the_whole_mesh(tiny):
    """FSDP on GLM's segment stacks [repeats, per_pattern, ...]: per-device bytes ~ total / 8."""
    model, params, *_ = tiny
    mesh = sharding.make_mesh("2x4")
    placed = jax.device_put(params, rules.named(rules.param_specs(params, mesh), mesh))
    used = {}
    for leaf in jax.tree.leaves(placed):
        for shard in leaf.addressable_shards:
            used[shard.device] = used.get(shard.device, 0) + shard.data.nbytes
    total = sum(x.nbytes for x in jax.tree.leaves(params))
    assert len(used) == 8 and max(used.values()) <= total / 8 + 1024, (max(used.values()), total / 8)


def test_routed_experts_are_expert_parallel(tiny):
    """The tiny config's 8 experts on 8 devices: one expert per device, split by expert index, never all-gathered
    (the replay's compiled program has no all-gather whose result holds a layer's experts), while the other layer
    weights are (FSDP); the results equal one device's (test above and the gradients below)."""
    model, params, tokens, *_ = tiny
    mesh = sharding.make_mesh("2x4")
    specs = rules.param_specs(params, mesh)
    layer = specs["layers"]["0"]["full_sparse"]["mlp"]
    assert {layer[name] for name in rules.EXPERT_LEAVES} == {jax.sharding.PartitionSpec(None, None, rules.FSDP)}
    assert layer["router"] != layer["experts_gate"]  # FSDP's choice, not the expert rule
    placed = jax.device_put(params, rules.named(specs, mesh))
    sstate = capture_on_mesh(model, placed, tokens[:PROMPT], mesh)
    hlo = engine_capture._jitted_extend_hidden.lower(model, placed, sstate, tokens[PROMPT:], mesh).compile().as_text()
    gathered = [line.split("=")[1].split()[0] for line in hlo.splitlines() if " all-gather(" in line]
    e, i, d = params["layers"]["0"]["full_sparse"]["mlp"]["experts_gate"].shape[2:]
    assert gathered and not [g for g in gathered if f"[{e},{i},{d}]" in g or f"[{e},{d},{i}]" in g], gathered


def test_padding_cannot_leak(tiny):
    """2x4 in one round with placed parameters: the compiled capture of the 2x4 case above (pad_id only changes the
    host-side token layout)."""
    model, params, tokens, _, _ = tiny
    mesh = sharding.make_mesh("2x4")
    params = jax.device_put(params, rules.named(rules.param_specs(params, mesh), mesh))
    a = capture_on_mesh(model, params, tokens[:PROMPT], mesh, pad_id=0)
    b = capture_on_mesh(model, params, tokens[:PROMPT], mesh, pad_id=7)
    padding = np.setdiff1d(np.arange(a.layout.padded), np.argsort(a.layout.stored_positions())[:PROMPT])
    assert not np.any(np.asarray(a.state.kv)[:, padding])
    chex.assert_trees_all_equal(a, b)


def _batch(vocab: int, prompt: int = PROMPT + 1, length: int = 7):
    rng = np.random.default_rng(0)
    mask = (np.arange(length)[None, :] < np.array([[length], [4], [length - 1]])).astype(np.float32)
    return GroupBatch(prompt=rng.integers(0, vocab, prompt).astype(np.int32),
                      responses=rng.integers(0, vocab, (3, length)).astype(np.int32), mask=mask,
                      rewards=np.array([1.0, 0.0, 0.5], np.float32),
                      old_logprobs=np.where(mask == 1, rng.normal(-6, 0.3, mask.shape), np.nan).astype(np.float32),
                      ref_logprobs=rng.normal(-6, 0.3, mask.shape).astype(np.float32))


@pytest.mark.slow  # caches cleared: capture, extend and grpo_grads compile again with the emulated exchange
def test_ragged_exchange_equals_one_device(tiny, monkeypatch):
    """The GPU exchange (`parallel.experts.ragged`, with `ragged_all_to_all` emulated: XLA:CPU has none) in the model:
    capture + decoding (tokens replicated over seq) on 2x4 and grpo_grads on 2x4 (inside `groups.over_data`: the
    exchange names the manual `data` axis) equal one device. The caches are cleared first, so that nothing compiled
    by the tests above (the all-gather exchange) is reused; each step traces the emulated collective."""
    traced = []

    def collective(*args, **kwargs):
        traced.append(kwargs["axis_name"])
        return emulated_ragged_all_to_all(*args, **kwargs)

    monkeypatch.setattr(experts, "exchange_for", lambda backend: functools.partial(experts.ragged,
                                                                                   collective=collective))
    jax.clear_caches()
    model, params, tokens, _, logits = tiny
    mesh = sharding.make_mesh("2x4")
    placed = jax.device_put(params, rules.named(rules.param_specs(params, mesh), mesh))
    sstate = capture_on_mesh(model, placed, tokens[:PROMPT], mesh)
    np.testing.assert_allclose(extend_on_mesh(model, placed, sstate, tokens[PROMPT:], mesh), logits, atol=1e-4)
    assert traced and set(traced) == {rules.FSDP}
    traced.clear()
    assert_sharded_grads_match(model, params, _batch(model.config.vocab_size), "2x4", "detached")
    assert traced


def _check_32_devices() -> dict:
    """In a fresh process with 32 CPU devices, 4x8: capture + extend (37 prompt positions: 16 segments of 3, 11
    padding) and exact grpo_grads (prompt 38, rounds of 24) against one device; returns the errors (as
    tests/models/test_qwen36_mesh.py's)."""
    jax.config.update("jax_num_cpu_devices", 32)
    jax.config.update("jax_default_matmul_precision", "highest")
    # 32 experts: one per device (expert-parallel on 4x8)
    model, params = _model(num_hidden_layers=2, indexer_types=("full", "shared"), mlp_layer_types=("sparse",) * 2,
                           n_routed_experts=32)
    tokens = jax.random.randint(jax.random.key(2), (43,), 0, model.config.vocab_size, dtype=jnp.int32)
    reference = model.extend(params, model.capture(params, tokens[:37], chunk_size=16), tokens[37:])
    mesh = sharding.make_mesh("4x8")
    placed = jax.device_put(params, rules.named(rules.param_specs(params, mesh), mesh))
    sstate = capture_on_mesh(model, placed, tokens[:37], mesh)
    got = extend_on_mesh(model, placed, sstate, tokens[37:], mesh)
    batch = _batch(model.config.vocab_size, prompt=38, length=5)
    loss, grads, _ = grpo_grads(model, params, batch, SHARDED_CFG, "exact", chunk_size=16)
    got_loss, got_grads, _ = grpo_grads(model, placed, batch, SHARDED_CFG, "exact", chunk_size=24, mesh=mesh)
    experts = got_grads["layers"]["0"]["full_sparse"]["mlp"]["experts_gate"]
    return {"logits_max_abs_diff": float(jnp.max(jnp.abs(got - reference))),
            "expert_grad_shards": sorted({s.data.shape[2] for s in experts.addressable_shards}),
            "cache_devices": len({s.device for s in sstate.state.kv.addressable_shards}),
            "grads_rel_err": rel_err(got_grads, grads), "loss_diff": abs(float(got_loss) - float(loss))}


@pytest.mark.slow  # a fresh 32-device process compiles capture, extend and grpo_grads
def test_capture_extend_and_grads_equal_one_device_on_32_devices():
    result = run_32_device_check("tests.models.test_glm52_mesh")
    assert result["cache_devices"] == 32 and result["expert_grad_shards"] == [1], result
    assert result["logits_max_abs_diff"] <= 1e-4, result
    assert result["grads_rel_err"] <= 1e-4, result
    assert result["loss_diff"] <= 1e-5, result


if __name__ == "__main__":
    print(json.dumps(_check_32_devices()))
