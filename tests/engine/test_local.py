"""The capture -> replay -> prompt-backward engine against its oracles (docs/architecture.md 2), on the tiny Qwen3.6.

- exact == naive_grpo_grads (one graph over G copies of prompt + response): loss, gradient pytree, metrics;
- detached == autograd through `extend` on a stop_gradient-ed captured state (vmapped over branches), and
  detached != exact (the prompt's share of the gradient is real) while their losses agree;
- equal rewards -> zero advantages -> exactly zero gradients; a left-out branch (valid 0) is left out, exactly;
- bad input raises before anything is computed;
- AOT memory: temporaries do not grow with G; exact needs < 1/4 of naive at P = 8K, G = 8.

Compilation dominates on CPU, so each compiled configuration covers several requirements at once (the cases,
P = 25 prompt and R = 8 response tokens, their batches and the detached oracle live in tests/helpers.py, shared
with tests/models/test_glm52.py):

    case  G  masks          chunk_size vs P-1 = 24          KL   old_logprobs         loss_agg
    A     3  ragged         7  (3 full chunks + remainder)  on   given (NaN at pads)  token-mean
    B     4  ragged, len 1  32 (> P-1: remainder only)      off  None                 seq-mean-token-mean
    C     1  ragged         8  (divides P-1: no remainder)  on   given                seq-mean-token-sum-norm

B also uses adv_norm="none" and logprob_chunk=3 (log-probs over R = 8 in a scan of 2 chunks plus a tail of 2).
"""
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longstraw_jax import GroupBatch, GRPOConfig, engine, grpo_grads, models, naive_grpo_grads
from tests.helpers import (
    CASES,
    assert_metrics_equal,
    detached_reference,
    make_batch,
    o1_params,
    prompt_only_tokens,
    rel_err,
)

grads_fn = jax.jit(grpo_grads, static_argnums=(0, 3, 4, 5))
naive_fn = jax.jit(naive_grpo_grads, static_argnums=(0, 3))


@pytest.fixture(scope="module")
def model_params():
    model = models.build(models.Qwen36Config.tiny(gdn_chunk_size=16))
    return model, o1_params(model.init(jax.random.key(0)), jax.random.key(1))


@pytest.fixture(scope="module")
def cases(model_params):
    """cases(name) -> batch, exact (loss, grads, metrics), naive (loss, grads, metrics); each case is computed on
    its first use (a run that deselects case C's test does not compile it)."""
    model, params = model_params

    @functools.cache
    def case(name):
        spec = CASES[name]
        batch = make_batch(model, params, spec["lengths"], spec["rewards"], spec["old"], spec["ref"],
                           seed=list(CASES).index(name))
        exact = grads_fn(model, params, batch, spec["cfg"], "exact", spec["chunk"])
        return batch, exact, naive_fn(model, params, batch, spec["cfg"])

    return case


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.slow) if name in "BCD" else name
                                  for name in CASES])  # B, C (G = 1), D (GSPO): the whole suite only
def test_exact_equals_naive(model_params, cases, name):
    _, params = model_params
    batch, (loss, grads, metrics), (naive_loss, naive_grads, naive_metrics) = cases(name)
    chex.assert_trees_all_equal_shapes_and_dtypes(grads, params)  # and the same tree structure
    chex.assert_tree_all_finite(grads)
    # embedding rows of tokens that occur only in prompt[:-1] are reached only through the prompt backward
    prompt_only = prompt_only_tokens(batch)
    assert prompt_only.size and np.abs(np.asarray(grads["embed"])[prompt_only]).min() > 0
    assert np.isfinite(loss)  # (case B's value is 0: on-policy ratio 1, centred advantages, equal branch weights)
    err = rel_err(grads, naive_grads)
    print(f"case {name}: loss {float(loss):.6f} vs naive {float(naive_loss):.6f}, grad rel err {err:.2e}")
    assert err <= 1e-4
    assert abs(float(loss) - float(naive_loss)) <= 1e-5
    assert_metrics_equal(metrics, naive_metrics)
    if name in "AD":
        assert 0 < float(metrics["clip_frac"]) < 1  # the clip is exercised, but not everywhere
    if name == "A":
        assert float(metrics["kl"]) > 0


