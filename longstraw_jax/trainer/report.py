"""Watching a run beyond metrics.jsonl: what the policy writes (samples.jsonl), the scalars in TensorBoard / Weights &
Biases (--report-to), and a profiler trace of chosen steps (--profile-steps). Host-side only, and (but the profiler,
which traces every process's own devices) process 0 only: every process computes the same values.

- `<out>/samples.jsonl` (--log-samples-every N; `sample_step`, `sample_rows`): one line per group of step 1, of every
  N-th step and of the last step, {"step", "group", "prompt_tokens", "prompt_tail" (the last PROMPT_TAIL_CHARS
  characters of the prompt's text) or "prompt_tail_ids" (its last PROMPT_TAIL_IDS token ids), "completions": G x
  {"text" (decoded, special tokens skipped: what text rewards see) or "ids", "tokens", "reward", "rewards" ({function:
  value, None where it does not apply}; text rewards only), "correct" (tasks with `is_correct`), "advantage"; agent
  branches also "turns", "status", "error": `transcript_view`}}. A
  resumed run drops the lines after its checkpoint first (`metrics.MetricsLog.keep_until`), so no step is listed twice.
- `ReportedLog`: metrics.jsonl plus the reporters: each record written there also goes to `<out>/tensorboard`
  (tensorboardX; warm-up steps in `<out>/tensorboard/warm-up`, against the warm-up step) and / or wandb (`dir=<out>`,
  each namespace against its own step metric). Tags (`scalars`): "train/<field>" for a GRPO step, "eval/<field>" (the
  field without its "eval_" prefix) for a held-out evaluation ("eval_before_warm_up/" for the one before the warm-up),
  "sft/<field>" for a warm-up step; numbers only. A resumed TensorBoard log hides the events after the checkpoint
  (tensorboardX's purge_step); a resumed wandb run is a new wandb run.
- `ProfileWindow`: jax.profiler.start_trace before step A, stop_trace after step B (or at the end of the run), into
  `<out>/profile/` (`profile/process-<i>/` with several processes): `plugins/profile/<time>/<host>.xplane.pb` for
  XProf / TensorBoard's profile plugin and `perfetto_trace.json.gz` for https://ui.perfetto.dev.
"""
from __future__ import annotations

import importlib.util
import math
import os
import shutil
import sys

import jax
import numpy as np

from longstraw_jax.grpo import GRPOConfig, batch_advantages
from longstraw_jax.trainer.config import RunError, report_targets

SAMPLES_FILE = "samples.jsonl"
TENSORBOARD_DIR = "tensorboard"
WARM_UP_DIR = "warm-up"
PROFILE_DIR = "profile"
PROMPT_TAIL_CHARS = 200
PROMPT_TAIL_IDS = 64
_PACKAGES = {"tensorboard": ("tensorboardX", "pip install 'longstraw-jax[report]' (tensorboardX)"),
             "wandb": ("wandb", "pip install wandb")}


# --------------------------------------------------------------------------------------------------- samples.jsonl


def sample_step(step: int, every: int, last: int) -> bool:
    """Whether step `step` (1-based) goes to samples.jsonl: every > 0 and step 1, a multiple of `every` or `last`."""
    return every > 0 and (step == 1 or step % every == 0 or step == last)


def decode(tokenizer, rows: list[list[int]]) -> list[str]:
    """Token id lists -> text (special tokens skipped, as text rewards see completions)."""
    return tokenizer.batch_decode(rows, skip_special_tokens=True)


def prompt_view(prompt_ids: np.ndarray, text: str | None) -> dict:
    """One prompt (ids int [P], its text or None) -> {"prompt_tokens": P, "prompt_tail": its text's last
    PROMPT_TAIL_CHARS characters} when it has text, else {"prompt_tokens", "prompt_tail_ids": its last PROMPT_TAIL_IDS
    ids}."""
    ids = np.asarray(prompt_ids)
    view = {"prompt_tokens": int(ids.size)}
    if text is not None:
        view["prompt_tail"] = text[-PROMPT_TAIL_CHARS:]
    else:
        view["prompt_tail_ids"] = ids[-PROMPT_TAIL_IDS:].tolist()
    return view


def _float32(value) -> float:
    """A float32 value as the shortest decimal that reads back to it (0.9, not 0.8999999761581421)."""
    return float(str(np.float32(value)))


