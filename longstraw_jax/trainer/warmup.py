"""Supervised warm-up (the trainer's `--sft-steps`): before GRPO, N steps of cross-entropy on the task's target
response, e.g. to give a random tiny model the answer format and short-range retrieval before GRPO at long range.

    params, records = warm_up(model, params, task, steps=N, batch=16, learning_rate=1e-3)

The task must have `target(info) -> int tokens [T]` (the retrieval task: [answer, STOP]). Step i takes the task's
prompts i * batch .. i * batch + batch - 1 (build the task with `warm_up_seed(seed)`: a stream that neither GRPO
nor the held-out evaluation draws). The loss is the token mean of -log p(target token) over the batch, computed
through the full graph (`model._forward` of prompt + target[:-1], every activation kept): meant for short prompts,
not for the long-prompt engine. Its own AdamW state (global-norm clip 1), dropped after the warm-up: GRPO starts with
fresh optimizer moments, as from any checkpoint.
"""
from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from longstraw_jax.trainer import distributed

WARM_UP_BIT = 1 << 30  # warm-up prompts: the task built with seed ^ WARM_UP_BIT (held-out: bit 31, trainer/evaluate.py)


def warm_up_seed(seed: int) -> int:
    """The seed of the warm-up prompt stream of a run with `seed` (>= 0): bit 30 flipped."""
    return int(seed) ^ WARM_UP_BIT


def warm_up_task(config, vocab_size: int):
    """The warm-up task of a RunConfig: its --task (and --depth) at --sft-prompt-len (default --prompt-len), seed
    `warm_up_seed(--seed)`."""
    from longstraw_jax.tasks import make_task

    return make_task(config.task, prompt_len=config.sft_prompt_len or config.prompt_len, vocab_size=vocab_size,
                     seed=warm_up_seed(config.seed), **config.task_options())


def target_batch(task, start: int, size: int, pad_token: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The task's prompts start .. start + size - 1 -> (prompts int32 [N, P], targets int32 [N, T], mask float32
    [N, T]): targets right-padded with pad_token (mask 0) to the longest, T >= 1. ValueError when the task has no
    `target` or a target is empty."""
    if not hasattr(task, "target"):
        raise ValueError(f"task {getattr(task, 'name', task)!r} has no target(info) method: the supervised warm-up "
                         "(--sft-steps) needs the response to imitate; pass --sft-steps 0")
    prompts = [task.prompt(i) for i in range(start, start + size)]
    targets = [np.asarray(task.target(p.info), np.int32) for p in prompts]
    if any(t.ndim != 1 or t.size == 0 for t in targets):
        raise ValueError("task.target(info) must return a non-empty 1-d list of token ids")
    length = max(t.size for t in targets)
    out = np.full((size, length), pad_token, np.int32)
    mask = np.zeros((size, length), np.float32)
    for i, t in enumerate(targets):
        out[i, : t.size], mask[i, : t.size] = t, 1.0
    return np.stack([p.tokens for p in prompts]).astype(np.int32), out, mask


def sft_loss(model, params, prompts, targets, mask) -> tuple[jax.Array, dict]:
    """prompts int32 [N, P], targets int32 [N, T], mask float32 [N, T] -> (token-mean cross-entropy over the real
    target tokens, {"sft_loss": same, "sft_accuracy": fraction of rows whose first target token is the argmax})."""
    p = prompts.shape[1]
    tokens = jnp.concatenate([prompts, targets[:, :-1]], axis=1)  # [N, P + T - 1]
    logits = jax.vmap(lambda t: model._forward(params, t))(tokens)[:, p - 1 :]  # [N, T, V]
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]  # [N, T]
    loss = -jnp.sum(picked * mask) / jnp.maximum(jnp.sum(mask), 1.0)
    accuracy = jnp.mean((jnp.argmax(logits[:, 0], axis=-1) == targets[:, 0]).astype(jnp.float32))
    return loss, {"sft_loss": loss, "sft_accuracy": accuracy}


def sft_step(model, optimizer, params, opt_state, prompts, targets, mask):
    """One warm-up update -> (params, opt_state, metrics). (`warm_up` jits it with the params' and optimizer
    state's shardings as output shardings, so that every step sees the same placement and it compiles once.)"""
    (_, metrics), grads = jax.value_and_grad(lambda q: sft_loss(model, q, prompts, targets, mask), has_aux=True)(
        params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, dict(metrics, sft_grad_norm=optax.tree.norm(grads))


@functools.lru_cache(maxsize=8)
def _jitted_step(model, optimizer, param_shardings: tuple, opt_shardings: tuple):
    """`sft_step` jitted with output shardings = the inputs' ((treedef, leaves) pairs, hashable): one compile per
    model, optimizer, placement and batch shape, shared by every warm-up in the process."""
    unflat = lambda pair: jax.tree.unflatten(*pair)  # noqa: E731
    return jax.jit(functools.partial(sft_step, model, optimizer), donate_argnums=(0, 1),
                   out_shardings=(unflat(param_shardings), unflat(opt_shardings), None))


@functools.lru_cache(maxsize=None)
def warm_up_optimizer(learning_rate: float) -> optax.GradientTransformation:
    """AdamW (b2 0.95, clipped to global norm 1), one object per rate (a static jit argument: one compile)."""
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(learning_rate, b1=0.9, b2=0.95))


def warm_up(model, params, task, steps: int, batch: int, learning_rate: float, pad_token: int = 0, say=None,
            place=None):
    """`steps` supervised updates of `params` on `task`'s targets -> (params, records): one record per step
    {"step": 0, "kind": "sft", "sft_step", "sft_loss", "sft_accuracy", "sft_grad_norm", "sft_s"} (its loss and
    accuracy on that step's batch, before the update). params placed on a mesh keep their shardings. say: a print
    function for progress lines (every ~10% of the steps), or None. place(opt_state) -> the optimizer state placed
    like the params (the trainer's `setup.place`; default: on the params' first device), so that the step
    compiles once."""
    optimizer = warm_up_optimizer(float(learning_rate))
    shardings = jax.tree.map(lambda x: x.sharding, params)
    opt_state = jax.jit(optimizer.init)(params)
    if place is None:
        device = next(iter(jax.tree.leaves(params)[0].devices()))
        place = lambda tree: jax.device_put(tree, device)  # noqa: E731
    opt_state = place(opt_state)
    flat = lambda tree: (jax.tree.structure(tree), tuple(jax.tree.leaves(tree)))  # noqa: E731 (hashable)
    step = _jitted_step(model, optimizer, flat(shardings), flat(jax.tree.map(lambda x: x.sharding, opt_state)))
    records = []
    for i in range(steps):
        start = time.perf_counter()
        prompts, targets, mask = target_batch(task, i * batch, batch, pad_token)
        params, opt_state, metrics = step(params, opt_state, prompts, targets, mask)
        metrics = {k: float(v) for k, v in distributed.to_host(metrics).items()}
        records.append({"step": 0, "kind": "sft", "sft_step": i + 1, **metrics, "sft_s": time.perf_counter() - start})
        if say is not None and ((i + 1) % max(1, steps // 10) == 0 or i + 1 == steps):
            window = records[-max(1, steps // 10):]
            say(f"warm-up {i + 1:>4}/{steps}: loss {np.mean([r['sft_loss'] for r in window]):.3f} accuracy "
                f"{np.mean([r['sft_accuracy'] for r in window]):.3f} (mean of the last {len(window)} batches) | "
                f"{records[-1]['sft_s']:.2f} s/step", flush=True)
    return params, records
