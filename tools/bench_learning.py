"""Learning-curve benchmark: GRPO (exact mode) on the synthetic retrieval task with a tiny Qwen3.6 on CPU.

Runs the trainer (`longstraw_jax.trainer.cli`, in this process) from a random init, then prints a markdown table of the
mean reward and accuracy (first response token = the planted fact's value) per window of steps, next to chance
(uniform guessing among the answers). Not a test: it takes minutes to tens of minutes on a small CPU.

    python tools/bench_learning.py --steps 600 --window 50 --out out/bench_learning -- --depth 1.0
    python tools/bench_learning.py --steps 600 --window 50 --out out/bench_learning_random     # random depth

Everything after `--` is passed to the trainer unchanged (e.g. `-- --learning-rate 3e-3 --depth 0.5`).
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from longstraw_jax.tasks.retrieval import RetrievalTask
from longstraw_jax.trainer import cli as run
from longstraw_jax.trainer.metrics import read_metrics, split_records

# --num-facts 1 (no distractor) and no held-out evaluation: the setting the README's table was measured with
DEFAULTS = ["--num-facts", "1", "--eval-every", "0", "--vocab-size", "32", "--prompt-len", "128", "--group-size", "8",
            "--response-len", "2", "--mode", "exact", "--chunk-size", "64", "--learning-rate", "1e-3", "--log-every",
            "10", "--save-every", "100"]


def table(records: list[dict], window: int, chance: float, chance_reward: float) -> str:
    rows = ["| steps | mean reward | accuracy | chance accuracy | reward if guessing | median step |",
            "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for start in range(0, len(records), window):
        part = records[start : start + window]
        rows.append(f"| {part[0]['step']}-{part[-1]['step']} | {np.mean([r['reward_mean'] for r in part]):.3f} | "
                    f"{np.mean([r['accuracy'] for r in part]):.3f} | {chance:.3f} | {chance_reward:.3f} | "
                    f"{np.median([r['step_s'] for r in part]):.2f} s |")
    return "\n".join(rows)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", default="out/bench_learning")
    parser.add_argument("--window", type=int, default=25, help="steps per table row")
    args = parser.parse_args(own)
    trainer_args = DEFAULTS + ["--steps", str(args.steps), "--out", args.out] + extra
    print("trainer options:", " ".join(trainer_args), flush=True)
    status = run.main(trainer_args)
    if status:
        return status
    records = split_records(read_metrics(os.path.join(args.out, "metrics.jsonl")))[0]
    config, _ = run.parse_args(trainer_args)

    task = RetrievalTask(prompt_len=config.prompt_len, vocab_size=config.vocab_size, **config.task_options())
    print()
    print(table(records, args.window, 1 / task.num_answers, task.chance_reward))
    return 0


if __name__ == "__main__":
    sys.exit(main())
