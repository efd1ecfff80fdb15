"""Supervised warm-up (the trainer's `--sft-steps`): before GRPO, N steps of cross-entropy on the target response,
e.g. to give a random tiny model the answer format and short-range retrieval before GRPO at long range.

    params, records = warm_up(model, params, task, steps=N, batch=16, learning_rate=1e-3)            # a --task
    params, records = warm_up(model, params, DatasetTargets(...), steps=N, batch=4, learning_rate=1e-3)  # --data

A task needs `target(info) -> int tokens [T]` (the retrieval task: [answer, STOP]), or (tokens [T], mask [T]): an
agent task's episode, whose tool replies (mask 0) are read but not imitated (tasks/lookup.py). Step i takes the
task's prompts i * batch .. i * batch + batch - 1 (build the task with `warm_up_seed(seed)`: a stream that neither
GRPO nor the held-out evaluation draws). A --data run's targets are `DatasetTargets`: each training row's --answer-field
tokenized + the run's stop token, right-padded to --response-len, its prompt rendered and left-padded to the GRPO
phase's bucket (one compile per bucket), rows in an order drawn from `warm_up_seed(seed)` over the training rows only.

The loss is the token mean of -log p(target token) over the batch, computed through the full graph (`_extend_hidden`
of prompt + target[:-1]; vocabulary logits only at the T target positions). Short prompts (a task): the batch vmapped,
every activation kept. Long prompts (`per_row`, --data): one row at a time in a `lax.scan` that sums the rows'
gradients, each row's blocks rematerialised, so memory is one row's graph whatever the batch; the same loss and
gradient. Its own AdamW state (global-norm clip 1), dropped after the warm-up: GRPO starts with fresh optimizer
moments, as from any checkpoint.
"""
from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from longstraw_jax.sharding import hosts
from longstraw_jax.train import make_optimizer

# the warm-up's AdamW weight decay: optax.adamw's default, the warm-up's since it began (GRPO's: make_optimizer's, 0)
WARM_UP_WEIGHT_DECAY = 1e-4
WARM_UP_BIT = 1 << 30  # warm-up prompts: the task built with seed ^ WARM_UP_BIT (held-out: bit 31, trainer/evaluate.py)


def warm_up_seed(seed: int) -> int:
    """The seed of the warm-up prompt stream of a run with `seed` (>= 0): bit 30 flipped."""
    return int(seed) ^ WARM_UP_BIT


def warm_up_max_depth(config) -> float | None:
    """The warm-up prompts' --max-depth: --sft-max-depth, else --max-depth (None: the task's default)."""
    return config.max_depth if config.sft_max_depth is None else config.sft_max_depth


def warm_up_task(config, vocab_size: int):
    """The warm-up task of a RunConfig: its --task (and --depth, --num-facts, --max-depth) at --sft-prompt-len (default
    --prompt-len) with --sft-num-facts facts and --sft-max-depth (defaults: GRPO's), seed `warm_up_seed(--seed)`."""
    from longstraw_jax.tasks import make_task

    options = config.task_options()
    if config.sft_num_facts is not None:
        options["num_facts"] = config.sft_num_facts
    depth = warm_up_max_depth(config)
    if depth is not None:
        options["max_depth"] = depth
    return make_task(config.task, prompt_len=config.sft_prompt_len or config.prompt_len, vocab_size=vocab_size,
                     seed=warm_up_seed(config.seed), **options)


