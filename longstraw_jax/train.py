"""Optimizer and one GRPO training step: engine gradients, AdamW with global-norm clipping, skip on non-finite.

    optimizer = make_optimizer(learning_rate=1e-6)           # build once: it is a static (hashable) jit argument
    opt_state = optimizer.init(params)
    params, opt_state, metrics = train_step(model, params, opt_state, batch, optimizer, cfg, mode="exact")

`train_step` validates the batch on the host (a NaN reward or an out-of-range token id raises before anything is
computed), then runs one jitted step with `model`, `optimizer`, `cfg`, `mode` and `chunk_size` static. If the loss or
any gradient entry is non-finite, the update is skipped: params and opt_state come back bit-identical and
metrics["skipped"] is 1.0, so one bad group never writes NaN into the weights or the Adam moments.

`train_step` is itself traceable, so an outer `jax.jit(train_step, static_argnums=(0, 4, 5, 6, 7))` works too (then
only shapes are validated; validate concrete batches with `grpo.validate_batch` first).

The jitted program behind it, for ahead-of-time tools that lower it from abstract arrays (`longstraw_jax.capacity`,
tools/bench_step.py): `jitted_train_step` and `jitted_train_step_donated` (`DONATE_ARGNUMS`, as the trainer runs
it), both `jax.jit(train_step_unvalidated, static_argnums=STATIC_ARGNUMS)`; they skip `train_step`'s host checks.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import optax

from longstraw_jax.common.validation import check_size, is_real
from longstraw_jax.engine import MODES
from longstraw_jax.engine.capture import chunk_layout
from longstraw_jax.engine.local import check_captured, grpo_grads_unvalidated
from longstraw_jax.grpo import GroupBatch, GRPOConfig, validate_batch
from longstraw_jax.sharding.groups import check_groups


def make_optimizer(learning_rate=1e-6, weight_decay: float = 0.0, max_grad_norm: float | None = 1.0,
                   b1: float = 0.9, b2: float = 0.95, lr_warmup_steps: int = 0) -> optax.GradientTransformation:
    """AdamW after clipping the gradient to global norm `max_grad_norm` (None: no clipping).

    `learning_rate` is a float or an optax schedule (step -> rate). Each call returns a new transformation, and
    `train_step` compiles once per transformation object: build it once and reuse it.

    lr_warmup_steps N > 0: the rate rises linearly over the first N updates, update k (1-based) at
    learning_rate * min(1, k / N), then stays (`learning_rate_at`). Adam's first updates are about the rate on
    every weight, whatever its gradient's signal-to-noise (its second moment has seen a few gradients only), so a
    noisy policy gradient at the full rate first moves the policy in random directions; the ramp lets the moments
    settle first.

    The defaults are the trainer's too (`python -m longstraw_jax.run` reads them from here). learning_rate 1e-6: the
    usual rate of RL post-training (GRPO / PPO) of a pretrained model with every weight trained. AdamW moves each
    weight by about the rate per step whatever its gradient's scale, and a policy gradient is noisy (a few sampled
    groups per step), so larger rates drift a model of billions of parameters away from its pretrained behaviour
    (entropy collapse, rising KL) within tens of steps. LoRA adapters (1e-5 .. 1e-4) and small or randomly
    initialised models (the tests, `make run`: 1e-4) want larger rates, given explicitly. b2 0.95 (not Adam's 0.999),
    as in large-model training: the second moment follows the gradient's scale over ~20 steps, not ~1000.
    """
    errors = []

    def finite(name, value):
        ok = is_real(value) and math.isfinite(value)
        if not ok:
            errors.append(f"{name}={value!r} must be a finite number")
        return ok

    if not callable(learning_rate) and finite("learning_rate", learning_rate) and learning_rate < 0:
        errors.append(f"learning_rate={learning_rate} must be >= 0")
    if finite("weight_decay", weight_decay) and weight_decay < 0:
        errors.append(f"weight_decay={weight_decay} must be >= 0")
    if max_grad_norm is not None and finite("max_grad_norm", max_grad_norm) and max_grad_norm <= 0:
        errors.append(f"max_grad_norm={max_grad_norm} must be > 0 (or None for no clipping)")
    for name, value in (("b1", b1), ("b2", b2)):
        if finite(name, value) and not 0 <= value < 1:
            errors.append(f"{name}={value} must be in [0, 1)")
    if isinstance(lr_warmup_steps, bool) or not isinstance(lr_warmup_steps, int) or lr_warmup_steps < 0:
        errors.append(f"lr_warmup_steps={lr_warmup_steps!r} must be an int >= 0")
    elif lr_warmup_steps and callable(learning_rate):
        errors.append("lr_warmup_steps > 0 needs a constant learning_rate (a schedule brings its own warm-up)")
    if errors:
        raise ValueError("invalid optimizer settings: " + "; ".join(errors))
    if lr_warmup_steps:
        learning_rate = functools.partial(learning_rate_at, learning_rate, lr_warmup_steps)
    adamw = optax.adamw(learning_rate, b1=b1, b2=b2, weight_decay=weight_decay)
    if max_grad_norm is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(max_grad_norm), adamw)


def learning_rate_at(learning_rate: float, lr_warmup_steps: int, count):
    """The rate of the update after `count` updates (count 0: the first update): learning_rate * min(1, (count + 1)
    / lr_warmup_steps) (`make_optimizer`'s linear warm-up; traceable, count an int array or a Python int). In the
    default float dtype: float64 under x64, so that a float64 run's rate is not rounded to float32."""
    return learning_rate * jnp.minimum(1.0, (jnp.asarray(count, float) + 1) / lr_warmup_steps)


def train_step(model, params, opt_state, batch: GroupBatch, optimizer: optax.GradientTransformation,
               cfg: GRPOConfig = GRPOConfig(), mode: str = "exact", chunk_size: int = 2048, mesh=None,
               captured=None, donate: bool = False, frozen=None):
    """One GRPO update on one group or on B groups side by side (a batch with a group axis): (params, opt_state,
    metrics). captured: the sampler's capture of the prompt(s) (`engine.grpo_grads`): the step does not capture
    again. donate: the step may reuse the buffers of `params` and `opt_state` for its results (they are deleted:
    use the returned ones), so that the update does not hold them twice (the trainer does; the capacity planner,
    `longstraw_jax.capacity`, assumes it). frozen: parameters that are not trained (`trainable.split`; LoRA's base
    matrices): params and opt_state are then the trainable part only (grads, AdamW moments and the update exist for
    it alone); frozen is read, never donated or changed.

    metrics: the engine's metrics (reward_mean, clip_frac, kl, entropy, ...) plus "loss" (before the update),
    "grad_norm" (global norm of the raw, unclipped gradient), "update_norm" (global norm of the applied update: how
    far the step moved the weights; 0 when skipped) and "skipped" (1.0 when the loss or a gradient was non-finite
    and the update was not applied, else 0.0). All are scalar arrays. (The weights' own norm is not taken here: on
    XLA:CPU its reduction keeps a float32 copy of a leaf live in the step; the trainer divides by it, `param_norm`.)

    Host-side checks first (mode, chunk_size, and the batch's shapes and values via `validate_batch`), then one
    jitted step with model, optimizer, cfg, mode, chunk_size and mesh static (mesh is passed to `grpo_grads`).
    """
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}; allowed: {', '.join(map(repr, MODES))}")
    validate_batch(batch, model.config.vocab_size, cfg)
    chunk_size = check_size(chunk_size, "chunk_size")
    chunk_layout(batch.prompt.shape[-1] - 1, chunk_size)
    if mesh is not None and batch.groups_per_step is not None:
        check_groups(batch.groups_per_step, mesh)
    if mesh is None and captured is not None:
        check_captured(captured, batch, mode)
    step = jitted_train_step_donated if donate else jitted_train_step
    return step(model, params, opt_state, batch, optimizer, cfg, mode, chunk_size, mesh, captured, frozen)


def train_step_unvalidated(model, params, opt_state, batch, optimizer, cfg, mode, chunk_size, mesh=None,
                           captured=None, frozen=None):
    """`train_step`'s traceable core, for a caller that has checked `mode`, `chunk_size` and the batch itself (under
    a trace only shapes could be checked): (params, opt_state, metrics). Static: `STATIC_ARGNUMS`."""
    extra = {name: value for name, value in (("mesh", mesh), ("captured", captured), ("frozen", frozen))
             if value is not None}
    loss, grads, metrics = grpo_grads_unvalidated(model, params, batch, cfg, mode, chunk_size, **extra)
    finite = jnp.isfinite(loss)
    for g in jax.tree.leaves(grads):
        finite = finite & jnp.all(jnp.isfinite(g))

    def apply(params, opt_state):
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, optax.tree.norm(updates).astype(jnp.float32)

    def keep(params, opt_state):
        return params, opt_state, jnp.zeros((), jnp.float32)

    # Skipped steps return the inputs untouched (no arithmetic on them, so the bits are preserved).
    params, opt_state, update_norm = jax.lax.cond(finite, apply, keep, params, opt_state)
    metrics = dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads),
                   update_norm=update_norm,
                   skipped=jnp.where(finite, 0.0, 1.0).astype(jnp.float32))
    return params, opt_state, metrics


@jax.jit
def param_norm(params) -> jax.Array:
    """Global norm of a parameter tree (float32 []): the trainer's `update_ratio` = update_norm / param_norm of the
    weights before the step, a program of its own so that the step keeps no copy for it."""
    return optax.tree.norm(params).astype(jnp.float32)


STATIC_ARGNUMS = (0, 4, 5, 6, 7, 8)  # model, optimizer, cfg, mode, chunk_size, mesh
DONATE_ARGNUMS = (1, 2)  # params, opt_state
jitted_train_step = jax.jit(train_step_unvalidated, static_argnums=STATIC_ARGNUMS)
jitted_train_step_donated = jax.jit(train_step_unvalidated, static_argnums=STATIC_ARGNUMS,
                                    donate_argnums=DONATE_ARGNUMS)
