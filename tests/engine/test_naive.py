"""The full-graph GRPO oracle on the tiny Qwen3.6: finite, params-shaped gradients; loss equal to a per-branch loop
over `model.forward`; gradient consistent with a finite difference of its own loss."""
import chex
import jax
import numpy as np
import pytest

from longstraw_jax import GroupBatch, GRPOConfig, models, naive_grpo_grads
from longstraw_jax.grpo import branch_loss, group_advantages, token_weights

P, G, R = 24, 3, 8
CFG = GRPOConfig(loss_agg="seq-mean-token-mean", kl_coef=0.1)


@pytest.fixture(scope="module")
def setup():
    # gdn_chunk_size=16: P + R = 32 tokens span two GDN chunks; it also keeps XLA:CPU off its slow 64x64
    # triangular solve (~50 ms per call), which would make every step here seconds long.
    model = models.build(models.Qwen36Config.tiny(gdn_chunk_size=16))
    params = model.init(jax.random.key(0))
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    lengths = np.array([8, 3, 6])  # ragged
    mask = (np.arange(R)[None, :] < lengths[:, None]).astype(np.float32)
    noise = lambda: rng.normal(0, 0.3, (G, R)).astype(np.float32)
    base = np.float32(-np.log(vocab))  # about the log-prob of a random token under a random tiny model
    batch = GroupBatch(prompt=rng.integers(0, vocab, P).astype(np.int32),
                       responses=rng.integers(0, vocab, (G, R)).astype(np.int32), mask=mask,
                       rewards=np.array([1.0, 0.0, 0.25], np.float32),
                       old_logprobs=base + noise(), ref_logprobs=base + noise())
    step = jax.jit(naive_grpo_grads, static_argnums=(0, 3))
    return model, params, batch, step, step(model, params, batch, CFG)


def test_finite_loss_and_params_shaped_grads(setup):
    model, params, batch, _, (loss, grads, metrics) = setup
    assert np.isfinite(loss)
    chex.assert_trees_all_equal_shapes_and_dtypes(grads, params)  # and the same tree structure
    chex.assert_tree_all_finite(grads)
    assert np.abs(grads["lm_head"]).max() > 0 and np.abs(grads["blocks"]["linear"]["in_proj_qkv"]).max() > 0
    assert all(np.isfinite(v) for v in metrics.values())
    np.testing.assert_allclose(metrics["response_len_mean"], batch.mask.sum() / G)
    assert 0 < metrics["entropy"] <= np.log(model.config.vocab_size) + 1e-4


def test_loss_equals_loop_over_branches(setup):
    model, params, batch, _, (loss, _, metrics) = setup
    adv, weights = group_advantages(batch.rewards, CFG), token_weights(batch.mask, CFG)
    total, clipped = 0.0, 0.0
    for g in range(G):
        logits = model.forward(params, np.concatenate([batch.prompt, batch.responses[g]]))
        scored = jax.nn.log_softmax(logits[P - 1 : P - 1 + R], axis=-1)  # the logit at P-1+t scores token t
        logp = scored[np.arange(R), batch.responses[g]]
        loss_g, sums = branch_loss(logp, batch.old_logprobs[g], batch.ref_logprobs[g], adv[g], weights[g],
                                   batch.mask[g], CFG)
        total, clipped = total + loss_g, clipped + sums["clipped"]
    np.testing.assert_allclose(loss, total, rtol=1e-5, atol=1e-6)
    assert abs(float(total)) > 1e-3
    np.testing.assert_allclose(metrics["clip_frac"], clipped / batch.mask.sum(), rtol=1e-6)


def test_gradient_matches_directional_finite_difference(setup):
    model, params, batch, step, (_, grads, _) = setup
    norm = np.sqrt(sum(np.sum(np.square(g, dtype=np.float64)) for g in jax.tree.leaves(grads)))
    move = jax.jit(lambda params, h: jax.tree.map(lambda p, g: p + (h / norm) * g, params, grads))
    h = 1e-4  # the tiny model is strongly curved along its gradient (l2-normalised q, k of small norm)
    plus = step(model, move(params, h), batch, CFG)[0]
    minus = step(model, move(params, -h), batch, CFG)[0]
    np.testing.assert_allclose((plus - minus) / (2 * h), norm, rtol=1e-2)  # d/dh loss(p + h g/|g|) = |g|


def test_eager_call_validates_batch(setup):
    model, params, batch, _, _ = setup
    bad = batch.replace(responses=np.where(batch.mask == 1, batch.responses, model.config.vocab_size))
    with pytest.raises(ValueError, match="responses"):
        naive_grpo_grads(model, params, bad, CFG)
