"""`python -m longstraw_jax.run`: GRPO training on long shared prompts, end to end.

Each step: take a prompt (a task's prompt number `data_position`, a --data row in the shuffled order, or the next group
of a rollout file), capture it once and sample G branches from the captured state (sampling/branches.py), score them
with the reward function(s), then one GRPO update (engine gradients, exact or detached; clipped AdamW). Before step 1,
optionally a supervised warm-up (--sft-steps, trainer/warmup.py); before step 1, every --eval-every steps and after the
last, a held-out evaluation (greedy, K prompts training never draws; trainer/evaluate.py). Writes to --out:
metrics.jsonl (one line per step, evaluation and warm-up step), metrics.png (reward, held-out accuracy, entropy, KL,
grad norm, clip fraction), checkpoints/ (Orbax: params, optimizer state, RNG key, data position), eval_start.npy (the
start's first-token distribution on the held-out prompts), and with --export-hf a safetensors checkpoint of the final
params.

With no arguments: the embedded default, a tiny Qwen3.6 (vocabulary 32) on the synthetic retrieval task (a 32-token tool
log with the queried fact and a distractor at random depths): held-out accuracy of the random init, a 60-step supervised
warm-up (lr 1e-3), then 40 exact-mode GRPO steps, evaluated on 128 held-out prompts every 20 steps (CPU, ~2 min).

The parts (trainer/): config.py (RunConfig: the options, their checks, the merge on --resume), outdir.py (what may be
written where: --out, the checkpoint to resume, --export-hf; incomplete saves and damaged checkpoints), setup.py (mesh,
model and params, optimizer, data source), loop.py (Trainer: the loop and checkpoints, Ctrl-C), log.py (metrics records,
progress lines, summary), distributed.py (several processes: --coordinator, --num-processes, --process-id or the
cluster's environment; docs/cluster.md; launch.py starts them on one machine).
"""
from __future__ import annotations

import sys

from longstraw_jax.trainer.config import RunConfig, RunError, build_parser, parse_args
from longstraw_jax.trainer.distributed import DistributedError, start_jax

__all__ = ["main", "RunConfig", "RunError", "build_parser", "parse_args"]


def main(argv=None) -> int:
    """Train as the command line says; 0 when done, 2 (with a one-line error) on bad input or a file that cannot be
    read or written, 130 on Ctrl-C. The arguments are parsed and JAX's processes joined before the trainer is
    imported."""
    try:
        config, explicit = parse_args(argv)
        start_jax(config)
        from longstraw_jax.trainer.loop import Trainer

        return Trainer(config, explicit).run()
    except (RunError, DistributedError, ValueError, OSError, NotImplementedError) as e:  # OSError: FileNotFound..
        print(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before the run started writing (Trainer.run handles it after)
        print("interrupted (Ctrl-C) before the run wrote anything: --out is as it was", file=sys.stderr)
        return 130


def __getattr__(name):  # `run.Trainer` without importing the training loop before JAX is set up
    if name == "Trainer":
        from longstraw_jax.trainer.loop import Trainer

        return Trainer
    raise AttributeError(name)


if __name__ == "__main__":
    sys.exit(main())
