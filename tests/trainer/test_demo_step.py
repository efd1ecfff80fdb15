"""The demo's training step (configs/demo.toml, `make run`) against a plain full-graph GRPO step, in float64.

The trainer's step, as `trainer/loop.py:Trainer.train_one` runs it: the task sampler (`TaskSampler.batch`: B prompts,
G branches each from the run key folded with the step and the group, the task's rewards, the sampler's log-probs as
old log-probs and its captures kept), then `train.train_step` in exact mode (capture, replay, prompt backward; the
clipped ratio and the loss aggregation of `grpo.py`; AdamW after global-norm clipping), all at the demo's options.

The plain step shares none of that past the model's `forward`: each branch's log-probs from `forward(prompt +
response)` (one full graph per branch), the GRPO loss written out from its definition (advantages (r - mean) /
(std + eps) per group, ratio exp(logp - old logp) clipped to [1 - low, 1 + high], every response token of the batch
weighted equally), its gradient by `jax.grad`, the global-norm clip and AdamW's moments and bias corrections
written out, at the rate of the demo's linear ramp (`--lr-warmup-steps`). Two steps (the second sampled from the
first's parameters), so Adam's moments carry over and the rate differs between them.

In float64 (x64 inside `jax.enable_x64`, as tests/engine/test_float64.py) round-off is ~1e-14: the loss, the raw
gradient's norm and the new parameters agree to 1e-10 (measured: 1e-14 and 3e-14 after steps 1 and 2). Two numbers
are float32 by the batch's contract and shared: the sampler's log-probs (stored as float32, the old log-probs of
both steps; they equal the forward's to ~1e-7, so the ratio is 1) and the advantages (grpo.py computes them in
float32 from the float32 rewards; checked against their definition to float32 round-off). Adam divides by the
gradient's own scale, so the loss and the gradient norm are compared too: a loss scaled by a constant would leave
the parameters almost unchanged.

The fast tier keeps `test_the_demo_trains_two_steps` (the demo's own file, float32, through `run.main`).
"""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longstraw_jax.grpo import GRPOConfig, batch_advantages
from longstraw_jax.train import train_step
from longstraw_jax.trainer import cli as run, components
from longstraw_jax.trainer.config import parse_args
from tests.helpers import ROOT

DEMO = os.path.join(ROOT, "configs", "demo.toml")
TOL = 1e-10
STEPS = 2


def plain_loss(model, params, batch, cfg: GRPOConfig):
    """The demo's GRPO loss from its definition: prompt [B, P], responses / mask / old log-probs [B, G, R],
    rewards [B, G]."""
    b, g, r = batch.responses.shape
    p = batch.prompt.shape[-1]
    tokens = np.concatenate([np.repeat(np.asarray(batch.prompt)[:, None], g, 1), batch.responses], -1)
    logits = jax.vmap(lambda t: model.forward(params, t))(jnp.asarray(tokens.reshape(b * g, p + r)))
    # the logits at position i score token i + 1: response token t (at p + t) by the logits at p + t - 1
    logp_all = jax.nn.log_softmax(logits[:, p - 1: p + r - 1], axis=-1)
    logp = jnp.take_along_axis(logp_all, jnp.asarray(batch.responses.reshape(b * g, r))[..., None], -1)[..., 0]
    logp = logp.reshape(b, g, r)
    # the advantages and the token weights are float32 numbers (grpo.py computes them in float32 from the batch's
    # float32 rewards and mask, whatever the model's dtype): the advantages are the one input both steps share (the
    # test checks them against their definition to float32 round-off first); the weights are rounded here too
    advantages = np.asarray(batch_advantages(batch.rewards, cfg))
    mask = np.asarray(batch.mask, np.float32)
    weights = mask / mask.sum()  # token-mean: every response token of the batch counts the same
    old = np.where(mask > 0, np.asarray(batch.old_logprobs, np.float64), 0.0)
    ratio = jnp.exp(logp - old)
    adv = advantages.astype(np.float64)[..., None]
    surrogate = jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high) * adv)
    return -jnp.sum(surrogate * weights.astype(np.float64)), logp


def plain_adamw(params, grads, moments, count: int, lr: float, weight_decay: float, max_norm: float | None,
                b1=0.9, b2=0.95, eps=1e-8):
    """One AdamW step (optax.adamw's definition) after clipping the gradient to global norm `max_norm`."""
    norm = np.sqrt(sum(np.sum(np.square(x)) for x in jax.tree.leaves(grads)))
    if max_norm is not None and norm > max_norm:
        grads = jax.tree.map(lambda x: x * (max_norm / norm), grads)
    m, v = moments
    m = jax.tree.map(lambda m, x: b1 * m + (1 - b1) * x, m, grads)
    v = jax.tree.map(lambda v, x: b2 * v + (1 - b2) * x * x, v, grads)
    step = lambda p, m, v: p - lr * ((m / (1 - b1**count)) / (np.sqrt(v / (1 - b2**count)) + eps) + weight_decay * p)
    return jax.tree.map(step, params, m, v), (m, v), norm


