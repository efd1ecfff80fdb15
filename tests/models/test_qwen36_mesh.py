"""Sequence-parallel capture and sharded replay of Qwen3.6 == one device (float32, tiny config, 8 CPU devices).

Prompt lengths do not divide by the 2 * seq segments; padding must not leak (results do not depend on the pad id,
padding slots of the cache are zero). A 4x8 mesh (32 devices) runs in a subprocess.
"""
import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from longstraw_jax import models, sharding
from longstraw_jax.engine.capture import capture_on_mesh, extend_on_mesh
from longstraw_jax.models.qwen36 import Qwen36Config
from longstraw_jax.sharding import SeqLayout, rules, sequence
from longstraw_jax.sharding.layout import RoundLayout
from longstraw_jax.sharding.sequence import SEQ
from tests.helpers import o1_params, rel_err, run_32_device_check

PROMPT, TOTAL = 45, 56  # 45 = 2 * 8 segments of 3 with 3 padding positions (2x4: 8 segments of 6, 3 padding)


@pytest.fixture(scope="module")
def tiny():
    model = models.build(Qwen36Config.tiny())
    params = o1_params(model.init(jax.random.key(0)), jax.random.key(1))
    tokens = jax.random.randint(jax.random.key(2), (TOTAL,), 0, model.config.vocab_size, dtype=jnp.int32)
    reference = model.capture(params, tokens[:PROMPT], chunk_size=16)
    return model, params, tokens, reference, model.extend(params, reference, tokens[PROMPT:])


