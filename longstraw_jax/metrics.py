"""Training metrics: one JSON object per step in `<out>/metrics.jsonl`, a PNG plot at the end, peak memory.

Each JSONL line is a flat object of numbers (see `run_log.step_record` for the fields); lines are flushed as they
are written, so a crashed run keeps every completed step. `plot_metrics` draws reward and loss against step with
matplotlib's non-interactive Agg backend (no display needed).
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

    def keep_until(self, step: int) -> None:
        if not os.path.exists(self.path):
            return
        kept = [record for record in read_metrics(self.path) if record["step"] <= step]
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(json.dumps(record) + "\n" for record in kept)
        os.replace(tmp, self.path)

    def write(self, record: dict) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps(clean) + "\n")


def read_metrics(path: str | os.PathLike) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


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
