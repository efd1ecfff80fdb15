"""train_step / make_optimizer on the tiny Qwen3.6: the GRPO loss goes down on a fixed batch; a bad batch raises on the
host before anything runs; a non-finite gradient skips the update, leaving params and opt_state bit-identical.

The step under test is the public `train_step`, jitted from outside with its static arguments (which also shows it
is jittable).
"""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longstraw_jax import GroupBatch, GRPOConfig, make_optimizer, models, train, train_step
from tests.helpers import o1_params

P, G, R, CHUNK = 25, 3, 8, 8
CFG = GRPOConfig(loss_agg="token-mean")
STEPS = 6

step_fn = jax.jit(train_step, static_argnums=(0, 4, 5, 6, 7))


def bits(tree):
    """Every leaf's raw bytes (NaN-safe, sign-of-zero-safe equality)."""
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


@pytest.fixture(scope="module")
def setup():
    model = models.build(models.Qwen36Config.tiny(gdn_chunk_size=16))
    params = o1_params(model.init(jax.random.key(0)), jax.random.key(1))
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    prompt = rng.integers(0, vocab, P).astype(np.int32)
    responses = rng.integers(0, vocab, (G, R)).astype(np.int32)
    mask = (np.arange(R)[None, :] < np.array([8, 4, 6])[:, None]).astype(np.float32)
    # old_logprobs = the current policy's, so the ratio starts at 1 and the clipped surrogate has room to improve
    old = []
    for response in responses:
        logits = model.forward(params, np.concatenate([prompt, response]))[P - 1 : P - 1 + R]
        old.append(np.take_along_axis(np.asarray(jax.nn.log_softmax(logits)), response[:, None], 1)[:, 0])
    batch = GroupBatch(prompt=prompt, responses=responses, mask=mask, rewards=np.array([1.0, -0.5, 0.2], np.float32),
                       old_logprobs=np.stack(old).astype(np.float32))
    # 1e-5 (10x the default: this tiny O(1)-scale model is not a pretrained one): the clipped surrogate saturates
    # within a few steps at 1e-4, at 1e-5 it improves steadily
    optimizer = make_optimizer(learning_rate=1e-5)
    opt_state = optimizer.init(params)
    trajectory = [(params, opt_state)]
    history = []
    for _ in range(STEPS):
        params, opt_state, metrics = step_fn(model, params, opt_state, batch, optimizer, CFG, "exact", CHUNK)
        trajectory.append((params, opt_state))
        history.append(jax.device_get(metrics))
    return model, batch, optimizer, trajectory, history


def test_loss_decreases_on_a_fixed_batch(setup):
    _, _, _, trajectory, history = setup
    losses = [float(m["loss"]) for m in history]  # loss before each update
    print("GRPO loss per step:", " ".join(f"{x:.4f}" for x in losses))
    assert all(m["skipped"] == 0.0 for m in history)
    assert all(np.isfinite(m["grad_norm"]) and m["grad_norm"] > 0 for m in history)
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < losses[0] - 0.1, losses
    params0, state0 = trajectory[0]
    params1, state1 = trajectory[1]
    assert bits(params1) != bits(params0) and int(state1[1][0].count) == 1
    # update_norm: how far each step moved the weights (the trainer's update_ratio divides it by param_norm)
    for (before, _), (after, _), m in zip(trajectory, trajectory[1:], history):
        moved = np.sqrt(sum(np.sum((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2)
                            for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before))))
        size = np.sqrt(sum(np.sum(np.asarray(b, np.float64) ** 2) for b in jax.tree.leaves(before)))
        np.testing.assert_allclose(float(m["update_norm"]), moved, rtol=1e-3)
        np.testing.assert_allclose(float(m["update_norm"]) / float(train.param_norm(before)), moved / size, rtol=1e-3)
    chex.assert_trees_all_equal_shapes_and_dtypes(params1, params0)  # and the same tree structure
    chex.assert_tree_all_finite(params1)


@pytest.mark.parametrize("where, value", [(("blocks", "full", "o_proj"), np.nan), (("lm_head",), np.inf)])
def test_non_finite_gradient_skips_the_update(setup, where, value):
    model, batch, optimizer, trajectory, _ = setup
    params, opt_state = trajectory[2]  # mid-training: non-trivial Adam moments and step count
    leaf = params
    for key in where[:-1]:
        leaf = leaf[key]
    poisoned = np.asarray(leaf[where[-1]]).copy()
    poisoned.flat[7] = value
    params = jax.tree.map(lambda x: x, params)  # shallow copy of the dicts
    target = params
    for key in where[:-1]:
        target = target[key]
    target[where[-1]] = jnp.asarray(poisoned)

    new_params, new_state, metrics = step_fn(model, params, opt_state, batch, optimizer, CFG, "exact", CHUNK)
    assert float(metrics["skipped"]) == 1.0 and float(metrics["update_norm"]) == 0.0
    assert not np.isfinite(float(metrics["grad_norm"]))
    assert bits(new_params) == bits(params)
    assert bits(new_state) == bits(opt_state)