def target_batch(task, start: int, size: int, pad_token: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The task's prompts start .. start + size - 1 -> (prompts int32 [N, P], targets int32 [N, T], mask float32
    [N, T]): targets right-padded with pad_token (mask 0) to the longest, T >= 1. ValueError when the task has no
    `target` or a target is empty."""
    if not hasattr(task, "target"):
        raise ValueError(f"task {getattr(task, 'name', task)!r} has no target(info) method: the supervised warm-up "
                         "(--sft-steps) needs the response to imitate; pass --sft-steps 0")
    prompts = [task.prompt(i) for i in range(start, start + size)]
    targets = [task.target(p.info) for p in prompts]
    targets = [(np.asarray(t[0], np.int32), np.asarray(t[1], np.float32)) if isinstance(t, tuple)
               else (np.asarray(t, np.int32), np.ones(np.shape(t), np.float32)) for t in targets]
    if any(t.ndim != 1 or t.size == 0 or m.shape != t.shape or not m.any() for t, m in targets):
        raise ValueError("task.target(info) must return a non-empty 1-d list of token ids, or (ids, mask) with a "
                         "mask of the same length that keeps at least one of them")
    length = max(t.size for t, _ in targets)
    out = np.full((size, length), pad_token, np.int32)
    mask = np.zeros((size, length), np.float32)
    for i, (t, m) in enumerate(targets):
        out[i, : t.size], mask[i, : t.size] = t, m
    return np.stack([p.tokens for p in prompts]).astype(np.int32), out, mask


def row_loss(model, params, prompt, target, mask, left_pad=None, remat: bool = False):
    """One row: prompt int32 [P], target int32 [T], mask float32 [T], left_pad int32 [] or None (prompt[:left_pad]
    are pads) -> (sum over the real target tokens of -log p(token), (first target token is the argmax, every real
    target token is the argmax) as float32 0/1). An episode's target (a tool reply inside it: mask 0 between 1s)
    counts as right only when every real token is: its first token (a tool call's opening) says nothing. Logits
    only at the T positions that predict the target."""
    p = prompt.shape[0]
    tokens = jnp.concatenate([prompt, target[:-1]])  # [P + T - 1]
    hidden = model._extend_hidden(params, model.init_state(0, params["embed"].dtype), tokens, remat=remat,
                                  left_pad=left_pad)[p - 1 :]  # [T, D]
    logits = model.logits(params, hidden)  # [T, V]
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logp, target[:, None], axis=-1)[:, 0]  # [T]
    return -jnp.sum(picked * mask), target_accuracy(jnp.argmax(logits, axis=-1) == target, mask)


def target_accuracy(hit, mask) -> tuple[jax.Array, jax.Array]:
    """hit bool [T] (each target token the argmax), mask [T] -> (accuracy, exact) float32 0/1: exact when every real
    token is hit; accuracy the first token's hit, or for an agent episode's target (a hole in its mask: a tool
    reply) its exactness (an episode is right only as a whole)."""
    exact = jnp.all(hit | (mask == 0))
    episode = jnp.any((mask[:-1] == 0) & (mask[1:] > 0))
    return jnp.where(episode, exact, hit[0]).astype(jnp.float32), exact.astype(jnp.float32)


def _metrics(total, first, exact, mask) -> tuple[jax.Array, dict]:
    loss = total / jnp.maximum(jnp.sum(mask), 1.0)
    return loss, {"sft_loss": loss, "sft_accuracy": jnp.mean(first), "sft_exact": jnp.mean(exact)}


def sft_loss(model, params, prompts, targets, mask, left_pad=None) -> tuple[jax.Array, dict]:
    """prompts int32 [N, P], targets int32 [N, T], mask float32 [N, T], left_pad int32 [N] or None -> (token-mean
    cross-entropy over the real target tokens, {"sft_loss": same, "sft_accuracy": fraction of rows whose first target
    token is the argmax (an episode's: whose every real token is, `row_loss`), "sft_exact": fraction of rows whose
    every target token is (teacher-forced)}). The rows vmapped: every row's activations live together (short
    prompts)."""
    pads = left_pad if left_pad is not None else jnp.zeros(prompts.shape[:1], jnp.int32)
    one = lambda p, t, m, lp: row_loss(model, params, p, t, m, lp if left_pad is not None else None)  # noqa: E731
    sums, (first, exact) = jax.vmap(one)(prompts, targets, mask, pads)
    return _metrics(jnp.sum(sums), first, exact, mask)


def sft_grads_by_row(model, params, prompts, targets, mask, left_pad=None) -> tuple[dict, dict]:
    """The gradient of `sft_loss` and its metrics, one row at a time (a `lax.scan` summing the rows' gradients of
    their summed -log p, divided by the batch's target-token count at the end; blocks rematerialised): memory is one
    row's graph (long prompts). Same arguments as `sft_loss` -> (grads like params, metrics)."""
    pads = left_pad if left_pad is not None else jnp.zeros(prompts.shape[:1], jnp.int32)

    def one(grads, row):
        p, t, m, lp = row
        (total, extra), g = jax.value_and_grad(
            lambda q: row_loss(model, q, p, t, m, lp if left_pad is not None else None, remat=True), has_aux=True)(
            params)
        return jax.tree.map(jnp.add, grads, g), (total, *extra)

    zero = jax.tree.map(jnp.zeros_like, params)
    grads, (sums, first, exact) = jax.lax.scan(one, zero, (prompts, targets, mask, pads))
    count = jnp.maximum(jnp.sum(mask), 1.0)
    grads = jax.tree.map(lambda g: (g / count).astype(g.dtype), grads)
    return grads, _metrics(jnp.sum(sums), first, exact, mask)[1]


def sft_step(model, optimizer, params, opt_state, prompts, targets, mask, left_pad=None, per_row: bool = False):
    """One warm-up update -> (params, opt_state, metrics); per_row: the gradient by `sft_grads_by_row` (long
    prompts), else by autodiff of `sft_loss`. (`warm_up` jits it with the params' and optimizer state's shardings
    as output shardings, so that every step sees the same placement and it compiles once per prompt bucket.)"""
    if per_row:
        grads, metrics = sft_grads_by_row(model, params, prompts, targets, mask, left_pad)
    else:
        (_, metrics), grads = jax.value_and_grad(
            lambda q: sft_loss(model, q, prompts, targets, mask, left_pad), has_aux=True)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, dict(metrics, sft_grad_norm=optax.tree.norm(grads))


@functools.lru_cache(maxsize=8)
def _jitted_step(model, optimizer, param_shardings: tuple, opt_shardings: tuple, per_row: bool = False):
    """`sft_step` jitted with output shardings = the inputs' ((treedef, leaves) pairs, hashable): one compile per
    model, optimizer, placement and batch shape, shared by every warm-up in the process."""
    unflat = lambda pair: jax.tree.unflatten(*pair)  # noqa: E731
    return jax.jit(functools.partial(sft_step, model, optimizer, per_row=per_row), donate_argnums=(0, 1),
                   out_shardings=(unflat(param_shardings), unflat(opt_shardings), None))


@functools.lru_cache(maxsize=None)
def warm_up_optimizer(learning_rate: float) -> optax.GradientTransformation:
    """`train.make_optimizer`'s AdamW (its b1, b2 and global-norm clip) with WARM_UP_WEIGHT_DECAY, one object per
    rate (a static jit argument: one compile)."""
    return make_optimizer(learning_rate, weight_decay=WARM_UP_WEIGHT_DECAY)


class DatasetTargets:
    """The warm-up examples of a --data run: the training rows of `task` (a `tasks.dataset.DatasetTask`; never its
    held-out rows), in an order drawn from `seed` (the trainer passes `warm_up_seed(--seed)`: another order than
    GRPO's), each prompt rendered exactly as the GRPO phase renders it (chat template, --max-prompt-len, --truncate).

    example(i) -> (Prompt, target int32 [k]): the row's `answer_field` (a string) tokenized with the run's tokenizer,
    no special tokens added, then `stop_token` (None: none), 1 <= k <= response_len.
    batch(start, size) -> (prompts int32 [N, L], left_pad int32 [N] or None, targets int32 [N, response_len], mask
    float32 [N, response_len]): prompts start .. start + size - 1 stacked like the GRPO phase stacks them
    (`batches.stack_prompts` with `buckets`: left-padded to one bucket length), targets right-padded with
    `pad_token`. ValueError "FILE: row N: 'FIELD' ..." for a training row without the answer (when built: the
    column's nulls) or with one that is not a string or does not fit --response-len (when drawn)."""

    def __init__(self, task, answer_field: str, stop_token: int | None, response_len: int, buckets=None,
                 seed: int = 0, pad_token: int = 0):
        from longstraw_jax.tasks import dataset

        self.task = dataset.DatasetTask(task.dataset, task.path, task.rows, task.tokenizer, task.format, seed=seed,
                                        name=f"warm-up {task.name}")
        self.field, self.stop_token, self.response_len = answer_field, stop_token, int(response_len)
        self.buckets, self.pad_token = buckets, int(pad_token)
        if answer_field not in task.dataset.column_names:
            raise ValueError(f"{task.path}: row {int(task.rows[0])}: '{answer_field}' is missing: the supervised "
                             "warm-up (--sft-steps) imitates the --answer-field column")
        null = dataset.first_null_row(task.dataset, answer_field, among=task.rows)
        if null is not None:
            raise ValueError(f"{task.path}: row {null}: '{answer_field}' is missing: the supervised warm-up "
                             "(--sft-steps) imitates the --answer-field column")

    def example(self, index: int):
        from longstraw_jax.tasks import dataset

        row = self.task.row_of(index)
        prompt = self.task.render(row)
        answer = prompt.info.get(self.field)
        where = f"{self.task.path}: row {row}: '{self.field}'"
        if answer is None:
            raise ValueError(f"{where} is missing: the supervised warm-up (--sft-steps) imitates the --answer-field "
                             "column")
        if not isinstance(answer, str):
            raise ValueError(f"{where} must be a string (the warm-up's target), not {dataset.shown(answer)}")
        tokens = list(self.task.tokenizer(answer, add_special_tokens=False)["input_ids"])
        tokens += [] if self.stop_token is None else [int(self.stop_token)]
        if not 1 <= len(tokens) <= self.response_len:
            raise ValueError(f"{where} has {len(tokens)} tokens with the stop token; the warm-up's target needs "
                             f"1..--response-len={self.response_len}")
        return prompt, np.asarray(tokens, np.int32)

    def batch(self, start: int, size: int):
        from longstraw_jax.trainer.components import stack_prompts

        prompts, targets = zip(*(self.example(i) for i in range(start, start + size)))
        tokens, left_pad = stack_prompts(list(prompts), self.buckets)
        out = np.full((size, self.response_len), self.pad_token, np.int32)
        mask = np.zeros((size, self.response_len), np.float32)
        for i, t in enumerate(targets):
            out[i, : t.size], mask[i, : t.size] = t, 1.0
        return tokens, left_pad, out, mask


STOP_WINDOW = 4  # --sft-stop-accuracy: the mean over this many of the latest batches (4 x 32 prompts: std ~0.04)


def warm_up(model, params, task, steps: int, batch: int, learning_rate: float, pad_token: int = 0, say=None,
            place=None, stop_accuracy: float | None = None):
    """`steps` supervised updates of `params` on `task`'s targets (a task with `target(info)`, or `DatasetTargets`:
    then the gradient one row at a time, `sft_grads_by_row`) -> (params, records): one record per step
    {"step": 0, "kind": "sft", "sft_step", "sft_loss", "sft_accuracy", "sft_exact", "sft_grad_norm", "sft_s"} (its
    loss and accuracies on that step's batch, before the update). params placed on a mesh keep their shardings. say: a
    print function for progress lines (every ~10% of the steps), or None. place(opt_state) -> the optimizer state
    placed like the params (the trainer's `components.place`; default: on the params' first device), so that the step
    compiles once (per prompt bucket).

    stop_accuracy: stop before `steps` once the mean `sft_accuracy` of the latest STOP_WINDOW batches reaches it. Each
    batch is scored before the update that trains on it, so this is an estimate on prompts not yet trained on: the
    warm-up then ends at the same level of skill whatever the seed, where a fixed step count lands each seed at
    another point of a steep transition (docs/benchmarks.md 6)."""
    per_row = isinstance(task, DatasetTargets)
    optimizer = warm_up_optimizer(float(learning_rate))
    shardings = jax.tree.map(lambda x: x.sharding, params)
    opt_state = jax.jit(optimizer.init)(params)
    if place is None:
        device = next(iter(jax.tree.leaves(params)[0].devices()))
        place = lambda tree: jax.device_put(tree, device)  # noqa: E731
    opt_state = place(opt_state)
    flat = lambda tree: (jax.tree.structure(tree), tuple(jax.tree.leaves(tree)))  # noqa: E731 (hashable)
    step = _jitted_step(model, optimizer, flat(shardings), flat(jax.tree.map(lambda x: x.sharding, opt_state)),
                        per_row)
    records = []
    for i in range(steps):
        start = time.perf_counter()
        if per_row:
            prompts, left_pad, targets, mask = task.batch(i * batch, batch)
        else:
            (prompts, targets, mask), left_pad = target_batch(task, i * batch, batch, pad_token), None
        params, opt_state, metrics = step(params, opt_state, prompts, targets, mask, left_pad)
        metrics = {k: float(v) for k, v in hosts.to_host(metrics).items()}
        records.append({"step": 0, "kind": "sft", "sft_step": i + 1, **metrics, "sft_s": time.perf_counter() - start})
        if say is not None and ((i + 1) % max(1, steps // 10) == 0 or i + 1 == steps):
            window = records[-max(1, steps // 10):]
            mean = lambda key: np.mean([r[key] for r in window])  # noqa: E731
            say(f"warm-up {i + 1:>4}/{steps}: loss {mean('sft_loss'):.3f} accuracy {mean('sft_accuracy'):.3f} exact "
                f"{mean('sft_exact'):.3f} (mean of the last {len(window)} batches) | {records[-1]['sft_s']:.2f} "
                "s/step", flush=True)
        if stop_accuracy is not None and len(records) >= STOP_WINDOW:
            reached = np.mean([r["sft_accuracy"] for r in records[-STOP_WINDOW:]])
            if reached >= stop_accuracy:
                if say is not None:
                    say(f"warm-up stopped at step {i + 1}/{steps}: accuracy {reached:.3f} over the last {STOP_WINDOW} "
                        f"batches >= --sft-stop-accuracy {stop_accuracy}", flush=True)
                break
    return params, records