@pytest.mark.slow  # case B's exact compile (the fast tier runs case A)
def test_equal_rewards_give_zero_advantages_and_zero_grads(model_params, cases):
    """Reuses compiled cases: B (KL off) -> exactly zero loss and gradient; A (KL on) -> only the KL gradient,
    still equal to the oracle."""
    model, params = model_params
    batch = cases("B")[0].replace(rewards=np.full(4, 0.7, np.float32))
    loss, grads, metrics = grads_fn(model, params, batch, CASES["B"]["cfg"], "exact", CASES["B"]["chunk"])
    assert np.isfinite(loss) and float(loss) == 0.0
    assert float(metrics["adv_abs_mean"]) == 0.0 and float(metrics["reward_std"]) == 0.0
    for g in jax.tree.leaves(grads):
        assert not np.any(np.asarray(g)), "equal rewards with kl_coef=0 must give exactly zero gradients"

    batch = cases("A")[0].replace(rewards=np.full(3, -2.0, np.float32))
    loss, grads, metrics = grads_fn(model, params, batch, CASES["A"]["cfg"], "exact", CASES["A"]["chunk"])
    naive_loss, naive_grads, naive_metrics = naive_fn(model, params, batch, CASES["A"]["cfg"])
    assert float(metrics["adv_abs_mean"]) == 0.0 and float(loss) > 0  # k3 KL >= 0
    assert rel_err(grads, naive_grads) <= 1e-4 and abs(float(loss) - float(naive_loss)) <= 1e-5


def test_a_left_out_branch_is_left_out_of_the_exact_gradient(model_params, cases):
    """valid = 0 on branch 1 of case A (an agent branch whose environment failed, mask zeroed): exact still equals
    naive, and both differ from case A's gradient (the branch really is left out)."""
    model, params = model_params
    batch, (full_loss, full_grads, _), _ = cases("A")
    batch = batch.replace(valid=np.array([1, 0, 1], np.float32), mask=np.asarray(batch.mask) * [[1], [0], [1]])
    loss, grads, metrics = grads_fn(model, params, batch, CASES["A"]["cfg"], "exact", CASES["A"]["chunk"])
    naive_loss, naive_grads, naive_metrics = naive_fn(model, params, batch, CASES["A"]["cfg"])
    assert rel_err(grads, naive_grads) <= 1e-4 and abs(float(loss) - float(naive_loss)) <= 1e-5
    assert_metrics_equal(metrics, naive_metrics)
    assert rel_err(grads, full_grads) > 1e-2


def test_detached_equals_stop_gradient_autograd_and_differs_from_exact(model_params, cases):
    model, params = model_params
    case = CASES["A"]
    batch, (exact_loss, exact_grads, exact_metrics), _ = cases("A")
    loss, grads, metrics = grads_fn(model, params, batch, case["cfg"], "detached", case["chunk"])
    reference = jax.jit(detached_reference, static_argnums=(0, 3, 4))
    ref_loss, ref_grads, ref_metrics = reference(model, params, batch, case["cfg"], case["chunk"])

    err = rel_err(grads, ref_grads)
    gap = rel_err(grads, exact_grads)
    print(f"detached vs stop_gradient autograd: rel err {err:.2e}; detached vs exact: rel diff {gap:.2e}")
    assert err <= 1e-4
    assert abs(float(loss) - float(ref_loss)) <= 1e-5
    assert_metrics_equal(metrics, ref_metrics)
    assert gap > 1e-2  # the prompt's contribution to the gradient is real
    assert abs(float(loss) - float(exact_loss)) <= 1e-5  # same forward: only the gradient differs
    assert_metrics_equal(metrics, exact_metrics)
    # the prompt is constant in detached mode: embedding rows of prompt-only tokens get exactly zero gradient
    assert not np.any(np.asarray(grads["embed"])[prompt_only_tokens(batch)])
    assert all(np.abs(g).max() > 0 for g in jax.tree.leaves(grads["blocks"]))


# ----- bad input: every error is raised on the host, before anything is compiled or run ---------------------------


