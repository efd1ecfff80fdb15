"""Benchmark one GRPO step: naive full graph vs the LongStraw engine (detached, exact). Compiled memory, RSS, time.

    .venv/bin/python tools/bench_step.py --quick                      # smoke run (P=512, R=16, G=2, 2 reps)
    .venv/bin/python tools/bench_step.py                              # Table 1 at P=8192, R=128, G=8, chunk 1024
    .venv/bin/python tools/bench_step.py --sweep --sweep-g 1,4,16     # + Table 2: compiled memory over G x P
    .venv/bin/python tools/bench_step.py --sweep --sweep-time --markdown
    .venv/bin/python tools/bench_step.py --config tiny-glm --quick     # the tiny GLM-5.x (MLA + DSA + MoE)
    .venv/bin/python tools/bench_step.py --config tiny-glm --train lora --modes detached,exact   # LoRA vs full

`--train lora` makes Table 1 the trainer's whole update (`train.jitted_train_step_donated`: grads + clipping + AdamW,
trainable params and optimizer state donated) for full-parameter training and for LoRA (`--lora-rank`,
`--lora-alpha`, `--lora-targets`, adapters on a frozen base as `--train lora` trains them), per engine mode, each in
its own child, with ratios LoRA / full of compiled memory and median step time.

Table 1 ("modes") runs each mode in its own child process (this script with a hidden `--one` flag, one JSON line
per result) so that the peak RSS (getrusage ru_maxrss) belongs to that mode alone. Compiled memory is
`jax.jit(...).lower(abstract args).compile().memory_analysis()`; the timed calls run that same executable. Time is
the median of --reps calls after one warm-up call. Ratios are to naive (or to the first mode when naive is not
requested); all numbers in one table come from one invocation, so compare ratios, not absolute times, across
machines.

Table 2 ("sweep") compiles every (mode, P, G) cell ahead of time (no execution unless --sweep-time) to show that
the engine's memory does not grow with G and grows with P only through the prompt state. Naive is compiled in
order of increasing P and G and dropped ("—") once its compiled total passes --naive-limit-gib.

Batch: prompt and responses drawn from numpy's default_rng(--seed), ragged masks (each branch keeps a random
length in [R/2, R]), uniform rewards, old_logprobs = ref_logprobs = None (on-policy, no KL).

Imports of jax and the package are function-local on purpose: the parent only orchestrates and must not start XLA
(its own RSS and a second CPU client would distort the children's numbers); each child sets its flags first.
--snapshot (the default) copies longstraw_jax/ at start and puts the copy first on every child's PYTHONPATH, so that
all children measure the same source even while the working tree is being edited.

This file is the command line; bench_step_child.py is a child (model, batch, the measured programs),
bench_step_runner.py the children and the snapshot (and the header), bench_step_tables.py the cells each table needs
and the tables, bench_step_format.py units and table layout; tools/bench_harness.py the BENCH_JSON line protocol.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time

from bench_step_child import child_main
from bench_step_format import GIB
from bench_step_runner import geometry, header, log, make_snapshot
from bench_step_tables import ALL_MODES, run_sweep, table_modes, table_train

QUICK = dict(prompt_len=512, response_len=16, group_size=2, reps=2, chunk_size=128)
QUICK_SWEEP = dict(sweep_g=[1, 2], sweep_p=[256, 512])


def _mem_total_bytes() -> int:
    """This machine's memory (/proc/meminfo), 16 GiB when unknown: the default --run-limit-gib is 40 % of it."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 16 * GIB


