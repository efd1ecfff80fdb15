"""The demo's learning (`make run`, configs/demo.toml; or --config configs/agent_demo.toml, the agent demo) over
seeds and settings: what GRPO adds to the warm-up.

Each (setting, seed) is one trainer run, `python -m longstraw_jax.run --config CONFIG --seed S
--eval-prompts N <the setting's options>`, in a child process (--jobs of them at a time). From each run's metrics.jsonl
it reads the held-out accuracy before the warm-up, after it (GRPO step 0) and after GRPO, and the per-step signal:
the share of groups whose rewards differ (`signal_groups`: the others give no gradient), the mean |advantage|, the
update's size relative to the weights (`update_ratio`), the raw gradient norm, the clip fraction, the policy's
entropy and the held-out KL to the GRPO start. Prints a markdown table per run and one line per setting (the gain
on every seed, the smallest, the mean final accuracy), next to chance and the copy-any-fact level.

    python tools/bench_demo.py --seeds 0,1,2 --eval-prompts 512 --out out/bench_demo \\
        --setting demo= --setting "lr3e-4=--learning-rate 3e-4 --steps 80"
    python tools/bench_demo.py --config configs/agent_demo.toml --seeds 0,1,2 --jobs 1 --out out/bench_agent

A setting is NAME=OPTIONS (trainer options, split like a shell line). `--reuse` reads a run directory that already
holds a finished run of the same command instead of running it again. Not a test: minutes per run on 2 CPU cores.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from longstraw_jax.tasks import make_task
from longstraw_jax.trainer.config import parse_args
from longstraw_jax.trainer.metrics import read_metrics, split_records

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "configs", "demo.toml")


def command(options: list[str], seed: int, eval_prompts: int, out: str, config: str = DEMO) -> list[str]:
    return ["--config", config, "--seed", str(seed), "--eval-prompts", str(eval_prompts), "--out", out, *options]


def finished(out: str, argv: list[str]) -> bool:
    """Whether `out` holds a finished run of exactly this command line (its bench_demo.json)."""
    try:
        with open(os.path.join(out, "bench_demo.json")) as f:
            return json.load(f)["argv"] == argv
    except (FileNotFoundError, KeyError, json.JSONDecodeError):
        return False


def run_one(argv: list[str], out: str, reuse: bool, log: str) -> None:
    """One trainer run in a child process (its output to `log`); its wall time to <out>/bench_demo.json."""
    if reuse and finished(out, argv):
        return
    shutil.rmtree(out, ignore_errors=True)  # a run left unfinished, or another command's
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    start = time.perf_counter()
    with open(log, "w") as f:
        status = subprocess.run([sys.executable, "-m", "longstraw_jax.run", *argv], stdout=f,
                                stderr=subprocess.STDOUT, cwd=ROOT).returncode
    if status:
        raise SystemExit(f"error: the run {' '.join(argv)} failed (exit {status}); its output: {log}")
    with open(os.path.join(out, "bench_demo.json"), "w") as f:
        json.dump({"argv": argv, "wall_s": time.perf_counter() - start}, f)


def mean(values) -> float:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else float("nan")


def summary(out: str) -> dict:
    """The run's held-out accuracies and its per-step signal, from <out>/metrics.jsonl."""
    steps, evals, _ = split_records(read_metrics(os.path.join(out, "metrics.jsonl")))
    before = next(e for e in evals if e.get("before_warm_up"))
    grpo = [e for e in evals if not e.get("before_warm_up")]
    with open(os.path.join(out, "bench_demo.json")) as f:
        wall = json.load(f)["wall_s"]
    first, last = steps[: max(1, len(steps) // 4)], steps[-max(1, len(steps) // 4):]
    return {
        "init": before["eval_accuracy"], "warm": grpo[0]["eval_accuracy"], "final": grpo[-1]["eval_accuracy"],
        "curve": [(e["step"], e["eval_accuracy"]) for e in grpo], "prompts": grpo[-1]["eval_prompts"],
        "kl": grpo[-1].get("eval_kl_to_start"), "steps": len(steps),
        "signal": mean(s.get("signal_groups") for s in steps), "adv": mean(s["adv_abs_mean"] for s in steps),
        "update": mean(s.get("update_ratio") for s in steps), "grad": mean(s["grad_norm"] for s in steps),
        "clip": mean(s["clip_frac"] for s in steps),
        "entropy": (mean(s["entropy"] for s in first), mean(s["entropy"] for s in last)),
        "train_acc": (mean(s.get("accuracy") for s in first), mean(s.get("accuracy") for s in last)),
        "wall": wall,
    }


def table(results: dict, chance: float, copy_any: float | None) -> str:
    rows = ["| setting | seed | init | warm-up | after GRPO | gain | curve | signal groups | mean abs adv | update / "
            "weights | grad norm | entropy first -> last quarter | sampled acc first -> last | KL to start | wall s |",
            "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | --- | --- | ---: | ---: |"]
    for (name, seed), r in results.items():
        curve = " ".join(f"{a:.3f}" for _, a in r["curve"])
        rows.append(f"| {name} | {seed} | {r['init']:.3f} | {r['warm']:.3f} | {r['final']:.3f} | "
                    f"{r['final'] - r['warm']:+.3f} | {curve} | {r['signal']:.2f} | {r['adv']:.2f} | "
                    f"{r['update']:.1e} | {r['grad']:.2f} | {r['entropy'][0]:.2f} -> {r['entropy'][1]:.2f} | "
                    f"{r['train_acc'][0]:.2f} -> {r['train_acc'][1]:.2f} | "
                    f"{r['kl'] if r['kl'] is None else format(r['kl'], '.3f')} | {r['wall']:.0f} |")
    rows += ["", "| setting | gains per seed | smallest gain | mean after GRPO | mean wall s |",
             "| --- | --- | ---: | ---: | ---: |"]
    for name in dict.fromkeys(n for n, _ in results):
        mine = [r for (n, _), r in results.items() if n == name]
        gains = [r["final"] - r["warm"] for r in mine]
        rows.append(f"| {name} | {' '.join(f'{g:+.3f}' for g in gains)} | {min(gains):+.3f} | "
                    f"{mean(r['final'] for r in mine):.3f} | {mean(r['wall'] for r in mine):.0f} |")
    rows.append(f"\nchance {chance:.3f}" + (f"; copying a random fact's value {copy_any:.3f}" if copy_any else ""))
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--setting", action="append", default=[], metavar="NAME=OPTIONS",
                   help="trainer options of one setting (repeatable; default: the demo as it is)")
    p.add_argument("--config", default=DEMO, help="the trainer's config file (default configs/demo.toml)")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--eval-prompts", type=int, default=512, help="held-out prompts per evaluation")
    p.add_argument("--jobs", type=int, default=2, help="runs at a time")
    p.add_argument("--out", default="out/bench_demo")
    p.add_argument("--reuse", action="store_true", help="keep a finished run of the same command")
    args = p.parse_args(argv)
    settings = [s.partition("=") for s in (args.setting or ["demo="])]
    seeds = [int(s) for s in args.seeds.split(",")]
    runs = {}
    for name, _, options in settings:
        for seed in seeds:
            out = os.path.join(args.out, name, f"seed{seed}")
            runs[(name, seed)] = (command(shlex.split(options), seed, args.eval_prompts, out, args.config), out)
    with ThreadPoolExecutor(args.jobs) as pool:
        for future in [pool.submit(run_one, argv, out, args.reuse, out + ".log") for argv, out in runs.values()]:
            future.result()
    results = {key: summary(out) for key, (_, out) in runs.items()}
    config, _ = parse_args(next(iter(runs.values()))[0])
    task = make_task(config.task, prompt_len=config.prompt_len, vocab_size=config.vocab_size, seed=config.seed,
                     **config.task_options())
    copy_any = getattr(task, "copy_any_fact_accuracy", None) or getattr(task, "call_any_fact_accuracy", None)
    print(table(results, task.chance_accuracy, copy_any))
    return 0


if __name__ == "__main__":
    sys.exit(main())
