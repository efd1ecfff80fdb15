"""Length generalisation, exact vs detached: warm-start at short range, evaluate and GRPO-train at long range.

Each run is the trainer (`longstraw_jax.trainer.cli`, in this process) with:
1. a supervised warm-up (`--sft-steps`) on short prompts (`--short` tokens, the queried fact and a distractor at
   random depths): a policy that can do the task at short range;
2. held-out evaluations (greedy, `--eval-prompts` prompts never trained on) of that warm start at the short length
   and at the long length (`--long` tokens: the facts at random depths of a prompt several times longer);
3. GRPO at the long length in `--mode exact` or `detached`, evaluated every `--eval-every` steps.

Every mode runs every seed (`--seeds`), everything else identical (the warm-up depends on the seed only, so both
modes start from the same policy). Writes into --out: one run directory per mode and seed, `length.png` (held-out
accuracy at the long length over GRPO steps: per mode the mean over seeds, the min-max band and each seed),
`length.md` (mean and range at fixed steps, with chance, copying a random fact's value, and the warm start at
both lengths) and `length.json` (every number of both). Not a test: minutes per run on a small CPU.

    python tools/bench_length.py --modes exact,detached --seeds 0,1,2 --out out/bench_length   # docs/benchmarks.md 6c
    python tools/bench_length.py --short 16 --long 24 --sft-steps 2 --steps 2 --eval-every 1 --eval-prompts 2 \\
        --seeds 0 --out /tmp/smoke                                                   # the smoke test's size

Everything after `--` is passed to the trainer unchanged (e.g. `-- --learning-rate 3e-4 -B 2`).

`--reuse` reads a run directory that already holds a completed run (its evaluation after the last step) instead of
running it again, so the runs can be split over several invocations (e.g. one per mode, side by side, into the same
--out) and one last invocation with every mode and seed and `--reuse` writes the figure, table and JSON of them all.
Each run's wall time is kept in its directory (`bench_wall.json`) for that.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
import time

import numpy as np

from longstraw_jax.tasks.retrieval import RetrievalTask
from longstraw_jax.trainer import cli as run
from longstraw_jax.trainer.metrics import read_metrics, split_records


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", default="exact,detached", help="comma list of trainer modes")
    p.add_argument("--seeds", default="0,1,2", help="comma list of seeds (each mode runs each)")
    p.add_argument("--short", type=int, default=32, help="warm-up prompt length")
    p.add_argument("--long", type=int, default=128, help="evaluation and GRPO prompt length")
    p.add_argument("--sft-steps", type=int, default=50)
    p.add_argument("--sft-batch", type=int, default=32)
    p.add_argument("--sft-lr", type=float, default=1e-3, help="warm-up learning rate (3e-3, the default before: "
                   "the copy-a-fact plateau, or chance on one seed; docs/benchmarks.md 6c)")
    p.add_argument("--steps", type=int, default=160, help="GRPO steps at the long length")
    p.add_argument("--lr", type=float, default=5e-4, help="GRPO learning rate")
    p.add_argument("--group-size", "-G", type=int, default=8)
    p.add_argument("--groups-per-step", "-B", type=int, default=8)
    p.add_argument("--chunk-size", type=int, default=None, help="default: the long length (one chunk)")
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--eval-prompts", type=int, default=128)
    p.add_argument("--facts", type=int, default=2, help="facts per prompt (the queried one and distractors)")
    p.add_argument("--max-depth", type=float, default=None, help="every fact of the long prompts (GRPO and their "
                   "evaluation) in the first D of the log; the warm-up's and the short evaluation's facts stay at "
                   "every depth (default: every depth everywhere)", metavar="D")
    p.add_argument("--table-steps", default=None, help="comma list of steps for the table (default: every evaluation "
                   "up to 7 of them, else 5 evenly spaced)")
    p.add_argument("--out", default="out/bench_length")
    p.add_argument("--reuse", action="store_true", help="read a completed run directory instead of running it again "
                   "(same options: the trainer's command line is checked)")
    args = p.parse_args(own)
    for name in ("short", "long", "sft_steps", "steps", "eval_every", "eval_prompts"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    return args, extra


def trainer_args(args: argparse.Namespace, mode: str, seed: int, out: str, extra: list[str]) -> list[str]:
    """The trainer's command line of one run."""
    return ["--prompt-len", str(args.long), "--sft-prompt-len", str(args.short), "--sft-steps", str(args.sft_steps),
            "--sft-batch", str(args.sft_batch), "--sft-learning-rate", str(args.sft_lr), "--steps", str(args.steps),
            "--learning-rate", str(args.lr), "-G", str(args.group_size), "-B", str(args.groups_per_step),
            "--chunk-size", str(args.chunk_size or args.long), "--eval-every", str(args.eval_every),
            "--eval-prompts", str(args.eval_prompts), "--num-facts", str(args.facts), "--vocab-size", "32",
            "--response-len", "2", "--mode", mode, "--seed", str(seed), "--out", out,
            "--save-every", str(args.steps), "--log-every", str(max(1, args.steps // 20))] + depths(args) + extra


def depths(args: argparse.Namespace) -> list[str]:
    """--max-depth D: the long prompts' facts in the first D; the warm-up's at every depth."""
    return [] if args.max_depth is None else ["--max-depth", str(args.max_depth), "--sft-max-depth", "1.0"]


def curves(records: list[dict], long: int) -> tuple[dict[int, float], float | None]:
    """A run's metrics.jsonl records -> ({step: held-out accuracy at the long length}, the warm start's held-out
    accuracy at the warm-up's length, or None)."""
    evals = [r for r in split_records(records)[1] if not r.get("before_warm_up")]
    at_long = {r["step"]: r["eval_accuracy"] for r in evals if r["eval_prompt_len"] == long}
    short = [r["eval_accuracy"] for r in evals if r["eval_prompt_len"] != long]
    return at_long, (short[0] if short else None)


def completed(out: str, steps: int, argv_run: list[str]) -> bool:
    """Whether `out` holds a completed run of this command line: its wall-time file with the same trainer options
    (the same RunConfig, however spelled: a run saved with --lr matches --learning-rate; a different one is an error,
    not a silent mix) and an evaluation after the last GRPO step."""
    try:
        with open(os.path.join(out, "bench_wall.json")) as f:
            saved = json.load(f)["argv"]
    except FileNotFoundError:
        return False
    if saved != argv_run and run.parse_args(saved)[0] != run.parse_args(argv_run)[0]:
        raise SystemExit(f"error: --reuse: {out} was run with other options:\n  {' '.join(saved)}\nnot\n  "
                         f"{' '.join(argv_run)}")
    return any(r.get("step") == steps for r in split_records(read_metrics(os.path.join(out, "metrics.jsonl")))[1])


def table(results: dict[str, dict[int, dict[int, float]]], steps: list[int]) -> str:
    """results[mode][seed] = {step: accuracy} -> a markdown table: per step and mode, mean [min, max] over seeds."""
    modes = list(results)
    rows = ["| GRPO step | " + " | ".join(f"{m}: mean [min, max]" for m in modes) + " |",
            "| ---: | " + " | ".join("---:" for _ in modes) + " |"]
    for step in steps:
        cells = []
        for mode in modes:
            values = [c[step] for c in results[mode].values() if step in c]
            cells.append(f"{np.mean(values):.3f} [{min(values):.3f}, {max(values):.3f}]" if values else "-")
        rows.append(f"| {step} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def plot(results: dict[str, dict[int, dict[int, float]]], levels: dict[str, float], path: str, title: str) -> None:
    """Held-out accuracy over GRPO steps: per mode the mean over seeds (line), min-max band, and each seed (thin)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, (mode, runs) in enumerate(results.items()):
        color = f"C{i}"
        steps = sorted(set.intersection(*(set(c) for c in runs.values())))
        grid = np.array([[c[s] for s in steps] for c in runs.values()])
        for seed, c in runs.items():
            ax.plot(sorted(c), [c[s] for s in sorted(c)], "-", color=color, alpha=0.25, linewidth=0.8)
        ax.fill_between(steps, grid.min(0), grid.max(0), color=color, alpha=0.15)
        ax.plot(steps, grid.mean(0), "o-", color=color, markersize=3,
                label=f"{mode}: mean of {len(runs)} seeds (band: min-max)")
    for j, (label, level) in enumerate(levels.items()):
        ax.axhline(level, color="gray", linestyle=(":", "--", "-.")[j % 3], alpha=0.7, label=f"{label} {level:.3f}")
    ax.set_xlabel("GRPO step at the long length (step 0: the warm start)")
    ax.set_ylabel("held-out accuracy (greedy)")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    ax.set_title("\n".join(textwrap.wrap(title, 100)), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    args, extra = parse(sys.argv[1:] if argv is None else argv)
    modes = [m for m in args.modes.split(",") if m]
    seeds = [int(s) for s in args.seeds.split(",") if s]
    os.makedirs(args.out, exist_ok=True)
    results: dict[str, dict[int, dict[int, float]]] = {m: {} for m in modes}
    short_acc: dict[str, dict[int, float | None]] = {m: {} for m in modes}
    walls: dict[str, dict[int, float]] = {m: {} for m in modes}
    commands = {}
    for seed in seeds:
        for mode in modes:
            out = os.path.join(args.out, f"{mode}-seed{seed}")
            argv_run = trainer_args(args, mode, seed, out, extra)
            commands[f"{mode}-seed{seed}"] = "python -m longstraw_jax.run " + " ".join(argv_run)
            wall_file = os.path.join(out, "bench_wall.json")
            if args.reuse and completed(out, args.steps, argv_run):
                print(f"== {mode}, seed {seed}: reusing {out}", flush=True)
                with open(wall_file) as f:
                    walls[mode][seed] = json.load(f)["wall_s"]
            else:
                print(f"== {mode}, seed {seed}: python -m longstraw_jax.run {' '.join(argv_run)}", flush=True)
                start = time.perf_counter()
                status = run.main(argv_run)
                if status:
                    return status
                walls[mode][seed] = time.perf_counter() - start
                with open(wall_file, "w") as f:
                    json.dump({"wall_s": walls[mode][seed], "argv": argv_run}, f)
            results[mode][seed], short_acc[mode][seed] = curves(read_metrics(os.path.join(out, "metrics.jsonl")),
                                                                args.long)
    task = RetrievalTask(prompt_len=args.long, vocab_size=32, num_facts=args.facts)
    levels = {"chance": task.chance_accuracy}
    if args.facts > 1:
        levels["copying a random fact's value"] = task.copy_any_fact_accuracy
    common = sorted(set.intersection(*(set(c) for runs in results.values() for c in runs.values())))
    steps = ([int(s) for s in args.table_steps.split(",")] if args.table_steps else common if len(common) <= 7 else
             sorted({common[round(i * (len(common) - 1) / 4)] for i in range(5)}))
    title = (f"warm-up {args.sft_steps} x {args.sft_batch} prompts of {args.short} tokens (lr {args.sft_lr:g}), then "
             f"GRPO at {args.long} tokens ({args.facts} facts"
             + ("" if args.max_depth is None else f" in the first {args.max_depth:.0%}")
             + f", G={args.group_size}, B={args.groups_per_step}, "
             f"lr {args.lr:g})")
    plot(results, levels, os.path.join(args.out, "length.png"), title)
    warm_long = {m: [c.get(0) for c in results[m].values()] for m in modes}
    warm_short = {m: list(short_acc[m].values()) for m in modes}
    fmt = lambda xs: ", ".join("-" if x is None else f"{x:.3f}" for x in xs)  # noqa: E731
    lines = [f"# {title}", "",
             f"held-out accuracy at {args.long} tokens ({args.eval_prompts} prompts never trained on, greedy); "
             f"seeds {', '.join(map(str, seeds))}", "", table(results, steps), "",
             f"chance {task.chance_accuracy:.3f}"
             + (f"; copying a random fact's value {task.copy_any_fact_accuracy:.3f}" if args.facts > 1 else ""),
             *[f"{m}: warm start (step 0) at {args.long} tokens per seed: {fmt(warm_long[m])}; at the warm-up's "
               f"{args.short} tokens: {fmt(warm_short[m])}; wall per run: {fmt(walls[m].values())} s" for m in modes]]
    markdown = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "length.md"), "w") as f:
        f.write(markdown)
    with open(os.path.join(args.out, "length.json"), "w") as f:
        json.dump({"args": vars(args), "extra": extra, "commands": commands, "levels": levels,
                   "accuracy": {m: {str(s): {str(k): v for k, v in c.items()} for s, c in r.items()}
                                for m, r in results.items()},
                   "warm_start_short": {m: {str(s): v for s, v in r.items()} for m, r in short_acc.items()},
                   "wall_s": {m: {str(s): v for s, v in r.items()} for m, r in walls.items()}}, f, indent=1)
    print()
    print(markdown)
    print(f"wrote {os.path.join(args.out, 'length.png')}, length.md, length.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
