"""Groups side by side: a batch of B groups (prompt [B, P], responses [B, G, R], ...) has per-group advantages and
one loss aggregated over the whole batch; on a mesh, B is split over `data` and each data slice computes only its
own groups (sequence-parallel inside the slice), gradients reduced over the whole mesh.

Oracles: the naive full graph on the same B groups (one device), and the one-device engine (for the mesh).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longstraw_jax import GroupBatch, GRPOConfig, grpo_grads, models, naive_grpo_grads, sharding
from longstraw_jax.grpo import grpo_loss, token_weights, validate_batch
from longstraw_jax.models.glm52 import Glm52Config
from longstraw_jax.parallel import groups as groups_lib, rules
from tests.helpers import assert_metrics_equal, o1_params, rel_err

P, R, G = 30, 6, 3
CFG = GRPOConfig(kl_coef=0.1, loss_agg="seq-mean-token-mean")


def _model(family: str):
    config = models.Qwen36Config.tiny() if family == "qwen" else Glm52Config.tiny()
    model = models.build(config)
    return model, o1_params(model.init(jax.random.key(0)), jax.random.key(1))


def _groups(vocab: int, groups_per_step: int, seed: int = 0) -> GroupBatch:
    """B groups with different prompts, ragged masks, distinct rewards per group, old and ref log-probs."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, R + 1, (groups_per_step, G))
    mask = (np.arange(R) < lengths[..., None]).astype(np.float32)
    logp = lambda: rng.normal(-6, 0.3, mask.shape).astype(np.float32)
    return GroupBatch(prompt=rng.integers(0, vocab, (groups_per_step, P)).astype(np.int32),
                      responses=rng.integers(0, vocab, (groups_per_step, G, R)).astype(np.int32), mask=mask,
                      rewards=rng.normal(0, 1, (groups_per_step, G)).astype(np.float32),
                      old_logprobs=np.where(mask == 1, logp(), np.nan).astype(np.float32), ref_logprobs=logp())


@pytest.fixture(scope="module")
def qwen():
    return _model("qwen")


def test_whole_batch_aggregation_matches_verl():
    """token-mean divides by all tokens of all groups; seq-mean-token-mean averages over all B * G sequences;
    seq-mean-token-sum-norm divides by B * G * R; advantages are normalised within each group."""
    batch = _groups(50, 2)
    mask = batch.mask
    for agg, want in (("token-mean", mask / mask.sum()),
                      ("seq-mean-token-mean", mask / (2 * G * mask.sum(-1, keepdims=True))),
                      ("seq-mean-token-sum-norm", mask / (2 * G * R))):
        np.testing.assert_allclose(token_weights(mask, GRPOConfig(loss_agg=agg)), want, rtol=1e-6, err_msg=agg)
    # the batch loss is not the mean of the groups' own losses when lengths differ (token-mean): one aggregation
    logp = jnp.asarray(np.random.default_rng(1).normal(-2, 0.5, mask.shape), jnp.float32)
    cfg = GRPOConfig(loss_agg="token-mean")
    whole, metrics = grpo_loss(logp, batch, cfg)
    per_group = [grpo_loss(logp[b], batch.group(b), cfg)[0] * batch.group(b).mask.sum() for b in range(2)]
    np.testing.assert_allclose(whole, sum(per_group) / mask.sum(), rtol=1e-5)
    np.testing.assert_allclose(metrics["reward_mean"], batch.rewards.mean(), rtol=1e-6)


@pytest.mark.slow  # naive and exact compiles of a two-group batch
def test_grouped_engine_equals_naive_on_one_device(qwen):
    """The batch of `test_groups_on_the_mesh_equal_one_device`'s ("qwen", "exact", 2) case: one compile of the exact
    engine serves as this test's subject and as that test's one-device reference."""
    model, params = qwen
    batch = _groups(model.config.vocab_size, 2, seed=2)
    want_loss, want_grads, want_metrics = naive_grpo_grads(model, params, batch, CFG)
    loss, grads, metrics = grpo_grads(model, params, batch, CFG, "exact", chunk_size=8)
    assert abs(float(loss) - float(want_loss)) <= 1e-5 * max(1.0, abs(float(want_loss)))
    assert rel_err(grads, want_grads) <= 1e-4
    assert_metrics_equal(metrics, want_metrics)


def test_grouped_batch_errors_name_the_field(qwen):
    model, _ = qwen
    batch = _groups(model.config.vocab_size, 2)
    with pytest.raises(ValueError, match=r"GroupBatch.responses has 3 groups but prompt has 2"):
        validate_batch(batch.replace(responses=np.zeros((3, G, R), np.int32)), model.config.vocab_size)
    with pytest.raises(ValueError, match=r"GroupBatch.rewards has shape \(2, 4\); expected \[B, G\] = \(2, 3\)"):
        validate_batch(batch.replace(rewards=np.zeros((2, 4), np.float32)), model.config.vocab_size)
    empty = batch.mask.copy()
    empty[1, 2] = 0
    with pytest.raises(ValueError, match=r"all zero for \(group, branch\) \[\(1, 2\)\]"):
        validate_batch(batch.replace(mask=empty), model.config.vocab_size)
    bad = batch.prompt.copy()
    bad[1, 4] = model.config.vocab_size
    with pytest.raises(ValueError, match=r"GroupBatch.prompt\[1, 4\] = \d+ is out of range"):
        validate_batch(batch.replace(prompt=bad), model.config.vocab_size)


