"""What a run is built from, given its RunConfig (the output directory and the checkpoint to resume: trainer/outdir.py):
the device mesh, the model and its params (placed on one device or FSDP-sharded), the optimizer, and the data source
(a task sampled from the policy, or a rollout file). Every function here checks its inputs before anything is written.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import re
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from longstraw_jax import models
from longstraw_jax.adapters import lora, trainable
from longstraw_jax.grpo import GroupBatch
from longstraw_jax.io import checkpoints, peft
from longstraw_jax.ops import kernels as kernel_choice
from longstraw_jax.sampling.branches import SamplingConfig
from longstraw_jax.sampling.groups import sample_groups
from longstraw_jax.sharding import hosts, make_mesh, rules
from longstraw_jax.sharding.mesh import parse_mesh_spec
from longstraw_jax.tasks import load_callable, make_task
from longstraw_jax.tasks.rollout_file import load_rollouts
from longstraw_jax.train import make_optimizer
from longstraw_jax.trainer import distributed, episodes
from longstraw_jax.trainer.batches import (  # noqa: F401 (part_means, prompt_batches: used through components)
    PromptBuckets,
    part_means,
    prompt_batches,
    score_groups,
    stack_prompts,
)
from longstraw_jax.trainer.config import RunConfig, RunError


def default_out() -> str:
    return os.path.join("out", time.strftime("run-%Y%m%d-%H%M%S", time.gmtime()))


def load_model(config: RunConfig):
    """(model, params) from --hf, --init-from, a --model config.json (random init) or the tiny preset, running the
    --kernels it resolves to. Unknown config.json fields are errors here, not warnings (the model configs warn about
    them)."""
    model, params = _load_model(config)
    return with_kernels(model, config.kernels), params


def with_kernels(model, choice: str):
    """The model running its attention as `kernel_choice.resolve(choice)`."""
    impl = kernel_choice.resolve(choice)
    return model if model.config.kernels == impl else models.build(dataclasses.replace(model.config, kernels=impl))


def _load_model(config: RunConfig):
    dtype = jnp.dtype(config.dtype)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=r"(?i).*unknown", category=UserWarning)
        try:
            if config.hf:
                return models.load_hf(config.hf, dtype=dtype)
            if config.init_from:
                return checkpoints.load_init_dir(config.init_from, dtype=dtype)
            if config.model == "tiny":
                model_config = models.Qwen36Config.tiny(vocab_size=config.vocab_size)
            else:
                if not os.path.isfile(config.model):
                    raise RunError(f"--model {config.model}: no such config file (or use 'tiny')")
                model_config = models.config_from_hf(config.model)
        except UserWarning as w:
            raise RunError(str(w)) from None
    model = models.build(model_config)
    check_fits(model, dtype, "--model " + config.model if config.model != "tiny" else
               f"--model tiny --vocab-size {config.vocab_size}")
    return model, _init(model, jax.random.key(config.seed), dtype)


def available_bytes() -> int:
    """Memory the params may use: the sum of the local accelerators' `bytes_limit`, or on CPU the host's available
    memory (/proc/meminfo MemAvailable, else physical pages)."""
    limits = [(d.memory_stats() or {}).get("bytes_limit") for d in jax.local_devices()]
    if all(limits):
        return int(sum(limits))
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_fits(model, dtype, what: str, available: int | None = None) -> None:
    """Before a random init allocates anything: the params (at `dtype`) and AdamW's two float32 moments must fit in
    `available` bytes (default `available_bytes()`), else a RunError naming `what` and both sizes (the shapes come
    from `jax.eval_shape`: nothing is allocated)."""
    shapes = jax.eval_shape(lambda key: model.init(key, dtype), jax.random.key(0))
    count = sum(x.size for x in jax.tree.leaves(shapes))
    need = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes)) + 8 * count
    available = available_bytes() if available is None else available
    if need > available:
        raise RunError(f"{what}: {count / 1e9:.3g} B parameters need {need / 2**30:.1f} GiB (params + AdamW "
                       f"moments) before any activation; {available / 2**30:.1f} GiB available on "
                       f"{jax.local_device_count()} local device(s)")


# one jitted init for every run in a process (a `jax.jit(model.init)` made per call compiled again each time)
_init = jax.jit(lambda model, key, dtype: model.init(key, dtype), static_argnums=(0, 2))


def place(tree, mesh, params=None):
    """Params or optimizer state -> committed to the first device, or on a mesh sharded by the FSDP rules
    (`sharding.rules.param_specs` of `params`, default `tree` itself; optimizer moments like the params, step
    counts replicated). Committed whatever the source (init, safetensors, Orbax), so the jitted sampler and step
    see the same argument placement on every call and compile once."""
    if mesh is None:
        return jax.device_put(tree, jax.local_devices()[0])
    params = tree if params is None else params
    specs = rules.like_params_specs(tree, params, rules.param_specs(params, mesh))
    if jax.process_count() > 1:  # every process holds the same values: each builds its own devices' shards
        return distributed.to_global(tree, rules.named(specs, mesh))
    return jax.device_put(tree, rules.named(specs, mesh))


def place_key(key, mesh):
    """The run's RNG key: as it is without a mesh, else replicated on the mesh (a global array every process holds,
    which the sampler's jit and a multi-process Orbax save accept)."""
    if mesh is None:
        return key
    return distributed.to_global(key, distributed.replicated(mesh))