def rel(a, b) -> float:
    diff = np.sqrt(sum(np.sum((np.asarray(x) - np.asarray(y)) ** 2) for x, y in zip(jax.tree.leaves(a),
                                                                                   jax.tree.leaves(b))))
    size = np.sqrt(sum(np.sum(np.asarray(y) ** 2) for y in jax.tree.leaves(b)))
    return float(diff / size)


@pytest.mark.slow  # float64 compiles of the sampler, the exact step and the plain full graph
def test_the_demo_step_equals_a_plain_full_graph_step_in_float64():
    config, _ = parse_args(["--config", DEMO])
    assert config.mode == "exact" and config.groups_per_step == 8 and config.kl_coef == 0  # the demo being checked
    cfg = GRPOConfig(loss_agg=config.loss_agg, kl_coef=config.kl_coef, ratio=config.ratio,
                     clip_eps_low=config.clip_eps_low, clip_eps_high=config.clip_eps_high)
    assert cfg.loss_agg == "token-mean" and cfg.ratio == "token"  # what plain_loss writes out
    max_norm = config.max_grad_norm or None
    with jax.enable_x64():
        model, params = components.load_model(config)
        params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float64), params)
        data = components.data_source(config, model.config.vocab_size)
        optimizer = components.run_optimizer(config)
        opt_state = optimizer.init(params)
        key = jax.random.key(config.seed)
        plain = jax.tree.map(np.asarray, params)
        moments = (jax.tree.map(np.zeros_like, plain), jax.tree.map(np.zeros_like, plain))
        for step in range(STEPS):
            batch, _, captured = data.batch(model, params, key, step, step)
            rewards = np.asarray(batch.rewards, np.float64)
            assert rewards.std(1).max() > 0  # a step with a signal
            definition = (rewards - rewards.mean(1, keepdims=True)) / (rewards.std(1, keepdims=True) + cfg.eps)
            np.testing.assert_allclose(np.asarray(batch_advantages(batch.rewards, cfg)), definition, rtol=0,
                                       atol=1e-6)  # float32 advantages: their round-off, no more
            params, opt_state, metrics = train_step(model, params, opt_state, batch, optimizer, cfg, config.mode,
                                                    config.chunk_size, captured=captured)
            (loss, logp), grads = jax.value_and_grad(lambda p: plain_loss(model, p, batch, cfg), has_aux=True)(plain)
            mask = np.asarray(batch.mask) > 0
            # the sampler's log-probs are the policy's (ratio 1), rounded to float32 (GroupBatch's old_logprobs are
            # float32): both steps read the same rounded values
            np.testing.assert_allclose(np.asarray(batch.old_logprobs)[mask], np.asarray(logp)[mask], rtol=1e-6)
            grads = jax.tree.map(np.asarray, grads)
            # the rate ramps linearly over the first lr_warmup_steps updates (update k of N: k / N of it)
            ramp = min(1.0, (step + 1) / config.lr_warmup_steps) if config.lr_warmup_steps else 1.0
            plain, moments, grad_norm = plain_adamw(plain, grads, moments, step + 1, config.learning_rate * ramp,
                                                    config.weight_decay, max_norm)
            assert abs(float(metrics["loss"]) - float(loss)) <= TOL * max(1.0, abs(float(loss)))
            assert abs(float(metrics["grad_norm"]) - grad_norm) <= TOL * grad_norm
            assert float(metrics["skipped"]) == 0.0
            error = rel(params, plain)
            print(f"step {step + 1}: loss {float(loss):.6f} grad norm {grad_norm:.4f}; new params relative error "
                  f"{error:.2e}")
            assert error <= TOL


def test_the_demo_trains_two_steps(tmp_path, capsys):
    """`make run`'s own file, shortened: 2 warm-up and 2 GRPO steps, an evaluation before the warm-up, after it and
    after GRPO; its last lines: the three held-out accuracies side by side with chance and the copy-a-fact level, then
    where the metrics, samples and plot are."""
    out = str(tmp_path / "demo")
    argv = ["--config", DEMO, "--steps", "2", "--sft-steps", "2", "--eval-every", "2", "--eval-prompts", "8",
            "--out", out]
    assert run.main(argv) == 0
    records = [line for line in open(os.path.join(out, "metrics.jsonl"))]
    assert sum('"sft_step"' in r for r in records) == 2
    assert any('"step": 2' in r and '"loss"' in r for r in records)
    last = capsys.readouterr().out.strip().splitlines()[-3:]
    assert last[0].startswith("held-out accuracy: initial policy ") and " -> after the warm-up " in last[0]
    assert " -> after GRPO (step 2) " in last[0] and last[0].endswith("; chance 0.250, copying a random fact's value "
                                                                      "0.625"), last[0]
    assert last[1].startswith("wrote: ") and os.path.join(out, "metrics.jsonl") in last[1]
    assert os.path.join(out, "samples.jsonl") in last[1]
    assert last[2] == f"plot: {os.path.join(out, 'metrics.png')}"
