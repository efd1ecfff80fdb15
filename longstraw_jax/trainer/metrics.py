"""Training metrics: one JSON object per step in `<out>/metrics.jsonl`, a PNG plot at the end, peak memory. (The
same append-only log keeps `<out>/samples.jsonl`, trainer/report.py.)

Each JSONL line is a flat object of numbers (`step_record` builds a step's; `NoLog` stands in for the log on the
processes that do not write it). Each line is appended with one write and fsync'd before the step is reported, so a
crash can damage at most the line being written, never an earlier one; on resume `keep_until` drops such a partial
last line (and the steps after the checkpoint) with a message. Held-out evaluations (trainer/evaluate.py) and warm-up
steps (trainer/warmup.py) are lines of their own ("kind": "eval" / "sft"; `split_records`). `plot_metrics` draws
reward, held-out accuracy, entropy, KL, grad norm and clip fraction against step with matplotlib's non-interactive
Agg backend (no display needed).
"""
from __future__ import annotations

import json
import math
import os
import resource
import sys

import jax
import numpy as np


def peak_memory() -> tuple[int, str]:
    """(bytes, source): the accelerator's peak bytes in use when it reports them ("device"), else this process's
    peak resident set size ("host_rss": on CPU the arrays live in host memory)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return int(stats["peak_bytes_in_use"]), "device"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024), "host_rss"


class MetricsLog:
    """Appends one JSON line per step to `path`. `keep_until(step)` drops lines after `step` (used on resume, so
    steps that ran after the last checkpoint of a crashed run are not listed twice)."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)

    def keep_until(self, step: int) -> list[str]:
        """Keep the records of steps <= `step` (atomically: a new file renamed over the old one) -> messages saying
        what was dropped: a partial last line (a crash mid-write), records after `step`. ValueError naming
        `path:line` for any other line that is not a JSON object."""
        if not os.path.exists(self.path):
            return []
        records, partial = _parse(self.path, allow_partial_last=True)
        kept = [record for record in records if record["step"] <= step]
        notes = [f"{self.path}:{partial}: dropped a partial last line (the run stopped while writing it)"] if partial \
            else []
        if len(kept) < len(records):
            notes.append(f"{self.path}: dropped the records of steps {kept[-1]['step'] + 1 if kept else 1}.."
                         f"{records[-1]['step']} (after the checkpoint of step {step}; they are run again)")
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(json.dumps(record) + "\n" for record in kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        return notes

    def write(self, record: dict) -> None:
        self.write_many([record])

    def write_many(self, records: list[dict]) -> None:
        """Append `records` (objects with an integer "step"), one line each, in one write (fsync'd); non-finite
        floats, also nested ones, become null."""
        with open(self.path, "a") as f:
            f.write("".join(json.dumps(_finite(record)) + "\n" for record in records))
            f.flush()
            os.fsync(f.fileno())

    def close(self) -> None:
        pass


class NoLog:
    """metrics.jsonl (samples.jsonl) on the processes other than 0: they compute the same records, process 0 writes
    them. The interface of MetricsLog."""

    path = None

    def keep_until(self, step: int) -> list[str]:
        return []

    def write(self, record: dict) -> None:
        pass

    def write_many(self, records: list[dict]) -> None:
        pass

    def close(self) -> None:
        pass


def step_record(step: int, step_metrics: dict, extra: dict, batch, start: float, sampled: float,
                done: float) -> dict:
    """One metrics.jsonl line: the step's metrics (host values), the data source's extras, token counts, timings
    (perf_counter at the step's start, after sampling and after the update) and peak memory."""
    pads = 0 if batch.left_pad is None else int(np.sum(batch.left_pad))
    prompt_tokens = int(np.size(batch.prompt)) - pads  # real tokens, over all groups of the step
    response_tokens = int(batch.mask.sum())
    peak, source = peak_memory()
    return {"step": step, **{k: float(v) for k, v in step_metrics.items()}, **extra,
            "prompt_tokens": prompt_tokens, "response_tokens": response_tokens,
            "group_size": int(batch.responses.shape[-2]), "groups": int(np.prod(batch.responses.shape[:-2])),
            "tokens_per_s": (prompt_tokens + response_tokens) / (done - start),
            "rollout_s": sampled - start, "update_s": done - sampled, "step_s": done - start,
            "peak_mem_bytes": peak, "peak_mem_source": source}


def _finite(value):
    """`value` with every non-finite float (in dicts and lists too) replaced by None (JSON has no NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _parse(path: str, allow_partial_last: bool = False) -> tuple[list[dict], int | None]:
    """(records, the number of a partial last line that was skipped, or None). A bad line is a ValueError naming
    `path:line`; with allow_partial_last, a last line that is not valid JSON is skipped instead."""
    with open(path) as f:
        lines = f.read().split("\n")
    records, partial = [], None
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise ValueError("not an object with an integer 'step'")
        except ValueError as e:
            if allow_partial_last and i == last and isinstance(e, json.JSONDecodeError):
                partial = i + 1
                continue
            raise ValueError(f"{path}:{i + 1}: not a metrics record ({e})") from None
        records.append(record)
    return records, partial


def check_metrics(path: str | os.PathLike) -> None:
    """ValueError naming `path:line` for a line that is neither a metrics record nor a partial last line (what
    `MetricsLog.keep_until` would refuse); reads only."""
    _parse(os.fspath(path), allow_partial_last=True)


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """Every record of a metrics.jsonl; ValueError naming `path:line` for a line that is not one."""
    return _parse(os.fspath(path))[0]


def split_records(records: list[dict]) -> tuple[list[dict], list[dict], list[dict]]:
    """metrics.jsonl records -> (GRPO steps, held-out evaluations (kind "eval"), warm-up steps (kind "sft")), each in
    file order. A GRPO step's record has no "kind"."""
    kinds = {None: [], "eval": [], "sft": []}
    for record in records:
        kinds.setdefault(record.get("kind"), []).append(record)
    return kinds[None], kinds["eval"], kinds["sft"]


def moving_mean(values: list[float], window: int) -> list[float]:
    """Trailing means over `window` values ([len - window + 1]; NaN where a window holds one); [] when shorter."""
    if len(values) < window:
        return []
    return [sum(values[i - window + 1 : i + 1]) / window for i in range(window - 1, len(values))]


def plot_metrics(records: list[dict], path: str | os.PathLike, title: str = "", smooth: int = 10,
                 chance: float | None = None, levels: dict | None = None) -> None:
    """PNG over GRPO step: (1) training reward (group mean, points and a `smooth`-step mean), training accuracy
    (`smooth`-step mean) and held-out accuracy / reward (evaluations, kind "eval"), with `chance` as a line; (2) the
    policy's entropy (training tokens) and the held-out KL to the start policy; (3) the update: grad norm (raw,
    before clipping) and clip fraction. levels: {label: accuracy} drawn as more horizontal lines in (1), e.g. the
    accuracy of copying a random fact's value. With warm-up records (kind "sft"), a first panel of its loss and batch
    accuracy per warm-up step. One helper per quantity below; this lays out the panels."""
    # here, not at module level: matplotlib costs ~0.5 s to import and only the end of a run plots; the Agg backend
    # must be chosen before pyplot is imported (headless machines)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, evals, warm = split_records(records)
    evals, other, before = _held_out_kinds(evals)
    panels = 3 + bool(warm)
    fig, axes = plt.subplots(panels, 1, figsize=(8, 2.6 * panels))
    if warm:
        _warm_up(axes[0], warm, smooth)
        axes = axes[1:]
    top, middle, bottom = axes
    _training_reward(top, steps, smooth)
    _held_out(top, evals, other, before)
    _reference_levels(top, chance, levels)
    top.set_ylabel("reward / accuracy")
    top.legend(loc="best", fontsize=7, ncol=2)
    _per_step(middle, steps, "entropy", smooth, "entropy", "training tokens, nats")
    _legend_with_twin(middle, _held_out_kl(middle, evals), loc="best", fontsize=8)
    _per_step(bottom, steps, "grad_norm", smooth, "grad norm", "before clipping")
    _legend_with_twin(bottom, _clip_fraction(bottom, steps), loc="best", fontsize=8)
    bottom.set_xlabel("GRPO step (evaluations at step 0 score the starting policy)")
    for axis in (top, middle):
        axis.sharex(bottom)
    for axis in (top, middle, bottom):
        axis.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _value(record: dict, key: str) -> float:
    """record[key], NaN where it is missing or None (a gap in the line)."""
    return record.get(key) if record.get(key) is not None else math.nan


def _legend_with_twin(ax, twin, **kwargs) -> None:
    """One legend on `ax` for its lines and those of its twin (the right-hand axis; None: none)."""
    handles, labels = ax.get_legend_handles_labels()
    if twin is not None:
        more = twin.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    ax.legend(handles, labels, **kwargs)


def _held_out_kinds(evals: list[dict]) -> tuple[list[dict], list[dict], list[dict]]:
    """Evaluation records -> (the curve: at the run's own prompt length (the last record's) after the warm-up; at
    another length (a warm-up at another length is evaluated at its length too, at step 0); before the warm-up)."""
    if not evals:
        return evals, [], []
    length = evals[-1]["eval_prompt_len"]
    other = [r for r in evals if r["eval_prompt_len"] != length]
    before = [r for r in evals if r.get("before_warm_up")]
    return [r for r in evals if r["eval_prompt_len"] == length and not r.get("before_warm_up")], other, before


def _warm_up(ax, warm: list[dict], smooth: int) -> None:
    """Warm-up panel: loss per warm-up step and, on a twin axis, batch accuracy (`smooth`-step mean, or fewer)."""
    ax.plot([r["sft_step"] for r in warm], [_value(r, "sft_loss") for r in warm], "-", label="warm-up loss")
    ax.set_ylabel("cross-entropy")
    twin = ax.twinx()
    acc = [_value(r, "sft_accuracy") for r in warm]
    window = max(1, min(smooth, len(acc)))
    twin.plot([r["sft_step"] for r in warm][window - 1 :], moving_mean(acc, window), "-", color="C2",
              label=f"batch accuracy ({window}-step mean)")
    twin.set_ylim(-0.02, 1.02)
    twin.set_ylabel("accuracy")
    ax.set_xlabel("warm-up step (supervised, before GRPO)")
    ax.grid(alpha=0.3)
    _legend_with_twin(ax, twin, loc="best", fontsize=8)


def _training_reward(ax, steps: list[dict], smooth: int) -> None:
    """Training reward per step (group mean: points, and a `smooth`-step mean), each text reward function's mean
    (`reward/<name>`, `smooth`-step mean) and training accuracy (`smooth`-step mean, when the records have it)."""
    x = [r["step"] for r in steps]
    reward = [_value(r, "reward_mean") for r in steps]
    ax.plot(x, reward, ".", alpha=0.3, color="C0", label="training reward (group mean)")
    if len(reward) >= smooth:
        ax.plot(x[smooth - 1 :], moving_mean(reward, smooth), "-", color="C0",
                label=f"training reward ({smooth}-step mean)")
    for i, key in enumerate(sorted({k for r in steps for k in r if k.startswith("reward/")})):  # text rewards
        values = [_value(r, key) for r in steps]
        window = max(1, min(smooth, len(values)))
        ax.plot(x[window - 1 :], moving_mean(values, window), ":", color=f"C{6 + i % 4}",
                label=f"{key} ({window}-step mean)")
    accuracy = [_value(r, "accuracy") for r in steps]
    if steps and "accuracy" in steps[-1] and len(accuracy) >= smooth:
        ax.plot(x[smooth - 1 :], moving_mean(accuracy, smooth), "-", color="C1", alpha=0.7,
                label=f"training accuracy ({smooth}-step mean)")


def _held_out(ax, evals: list[dict], other: list[dict], before: list[dict]) -> None:
    """Held-out accuracy and reward (greedy) per evaluation (`_held_out_kinds`), and single markers for the
    evaluations at another prompt length and before the warm-up."""
    if not evals:
        return
    x = [r["step"] for r in evals]
    if "eval_accuracy" in evals[-1]:
        ax.plot(x, [_value(r, "eval_accuracy") for r in evals], "o-", color="C3",
                label=f"held-out accuracy (greedy, {evals[-1]['eval_prompts']} prompts)")
    ax.plot(x, [_value(r, "eval_reward") for r in evals], "s--", color="C4", alpha=0.7, markersize=4,
            label="held-out reward (greedy)")
    for r in other:
        ax.plot([r["step"]], [_value(r, "eval_accuracy")], "*", color="C5", markersize=10,
                label=f"held-out accuracy at the warm-up's {r['eval_prompt_len']} tokens")
    for r in before:
        ax.plot([r["step"]], [_value(r, "eval_accuracy")], "x", color="C3", markersize=9,
                label="held-out accuracy before the warm-up")


def _reference_levels(ax, chance: float | None, levels: dict | None) -> None:
    """Horizontal lines: chance accuracy, and each of `levels` ({label: accuracy})."""
    if chance is not None:
        ax.axhline(chance, color="gray", linestyle=":", label=f"chance accuracy {chance:.2f}")
    for i, (label, level) in enumerate((levels or {}).items()):
        ax.axhline(level, color="gray", linestyle=("--", "-.")[i % 2], alpha=0.6, label=f"{label} {level:.2f}")


def _per_step(ax, steps: list[dict], key: str, smooth: int, name: str, detail: str) -> None:
    """`key` per step (faint) and its `smooth`-step mean, labelled "name (detail; N-step mean)"; y axis `name`."""
    x = [r["step"] for r in steps]
    values = [_value(r, key) for r in steps]
    ax.plot(x, values, "-", color="C0", alpha=0.3, linewidth=0.8)
    ax.plot(x[smooth - 1 :], moving_mean(values, smooth), "-", color="C0",
            label=f"{name} ({detail}; {smooth}-step mean)")
    ax.set_ylabel(name)


def _held_out_kl(ax, evals: list[dict]):
    """The held-out KL to the start policy per evaluation, on a twin axis of `ax` -> the twin, or None when no
    evaluation has it."""
    kl = [(r["step"], r["eval_kl_to_start"]) for r in evals if r.get("eval_kl_to_start") is not None]
    if not kl:
        return None
    twin = ax.twinx()
    twin.plot([s for s, _ in kl], [k for _, k in kl], "o-", color="C3",
              label="held-out KL(policy || start), first token")
    twin.set_ylabel("KL (nats)")
    return twin


def _clip_fraction(ax, steps: list[dict]):
    """The PPO clip fraction per step on a twin axis of `ax` (y from 0 to at least 0.2) -> the twin."""
    clip = [_value(r, "clip_frac") for r in steps]
    twin = ax.twinx()
    twin.plot([r["step"] for r in steps], clip, "-", color="C1", alpha=0.8,
              label="clip fraction" + (" (0: one on-policy update per batch)"
                                       if all(c == 0 for c in clip if not math.isnan(c)) else ""))
    twin.set_ylim(-0.02, max(0.2, max((c for c in clip if not math.isnan(c)), default=0) * 1.1))
    twin.set_ylabel("clip fraction")
    return twin
