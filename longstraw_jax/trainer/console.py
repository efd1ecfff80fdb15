"""What a run prints on the console: a header, a progress line per step, lines while a long phase of a step runs
(`PhaseTicker`), a summary at the end. (The metrics.jsonl record of a step, which the progress line and the summary
read: trainer/metrics.py:step_record.)"""
from __future__ import annotations

import contextlib
import os
import threading
import time

import jax
import numpy as np

from longstraw_jax.trainer import metrics


class PhaseTicker:
    """Progress inside a step: while a phase (sampling, update) runs, a daemon thread prints "step S/T: <phase>,
    X s so far" every `every` seconds, and "step S/T: <phase> done in X s" when a phase that printed ends; a phase
    shorter than `every` prints nothing. Host-side, it sees when the phase (a compiled call) starts and ends; with
    --progress-rounds it is also the sink of the compiled loops' ticks (`note`, longstraw_jax/common/progress.py), and
    its lines say how far the running loop is ("capture 37/128, 12.3K positions/s, ETA 4 min"). every = 0 or say = None:
    silent (processes other than 0)."""

    def __init__(self, say, every: float, clock=time.monotonic):
        self.say, self.every, self.clock = say, every, clock
        self.lock = threading.Lock()
        self.loop = None  # the running loop: [phase, first done, its time, done, total, positions per iteration]

    def note(self, phase: str, done: int, total: int, per: int) -> None:
        """A tick: iteration `done` of `total` of the compiled loop `phase` has run (`per` positions or tokens)."""
        now = self.clock()
        with self.lock:
            loop = self.loop
            if loop is None or loop[0] != phase or done <= loop[3]:  # another loop started
                self.loop = [phase, done, now, done, total, per]
            else:
                loop[3:] = [done, total, max(per, loop[5])]

    def status(self) -> str | None:
        """"<loop> done/total[, rate, ETA]" of the running loop (a rate once two of its ticks came), or None."""
        with self.lock:
            if self.loop is None:
                return None
            phase, first, since, done, total, per = self.loop
            elapsed = self.clock() - since
        text = f"{phase} {done}/{total}"
        if done > first and elapsed > 0:
            per_s = (done - first) / elapsed
            unit = "tokens" if phase == "sampling" else "positions"
            text += f", {_count(per_s * per)} {unit}/s, ETA {_duration((total - done) / per_s)}"
        return text

    @contextlib.contextmanager
    def phase(self, step: int, total: int, name: str):
        if not self.every or self.say is None:
            yield
            return
        start, stop, printed = self.clock(), threading.Event(), []
        with self.lock:
            self.loop = None  # a loop of an earlier phase is not this one's

        def tick():
            while not stop.wait(self.every):
                printed.append(True)
                loop = self.status()
                self.say(f"  step {step}/{total}: {name}, {self.clock() - start:.0f} s so far"
                         f"{f'; {loop}' if loop else ''}", flush=True)

        thread = threading.Thread(target=tick, name=f"progress {name}", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
            if printed:
                self.say(f"  step {step}/{total}: {name} done in {self.clock() - start:.1f} s", flush=True)


def _count(x: float) -> str:
    return f"{x:.0f}" if x < 1e3 else f"{x / 1e3:.1f}K" if x < 1e6 else f"{x / 1e6:.2f}M"


def _duration(seconds: float) -> str:
    return (f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min" if seconds < 7200
            else f"{seconds / 3600:.1f} h")


def header(trainer) -> str:
    """Two lines: the model and devices; the data, mode and the steps to run."""
    config, c, from_file = trainer.config, trainer.model.config, trainer.data.task is None
    length = "from file" if from_file else "from data" if config.data else config.prompt_len
    return (f"model: {type(c).__name__} {c.num_hidden_layers} layers, hidden {c.hidden_size}, vocab {c.vocab_size}"
            f" ({sum(x.size for x in jax.tree.leaves(trainer.params)) / 1e6:.2f} M params, {config.dtype}); "
            f"devices: {len(jax.devices())} x {jax.devices()[0].platform}"
            f"{f' in {jax.process_count()} processes' if jax.process_count() > 1 else ''}\n"
            f"data: {trainer.data.description}; prompt {length} tokens, "
            f"G={'from file' if from_file else config.group_size}, mode={config.mode}, chunk {config.chunk_size}"
            f"; steps {trainer.step + 1}..{config.steps}; out: {trainer.out}")


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def progress(r: dict, total: int, width: int = 20) -> str:
    filled = round(width * r["step"] / total)
    acc = f" acc {r['accuracy']:.2f}" if "accuracy" in r else ""
    skipped = " SKIPPED (non-finite)" if r.get("skipped") else ""
    return (f"[{'#' * filled}{'.' * (width - filled)}] {r['step']:>4}/{total} reward {r['reward_mean']:.3f}"
            f"±{r['reward_std']:.3f}{acc} loss {r['loss']:+.4f} kl {r['kl']:.4f} | {r['step_s']:.2f} s/step "
            f"(rollout {r['rollout_s']:.2f}) {r['tokens_per_s']:,.0f} tok/s | peak mem {_gib(r['peak_mem_bytes'])} "
            f"({r['peak_mem_source']}){skipped}")


def summary(records: list[dict], history: list[dict], wall: float, trainer) -> str:
    """records: this process's steps; history: every record of the run (metrics.jsonl, earlier processes included:
    GRPO steps, held-out evaluations, warm-up steps)."""
    history, evals, warm = metrics.split_records(history)
    n = max(1, min(10, len(history) // 2))
    head, tail = history[:n], history[-n:]
    mean = lambda rows, k: float(np.mean([r[k] for r in rows if r.get(k) is not None]))
    task = trainer.data.task
    lines = [f"done: {len(records)} steps this run ({records[0]['step']}..{records[-1]['step']}) in {wall:.1f} s; "
             f"median step {np.median([r['step_s'] for r in records[1:] or records]):.2f} s (first step incl. "
             f"compile {records[0]['step_s']:.1f} s)",
             f"reward mean: first {n} steps {mean(head, 'reward_mean'):.3f} -> last {n} steps "
             f"{mean(tail, 'reward_mean'):.3f}"]
    if task is not None and hasattr(task, "chance_reward"):
        lines[-1] += f" (uniform guessing among answers: {task.chance_reward:.3f})"
    functions = sorted({k for r in history for k in r if k.startswith("reward/")})
    if functions:  # text rewards: each function's mean over the completions it applies to
        shown = lambda rows, k: f"{mean(rows, k):.3f}" if any(r.get(k) is not None for r in rows) else "n/a"
        lines.append("reward per function: " + "; ".join(f"{k[len('reward/'):]} {shown(head, k)} -> {shown(tail, k)}"
                                                          for k in functions))
    if "accuracy" in history[-1]:
        chance = getattr(task, "chance_accuracy", None)
        lines.append(f"accuracy: first {n} {mean(head, 'accuracy'):.3f} -> last {n} {mean(tail, 'accuracy'):.3f}"
                     + (f" (chance {chance:.3f})" if chance is not None else ""))
    if warm:
        k = max(1, min(10, len(warm) // 2))
        lines.append(f"warm-up: {len(warm)} supervised steps; batch accuracy first {k} "
                     f"{mean(warm[:k], 'sft_accuracy'):.3f} -> last {k} {mean(warm[-k:], 'sft_accuracy'):.3f}, "
                     f"loss {mean(warm[:k], 'sft_loss'):.3f} -> {mean(warm[-k:], 'sft_loss'):.3f}")
    skipped = sum(int(r["skipped"]) for r in records)
    lines.append(f"loss (last step) {records[-1]['loss']:+.4f}; skipped updates {skipped}; peak mem "
                 f"{_gib(max(r['peak_mem_bytes'] for r in records))} ({records[-1]['peak_mem_source']})")
    if evals:
        at_length = [r for r in evals if r["eval_prompt_len"] == evals[-1]["eval_prompt_len"]
                     and not r.get("before_warm_up")]
        for r in evals:
            if r["eval_prompt_len"] != evals[-1]["eval_prompt_len"] and "eval_accuracy" in r:
                lines.append(f"the warm start at the warm-up's length ({r['eval_prompt_len']} tokens): held-out "
                             f"accuracy {r['eval_accuracy']:.3f}")
        lines.append(held_out_line(at_length, task))
        initial = [r for r in evals if r.get("before_warm_up") and "eval_accuracy" in r]
        if initial and "eval_accuracy" in at_length[-1]:
            lines.append(phases_line(initial[0], at_length[0], at_length[-1], task))
    files = [os.path.join(trainer.out, "metrics.jsonl"), os.path.join(trainer.checkpoints.directory, str(trainer.step))]
    if trainer.config.export_hf:
        files.append(trainer.config.export_hf)
    if getattr(trainer.config, "export_peft", None):
        files.append(trainer.config.export_peft)
    samples = os.path.join(trainer.out, "samples.jsonl")
    if getattr(trainer.config, "log_samples_every", 0) and os.path.exists(samples):
        files.append(samples)
    if "tensorboard" in getattr(trainer.config, "report_to", ""):
        files.append(os.path.join(trainer.out, "tensorboard"))
    if getattr(trainer.config, "profile_steps", None):
        files.append(os.path.join(trainer.out, "profile"))
    lines.append("wrote: " + ", ".join(files))
    lines.append(f"plot: {os.path.join(trainer.out, 'metrics.png')}")
    return "\n".join(lines)


def held_out_line(evals: list[dict], task=None) -> str:
    """The summary's line on the held-out evaluations (kind "eval" records, in step order): the first and last
    (and the best) accuracy, else reward, with the prompts' count and length, and the task's chance accuracy and
    the accuracy of copying a random fact's value (when the task has them)."""
    chance = getattr(task, "chance_accuracy", None)
    copy_any = getattr(task, "copy_any_fact_accuracy", None)
    first, last = evals[0], evals[-1]
    key = "eval_accuracy" if "eval_accuracy" in last else "eval_reward"
    best = max(evals, key=lambda r: r[key])
    what = "accuracy" if key == "eval_accuracy" else "reward"
    return (f"held-out {what} ({last['eval_prompts']} prompts of {last['eval_prompt_len']} tokens never trained on, "
            f"greedy): step {first['step']} {first[key]:.3f} -> step {last['step']} {last[key]:.3f} (best "
            f"{best[key]:.3f} at step {best['step']})" + (f"; chance {chance:.3f}" if chance is not None and
                                                           key == "eval_accuracy" else "")
            + (f", copying a random fact's value {copy_any:.3f}" if copy_any is not None and key == "eval_accuracy"
               and getattr(task, "num_facts", 1) > 1 else ""))


def phases_line(initial: dict, warm: dict, final: dict, task=None) -> str:
    """The run in one line: held-out accuracy of the initial policy, after the warm-up (the GRPO start) and after
    GRPO, side by side with chance and copying a random fact's value (when the task has them)."""
    chance = getattr(task, "chance_accuracy", None)
    copy_any = getattr(task, "copy_any_fact_accuracy", None)
    levels = ([f"chance {chance:.3f}"] if chance is not None else []) + (
        [f"copying a random fact's value {copy_any:.3f}"] if copy_any is not None and
        getattr(task, "num_facts", 1) > 1 else [])
    return (f"held-out accuracy: initial policy {initial['eval_accuracy']:.3f} -> after the warm-up "
            f"{warm['eval_accuracy']:.3f} -> after GRPO (step {final['step']}) {final['eval_accuracy']:.3f} "
            f"(GRPO {final['eval_accuracy'] - warm['eval_accuracy']:+.3f})" + (f"; {', '.join(levels)}" if levels
                                                                                else ""))


def accuracy_levels(task) -> dict:
    """Reference accuracies of a task besides chance, for the plot: copying a random fact's value (retrieval with
    distractors)."""
    if task is None or getattr(task, "num_facts", 1) < 2 or not hasattr(task, "copy_any_fact_accuracy"):
        return {}
    return {"copying a random fact's value": task.copy_any_fact_accuracy}