def test_errors_before_any_computation(model_params, cases, monkeypatch):
    model, params = model_params
    batch = cases("A")[0]
    cfg = CASES["A"]["cfg"]

    def must_not_run(*args, **kwargs):
        raise AssertionError("the engine ran on an invalid call")

    monkeypatch.setattr(engine.local, "jitted_grpo_grads", must_not_run)
    with pytest.raises(ValueError, match="mode='bogus'"):
        grpo_grads(model, params, batch, cfg, mode="bogus", chunk_size=7)
    rewards = batch.rewards.copy()
    rewards[1] = np.nan
    with pytest.raises(ValueError, match="rewards must be finite"):
        grpo_grads(model, params, batch.replace(rewards=rewards), cfg, chunk_size=7)
    responses = batch.responses.copy()
    responses[2, 1] = model.config.vocab_size
    with pytest.raises(ValueError, match=r"responses\[2, 1\] = 512 .*vocab_size=512"):
        grpo_grads(model, params, batch.replace(responses=responses), cfg, chunk_size=7)
    with pytest.raises(ValueError, match="chunk_size"):
        grpo_grads(model, params, batch, cfg, chunk_size=0)
    with pytest.raises(ValueError, match="chunk_size"):
        grpo_grads(model, params, batch, cfg, chunk_size=2.5)


# ----- memory: AOT compile only ------------------------------------------------------------------------------------


def _memory(model, mode, group_size, prompt_len, response_len, chunk):
    """AOT memory_analysis() of one grpo_grads step ("naive" for naive_grpo_grads) from abstract shapes only."""
    params = jax.eval_shape(model.init, jax.random.key(0))
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    g, r = group_size, response_len
    batch = GroupBatch(prompt=jax.ShapeDtypeStruct((prompt_len,), jnp.int32),
                       responses=jax.ShapeDtypeStruct((g, r), jnp.int32), mask=f32(g, r), rewards=f32(g),
                       old_logprobs=f32(g, r), ref_logprobs=f32(g, r))
    cfg = GRPOConfig(kl_coef=0.1)
    if mode == "naive":
        lowered = naive_fn.lower(model, params, batch, cfg)
    else:
        lowered = jax.jit(engine.local.jitted_grpo_grads, static_argnums=(0, 3, 4, 5)).lower(model, params, batch,
                                                                                          cfg, mode, chunk)
    return lowered.compile().memory_analysis()


def _total(analysis) -> int:
    return analysis.argument_size_in_bytes + analysis.output_size_in_bytes + analysis.temp_size_in_bytes


@pytest.mark.slow  # two AOT compiles at P = 1025
def test_exact_mode_temporaries_do_not_grow_with_branches():
    """The target: G = 2 vs G = 16 at fixed P, exact-mode temp bytes within 2 %."""
    model = models.build(models.Qwen36Config.tiny(gdn_chunk_size=16))
    prompt_len, response_len, chunk = 1025, 16, 256
    small = _memory(model, "exact", 2, prompt_len, response_len, chunk)
    large = _memory(model, "exact", 16, prompt_len, response_len, chunk)
    print(f"exact grpo_grads P={prompt_len} R={response_len} C={chunk}: temp G=2 {small.temp_size_in_bytes} B, "
          f"G=16 {large.temp_size_in_bytes} B")
    assert abs(large.temp_size_in_bytes - small.temp_size_in_bytes) < 0.02 * small.temp_size_in_bytes


@pytest.mark.slow  # AOT compiles of exact and naive at P = 8192
def test_exact_mode_needs_under_a_quarter_of_naive_at_8k():
    """The target at P = 8K, G = 8 (R = 64, chunk 1024): compiled argument + output + temp bytes."""
    model = models.build(models.Qwen36Config.tiny())
    exact = _memory(model, "exact", 8, 8192, 64, 1024)
    naive = _memory(model, "naive", 8, 8192, 64, 1024)
    print(f"P=8192 G=8 R=64: exact {_total(exact) / 2**20:.1f} MiB, naive {_total(naive) / 2**20:.1f} MiB")
    assert _total(exact) < 0.25 * _total(naive)