def groups_per_step(config: RunConfig) -> int:
    """B: --groups-per-step, or the mesh's data size (1 without --mesh)."""
    if config.groups_per_step is not None:
        return config.groups_per_step
    return parse_mesh_spec(config.mesh)[0] if config.mesh is not None else 1


def mesh_for(config: RunConfig):
    """The ("data", "seq") mesh of --mesh, or None."""
    return None if config.mesh is None else make_mesh(config.mesh)


@functools.lru_cache(maxsize=None)
def optimizer(learning_rate: float, weight_decay: float, max_grad_norm: float | None, lr_warmup_steps: int = 0):
    """One optimizer object per setting: `train_step` compiles once per optimizer object (a static argument), so
    runs in one process with equal settings (e.g. a run and its resumption) share the compiled step."""
    return make_optimizer(learning_rate, weight_decay=weight_decay, max_grad_norm=max_grad_norm,
                          lr_warmup_steps=lr_warmup_steps)


def run_optimizer(config: RunConfig):
    """The GRPO optimizer of a run's options (`optimizer`)."""
    return optimizer(config.learning_rate, config.weight_decay, config.max_grad_norm or None, config.lr_warmup_steps)


class RolloutFile:
    """Groups of an external rollout file, used in order and cyclically: step position p takes groups p * B ..
    p * B + B - 1 (mod count), stacked side by side (they must then have equal shapes)."""

    task = None

    def __init__(self, path: str, groups: list[GroupBatch], groups_per_step: int = 1):
        self.groups, self.groups_per_step = groups, groups_per_step
        self.description = f"rollout file {path}"
        if groups_per_step > 1:
            shapes = {tuple(np.shape(x) for x in jax.tree.leaves(g)) + (g.old_logprobs is None, g.ref_logprobs is None)
                      for g in groups}
            if len(shapes) > 1:
                raise RunError(f"--rollouts {path}: --groups-per-step={groups_per_step} stacks groups side by side, so "
                               "every group needs the same prompt length, G, R and the same optional fields; this "
                               f"file has {len(shapes)} different shapes")

    def batch(self, model, params, key, step: int, position: int) -> tuple[GroupBatch, dict, None]:
        count = len(self.groups)
        chosen = [self.groups[(position * self.groups_per_step + b) % count] for b in range(self.groups_per_step)]
        return stack_groups(chosen), {}, None


def stack_groups(groups: list[GroupBatch]) -> GroupBatch:
    """One-group batches -> one batch with a leading group axis [B, ...]."""
    return jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *groups)