def sample_rows(step: int, batch, advantages: np.ndarray, tokenizer=None, prompts=None, parts=None,
                correct=None, transcripts=None) -> list[dict]:
    """The samples.jsonl lines of one step: one per group of `batch` (a GroupBatch [B, ...]: prompt int [B, P],
    responses int [B, G, R], mask [B, G, R], rewards float [B, G]).

    advantages: float [B, G] (`grpo.batch_advantages` of the rewards); tokenizer: decodes the completions (None: ids);
    prompts: the B tasks.Prompt of the step (their `text`, when not None, gives the tail), None: the batch's ids;
    parts: {function: (values float [B, G], applies [B, G])} of `batches.score_groups` (None or {}: no per-function
    rewards); correct: float [B, G] or None; transcripts: [B][G] `agents.environment.Transcript` of agent branches
    (None: single responses): each completion then also has "turns" ({"role": "assistant" | "tool", "tokens": ids,
    "text" with a tokenizer; a tool turn also its reward, done and truncated}), "status" and "error"."""
    responses, mask = np.asarray(batch.responses), np.asarray(batch.mask)
    rewards, advantages = np.asarray(batch.rewards), np.asarray(advantages)
    prompt_ids = np.asarray(batch.prompt)
    rows = []
    for b in range(responses.shape[0]):
        kept = [r[m > 0].tolist() for r, m in zip(responses[b], mask[b])]
        texts = decode(tokenizer, kept) if tokenizer is not None else None
        completions = []
        for g, ids in enumerate(kept):
            completion = {"text": texts[g]} if texts is not None else {"ids": ids}
            completion.update(tokens=len(ids), reward=_float32(rewards[b, g]))
            if parts:
                completion["rewards"] = {name: float(values[b, g]) if applies[b, g] else None
                                         for name, (values, applies) in parts.items()}
            if correct is not None:
                completion["correct"] = bool(correct[b, g])
            completion["advantage"] = _float32(advantages[b, g])
            if transcripts is not None:
                completion.update(transcript_view(transcripts[b][g], tokenizer))
            completions.append(completion)
        text = prompts[b].text if prompts is not None else None
        rows.append({"step": step, "group": b, **prompt_view(prompt_ids[b], text), "completions": completions})
    return rows


def transcript_view(transcript, tokenizer=None) -> dict:
    """An agent branch's transcript as samples.jsonl shows it: {"turns": [...], "status", "error"}."""
    turns = []
    for turn in transcript.turns:
        view = {"role": turn["role"], "tokens": [int(t) for t in turn["tokens"]]}
        if tokenizer is not None:
            view["text"] = decode(tokenizer, [view["tokens"]])[0]
        view.update({k: turn[k] for k in ("reward", "done", "truncated", "error") if k in turn})
        turns.append(view)
    return {"turns": turns, "status": transcript.status, "error": transcript.error}


def step_samples(step: int, batch, grpo: GRPOConfig, data) -> list[dict]:
    """`sample_rows` of a trainer step from its data source (trainer/components.py): a TaskSampler's prompts, reward
    parts and correctness (`last_scored`) and its task's tokenizer (datasets); a rollout file's ids."""
    prompts, parts, correct = getattr(data, "last_scored", None) or (None, None, None)
    tokenizer = getattr(getattr(data, "task", None), "tokenizer", None)
    advantages = np.asarray(jax.device_get(batch_advantages(np.asarray(batch.rewards), grpo, batch.valid)))
    return sample_rows(step, batch, advantages, tokenizer, prompts, parts, correct,
                       getattr(data, "last_transcripts", None))


# ------------------------------------------------------------------------------------------ tensorboard and wandb


def check_available(report_to: str) -> None:
    """RunError naming the package and how to install it when a --report-to target's package is missing (before the
    run does any work)."""
    for target in report_targets(report_to):
        module, install = _PACKAGES[target]
        if module not in sys.modules and importlib.util.find_spec(module) is None:
            raise RunError(f"--report-to {target} needs the {module} package, which is not installed: {install}")


def _number(value) -> float | None:
    """A record's value as a finite float, or None (strings, lists, None, NaN / inf)."""
    if isinstance(value, (bool, np.bool_)):
        return float(value)
    if isinstance(value, (int, float, np.integer, np.floating)) and math.isfinite(float(value)):
        return float(value)
    return None


def scalars(record: dict) -> tuple[str, int, dict[str, float]]:
    """A metrics.jsonl record -> (namespace, its step, {tag: value}): "train" (a GRPO step: train/<field>, against
    "step"), "eval" / "eval_before_warm_up" (a held-out evaluation: <namespace>/<field without "eval_">, against
    "step"), "sft" (a warm-up step: sft/<field without "sft_">, against "sft_step"). Only numbers; the step fields
    and flags (kind, before_warm_up) are left out."""
    kind = record.get("kind")
    if kind == "sft":
        namespace, step, prefix = "sft", record["sft_step"], "sft_"
    elif kind == "eval":
        namespace = "eval_before_warm_up" if record.get("before_warm_up") else "eval"
        step, prefix = record["step"], "eval_"
    else:
        namespace, step, prefix = "train", record["step"], ""
    skip = {"step", "kind", "before_warm_up", "sft_step"}
    values = {f"{namespace}/{key.removeprefix(prefix)}": number for key, value in record.items()
              if key not in skip and (number := _number(value)) is not None}
    return namespace, int(step), values