def test_ring_take_fetches_any_shards_rows_and_sends_cotangents_home():
    """ring_take on 1x8 == indexing the whole array on one device, in value and in the gradient wrt the rows (each
    shard's cotangent lands on its own rows, repeated picks add up); wanted rows from every shard, in any order."""
    mesh = sharding.make_mesh("1x8")
    n, rows_per, width = 8, 5, 3
    x = jax.random.normal(jax.random.key(0), (n * rows_per, width))
    wanted = jax.random.randint(jax.random.key(1), (n, 4, 6), 0, n * rows_per)  # per shard [4, 6] global rows
    weights = jax.random.normal(jax.random.key(2), (n, 4, 6, width))

    def sharded(x, wanted, weights):
        def local(x, wanted, weights):
            got = sequence.ring_take(x, wanted[0] // rows_per, wanted[0] % rows_per, n)
            return got[None], jax.lax.psum(jnp.sum(got * weights[0]), SEQ)
        return rules.shard_map(local, mesh, (P(SEQ), P(SEQ), P(SEQ)), (P(SEQ), P()))(x, wanted, weights)

    got, _ = jax.jit(sharded)(x, wanted, weights)
    np.testing.assert_array_equal(got, x[wanted])
    grad = jax.jit(jax.grad(lambda x: sharded(x, wanted, weights)[1]))(x)
    np.testing.assert_allclose(grad, jax.grad(lambda x: jnp.sum(x[wanted] * weights))(x), rtol=1e-6, atol=1e-6)


def test_round_layout():
    rounds = RoundLayout.for_prompt(44, 2, min_segment=3, chunk_size=12)
    assert (rounds.full, rounds.round.segment, rounds.last.length, rounds.padded) == (3, 3, 8, 48)
    stored = rounds.stored_positions()
    assert list(stored[:12]) == [0, 1, 2, 9, 10, 11, 12, 13, 14, 21, 22, 23]  # shard 0: rounds 0 and 1
    x = jnp.arange(44) * 10
    np.testing.assert_array_equal(rounds.to_natural(rounds.to_stored(x, pad_id=-1), axis=0), x)
    single = RoundLayout.for_prompt(45, 4, min_segment=3)
    assert single.full == 0 and list(single.stored_positions()) == list(SeqLayout.for_prompt(45, 4, 3)
                                                                         .stored_positions())


def test_layout_zigzag_round_trip():
    layout = SeqLayout.for_prompt(45, 4, min_segment=3)
    assert (layout.segment, layout.padded) == (6, 48)
    stored = layout.stored_positions()
    assert list(stored[:12]) == list(range(0, 6)) + list(range(42, 48))  # shard 0: first and last segment
    x = jnp.arange(45) * 10
    np.testing.assert_array_equal(layout.to_natural(layout.to_stored(x, pad_id=-1), axis=0), x)
    assert SeqLayout.for_prompt(5, 8, min_segment=3).segment == 3  # the conv halo fits in one segment


@pytest.mark.parametrize("spec,attention", [("2x4", "ring"), ("1x8", "allgather"), ("1x8", "ring")])
def test_sharded_capture_and_extend_equal_one_device(tiny, spec, attention):
    model, params, tokens, reference, logits = tiny
    mesh = sharding.make_mesh(spec)
    params = jax.device_put(params, rules.named(rules.param_specs(params, mesh), mesh))
    sstate = capture_on_mesh(model, params, tokens[:PROMPT], mesh, attention=attention)
    assert sstate.state.length == PROMPT and sstate.state.keys.shape[2] == sstate.layout.padded
    # the cache is split along seq: each device holds 1/seq of the positions
    seq = mesh.shape["seq"]
    assert {s.data.shape[2] for s in sstate.state.keys.addressable_shards} == {sstate.layout.padded // seq}
    natural = sstate.natural()
    for name in ("conv", "recurrent", "keys", "values"):
        np.testing.assert_allclose(getattr(natural, name), getattr(reference, name), atol=1e-4, err_msg=name)
    padding = np.setdiff1d(np.arange(sstate.layout.padded), np.argsort(sstate.layout.stored_positions())[:PROMPT])
    assert not np.any(np.asarray(sstate.state.keys)[:, :, padding])
    got = extend_on_mesh(model, params, sstate, tokens[PROMPT:], mesh)
    np.testing.assert_allclose(got, logits, atol=1e-4)


def test_capture_in_rounds_equals_one_device(tiny):
    """Rounds: 4x2 with rounds of 12 = 3 full rounds + a last one of 9 (padded to 12). Same state and replay logits
    as one device. (2x4 in rounds of 16 is `test_row_blocks_change_nothing`'s set-up.)"""
    model, params, tokens, reference, logits = tiny
    mesh = sharding.make_mesh("4x2")
    sstate = capture_on_mesh(model, params, tokens[:PROMPT], mesh, chunk_size=12)
    assert sstate.layout.full == 3
    for name in ("conv", "recurrent", "keys", "values"):
        np.testing.assert_allclose(getattr(sstate.natural(), name), getattr(reference, name), atol=1e-4, err_msg=name)
    np.testing.assert_allclose(extend_on_mesh(model, params, sstate, tokens[PROMPT:], mesh), logits, atol=1e-4)


@pytest.mark.slow  # captures recompiled with small row blocks
def test_row_blocks_change_nothing(tiny, monkeypatch):
    """Position-wise work (and the earlier-rounds attention of the gathered queries) in blocks of 7 rows (ROWS is
    4096; 2x4 holds 12 positions per device): same state and logits as one device; `_by_rows` pads a ragged last
    block and returns pytrees. Also the 2x4 case of capture in rounds: rounds of 16 (segments of 3: 24 positions)
    = 1 full round + 21."""
    from longstraw_jax.engine import capture as api
    from longstraw_jax.models.qwen36 import mesh_forward as sharded_qwen36

    x = jnp.arange(30.0).reshape(10, 3)
    out = sharded_qwen36._by_rows(lambda a, b: {"s": a * 2 + b[:, :1]}, x, x + 1, rows=4)
    np.testing.assert_array_equal(out["s"], x * 2 + (x + 1)[:, :1])
    model, params, tokens, reference, logits = tiny
    monkeypatch.setattr(sharded_qwen36, "ROWS", 7)
    for fn in (api.jitted_capture_on_mesh, api._jitted_extend_hidden):
        fn.clear_cache()
    mesh = sharding.make_mesh("2x4")
    sstate = capture_on_mesh(model, params, tokens[:PROMPT], mesh, chunk_size=16)  # 2 rounds: 24 gathered queries
    assert sstate.layout.full == 1
    for name in ("conv", "recurrent", "keys", "values"):
        np.testing.assert_allclose(getattr(sstate.natural(), name), getattr(reference, name), atol=1e-4, err_msg=name)
    np.testing.assert_allclose(extend_on_mesh(model, params, sstate, tokens[PROMPT:], mesh), logits, atol=1e-4)
    for fn in (api.jitted_capture_on_mesh, api._jitted_extend_hidden):
        fn.clear_cache()


def _check_32_devices() -> dict:
    """Run in a fresh process with 32 CPU devices: 4x8 mesh, a one-block model (LLLF), 37 prompt positions (16
    segments of 3, 11 padding). Returns the largest logit difference from one device, the number of devices holding
    the cache, and the relative gradient error and loss difference of the exact-mode `grpo_grads` (prompt 38, two
    ragged branches of the 6 remaining tokens, KL on)."""
    jax.config.update("jax_num_cpu_devices", 32)
    jax.config.update("jax_default_matmul_precision", "highest")
    model = models.build(Qwen36Config.tiny(num_hidden_layers=4, layer_types=Qwen36Config.tiny().layer_types[:4]))
    params = o1_params(model.init(jax.random.key(0)), jax.random.key(1))
    tokens = jax.random.randint(jax.random.key(2), (43,), 0, model.config.vocab_size, dtype=jnp.int32)
    reference = model.extend(params, model.capture(params, tokens[:37], chunk_size=16), tokens[37:])
    mesh = sharding.make_mesh("4x8")
    params = jax.device_put(params, rules.named(rules.param_specs(params, mesh), mesh))
    sstate = capture_on_mesh(model, params, tokens[:37], mesh, attention="ring")
    got = extend_on_mesh(model, params, sstate, tokens[37:], mesh)

    from longstraw_jax import GroupBatch, GRPOConfig, grpo_grads

    mask = np.array([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], np.float32)
    batch = GroupBatch(prompt=tokens[:38], responses=jnp.stack([tokens[38:], tokens[38:][::-1]]), mask=mask,
                       rewards=np.array([1.0, 0.0], np.float32), ref_logprobs=np.full((2, 5), -6.0, np.float32))
    cfg = GRPOConfig(kl_coef=0.1)
    single = jax.device_put(jax.tree.map(np.asarray, params), jax.devices()[0])
    loss, grads, _ = grpo_grads(model, single, batch, cfg, "exact", chunk_size=16)
    got_loss, got_grads, _ = grpo_grads(model, params, batch, cfg, "exact", mesh=mesh)
    return {"logits_max_abs_diff": float(jnp.max(jnp.abs(got - reference))),
            "cache_devices": len({s.device for s in sstate.state.keys.addressable_shards}),
            "grads_rel_err": rel_err(got_grads, grads), "loss_diff": abs(float(got_loss) - float(loss))}


@pytest.mark.slow  # a fresh 32-device process compiles capture, extend and grpo_grads
def test_sharded_capture_extend_and_grads_equal_one_device_on_32_devices():
    """4x8 needs 32 devices, more than this session's 8: a subprocess (small model, one jitted shape each)."""
    result = run_32_device_check("tests.models.test_qwen36_mesh")
    assert result["cache_devices"] == 32, result
    assert result["logits_max_abs_diff"] <= 1e-4, result
    assert result["grads_rel_err"] <= 1e-4, result
    assert result["loss_diff"] <= 1e-5, result


def test_padding_cannot_leak(tiny):
    """Padding positions hold a different token id: every state entry and every logit is bit-identical (1x8 all-gather
    with placed parameters: the compiled capture of that case above; pad_id only changes the host-side layout)."""
    model, params, tokens, _, _ = tiny
    mesh = sharding.make_mesh("1x8")
    params = jax.device_put(params, rules.named(rules.param_specs(params, mesh), mesh))
    a = capture_on_mesh(model, params, tokens[:PROMPT], mesh, attention="allgather", pad_id=0)
    b = capture_on_mesh(model, params, tokens[:PROMPT], mesh, attention="allgather", pad_id=7)
    chex.assert_trees_all_equal(a, b)


if __name__ == "__main__":
    print(json.dumps(_check_32_devices()))