def test_groups_must_split_over_data(qwen):
    model, params = qwen
    with pytest.raises(ValueError, match="3 groups do not split over the mesh.s data axis of size 2"):
        grpo_grads(model, params, _groups(model.config.vocab_size, 3), CFG, "detached", chunk_size=8,
                   mesh=sharding.make_mesh("2x4"))


def _on_mesh(model, params, batch, mode, spec, chunk_size=8):
    mesh = sharding.make_mesh(spec)
    placed = jax.device_put(params, rules.named(rules.param_specs(params, mesh), mesh))
    return grpo_grads(model, placed, batch, CFG, mode, chunk_size=chunk_size, mesh=mesh)


@pytest.mark.slow  # three mesh compiles (and their one-device references)
@pytest.mark.parametrize("family,mode,groups_per_step", [("qwen", "exact", 2), ("qwen", "detached", 4),
                                                    ("glm", "exact", 2)])
def test_groups_on_the_mesh_equal_one_device(family, mode, groups_per_step, monkeypatch):
    """2x4: each data slice runs B/2 groups over its 4 seq devices (rounds of 8 positions). A debug callback at each
    group records (data index, group index) where it runs (once per data slice: `seq` is not manual there): each group
    is computed once, by its own slice, never by the other."""
    model, params = _model(family)
    batch = _groups(model.config.vocab_size, groups_per_step, seed=groups_per_step)
    want_loss, want_grads, want_metrics = grpo_grads(model, params, batch, CFG, mode, chunk_size=8)
    seen = []
    monkeypatch.setattr(groups_lib, "observe", lambda index: jax.debug.callback(
        lambda d, g: seen.append((int(d), int(g))), jax.lax.axis_index("data"), index))
    loss, grads, metrics = _on_mesh(model, params, batch, mode, "2x4")
    jax.effects_barrier()
    assert abs(float(loss) - float(want_loss)) <= 1e-5 * max(1.0, abs(float(want_loss)))
    assert rel_err(grads, want_grads) <= 1e-4
    assert_metrics_equal(metrics, want_metrics)
    per_slice = groups_per_step // 2
    assert sorted(seen) == [(g // per_slice, g) for g in range(groups_per_step)]  # once each, by its own slice


@pytest.mark.slow  # a fresh model config: the sampler and two train steps compile
def test_one_capture_per_step(monkeypatch):
    """The trainer's step: sample B groups keeping their captures, then train_step(captured=...). The prompt is
    captured once per group (traced capture calls counted; a fresh model config, so nothing comes from a jit cache),
    and the update from the kept capture equals the update that captures again."""
    from longstraw_jax import engine, train
    from longstraw_jax.sampling import branches as rollout
    from longstraw_jax.sampling.branches import SamplingConfig
    from longstraw_jax.sampling.groups import sample_groups

    calls = []

    def counting(original):
        def capture_chunks(*args, **kwargs):
            calls.append(args[2].shape)
            return original(*args, **kwargs)
        return capture_chunks

    for module in (engine, rollout):
        monkeypatch.setattr(module, "capture_chunks", counting(module.capture_chunks))
    model = models.build(models.Qwen36Config.tiny(vocab_size=37))
    params = o1_params(model.init(jax.random.key(0)), jax.random.key(1))
    prompts = np.random.default_rng(3).integers(0, 37, (2, P))
    keys = jax.vmap(lambda b: jax.random.fold_in(jax.random.key(4), b))(np.arange(2))
    rollouts, captured = sample_groups(model, params, prompts, keys, G, SamplingConfig(response_len=R), 8)
    batch = GroupBatch(prompt=prompts.astype(np.int32), responses=np.asarray(rollouts.responses),
                       mask=np.asarray(rollouts.mask), rewards=np.array([[1.0, 0.0, 0.5], [0.0, 0.0, 2.0]], np.float32),
                       old_logprobs=np.asarray(rollouts.logprobs))
    optimizer = train.make_optimizer(1e-2)
    opt_state = optimizer.init(params)
    assert len(calls) == 1  # the sampler's (traced once for the B groups' lax.map)
    cfg = GRPOConfig(loss_agg="token-mean")
    kept = train.train_step(model, params, opt_state, batch, optimizer, cfg, "exact", 8, captured=captured)
    assert len(calls) == 1  # the update did not capture
    again = train.train_step(model, params, opt_state, batch, optimizer, cfg, "exact", 8)
    assert len(calls) == 2  # without the kept capture it does (so the counter sees the update's capture)
    assert rel_err(kept[0], again[0]) <= 1e-4  # updated params (the two captures differ in round-off only)
    np.testing.assert_allclose(kept[2]["loss"], again[2]["loss"], rtol=1e-5, atol=1e-6)
