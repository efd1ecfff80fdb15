"""Groups side by side: a batch of B groups (prompt [B, P], responses [B, G, R], ...) has per-group advantages and
one loss aggregated over the whole batch (verl's aggregations), its errors name the field, and the trainer's step
captures each prompt once. The engine on B groups against the naive full graph, and on a mesh (B split over `data`,
each data slice computing only its own groups) against one device, are cases of tests/engine/test_mesh.py.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longstraw_jax import GroupBatch, GRPOConfig, models
from longstraw_jax.grpo import grpo_loss, token_weights, validate_batch
from tests.helpers import o1_params, random_groups, rel_err

P, R, G = 30, 6, 3


def test_whole_batch_aggregation_matches_verl():
    """token-mean divides by all tokens of all groups; seq-mean-token-mean averages over all B * G sequences;
    seq-mean-token-sum-norm divides by B * G * R; advantages are normalised within each group."""
    batch = random_groups(50, (0, 0), P, R, G)
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


def test_grouped_batch_errors_name_the_field():
    vocab = models.Qwen36Config.tiny().vocab_size
    batch = random_groups(vocab, (0, 0), P, R, G)
    with pytest.raises(ValueError, match=r"GroupBatch.responses has 3 groups but prompt has 2"):
        validate_batch(batch.replace(responses=np.zeros((3, G, R), np.int32)), vocab)
    with pytest.raises(ValueError, match=r"GroupBatch.rewards has shape \(2, 4\); expected \[B, G\] = \(2, 3\)"):
        validate_batch(batch.replace(rewards=np.zeros((2, 4), np.float32)), vocab)
    empty = batch.mask.copy()
    empty[1, 2] = 0
    with pytest.raises(ValueError, match=r"all zero for \(group, branch\) \[\(1, 2\)\]"):
        validate_batch(batch.replace(mask=empty), vocab)
    bad = batch.prompt.copy()
    bad[1, 4] = vocab
    with pytest.raises(ValueError, match=r"GroupBatch.prompt\[1, 4\] = \d+ is out of range"):
        validate_batch(batch.replace(prompt=bad), vocab)


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

    for module in (engine.local, rollout):
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
    # the two captures differ in round-off only: the raw gradients' norm agrees to float32 round-off, and the updates
    # up to a few elements, since AdamW's first step moves each parameter by about lr * sign(g) and round-off flips
    # the sign of near-zero gradients (on an AVX-512 host the updated params differed by 1.1e-4 relative, the updates
    # by 1.4e-3, the norms by 9e-7; an update from another prompt's capture differs by O(1))
    np.testing.assert_allclose(kept[2]["grad_norm"], again[2]["grad_norm"], rtol=1e-5)
    step = lambda new: jax.tree.map(lambda a, p: a - p, new, params)
    assert rel_err(step(kept[0]), step(again[0])) <= 1e-2
    np.testing.assert_allclose(kept[2]["loss"], again[2]["loss"], rtol=1e-5, atol=1e-6)


def test_one_group_decodes_without_a_group_axis():
    """`decode_together` vmaps over B > 1 groups (the GROUPS axis bound, as `any_slice` needs) and runs B = 1
    unbatched, its results given the unit axis back; None leaves pass through."""
    from longstraw_jax.sampling.groups import decode_together
    from longstraw_jax.sharding.groups import any_slice

    seen = []

    def sample(x, pad):
        seen.append((x.shape, pad))
        return {"twice": 2 * x, "any": any_slice(x > 2)}

    for b in (1, 3):
        x = jnp.arange(b * 4, dtype=jnp.float32).reshape(b, 4)
        out = decode_together(sample, x, None)
        assert seen[-1] == ((4,), None)  # each call sees one group's leaves
        np.testing.assert_array_equal(out["twice"], 2 * x)
        np.testing.assert_array_equal(out["any"], [bool((x > 2).any())] * b)  # over every group decoding together
    with pytest.raises(ValueError, match="leading axes"):
        decode_together(sample, jnp.zeros((1, 4)), jnp.zeros((2,)))


@pytest.mark.slow  # two sampler compiles
def test_one_group_samples_what_it_samples_among_others():
    """sample_groups on B = 1 (decoded without a group axis) draws group b's tokens of a B = 2 batch (vmapped over
    groups) from the same key and prompt, with the same log-probs and capture up to round-off."""
    from longstraw_jax.sampling.branches import SamplingConfig
    from longstraw_jax.sampling.groups import sample_groups

    model = models.build(models.Qwen36Config.tiny(vocab_size=37))
    params = o1_params(model.init(jax.random.key(0)), jax.random.key(1))
    prompts = np.random.default_rng(3).integers(0, 37, (2, P))
    keys = jax.vmap(lambda b: jax.random.fold_in(jax.random.key(4), b))(np.arange(2))
    sampling = SamplingConfig(response_len=R, stop_token=5)
    left_pad = np.array([0, 3], np.int32)
    both, both_captured = sample_groups(model, params, prompts, keys, G, sampling, 8, left_pad=left_pad)
    for b in range(2):
        one, one_captured = sample_groups(model, params, prompts[b : b + 1], keys[b : b + 1], G, sampling, 8,
                                          left_pad=left_pad[b : b + 1])
        np.testing.assert_array_equal(one.responses[0], both.responses[b])
        np.testing.assert_array_equal(one.mask[0], both.mask[b])
        np.testing.assert_allclose(one.logprobs[0], both.logprobs[b], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(one.first_logprobs[0], both.first_logprobs[b], rtol=1e-5, atol=1e-5)
        for got, want in zip(jax.tree.leaves(one_captured), jax.tree.leaves(both_captured)):
            np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(want[b], np.float32), rtol=1e-5,
                                       atol=1e-5)