class TaskSampler:
    """B groups per step: group b of step position p is the task's prompt number p * B + b, with G branches sampled from
    the policy (key = fold_in(fold_in(run key, step), b)) by `sampling.groups.sample_groups` (on the mesh when there is
    one) and scored by the reward function (or group scorer); extra metrics "accuracy" (over all B * G branches) when
    the task has `is_correct`, and "reward/<name>" per text reward function. The sampler's captures go to the update:
    each prompt is captured once per step."""

    def __init__(self, task, reward_fn, sampling: SamplingConfig, group_size: int, chunk_size: int,
                 groups_per_step: int = 1, mesh=None, buckets: PromptBuckets | None = None):
        self.task, self.reward_fn, self.sampling, self.buckets = task, reward_fn, sampling, buckets
        self.group_size, self.chunk_size, self.mesh = group_size, chunk_size, mesh
        self.groups_per_step = groups_per_step
        self.description = f"task {task.name}"
        self.last_scored = None  # the last batch's (prompts, parts, correct) of score_groups, for samples.jsonl

    def batch(self, model, params, key, step: int, position: int) -> tuple[GroupBatch, dict, object]:
        """-> (the step's batch [B, ...], extra metrics, the sampler's captures for the update)."""
        prompts = [self.task.prompt(position * self.groups_per_step + b) for b in range(self.groups_per_step)]
        tokens, left_pad = stack_prompts(prompts, self.buckets)
        step_key = jax.random.fold_in(key, step)
        keys = jax.vmap(lambda b: jax.random.fold_in(step_key, b))(np.arange(self.groups_per_step))
        rollouts, captured = sample_groups(model, params, tokens, keys, self.group_size, self.sampling,
                                           self.chunk_size, mesh=self.mesh, left_pad=left_pad)
        # the full values on every process (gathered when sharded over several); each group is scored by the
        # process that owns its data slice, and the rewards are summed over processes (zero where not owned)
        responses, mask, logprobs = hosts.to_host((rollouts.responses, rollouts.mask, rollouts.logprobs))
        rewards, correct, parts = score_groups(self.task, self.reward_fn, prompts, responses, mask, self.mesh)
        self.last_scored = (prompts, parts, correct)
        extra = {"accuracy": float(correct.mean())} if correct is not None else {}
        extra.update(part_means(parts))
        batch = GroupBatch(prompt=tokens, responses=responses, mask=mask, rewards=rewards, old_logprobs=logprobs,
                           left_pad=left_pad)
        return batch, extra, captured


def data_source(config: RunConfig, vocab_size: int, mesh=None) -> RolloutFile | TaskSampler:
    """--rollouts, --data (a dataset with its tokenizer and text rewards) or --task with its reward, and the sampling
    options (ids checked against `vocab_size`); a task samples on `mesh` when given."""
    if config.rollouts:
        required = {"ref_logprobs": f"--kl-coef={config.kl_coef} needs reference log-probs on every line"}
        return RolloutFile(config.rollouts, load_rollouts(config.rollouts, vocab_size, config.tokenizer,
                                                          required=required if config.kl_coef > 0 else None),
                           groups_per_step(config))
    buckets = None
    if config.data:
        task, scorer, stops, pad = dataset_task(config, vocab_size)
        buckets = prompt_buckets(config, pad)
    else:
        task = make_task(config.task, prompt_len=config.prompt_len, vocab_size=vocab_size, seed=config.seed,
                         **config.task_options())
        scorer = token_reward(config, task)
        stops = (config.stop_token if config.stop_token is not None else getattr(task, "stop_token", None),)
        pad = getattr(task, "pad_token", 0)
    sampling = sampling_config(config, stops, pad, vocab_size)
    factory, name = episodes.environment_factory(config, task)
    if factory is not None:
        environments, counts = episodes.build_environments(config, factory, name, groups_per_step(config),
                                                           config.group_size, vocab_size, task, sampling, mesh)
        reward_fn = scorer if config.data else (load_callable(config.reward) if config.reward else None)
        return episodes.EpisodeSampler(task, environments, name, sampling, episodes.turn_config(config),
                                       config.group_size, config.chunk_size, groups_per_step(config), buckets,
                                       reward_fn=reward_fn, max_errors=config.max_env_errors, mesh=mesh,
                                       tool_counts=counts)
    return TaskSampler(task, scorer, sampling, config.group_size, config.chunk_size, groups_per_step(config), mesh,
                       buckets)


def prompt_buckets(config: RunConfig, pad: int) -> PromptBuckets:
    """A dataset run's bucketing: multiples of --chunk-size doubling up to --max-prompt-len, --prompt-buckets."""
    return PromptBuckets(config.chunk_size, config.max_prompt_len, config.prompt_buckets, pad)


def token_reward(config: RunConfig, task):
    """--task's reward: --reward MODULE:FUNCTION (one token-level function) or the task's own."""
    if config.reward is None:
        return task.reward
    if "," in config.reward:
        raise RunError(f"--reward={config.reward!r}: a --task takes one token-level reward function; several (text) "
                       "rewards need --data")
    return load_callable(config.reward)