class TensorBoardReporter:
    """tensorboardX event files in `logdir` (GRPO steps and evaluations) and `logdir`/warm-up (warm-up steps, against
    the warm-up step); flushed after every record. resume_step: a resumed run's checkpoint step, whose later events
    (from the run before) TensorBoard then hides; None: a new run, which first removes what a run that completed no
    checkpoint left in `logdir`."""

    def __init__(self, logdir: str, resume_step: int | None = None):
        from tensorboardX import SummaryWriter

        if resume_step is None and os.path.isdir(logdir):
            shutil.rmtree(logdir)
        # the file name holds the time in seconds and the host: two writers opened in one second must not share one
        self.logdir, self._writer_class, self._suffix = logdir, SummaryWriter, f".{os.getpid()}.{resume_step or 0}"
        self.writer = SummaryWriter(logdir, purge_step=None if resume_step is None else resume_step + 1,
                                    filename_suffix=self._suffix)
        self.warm_up = None

    def report(self, record: dict) -> None:
        namespace, step, values = scalars(record)
        if namespace == "sft" and self.warm_up is None:
            self.warm_up = self._writer_class(os.path.join(self.logdir, WARM_UP_DIR), filename_suffix=self._suffix)
        writer = self.warm_up if namespace == "sft" else self.writer
        for tag, value in values.items():
            writer.add_scalar(tag, value, global_step=step)
        writer.flush()

    def close(self) -> None:
        for writer in (self.writer, self.warm_up):
            if writer is not None:
                writer.close()


class WandbReporter:
    """One wandb run (`wandb.init(dir=out, name=<out's name>, config=the run's options)`; WANDB_MODE=offline works
    without a network and `wandb sync` uploads later). Each namespace of `scalars` is plotted against its own step
    metric ("step" for train / eval, "sft/step" for the warm-up), so records may come in any order."""

    def __init__(self, out: str, options: dict):
        import wandb

        self.run = wandb.init(dir=out, name=os.path.basename(os.path.normpath(out)), config=options)
        self.run.define_metric("step")
        self.run.define_metric("sft/step")
        for namespace in ("train", "eval", "eval_before_warm_up"):
            self.run.define_metric(f"{namespace}/*", step_metric="step")
        self.run.define_metric("sft/*", step_metric="sft/step")

    def report(self, record: dict) -> None:
        namespace, step, values = scalars(record)
        self.run.log({"sft/step" if namespace == "sft" else "step": step, **values})

    def close(self) -> None:
        self.run.finish()


def open_reporters(report_to: str, out: str, options: dict, resume_step: int | None) -> dict:
    """{target: reporter} of --report-to (process 0 opens them when the run starts writing). resume_step: see
    TensorBoardReporter."""
    reporters = {}
    for target in report_targets(report_to):
        if target == "tensorboard":
            reporters[target] = TensorBoardReporter(os.path.join(out, TENSORBOARD_DIR), resume_step)
        else:
            reporters[target] = WandbReporter(out, options)
    return reporters


class ReportedLog:
    """metrics.jsonl (`log`: metrics.MetricsLog) whose every record also goes to `reporters` ({target: reporter}).
    A reporter that raises is reported once on stderr and dropped: the run (and metrics.jsonl) go on."""

    def __init__(self, log, reporters: dict):
        self.log, self.reporters = log, dict(reporters)

    @property
    def path(self):
        return self.log.path

    def keep_until(self, step: int) -> list[str]:
        return self.log.keep_until(step)

    def write(self, record: dict) -> None:
        self.log.write(record)
        for target, reporter in list(self.reporters.items()):
            try:
                reporter.report(record)
            except Exception as e:  # a full disk or a crashed wandb service must not end the training
                self.reporters.pop(target)
                print(f"warning: --report-to {target} failed ({type(e).__name__}: {e}); no more reports to it",
                      file=sys.stderr, flush=True)

    def close(self) -> None:
        for reporter in self.reporters.values():
            reporter.close()
        self.reporters = {}
        self.log.close()


# ---------------------------------------------------------------------------------------------------- the profiler


class ProfileWindow:
    """A jax.profiler trace of GRPO steps first..last into `directory`: `before(step)` starts it when `step` is in
    the window and it is not running (a resumed run inside the window starts at its first step), `after(step)`
    stops it after `last`, `close()` at the end of the run (a window beyond --steps)."""

    def __init__(self, first: int, last: int, directory: str):
        self.first, self.last, self.directory = first, last, directory
        self.active = False

    def before(self, step: int) -> None:
        if not self.active and self.first <= step <= self.last:
            os.makedirs(self.directory, exist_ok=True)
            jax.profiler.start_trace(self.directory, create_perfetto_trace=True)
            self.active = True

    def after(self, step: int) -> None:
        if self.active and step >= self.last:
            self.close()

    def close(self) -> None:
        if self.active:
            self.active = False
            jax.profiler.stop_trace()


def profile_dir(out: str) -> str:
    """<out>/profile, or <out>/profile/process-<i> with several processes (each traces its own host)."""
    base = os.path.join(out, PROFILE_DIR)
    return base if jax.process_count() == 1 else os.path.join(base, f"process-{jax.process_index()}")