def _int_list(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="HF config.json (Qwen3.6 or GLM-5.x, by model_type), or 'tiny-glm' for "
                    "Glm52Config.tiny(); default: the Qwen3.6 tiny preset")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--prompt-len", "-P", type=int, default=None, help="P (default 8192)")
    ap.add_argument("--response-len", "-R", type=int, default=None, help="R (default 128)")
    ap.add_argument("--group-size", "-G", type=int, default=None, help="G (default 8)")
    ap.add_argument("--chunk-size", type=int, default=None, help="capture chunk size (default 1024)")
    ap.add_argument("--modes", default="naive,detached,exact", help="comma list of naive, detached, exact")
    ap.add_argument("--reps", type=int, default=None, help="timed runs per mode after one warm-up (default 5)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compile-only", action="store_true", help="Table 1 without running the step (no RSS/time)")
    ap.add_argument("--no-modes", action="store_true", help="skip Table 1 (e.g. only the sweep)")
    ap.add_argument("--run-limit-gib", type=float, default=None,
                    help="do not execute (only compile) a cell whose compiled total is above this "
                         "(default: 40%% of MemTotal)")
    ap.add_argument("--sweep", action="store_true", help="also Table 2: compiled memory over G x P")
    ap.add_argument("--sweep-g", type=_int_list, default=None, help="default 1,2,4,8,16")
    ap.add_argument("--sweep-p", type=_int_list, default=None, help="default 2048,8192,32768,131072")
    ap.add_argument("--sweep-modes", default="naive,detached,exact")
    ap.add_argument("--naive-limit-gib", type=float, default=4.0)
    ap.add_argument("--sweep-time", action="store_true", help="also time sweep cells with P <= --sweep-time-max-p")
    ap.add_argument("--sweep-time-max-p", type=int, default=8192)
    ap.add_argument("--sweep-reps", type=int, default=3)
    ap.add_argument("--sweep-fast-compile", action=argparse.BooleanOptionalAction, default=True,
                    help="compile-only sweep cells with --xla_backend_optimization_level=0 (default on; about "
                         "halves compile time, memory_analysis moved < 0.1%% where checked)")
    ap.add_argument("--sweep-one-child-per-cell", action="store_true",
                    help="one process per sweep cell (default: one per (mode, P), cells in increasing G)")
    ap.add_argument("--train", choices=("full", "lora"), default="full",
                    help="lora: Table 1 times the trainer's whole update (grads + AdamW) full-parameter vs LoRA on a "
                         "frozen base, per mode (exact / detached), with ratios LoRA / full")
    ap.add_argument("--lora-rank", type=int, default=8, help="--train lora: adapter rank (default 8)")
    ap.add_argument("--lora-alpha", type=float, default=None, help="--train lora: alpha (default 2 x rank)")
    ap.add_argument("--lora-targets", default="all", help="--train lora: target groups / expressions (default all)")
    ap.add_argument("--quick", action="store_true", help="smoke run: P=512, R=16, G=2, reps=2, chunk=128")
    ap.add_argument("--markdown", action="store_true", help="print the tables as Markdown")
    ap.add_argument("--json-out", help="write all raw results to this JSON file")
    ap.add_argument("--child-timeout", type=float, default=7200)
    ap.add_argument("--snapshot", action=argparse.BooleanOptionalAction, default=True,
                    help="children import a copy of longstraw_jax/ taken at start (default on; the working tree may "
                         "change during a long run)")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        return args
    defaults = dict(prompt_len=8192, response_len=128, group_size=8, reps=5, chunk_size=1024)
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, QUICK[k] if args.quick else v)
    if args.sweep_g is None:
        args.sweep_g = QUICK_SWEEP["sweep_g"] if args.quick else [1, 2, 4, 8, 16]
    if args.sweep_p is None:
        args.sweep_p = QUICK_SWEEP["sweep_p"] if args.quick else [2048, 8192, 32768, 131072]
    if args.run_limit_gib is None:
        args.run_limit_gib = 0.4 * _mem_total_bytes() / GIB
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    args.sweep_modes = [m.strip() for m in args.sweep_modes.split(",") if m.strip()]
    for m in args.modes + args.sweep_modes:
        if m not in ALL_MODES:
            ap.error(f"unknown mode {m!r}; allowed: {', '.join(ALL_MODES)}")
    if args.reps < 1 or args.sweep_reps < 1:
        ap.error("--reps and --sweep-reps must be >= 1")
    if args.prompt_len < 2 or min(args.sweep_p) < 2:
        ap.error("prompt lengths must be >= 2")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.one:
        child_main(args.one)
        return
    start = time.perf_counter()
    args.snapshot_dir = make_snapshot() if args.snapshot else None  # the children's PYTHONPATH (bench_step_runner)
    try:
        _main(args, argv, start)
    finally:
        if args.snapshot_dir:
            shutil.rmtree(args.snapshot_dir, ignore_errors=True)


def _main(args, argv, start) -> None:
    geo = geometry(args)
    head = header(args, geo)
    log(head)
    tables, raw = [], []
    if not args.no_modes:
        t, r = table_train(args, geo) if args.train == "lora" else table_modes(args, geo)
        tables.append(t)
        raw += r
    if args.sweep:
        ts, r = run_sweep(args, geo)
        tables += ts
        raw += r
    digests = sorted({r.get("lib_digest") for r in raw if r.get("lib_digest")})
    if len(digests) > 1:
        head += f" | WARNING: children imported different library sources {digests}"
    wall = time.perf_counter() - start
    cmd = "tools/bench_step.py " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.markdown:
        print(f"`{cmd}` — wall time {wall:.0f} s\n\n{head}\n")
        print("\n\n".join(t.markdown() for t in tables))
    else:
        print(f"{cmd} — wall time {wall:.0f} s\n{head}\n")
        print("\n\n".join(t.text() for t in tables))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(dict(command=cmd, header=head, wall_s=wall, results=raw), f, indent=1)


if __name__ == "__main__":
    main()