def sampling_config(config: RunConfig, stops, pad: int, vocab_size: int, temperature: float | None = None):
    """The SamplingConfig of a run: -R, --temperature (or `temperature`), --top-p, --decode-batch, the stop ids
    (None entries dropped; the first is `stop_token`, the others `stop_tokens`) and the pad id, checked against the
    vocabulary."""
    stops = [s for s in stops if s is not None]
    for name, values in (("stop_token", stops), ("pad_token", [pad])):
        for value in values:
            if value >= vocab_size:
                raise RunError(f"{name}={value} is out of range: ids must be in [0, vocab_size={vocab_size})")
    return SamplingConfig(response_len=config.response_len,
                          temperature=config.temperature if temperature is None else temperature,
                          top_p=config.top_p, stop_token=stops[0] if stops else None, pad_token=pad,
                          decode_batch=config.decode_batch, stop_tokens=tuple(stops[1:]))


def tokenizer_dir(config: RunConfig) -> str:
    """--tokenizer, else the --hf / --init-from directory (RunError when there is none)."""
    path = config.tokenizer or config.hf or config.init_from
    if path is None:
        raise RunError("--data needs a tokenizer: --tokenizer DIR, or --hf / --init-from a directory with the "
                       "tokenizer files")
    return path


def dataset_task(config: RunConfig, vocab_size: int, held_out: bool = False):
    """--data -> (the DatasetTask of the training rows, or with held_out those of --eval-data / --eval-fraction
    (None when neither is given); its TextRewards scorer; the stop ids; the pad id). Tokenizer: `tokenizer_dir`,
    checked against `vocab_size`; stop ids: --stop-token, else the checkpoint's (`tasks.tokenizer.stop_ids`)."""
    from longstraw_jax.tasks import dataset, rewards, tokenizer as tokenizers

    if held_out and config.eval_data is None and config.eval_fraction is None:
        return None, None, (), 0
    tokenizer = tokenizers.load_tokenizer(tokenizer_dir(config), vocab_size)
    if held_out and config.eval_data is not None:
        path, rows = config.eval_data, dataset.read_dataset(config.eval_data, "--eval-data")
        chosen = np.arange(len(rows))
    else:
        path, rows = config.data, dataset.read_dataset(config.data)
        chosen = (np.arange(len(rows)) if config.eval_fraction is None
                  else dataset.split_rows(len(rows), config.eval_fraction, path)[1 if held_out else 0])
    fmt = dataset.choose_format(rows.column_names, config.prompt_field, config.messages_field,
                                chat_template_kwargs=dataset.template_kwargs(config.chat_template_kwargs),
                                max_prompt_len=config.max_prompt_len, truncate=config.truncate)
    task = dataset.DatasetTask(rows, path, chosen, tokenizer, fmt, seed=config.seed, shuffle=not held_out,
                               name=f"{'held-out ' if held_out else ''}data {path}")
    functions = rewards.load_rewards(config.reward, config.reward_weights, task.columns, config.answer_field)
    stops = ((config.stop_token,) if config.stop_token is not None
             else tokenizers.stop_ids(tokenizer, tokenizer_dir(config), config.hf or config.init_from))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None and tokenizer.pad_token_id < vocab_size else 0
    return task, rewards.TextRewards(functions, tokenizer), stops, pad


def prepare_training(config: RunConfig, model, params):
    """--train / --lora-* / --trainable / --export-peft -> (params, with adapters for --train lora; the trainable
    predicate for `trainable.split`, None when every leaf trains). Every model-dependent check happens here, before
    the run writes anything: unknown targets, a rank beyond a target's dimensions, a PEFT export of targets PEFT
    cannot express, a --trainable expression that matches nothing."""
    if config.train == "lora":
        paths = lora.resolve_targets(params, config.lora_targets)
        lora.check_rank(params, paths, config.lora_rank)
        key = jax.random.fold_in(jax.random.key(config.seed), 0x10A)
        params = lora.add_adapters(params, paths, config.lora_rank, config.lora_alpha, key)
        if config.export_peft:
            peft.check_peft(model, params)
        return params, trainable.adapter_leaf
    if config.trainable is not None:
        expression = re.compile(config.trainable)
        names = [trainable.path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]
        if not any(expression.search(n) for n in names):
            shown = ", ".join(dict.fromkeys(lora.short_path(n) if n.startswith(lora.STACKED) else n for n in names))
            raise ValueError(f"--trainable={config.trainable!r} matches no parameter; paths: {shown}")
        return params, lambda path: bool(expression.search(path))
    return params, None