def test_one_non_finite_gradient_entry_with_finite_loss_skips(setup, monkeypatch):
    """A finite loss with a single inf in one gradient leaf (engine monkeypatched; a fresh optimizer object forces a
    fresh trace, and the patched step compiles in about a second)."""
    model, batch, _, trajectory, _ = setup
    params, _ = trajectory[1]

    def fake_grads(model, params, batch, cfg, mode, chunk_size):
        grads = jax.tree.map(jnp.ones_like, params)
        grads["final_norm"] = grads["final_norm"].at[3].set(jnp.inf)
        return jnp.float32(0.5), grads, {"reward_mean": jnp.mean(batch.rewards)}

    monkeypatch.setattr(train, "grpo_grads_unvalidated", fake_grads)
    optimizer = make_optimizer(learning_rate=1e-2)
    opt_state = optimizer.init(params)
    new_params, new_state, metrics = train_step(model, params, opt_state, batch, optimizer, CFG, "exact", CHUNK)
    assert float(metrics["skipped"]) == 1.0 and float(metrics["loss"]) == 0.5
    assert bits(new_params) == bits(params) and bits(new_state) == bits(opt_state)


def test_bad_batch_raises_before_any_computation(setup, monkeypatch):
    model, batch, optimizer, trajectory, _ = setup
    params, opt_state = trajectory[0]

    def must_not_run(*args, **kwargs):
        raise AssertionError("train_step computed on an invalid batch")

    monkeypatch.setattr(train, "jitted_train_step", must_not_run)
    rewards = batch.rewards.copy()
    rewards[0] = np.nan
    with pytest.raises(ValueError, match="rewards must be finite"):
        train_step(model, params, opt_state, batch.replace(rewards=rewards), optimizer, CFG, "exact", CHUNK)
    with pytest.raises(ValueError, match="mode='bogus'"):
        train_step(model, params, opt_state, batch, optimizer, CFG, "bogus", CHUNK)
    with pytest.raises(ValueError, match="chunk_size"):
        train_step(model, params, opt_state, batch, optimizer, CFG, "exact", 0)
    responses = batch.responses.copy()
    responses[0, 0] = -1
    with pytest.raises(ValueError, match=r"responses\[0, 0\] = -1"):
        train_step(model, params, opt_state, batch.replace(responses=responses), optimizer, CFG, "exact", CHUNK)


def test_make_optimizer_is_clipped_adamw():
    params = {"w": jnp.ones(4, jnp.float32)}
    # weight decay alone (zero gradient): update = -lr * wd * w
    optimizer = make_optimizer(learning_rate=0.1, weight_decay=0.5)
    updates, _ = optimizer.update({"w": jnp.zeros(4)}, optimizer.init(params), params)
    np.testing.assert_allclose(updates["w"], -0.05, rtol=1e-6)
    # clipping happens before Adam: with max_grad_norm=1 a huge then a small gradient have equal (clipped) norms,
    # so the second Adam step is exactly -lr along the (shared) direction
    optimizer = make_optimizer(learning_rate=0.1, max_grad_norm=1.0, b1=0.5, b2=0.5)
    state = optimizer.init(params)
    big, small = {"w": jnp.array([300.0, 400.0, 0, 0])}, {"w": jnp.array([3.0, 4.0, 0, 0])}
    _, state = optimizer.update(big, state, params)
    updates, _ = optimizer.update(small, state, params)
    np.testing.assert_allclose(updates["w"], [-0.1, -0.1, 0, 0], atol=1e-6)
    unclipped = make_optimizer(learning_rate=0.1, max_grad_norm=None, b1=0.5, b2=0.5)
    state = unclipped.init(params)
    _, state = unclipped.update(big, state, params)
    updates, _ = unclipped.update(small, state, params)
    assert abs(float(updates["w"][0]) + 0.1) > 1e-2  # without clipping the two gradients differ
    for bad in (dict(learning_rate=-1.0), dict(max_grad_norm=0.0), dict(b2=1.0), dict(weight_decay=float("nan")),
                dict(lr_warmup_steps=-1), dict(lr_warmup_steps=2.5),
                dict(lr_warmup_steps=2, learning_rate=lambda count: 0.1)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            make_optimizer(**bad)


def test_lr_warmup_ramps_the_rate_linearly_then_holds():
    """lr_warmup_steps N: update k (1-based) at rate lr * min(1, k / N); a constant gradient makes Adam's direction
    exactly -1 per element (mhat / sqrt(vhat) = 1 up to eps), so each update is minus the rate."""
    params = {"w": jnp.zeros(3, jnp.float32)}
    optimizer = make_optimizer(learning_rate=0.1, max_grad_norm=None, lr_warmup_steps=4)
    state, seen = optimizer.init(params), []
    for _ in range(6):
        updates, state = optimizer.update({"w": jnp.ones(3)}, state, params)
        seen.append(float(updates["w"][0]))
    np.testing.assert_allclose(seen, [-0.025, -0.05, -0.075, -0.1, -0.1, -0.1], rtol=1e-5)
    assert [float(train.learning_rate_at(0.1, 4, c)) for c in (0, 3, 9)] == pytest.approx([0.025, 0.1, 0.1])
