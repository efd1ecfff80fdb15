"""GRPO objective against hand-written numpy formulas; branch decomposition; clipping; k3 KL; batch validation."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longstraw_jax import GroupBatch, GRPOConfig
from longstraw_jax.grpo import (
    LOSS_AGGS,
    batch_advantages,
    branch_loss,
    finalize_metrics,
    group_advantages,
    grpo_loss,
    per_token_loss,
    token_weights,
    validate_batch,
)

G, R, V = 5, 7, 50


def make_batch(seed=0, off_policy=True, ref=True, spread=0.5):
    rng = np.random.default_rng(seed)
    lengths = np.array([7, 3, 1, 5, 6])
    mask = (np.arange(R)[None, :] < lengths[:, None]).astype(np.float32)
    logp = np.log(rng.uniform(0.05, 0.95, (G, R))).astype(np.float32)
    batch = GroupBatch(
        prompt=rng.integers(0, V, 9).astype(np.int32),
        responses=rng.integers(0, V, (G, R)).astype(np.int32),
        mask=mask,
        rewards=rng.normal(size=G).astype(np.float32),
        old_logprobs=(logp + rng.normal(0, spread, (G, R))).astype(np.float32) if off_policy else None,
        ref_logprobs=(logp + rng.normal(0, spread, (G, R))).astype(np.float32) if ref else None,
    )
    return logp, batch


def numpy_loss(logp, batch, cfg):
    """Independent formula: explicit advantages, surrogate, k3, then each aggregation written out."""
    r = batch.rewards.astype(np.float64)
    adv = r - r.mean()
    if cfg.adv_norm == "std":
        adv = adv / (r.std() + cfg.eps)
    old = logp if batch.old_logprobs is None else batch.old_logprobs
    m = batch.mask
    ratio = np.exp(logp - old)
    if cfg.ratio == "sequence":  # GSPO: each branch's geometric mean of its real tokens' ratios, on every token
        ratio = np.exp(((logp - old) * m).sum(1, keepdims=True) / m.sum(1, keepdims=True)) * np.ones_like(logp)
    a = adv[:, None]
    per = -np.minimum(ratio * a, np.clip(ratio, 1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high) * a)
    if batch.ref_logprobs is not None:
        d = batch.ref_logprobs - logp
        per = per + cfg.kl_coef * (np.exp(d) - d - 1)
    if cfg.loss_agg == "token-mean":
        return (per * m).sum() / m.sum()
    if cfg.loss_agg == "seq-mean-token-mean":
        return np.mean((per * m).sum(1) / m.sum(1))
    return np.mean((per * m).sum(1) / R)


# ----- config -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value", [
    ("clip_eps_low", -0.1), ("clip_eps_low", 1.0), ("clip_eps_high", -1.0), ("kl_coef", -0.5),
    ("loss_agg", "sum"), ("adv_norm", "rank"), ("eps", 0.0), ("logprob_chunk", 0), ("logprob_chunk", 8.0),
    ("clip_eps_high", float("nan")),
])
def test_config_rejects_bad_fields(field, value):
    with pytest.raises(ValueError, match=field):
        GRPOConfig(**{field: value})


def test_config_defaults_and_hashable():
    cfg = GRPOConfig()
    assert (cfg.clip_eps_low, cfg.clip_eps_high, cfg.kl_coef, cfg.loss_agg, cfg.adv_norm, cfg.eps,
            cfg.logprob_chunk) == (0.2, 0.28, 0.0, "token-mean", "std", 1e-6, 1024)
    assert hash(cfg) == hash(GRPOConfig()) and cfg != GRPOConfig(kl_coef=0.1)


# ----- advantages -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("adv_norm", ["std", "none"])
def test_advantages_formula(adv_norm):
    r = np.array([1.0, 0.0, 0.0, 3.0], np.float32)
    cfg = GRPOConfig(adv_norm=adv_norm)
    want = (r - r.mean()) / ((r.std() + cfg.eps) if adv_norm == "std" else 1.0)
    np.testing.assert_allclose(group_advantages(r, cfg), want, rtol=1e-6)


@pytest.mark.parametrize("adv_norm", ["std", "none"])
def test_equal_rewards_give_exact_zero_advantages_and_finite_loss(adv_norm):
    cfg = GRPOConfig(adv_norm=adv_norm)
    rewards = np.full(G, 0.1, np.float32)  # mean(0.1 x 5) is not exactly 0.1 in float32
    adv = np.asarray(group_advantages(rewards, cfg))
    assert (adv == 0).all()
    logp, batch = make_batch()
    batch = batch.replace(rewards=rewards, ref_logprobs=None)
    loss, grad = jax.value_and_grad(lambda lp: grpo_loss(lp, batch, cfg)[0])(jnp.asarray(logp))
    assert loss == 0 and np.isfinite(grad).all() and (np.asarray(grad) == 0).all()


def test_single_branch_gets_zero_advantage():
    for adv_norm in ("std", "none"):
        adv = group_advantages(np.array([2.5], np.float32), GRPOConfig(adv_norm=adv_norm))
        assert np.asarray(adv).tolist() == [0.0]


@pytest.mark.parametrize("loss_agg", LOSS_AGGS)
@pytest.mark.parametrize("adv_norm", ["std", "none"])
def test_left_out_branches_count_for_nothing(loss_agg, adv_norm):
    """valid = 0 (an agent branch whose environment failed): the loss, its gradient and the advantages of the other
    branches are those of the group without it; its own mask may be all zero."""
    cfg = GRPOConfig(loss_agg=loss_agg, adv_norm=adv_norm, kl_coef=0.1)
    logp, batch = make_batch()
    valid = np.array([1, 0, 1, 1, 0], np.float32)
    keep = valid == 1
    mask = batch.mask.copy()
    mask[4] = 0  # a branch that failed before its first token
    batch = batch.replace(mask=mask, valid=valid, old_logprobs=np.minimum(batch.old_logprobs, 0),
                          ref_logprobs=np.minimum(batch.ref_logprobs, 0))
    validate_batch(batch, V, cfg)
    sub = jax.tree.map(lambda x: x[keep] if np.ndim(x) and np.shape(x)[0] == G else x, batch.replace(valid=None))
    loss_fn = lambda lp, b: grpo_loss(lp, b, cfg)[0]
    loss, grad = jax.value_and_grad(loss_fn)(jnp.asarray(logp), batch)
    sub_loss, sub_grad = jax.value_and_grad(loss_fn)(jnp.asarray(logp[keep]), sub)
    np.testing.assert_allclose(loss, sub_loss, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grad)[keep], sub_grad, rtol=1e-5, atol=1e-8)
    assert (np.asarray(grad)[~keep] == 0).all()
    adv = np.asarray(batch_advantages(batch.rewards, cfg, valid))
    np.testing.assert_allclose(adv[keep], group_advantages(batch.rewards[keep], cfg), rtol=1e-5, atol=1e-7)
    assert (adv[~keep] == 0).all()
    one = np.array([0, 0, 1, 0, 0], np.float32)  # a single valid branch: no signal
    assert (np.asarray(group_advantages(batch.rewards, cfg, one)) == 0).all()
    with pytest.raises(ValueError, match="all zero.*valid = 0"):
        validate_batch(batch.replace(valid=None), V, cfg)
    with pytest.raises(ValueError, match="GroupBatch.valid has shape"):
        validate_batch(batch.replace(valid=valid[:3]), V, cfg)


# ----- aggregation ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("ratio", ["token", "sequence"])
@pytest.mark.parametrize("loss_agg", LOSS_AGGS)
@pytest.mark.parametrize("off_policy, ref, kl_coef", [(True, True, 0.3), (False, False, 0.0), (True, True, 0.0)])
def test_loss_matches_numpy_formula(loss_agg, off_policy, ref, kl_coef, ratio):
    cfg = GRPOConfig(loss_agg=loss_agg, kl_coef=kl_coef, ratio=ratio)
    logp, batch = make_batch(seed=1, off_policy=off_policy, ref=ref)
    f = jax.jit(jax.value_and_grad(lambda lp: grpo_loss(lp, batch, cfg)[0]))
    loss, grad = f(jnp.asarray(logp))
    logp64 = logp.astype(np.float64)
    np.testing.assert_allclose(loss, numpy_loss(logp64, batch, cfg), rtol=1e-5, atol=1e-7)

    # gradient: central differences of the numpy formula, old/ref held fixed (on-policy: old = logp, constant)
    fixed = batch if off_policy else batch.replace(old_logprobs=logp64)
    step, want = 1e-6, np.zeros_like(logp64)
    for index in np.ndindex(logp.shape):
        e = np.zeros_like(logp64)
        e[index] = step
        want[index] = (numpy_loss(logp64 + e, fixed, cfg) - numpy_loss(logp64 - e, fixed, cfg)) / (2 * step)
    assert np.abs(want).max() > 1e-2 and (want[batch.mask == 0] == 0).all()
    np.testing.assert_allclose(grad, want, rtol=1e-4, atol=1e-7)


def test_sequence_ratio_by_hand():
    """GSPO on one branch of 2 real tokens (and one pad): of the token ratios 2 and 1/2 the first is clipped (A > 0),
    their geometric mean 1 is not; on-policy the gradient is A / len on each real token (seq-mean-token-mean over 2
    branches: weight 1 / (2 * 2))."""
    cfg = GRPOConfig(ratio="sequence", loss_agg="seq-mean-token-mean")
    logp = jnp.log(jnp.array([[0.4, 0.1, 0.5], [0.3, 0.3, 0.3]], jnp.float32))
    old = jnp.log(jnp.array([[0.2, 0.2, 0.9], [0.3, 0.3, 0.3]], jnp.float32))
    batch = GroupBatch(prompt=np.zeros(3, np.int32), responses=np.zeros((2, 3), np.int32),
                       mask=np.array([[1, 1, 0], [1, 1, 1]], np.float32), rewards=np.array([1.0, 0.0], np.float32),
                       old_logprobs=old)
    adv = float(group_advantages(batch.rewards, cfg)[0])  # (1 - 0.5) / (0.5 + eps) ~ 1
    loss, metrics = grpo_loss(logp, batch, cfg)
    assert float(metrics["clip_frac"]) == 0.0  # the token ratio would clip both tokens of branch 0
    token = grpo_loss(logp, batch, dataclasses.replace(cfg, ratio="token"))[1]["clip_frac"]
    assert float(token) == pytest.approx(1 / 5)
    np.testing.assert_allclose(loss, -(adv * 1.0 - adv * 1.0) / 2, atol=1e-6)  # ratios 1: -A1 / 2 - A2 / 2 = 0
    on_policy = batch.replace(old_logprobs=None)
    grad = jax.grad(lambda lp: grpo_loss(lp, on_policy, cfg)[0])(logp)
    want = np.array([[-adv / 4, -adv / 4, 0.0], [adv / 6, adv / 6, adv / 6]])  # branch 1: A = -adv, 3 tokens
    np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-7)


def test_aggregations_differ_and_weights_are_zero_on_padding():
    _, batch = make_batch()
    weights = {agg: np.asarray(token_weights(batch.mask, GRPOConfig(loss_agg=agg))) for agg in LOSS_AGGS}
    for w in weights.values():
        assert (w[batch.mask == 0] == 0).all()
    np.testing.assert_allclose(weights["token-mean"].sum(), 1.0, rtol=1e-6)
    np.testing.assert_allclose(weights["seq-mean-token-mean"].sum(1), np.full(G, 1 / G), rtol=1e-6)
    np.testing.assert_allclose(weights["seq-mean-token-sum-norm"][batch.mask == 1], 1 / (G * R), rtol=1e-6)
    assert not np.allclose(weights["token-mean"], weights["seq-mean-token-mean"])


@pytest.mark.parametrize("loss_agg", LOSS_AGGS)
def test_sum_of_branch_losses_equals_grpo_loss(loss_agg):
    cfg = GRPOConfig(loss_agg=loss_agg, kl_coef=0.1)
    logp, batch = make_batch(seed=2)
    entropy = np.random.default_rng(3).uniform(0, 4, (G, R)).astype(np.float32)
    loss, metrics = grpo_loss(jnp.asarray(logp), batch, cfg, entropy=jnp.asarray(entropy))

    adv, weights = group_advantages(batch.rewards, cfg), token_weights(batch.mask, cfg)
    total, sums = 0.0, None
    for g in range(G):  # what an engine does: one branch at a time, then add
        loss_g, sums_g = branch_loss(jnp.asarray(logp[g]), batch.old_logprobs[g], batch.ref_logprobs[g], adv[g],
                                     weights[g], batch.mask[g], cfg, entropy=entropy[g])
        total = total + loss_g
        sums = sums_g if sums is None else jax.tree.map(jnp.add, sums, sums_g)
    np.testing.assert_allclose(total, loss, rtol=1e-6)
    looped = finalize_metrics(sums, batch.rewards, batch.mask)
    assert set(looped) == set(metrics)
    for key in metrics:
        np.testing.assert_allclose(looped[key], metrics[key], rtol=1e-6, atol=1e-7, err_msg=key)

    m = batch.mask
    np.testing.assert_allclose(metrics["entropy"], (entropy * m).sum() / m.sum(), rtol=1e-6)
    np.testing.assert_allclose(metrics["reward_mean"], batch.rewards.mean(), rtol=1e-6)
    np.testing.assert_allclose(metrics["reward_std"], batch.rewards.std(), rtol=1e-6)
    np.testing.assert_allclose(metrics["response_len_mean"], m.sum() / G, rtol=1e-6)
    np.testing.assert_allclose(metrics["adv_mean"], 0.0, atol=1e-6)
    np.testing.assert_allclose(metrics["adv_abs_mean"], np.abs(np.asarray(adv)).mean(), rtol=1e-6)


# ----- clipping and on-policy gradient ----------------------------------------------------------------------------

def test_clipping_clips_and_zeroes_gradient_of_clipped_tokens():
    cfg = GRPOConfig()
    logp, batch = make_batch(seed=4, ref=False, spread=0.6)
    grad_fn = jax.value_and_grad(lambda lp: grpo_loss(lp, batch, cfg), has_aux=True)
    (_, metrics), grad = grad_fn(jnp.asarray(logp))
    grad = np.asarray(grad)

    adv = np.asarray(group_advantages(batch.rewards, cfg))[:, None]
    ratio = np.exp(logp - batch.old_logprobs)
    real = batch.mask == 1
    high = (ratio > 1 + cfg.clip_eps_high) & (adv > 0) & real   # pushed up past the bound: no more push
    low = (ratio < 1 - cfg.clip_eps_low) & (adv < 0) & real     # pushed down past the bound: no more push
    free = real & ~high & ~low
    assert high.any() and low.any(), "test data should exercise both clip sides"
    # the other sides of the bounds (ratio beyond the bound but advantage of the other sign) are NOT clipped
    assert (real & (ratio > 1 + cfg.clip_eps_high) & (adv < 0)).any()
    assert (real & (ratio < 1 - cfg.clip_eps_low) & (adv > 0)).any()

    np.testing.assert_allclose(metrics["clip_frac"], (high | low).sum() / real.sum(), rtol=1e-6)
    assert metrics["clip_frac"] > 0
    assert (grad[high | low] == 0).all() and (grad[~real] == 0).all()
    weights = np.asarray(token_weights(batch.mask, cfg))
    np.testing.assert_allclose(grad[free], (-adv * ratio * weights)[free], rtol=1e-5)  # d(-r A w)/dlogp


def test_on_policy_gradient_is_minus_advantage_times_weight():
    cfg = GRPOConfig(loss_agg="seq-mean-token-mean")
    logp, batch = make_batch(seed=5, off_policy=False, ref=False)
    (loss, metrics), grad = jax.value_and_grad(lambda lp: grpo_loss(lp, batch, cfg), has_aux=True)(jnp.asarray(logp))
    adv = np.asarray(group_advantages(batch.rewards, cfg))[:, None]
    weights = np.asarray(token_weights(batch.mask, cfg))
    np.testing.assert_allclose(grad, -adv * weights, rtol=1e-5, atol=1e-8)  # REINFORCE with advantage A
    np.testing.assert_allclose(loss, -(adv * weights).sum(), atol=1e-6)  # ratio 1: loss = -sum(w A)
    assert metrics["clip_frac"] == 0 and metrics["kl"] == 0


def test_padding_values_never_leak():
    cfg = GRPOConfig(kl_coef=0.2)
    logp, batch = make_batch(seed=6)
    pad = batch.mask == 0
    dirty = batch.replace(old_logprobs=np.where(pad, np.nan, batch.old_logprobs).astype(np.float32),
                          ref_logprobs=np.where(pad, -np.inf, batch.ref_logprobs).astype(np.float32))
    dirty_logp = np.where(pad, -1e4, logp).astype(np.float32)  # a hopeless padding token
    f = jax.value_and_grad(lambda lp, b: grpo_loss(lp, b, cfg)[0])
    clean_loss, clean_grad = f(jnp.asarray(logp), batch)
    loss, grad = f(jnp.asarray(dirty_logp), dirty)
    assert np.isfinite(loss) and np.isfinite(grad).all()
    np.testing.assert_allclose(loss, clean_loss, rtol=1e-6)
    np.testing.assert_allclose(grad, clean_grad, rtol=1e-6, atol=1e-9)


# ----- KL ---------------------------------------------------------------------------------------------------------

def test_k3_kl_nonnegative_zero_at_ref_and_added_with_coef():
    rng = np.random.default_rng(7)
    logp = jnp.asarray(np.log(rng.uniform(0.01, 1, 200)), jnp.float32)
    ref = logp + jnp.asarray(rng.normal(0, 2, 200), jnp.float32)
    _, stats = per_token_loss(logp, None, ref, 0.0, GRPOConfig())
    assert (np.asarray(stats["kl"]) >= 0).all() and np.asarray(stats["kl"]).max() > 0.1
    _, stats = per_token_loss(logp, None, logp, 1.0, GRPOConfig(kl_coef=1.0))
    assert (np.asarray(stats["kl"]) == 0).all()

    base, _ = per_token_loss(logp, None, ref, 0.7, GRPOConfig(kl_coef=0.0))
    with_kl, stats = per_token_loss(logp, None, ref, 0.7, GRPOConfig(kl_coef=0.25))
    d = np.asarray(ref - logp, np.float64)
    np.testing.assert_allclose(np.asarray(with_kl) - np.asarray(base), 0.25 * (np.exp(d) - d - 1), rtol=1e-4,
                               atol=1e-5)
    # the KL's gradient pulls logp toward ref: d/dlogp k3 = 1 - exp(ref - logp)
    grad = jax.grad(lambda lp: per_token_loss(lp, None, ref, 0.0, GRPOConfig(kl_coef=1.0))[0].sum())(logp)
    np.testing.assert_allclose(grad, 1 - np.exp(d), rtol=1e-4, atol=1e-5)


def test_kl_metric_is_token_mean_of_k3():
    logp, batch = make_batch(seed=8)
    _, metrics = grpo_loss(jnp.asarray(logp), batch, GRPOConfig())  # kl_coef = 0: reported, not in the loss
    d = (batch.ref_logprobs - logp).astype(np.float64)
    m = batch.mask
    np.testing.assert_allclose(metrics["kl"], ((np.exp(d) - d - 1) * m).sum() / m.sum(), rtol=1e-5)


# ----- batch validation -------------------------------------------------------------------------------------------

def valid_batch():
    """make_batch with its noisy old / ref log-probs capped at 0 (validate_batch requires log-probs <= 0)."""
    _, batch = make_batch()
    return _with(batch, old_logprobs=np.minimum(batch.old_logprobs, 0), ref_logprobs=np.minimum(batch.ref_logprobs, 0))


def _with(batch, **changes):
    return dataclasses.replace(batch, **changes)


def _set(array, index, value):
    array = np.array(array)
    array[index] = value
    return array


BAD_BATCHES = {
    "prompt id >= vocab": (lambda b: _with(b, prompt=_set(b.prompt, 3, V)), "prompt", ValueError),
    "prompt id < 0": (lambda b: _with(b, prompt=_set(b.prompt, 0, -1)), "prompt", ValueError),
    "response id >= vocab": (lambda b: _with(b, responses=_set(b.responses, (2, 0), V + 7)), "responses", ValueError),
    "response id < 0": (lambda b: _with(b, responses=_set(b.responses, (1, 1), -3)), "responses", ValueError),
    "prompt float": (lambda b: _with(b, prompt=b.prompt.astype(np.float32)), "prompt", TypeError),
    "prompt rank": (lambda b: _with(b, prompt=b.prompt[None]), "prompt", ValueError),
    "responses rank": (lambda b: _with(b, responses=b.responses[0]), "responses", ValueError),
    "rewards rank": (lambda b: _with(b, rewards=b.rewards[:, None]), "rewards", ValueError),
    "prompt too short": (lambda b: _with(b, prompt=b.prompt[:1]), "prompt", ValueError),
    "mask shape": (lambda b: _with(b, mask=b.mask[:, :-1]), "mask", ValueError),
    "rewards vs G": (lambda b: _with(b, rewards=b.rewards[:-1]), "rewards", ValueError),
    "old_logprobs shape": (lambda b: _with(b, old_logprobs=b.old_logprobs[:-1]), "old_logprobs", ValueError),
    "ref_logprobs shape": (lambda b: _with(b, ref_logprobs=b.ref_logprobs[:, :2]), "ref_logprobs", ValueError),
    "empty branch": (lambda b: _with(b, mask=_set(b.mask, 3, 0.0)), "mask", ValueError),
    "mask not 0/1": (lambda b: _with(b, mask=_set(b.mask, (0, 0), 0.5)), "mask", ValueError),
    "nan reward": (lambda b: _with(b, rewards=_set(b.rewards, 1, np.nan)), "rewards", ValueError),
    "inf reward": (lambda b: _with(b, rewards=_set(b.rewards, 1, np.inf)), "rewards", ValueError),
    "nan old logprob": (lambda b: _with(b, old_logprobs=_set(b.old_logprobs, (0, 2), np.nan)), "old_logprobs",
                        ValueError),
    "nan ref logprob": (lambda b: _with(b, ref_logprobs=_set(b.ref_logprobs, (4, 0), np.nan)), "ref_logprobs",
                        ValueError),
    "positive old logprob": (lambda b: _with(b, old_logprobs=_set(b.old_logprobs, (1, 2), 0.5)),
                             r"GroupBatch.old_logprobs\[1, 2\] = 0.5 where mask = 1; log-probs must be <= 0",
                             ValueError),
    "positive ref logprob": (lambda b: _with(b, ref_logprobs=_set(b.ref_logprobs, (0, 0), 1e-3)),
                             r"GroupBatch.ref_logprobs\[0, 0\] = 0.001.* log-probs must be <= 0", ValueError),
    "reward beyond float32": (lambda b: _with(b, rewards=_set(b.rewards.astype(np.float64), 2, 1e308)),
                              r"GroupBatch.rewards\[2\] = 1e\+308 is outside float32 range", ValueError),
    "bool rewards": (lambda b: _with(b, rewards=b.rewards > 0), "GroupBatch.rewards must be a float array",
                     TypeError),
    "int logprobs": (lambda b: _with(b, old_logprobs=np.zeros(b.mask.shape, np.int32)),
                     "GroupBatch.old_logprobs must be a float array", TypeError),
}


@pytest.mark.parametrize("case", sorted(BAD_BATCHES))
def test_validate_batch_errors_name_the_field(case):
    mutate, field, error = BAD_BATCHES[case]
    batch = valid_batch()
    validate_batch(batch, V)  # the unmodified batch is fine
    with pytest.raises(error, match=field):
        validate_batch(mutate(batch), V)


def test_validate_batch_accepts_nan_on_padding_and_skips_values_under_jit():
    batch = valid_batch()
    pad = batch.mask == 0
    validate_batch(_with(batch, old_logprobs=np.where(pad, np.nan, batch.old_logprobs)), V)
    bad_values = _with(batch, prompt=_set(batch.prompt, 0, V + 1))
    jax.jit(lambda b: validate_batch(b, V).rewards.sum())(bad_values)  # shapes OK; values unknown: no error
    with pytest.raises(ValueError, match="mask"):  # shape errors still surface under tracing
        jax.jit(lambda b: validate_batch(b, V).rewards.sum())(_with(batch, mask=batch.mask[:, :-1]))


def test_validate_batch_allows_positive_logprobs_on_padding():
    batch = valid_batch()
    validate_batch(_with(batch, old_logprobs=np.where(batch.mask == 0, 3.0, batch.old_logprobs)), V)


# ----- KL needs reference log-probs; large rewards; numpy integer sizes -------------------------------------------

def test_kl_coef_without_ref_logprobs_is_an_error_not_a_silent_zero():
    logp, batch = make_batch(ref=False)
    batch = _with(batch, old_logprobs=np.minimum(batch.old_logprobs, 0))
    cfg = GRPOConfig(kl_coef=0.1)
    validate_batch(batch, V)  # without the config: nothing to say
    validate_batch(batch, V, GRPOConfig())  # kl_coef=0: no reference needed
    message = ("GRPOConfig.kl_coef=0.1 needs GroupBatch.ref_logprobs (reference-policy log-probs), but it is None: "
               "pass ref_logprobs or set kl_coef=0")
    with pytest.raises(ValueError) as info:
        validate_batch(batch, V, cfg)
    assert str(info.value) == message
    with pytest.raises(ValueError, match=r"kl_coef=0.1 needs reference log-probs \(GroupBatch.ref_logprobs\)"):
        grpo_loss(jnp.asarray(logp), batch, cfg)  # the API path without validate_batch: an error too


def _unscaled_advantages(rewards, cfg):
    """group_advantages before the power-of-two scaling (overflows past ~1e19)."""
    rewards = jnp.asarray(rewards, jnp.float32)
    centred = rewards - jnp.mean(rewards)
    if cfg.adv_norm == "std":
        centred = centred / (jnp.std(rewards) + cfg.eps)
    return jnp.where(jnp.all(rewards == rewards[0]), 0.0, centred)


@pytest.mark.parametrize("adv_norm", ["std", "none"])
def test_large_rewards_do_not_overflow_and_small_ones_keep_their_bits(adv_norm):
    cfg = GRPOConfig(adv_norm=adv_norm)
    rng = np.random.default_rng(0)
    for scale in (1e-3, 1.0, 7.0, 1e4):
        for g in (1, 2, 5):
            rewards = (rng.standard_normal(g) * scale).astype(np.float32)
            assert (np.asarray(group_advantages(rewards, cfg)).tobytes()
                    == np.asarray(_unscaled_advantages(rewards, cfg)).tobytes()), rewards
    for big in (1e20, 3e38):
        rewards = np.array([big, 0, 0, big], np.float32)
        adv = np.asarray(group_advantages(rewards, cfg))
        assert np.isfinite(adv).all()
        expected = [1, -1, -1, 1] if adv_norm == "std" else np.float32(big) * np.array([0.5, -0.5, -0.5, 0.5])
        np.testing.assert_allclose(adv, expected, rtol=1e-5)
    # 1e20 used to give std = inf, so zero advantages: a silent zero update
    assert not np.asarray(_unscaled_advantages(np.array([1e20, 0], np.float32), GRPOConfig())).any()


def test_validate_batch_rejects_rewards_whose_advantages_overflow_without_std():
    batch = _with(valid_batch(), rewards=np.array([3e38, -3e38, -3e38, -3e38, -3e38], np.float32))
    validate_batch(batch, V, GRPOConfig())  # std normalisation: fine
    with pytest.raises(ValueError, match=r"with adv_norm='none' the advantages r - mean overflow float32"):
        validate_batch(batch, V, GRPOConfig(adv_norm="none"))


def test_numpy_integer_sizes_are_accepted_bool_and_float_are_not():
    from longstraw_jax.engine.capture import chunk_layout
    from longstraw_jax.ops.logprobs import token_logprobs
    from longstraw_jax.sampling.branches import SamplingConfig

    cfg = GRPOConfig(logprob_chunk=np.int64(4))
    assert cfg.logprob_chunk == 4 and type(cfg.logprob_chunk) is int and hash(cfg) == hash(GRPOConfig(logprob_chunk=4))
    assert chunk_layout(10, np.int32(4)) == (2, 2)
    sampling = SamplingConfig(response_len=np.int64(3), temperature=np.float32(0.5), stop_token=np.int16(2))
    assert sampling == SamplingConfig(response_len=3, temperature=0.5, stop_token=2)
    hidden, head = jnp.ones((5, 3)), jnp.ones((7, 3))
    logp, _ = token_logprobs(hidden, head, jnp.zeros(5, jnp.int32), np.uint8(2))
    assert logp.shape == (5,)
    for bad in (True, np.bool_(True), 4.0, np.float32(4), "4", 0, np.int64(-1)):
        with pytest.raises(ValueError, match="logprob_chunk"):
            GRPOConfig(logprob_chunk=bad)
        with pytest.raises(ValueError, match="chunk_size must be a positive int"):
            chunk_layout(10, bad)
        with pytest.raises(ValueError, match="response_len"):
            SamplingConfig(response_len=bad)


def test_numpy_integer_sizes_reach_the_jitted_functions_as_python_ints(monkeypatch):
    """grpo_grads, train_step and sample_group accept chunk_size=np.int64(4) (and G=np.int64) and pass Python ints
    on as static arguments (one compile per value); the jitted functions are stubbed: no compile here."""
    import types

    from longstraw_jax import engine, train
    from longstraw_jax.sampling import branches as rollout
    from longstraw_jax.sampling.branches import SamplingConfig

    seen = []
    record = lambda *args: seen.append([a for a in args if isinstance(a, (int, np.integer))])
    monkeypatch.setattr(engine.local, "grpo_grads_unvalidated", lambda *a: record(*a))
    monkeypatch.setattr(train, "jitted_train_step", lambda *a: record(*a))
    monkeypatch.setattr(rollout, "_sample_group", lambda *a: record(*a))
    model = types.SimpleNamespace(config=types.SimpleNamespace(vocab_size=V))
    batch = valid_batch()
    engine.grpo_grads(model, None, batch, GRPOConfig(), "exact", chunk_size=np.int64(4))
    train.train_step(model, None, None, batch, None, GRPOConfig(), "exact", np.int32(4))
    rollout.sample_group(model, None, batch.prompt, np.int64(3), SamplingConfig(), None, chunk_size=np.uint16(4))
    assert seen == [[4], [4], [3, 4]] and all(type(v) is int for values in seen for v in values), seen
    with pytest.raises(ValueError, match="chunk_size must be a positive int, got True"):
        engine.grpo_grads(model, None, batch, GRPOConfig(), "exact", chunk_size=True)
