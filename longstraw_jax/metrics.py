"""Training metrics: one JSON object per step in `<out>/metrics.jsonl`, a PNG plot at the end, peak memory.

Each JSONL line is a flat object of numbers (see `run_log.step_record` for the fields). Each line is appended with
one write and fsync'd before the step is reported, so a crash can damage at most the line being written, never an
earlier one; on resume `keep_until` drops such a partial last line (and the steps after the checkpoint) with a
message. `plot_metrics` draws reward and loss against step with matplotlib's non-interactive Agg backend (no
display needed).
"""
from __future__ import annotations

import json
import math
import os
import resource
import sys

import jax


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
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps(clean) + "\n")
            f.flush()
            os.fsync(f.fileno())


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


def plot_metrics(records: list[dict], path: str | os.PathLike, title: str = "", smooth: int = 10) -> None:
    """PNG with two panels over step: reward mean (points, and a `smooth`-step moving average) and loss."""
    # here, not at module level: matplotlib costs ~0.5 s to import and only the end of a run plots; the Agg backend
    # must be chosen before pyplot is imported (headless machines)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for axis, key, label in ((top, "reward_mean", "reward (group mean)"), (bottom, "loss", "GRPO loss")):
        values = [r.get(key) if r.get(key) is not None else math.nan for r in records]
        axis.plot(steps, values, ".", alpha=0.35, label=label)
        if len(values) >= smooth:
            window = [sum(values[i - smooth + 1 : i + 1]) / smooth for i in range(smooth - 1, len(values))]
            axis.plot(steps[smooth - 1 :], window, "-", label=f"{smooth}-step mean")
        axis.set_ylabel(key)
        axis.grid(alpha=0.3)
        axis.legend(loc="best")
    bottom.set_xlabel("step")
    if title:
        top.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
