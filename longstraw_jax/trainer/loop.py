"""The training loop: `Trainer(config, explicit)` holds one run's state (model, params, optimizer state, RNG key,
step, data position, checkpoints, metrics log); `run()` trains to `config.steps`, checkpointing every
`save_every` steps and after the last, then plots, exports and prints the summary.

Nothing is written before every input has been checked (trainer/components.py, trainer/outdir.py) and the first step
has been computed (so a bad reward function or batch is raised first too): until then the output directory stays as
it was. Ctrl-C stops the run (exit status 130) saying which checkpoint is the last complete one; a Ctrl-C during a
save or while the output directory is being set up takes effect when that is done.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys
import threading
import time

import jax
import numpy as np
import optax

from longstraw_jax import models
from longstraw_jax.adapters import lora, trainable
from longstraw_jax.common import progress
from longstraw_jax.grpo import GRPOConfig
from longstraw_jax.io import fault_hooks, peft
from longstraw_jax.sharding import hosts
from longstraw_jax.train import learning_rate_at, param_norm, train_step
from longstraw_jax.trainer import (
    components,
    console,
    distributed,
    evaluate,
    metrics,
    outdir,
    reference,
    report,
    updates,
    warmup,
    watchdog,
)
from longstraw_jax.trainer.config import RunConfig, RunError, profile_window


class Trainer:
    def __init__(self, config: RunConfig, explicit=frozenset()):
        """explicit: the options given on the command line (a resumed run's saved options must not contradict
        them)."""
        report.check_available(config.report_to)  # --report-to's packages, before any work
        progress.enable(config.progress_rounds)  # before anything compiles (a traced program keeps its ticks or not)
        self.out = config.out or components.default_out()
        # --out, --resume, --export-hf (reads only): first on --resume (the checkpoint has the options), else after
        # the model and data checks
        self.plan = outdir.plan(config, explicit, self.out) if config.resume else None
        self.config = config = self.plan.config if self.plan else config
        self.mesh = components.mesh_for(config)
        self.model, params = components.load_model(config)
        # --train lora: adapters added (frozen base); --trainable: a predicate; None: every leaf trains
        params, self.trains = components.prepare_training(config, self.model, params)
        if self.mesh is not None:
            self.model.mesh_adapter()  # a family without a sharded path says so here
        self.params = components.place(params, self.mesh)
        # --kl-coef > 0 while sampling: the reference policy (trainer/reference.py), taken before any update or restore
        self.reference = reference.for_run(config, self.model, self.params, self.trains,
                                           lambda tree: components.place(tree, self.mesh))
        self.data = components.data_source(config, self.model.config.vocab_size, self.mesh)
        self.grpo = GRPOConfig(loss_agg=config.loss_agg, kl_coef=config.kl_coef, ratio=config.ratio,
                               clip_eps_low=config.clip_eps_low, clip_eps_high=config.clip_eps_high,
                               replay_batch=config.replay_batch)
        self.optimizer = components.run_optimizer(config)
        self.plan = self.plan or outdir.plan(config, explicit, self.out)
        # committed like the params: a jit output built from an uncommitted init would be committed after step 1
        # and recompile the step once more
        part = self.split()[0]  # AdamW state for the trainable part only
        self.opt_state = components.place(jax.jit(self.optimizer.init)(part), self.mesh, part)
        self.key = components.place_key(jax.random.key(config.seed), self.mesh)
        self.step, self.data_position = 0, 0
        if self.plan.resuming:
            self.params, self.opt_state, self.key, meta = self.plan.restore(self.params, self.opt_state, self.key)
            self.step, self.data_position = meta["step"], meta["data_position"]
        self.start_step = self.step
        # held-out evaluation (trainer/evaluate.py): --eval-every N > 0 on a task (not a rollout file)
        self.evaluator = evaluate.for_run(config, explicit, self.data, self.model.config.vocab_size, self.mesh)
        if config.sft_steps and self.data.task is None and "sft_steps" in explicit:
            raise RunError(f"--sft-steps={config.sft_steps} needs task prompts: a --rollouts file has none (pass "
                           "--sft-steps 0)")
        if config.data and config.sft_prompt_len is not None and "sft_prompt_len" in explicit:
            raise RunError(f"--sft-prompt-len={config.sft_prompt_len} sets a --task's warm-up prompt length; a --data "
                           "warm-up renders the rows' own prompts (--max-prompt-len, --truncate)")
        for name in ("sft_num_facts", "sft_max_depth"):
            if config.data and getattr(config, name) is not None and name in explicit:
                raise RunError(f"--{name.replace('_', '-')}={getattr(config, name)} sets the retrieval task's warm-up "
                               "facts; a --data warm-up imitates the rows' own answers")
        # the warm-up trains every parameter: not with a frozen part (by default it is skipped there)
        self.freezes = config.train == "lora" or config.trainable is not None
        if config.sft_steps and self.freezes and "sft_steps" in explicit:
            raise RunError(f"--sft-steps={config.sft_steps}: the supervised warm-up trains every parameter, but "
                           "--train lora / --trainable keep some frozen (pass --sft-steps 0)")
        if (self.reference is not None and self.reference.kind == "initial" and config.sft_steps
                and self.data.task is not None and not self.freezes):
            raise RunError(f"--kl-coef={config.kl_coef} with --sft-steps={config.sft_steps}: the KL reference would be "
                           "the model before the warm-up; pass --ref-from DIR (e.g. a warmed-up checkpoint) or "
                           "--sft-steps 0")
        # a --data warm-up: each training row's --answer-field + the stop token (a missing column fails here)
        self.sft_targets = None
        if config.sft_steps and config.data and not self.freezes and not self.plan.resuming:
            self.sft_targets = warmup.DatasetTargets(
                self.data.task, config.answer_field, self.data.sampling.stop_token, config.response_len,
                self.data.buckets, warmup.warm_up_seed(config.seed), self.data.sampling.pad_token)
        # watching (trainer/report.py)
        self.ticker = console.PhaseTicker(print if distributed.is_primary() else None, config.progress_every)
        self.profile = (report.ProfileWindow(*profile_window(config.profile_steps), report.profile_dir(self.out))
                        if config.profile_steps else None)
        # opened by _start_writing, after the first step: until then the output directory is as it was
        self.checkpoints, self.log, self.samples = None, None, None
        self.pending = []  # records computed before the run writes (warm-up, the start's evaluation)

    def split(self):
        """(the trainable part of self.params, the frozen part or None): `trainable.split` by --train/--trainable."""
        if self.trains is None:
            return self.params, None
        return trainable.split(self.params, self.trains)

    def _start_writing(self) -> None:
        with _sigint_deferred():
            self.checkpoints = self.plan.start()
            # several processes: process 0 writes metrics.jsonl (every process computes the same records)
            self.log = (metrics.MetricsLog(os.path.join(self.out, "metrics.jsonl")) if distributed.is_primary()
                        else metrics.NoLog())
            # samples.jsonl, also when this run logs none: a resumed run never lists a step twice
            samples = (metrics.MetricsLog(os.path.join(self.out, report.SAMPLES_FILE)) if distributed.is_primary()
                       else metrics.NoLog())
            if self.plan.resuming:
                for note in self.log.keep_until(self.start_step) + samples.keep_until(self.start_step):
                    outdir.warn(note)
            self.samples = samples if self.config.log_samples_every and distributed.is_primary() else None
            if distributed.is_primary():  # --report-to: the same records go to tensorboard / wandb
                self.log = report.ReportedLog(self.log, report.open_reporters(
                    self.config.report_to, self.out, self.config.saved(),
                    self.start_step if self.plan.resuming else None))
            for record in self.pending:
                self.log.write(record)
            if self.evaluator is not None and not self.plan.resuming and distributed.is_primary():
                np.save(os.path.join(self.out, evaluate.REFERENCE_FILE), self.evaluator.reference)

    def train_one(self) -> dict:
        """One step: a batch from the data source, --updates-per-batch train_steps (none when --drop-uniform-groups
        leaves no group), one metrics.jsonl line (returned)."""
        start = time.perf_counter()
        with self.ticker.phase(self.step + 1, self.config.steps, "sampling"):
            batch, extra, captured = self.data.batch(self.model, self.params, self.key, self.step, self.data_position)
        sampled = time.perf_counter()
        fault_hooks.fire("step", self.step + 1)
        updated, updated_captured, last = batch, captured, batch
        if self.config.drop_uniform_groups:
            updated, updated_captured, uniform = updates.without_uniform_groups(batch, captured, self.mesh)
            extra = dict(extra, uniform_groups=uniform)
            if self.config.refill_batches:
                extra = dict(extra, refill_batches=0)
                if updates.uniform_groups(batch.rewards, batch.valid).any():  # fewer than -B groups with a signal
                    updated, batch, last, extra = self.refill(batch, extra)
                    updated_captured = None  # the update captures the pooled prompts afresh
                    sampled = time.perf_counter()  # rollout_s: every batch sampled
        if updated is None:  # every group uniform: no gradient to follow
            step_metrics = updates.no_update_metrics(batch)
        else:
            if self.reference is not None:  # the kept groups' reference log-probs (one more capture per group)
                with self.ticker.phase(self.step + 1, self.config.steps, "reference"):
                    started = time.perf_counter()
                    updated = updated.replace(ref_logprobs=self.reference.logprobs(
                        self.model, self.params, updated, self.config.chunk_size, self.mesh, self.grpo.logprob_chunk))
                    extra = dict(extra, ref_s=time.perf_counter() - started)
            with self.ticker.phase(self.step + 1, self.config.steps, "update"):
                step_metrics = updates.mean_metrics([self.update(updated, updated_captured if k == 0 else None)
                                                     for k in range(self.config.updates_per_batch)])
            step_metrics.update(updates.reward_metrics(batch))  # over every sampled group, kept or not
        done = time.perf_counter()
        self.step += 1
        self.data_position += 1
        record = metrics.step_record(self.step, step_metrics, extra, batch, start, sampled, done)
        if self.log is None:
            self._start_writing()
        self.log.write(record)
        if self.samples is not None and report.sample_step(self.step, self.config.log_samples_every,
                                                           self.config.steps):
            self.samples.write_many(report.step_samples(self.step, last, self.grpo, self.data))
        return record

    def refill(self, batch, extra: dict):
        """--refill-batches: sample up to K more batches (the next data positions, a key per refill) while fewer than
        -B groups carry a signal -> (the update's batch or None, every sampled group pooled, the last batch sampled
        (its samples are the ones the data source scored last), extra with uniform_groups and refill_batches)."""
        sampled, groups = [batch], len(batch.rewards)
        data_size = 1 if self.mesh is None else self.mesh.shape["data"]
        while len(sampled) <= self.config.refill_batches:
            self.data_position += 1
            with self.ticker.phase(self.step + 1, self.config.steps, f"refill {len(sampled)}"):
                more, _, _ = self.data.batch(self.model, self.params, jax.random.fold_in(self.key, len(sampled)),
                                             self.step, self.data_position)
            sampled.append(more)
            if sum(int((~updates.uniform_groups(b.rewards, b.valid)).sum()) for b in sampled) >= groups:
                break
        updated, uniform = updates.refilled(sampled, groups, data_size)
        extra = dict(extra, uniform_groups=uniform, refill_batches=len(sampled) - 1)
        return updated, updates.pooled(sampled), sampled[-1], extra

    def update(self, batch, captured) -> dict:
        """One train_step on `batch` (captured: the sampler's capture of its prompts, or None: the step captures
        them with the current params) -> its metrics on the host, with update_ratio (the update's norm / the trained
        weights' norm before it) and the update's learning_rate."""
        params, frozen = self.split()
        size = param_norm(params)  # before the step donates them
        rate = self.learning_rate()
        params, self.opt_state, step_metrics = train_step(
            self.model, params, self.opt_state, batch, self.optimizer, self.grpo, self.config.mode,
            self.config.chunk_size, mesh=self.mesh, captured=captured, donate=True, frozen=frozen)
        self.params = trainable.merge(params, frozen)
        step_metrics = hosts.to_host(dict(step_metrics, param_norm=size, learning_rate=rate))
        # how far the step moved the trained weights, relative to their size (0 when skipped)
        step_metrics["update_ratio"] = float(step_metrics["update_norm"]) / max(float(step_metrics.pop("param_norm")),
                                                                                 1e-30)
        return step_metrics

    def learning_rate(self):
        """The rate of the next update: --learning-rate, during --lr-warmup-steps its share (the optimizer's update
        count is in its state, so a resumed run continues the ramp)."""
        if not self.config.lr_warmup_steps:
            return self.config.learning_rate
        count = optax.tree_utils.tree_get_all_with_path(self.opt_state, "count")[0][1]
        return learning_rate_at(self.config.learning_rate, self.config.lr_warmup_steps, count)

    def run(self) -> int:
        """Train to config.steps -> 0; Ctrl-C -> 130 (after saying which checkpoint is the last complete one)."""
        config = self.config
        say = print if distributed.is_primary() else (lambda *args, **kwargs: None)  # process 0 prints
        say(console.header(self))
        records = []
        wall = time.perf_counter()
        with contextlib.ExitStack() as ticks:  # --progress-rounds: the loops' ticks reach the PhaseTicker's lines
            if config.progress_rounds:
                ticks.callback(progress.enable, False)  # later programs of this process trace without ticks
                if distributed.is_primary():
                    ticks.enter_context(progress.reporting(self.ticker.note))
            try:
                self.before_first_step(say)
                watchdog.note_checkpoint(self.last_checkpoint())  # several processes: a step that hangs ends them all
                while self.step < config.steps:
                    if self.profile is not None:
                        self.profile.before(self.step + 1)
                    with watchdog.step(self.step + 1):
                        record = self.train_one()
                    if self.profile is not None:
                        self.profile.after(self.step)
                    records.append(record)
                    if self.step % config.log_every == 0 or self.step == config.steps:
                        say(console.progress(record, config.steps), flush=True)
                    if self.evaluator is not None and (self.step % config.eval_every == 0 or self.step == config.steps):
                        self.log.write(self.evaluate(say))
                    if self.step % config.save_every == 0 or self.step == config.steps:
                        with _sigint_deferred():
                            self.checkpoints.save(self.step, self.params, self.opt_state, self.key, self.data_position,
                                                  config.saved())
                        watchdog.note_checkpoint(self.last_checkpoint())
                wall = time.perf_counter() - wall
                self.checkpoints.close()
                self.close_watchers()
                # a collective: all processes
                final = hosts.to_host(self.params) if config.export_hf or config.export_peft else None
                with distributed.agreed("finish", (RunError, OSError, ValueError)):
                    if distributed.is_primary():  # process 0 writes the plot and the export, and prints the summary
                        history = metrics.read_metrics(self.log.path)
                        metrics.plot_metrics(history, os.path.join(self.out, "metrics.png"),
                                             title=f"GRPO ({config.mode}) on {self.data.description}",
                                             chance=getattr(self.data.task, "chance_accuracy", None),
                                             levels=console.accuracy_levels(self.data.task))
                        if config.export_hf:  # merged weights (base + scale * B A) for a LoRA run
                            with outdir.replaced_dir(config.export_hf, config.force) as staging:
                                models.save_hf(self.model, lora.merged(final), staging)
                        if config.export_peft:
                            with outdir.replaced_dir(config.export_peft, config.force, "--export-peft") as staging:
                                peft.save_peft(self.model, final, staging)
                        print(console.summary(records, history, wall, self))
            except KeyboardInterrupt:
                return self.interrupted()
        return 0

    def before_first_step(self, say) -> None:
        """A new run (not resumed): the supervised warm-up (--sft-steps), then the held-out evaluation of the
        starting policy (its first-token distribution is the reference of eval_kl_to_start). A resumed run: the
        reference from <out>/eval_start.npy. Records wait in self.pending until the run writes."""
        config = self.config
        if self.plan.resuming:
            if self.evaluator is not None:
                self.evaluator.reference = evaluate.load_reference(self.out, self.evaluator)
            return
        # (a --rollouts run has no task to imitate; a run with frozen parameters skips it)
        if config.sft_steps and self.data.task is not None and not self.freezes:
            if self.evaluator is not None:  # the policy before the warm-up (a random init: what the warm-up adds)
                self.pending.append(dict(self.evaluate(say, label="before the warm-up"), before_warm_up=True))
            if self.sft_targets is not None:
                task = self.sft_targets
                say(f"warm-up: {config.sft_steps} supervised steps x {config.sft_batch} training rows of "
                    f"{config.data} (target: '{config.answer_field}' + the stop token), lr {config.sft_learning_rate}",
                    flush=True)
            else:
                task = warmup.warm_up_task(config, self.model.config.vocab_size)
                say(f"warm-up: {config.sft_steps} supervised steps x {config.sft_batch} prompts of "
                    f"{config.sft_prompt_len or config.prompt_len} tokens"
                    + (f" with {task.num_facts} fact{'s' * (task.num_facts > 1)}" if hasattr(task, "num_facts") else "")
                    + f", lr {config.sft_learning_rate}", flush=True)
            self.params, records = warmup.warm_up(self.model, self.params, task, config.sft_steps, config.sft_batch,
                                               config.sft_learning_rate, getattr(task, "pad_token", 0), say=say,
                                               place=lambda tree: components.place(tree, self.mesh, self.params),
                                               stop_accuracy=config.sft_stop_accuracy)
            self.pending.extend(records)
            if (self.evaluator is not None and self.sft_targets is None
                    and config.sft_prompt_len not in (None, config.prompt_len)):
                # the warm start at the warm-up's length (and facts' depths) too
                short = evaluate.for_config(dataclasses.replace(config, prompt_len=config.sft_prompt_len,
                                                                max_depth=warmup.warm_up_max_depth(config)),
                                            self.model.config.vocab_size, self.mesh)
                self.pending.append(self.evaluate(say, evaluator=short, label="warm start at the warm-up length"))
        if self.evaluator is not None:
            self.pending.append(self.evaluate(say, reference=True))

    def evaluate(self, say, reference: bool = False, evaluator=None, label: str = "") -> dict:
        """Score the held-out prompts (of `evaluator`, default the run's) with the current params -> the
        metrics.jsonl record (kind "eval")."""
        evaluator = evaluator or self.evaluator
        result = evaluator(self.model, self.params, reference=reference)
        say(f"eval @ step {self.step}{f' ({label})' if label else ''}: "
            + evaluate.describe(result, getattr(evaluator.task, "chance_accuracy", None)), flush=True)
        return {"step": self.step, "kind": "eval", **result}

    def last_checkpoint(self) -> str:
        """Where the run stands: "the last complete checkpoint is step N (PATH); continue with --out OUT --resume",
        or that none was saved."""
        if self.checkpoints is not None:
            last = self.checkpoints.latest_step()
            where = self.checkpoints.directory
        else:  # nothing written yet: the resumed checkpoint, if any, is still the newest
            last = self.start_step if self.plan.resuming else None
            where = os.path.join(self.plan.out, "checkpoints")
        if last is None:
            return "no checkpoint was saved (a new run with the same --out starts over)"
        return (f"the last complete checkpoint is step {last} ({os.path.join(where, str(last))}); continue with --out "
                f"{self.plan.out} --resume")

    def close_watchers(self) -> None:
        """Stop a --profile-steps trace still running (a window beyond --steps) and close the --report-to
        reporters."""
        if self.profile is not None:
            self.profile.close()
        if self.log is not None:
            self.log.close()

    def interrupted(self) -> int:
        """After Ctrl-C: say where the run stands on stderr -> 130."""
        if self.checkpoints is not None:
            self.checkpoints.close()
        self.close_watchers()
        if distributed.is_primary():
            print(f"interrupted (Ctrl-C) after {self.step} completed steps: {self.last_checkpoint()}",
                  file=sys.stderr, flush=True)
        return 130


@contextlib.contextmanager
def _sigint_deferred():
    """Ctrl-C inside the block takes effect (KeyboardInterrupt) when the block is done: a checkpoint save or the
    output directory's set-up is never cut in half by it. (Signal handlers can only be set in the main thread;
    elsewhere this does nothing.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)
    if caught:
        raise KeyboardInterrupt
