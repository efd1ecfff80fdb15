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

Defaults serve a real run (no warm-up, no held-out evaluation unless asked). The demo, `make run`, is
`--config configs/demo.toml`: a tiny Qwen3.6 (vocabulary 32) on the synthetic retrieval task (a 32-token tool log
with the queried fact and a distractor at random depths): held-out accuracy of the random init, a short supervised
warm-up (until 72 % of its latest batches are right), then 80 exact-mode GRPO steps, evaluated on 512 held-out
prompts (2-core CPU, ~4 min). `--config FILE.toml` keeps any run's options in a file; flags on the command line
override it.

The parts (trainer/): config.py (RunConfig: the options, their checks, the merge on --resume), outdir.py (what may be
written where: --out, the checkpoint to resume, --export-hf; incomplete saves and damaged checkpoints), components.py
(what a run is built from: mesh, model and params, optimizer, data source), loop.py (Trainer: the loop and
checkpoints, Ctrl-C), console.py (the header, progress lines, summary), metrics.py (metrics.jsonl records, the plot),
distributed.py (several processes: --coordinator, --num-processes, --process-id or the cluster's environment;
docs/cluster.md; launch.py starts them on one machine).
"""
from __future__ import annotations

import sys
import traceback

from longstraw_jax.trainer import supervise, watchdog
from longstraw_jax.trainer.config import RunConfig, RunError, build_parser, parse_args
from longstraw_jax.trainer.distributed import DistributedError, resolve, start_jax

__all__ = ["main", "RunConfig", "RunError", "build_parser", "parse_args"]


def main(argv=None) -> int:
    """Train as the command line says; 0 when done, 2 (with a one-line error) on bad input or a file that cannot be
    read or written, 130 on Ctrl-C. The arguments are parsed and JAX's processes joined before the trainer is
    imported. A process of a multi-process run runs the trainer as a supervised child (trainer/supervise.py: one
    line even when the runtime aborts natively); every failure there ends every process (trainer/watchdog.py)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    supervise.die_with_parent()
    try:
        config, explicit = parse_args(argv)
        multi = config.mesh is not None and resolve(config.coordinator, config.num_processes, config.process_id)
        if multi and not supervise.supervised():
            return supervise.run(argv)
        start_jax(config, explicit)
        from longstraw_jax.trainer.loop import Trainer

        status = Trainer(config, explicit).run()
    except (RunError, DistributedError, ValueError, OSError, NotImplementedError) as e:  # OSError: FileNotFound..
        return watchdog.leave(2, f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
    except KeyboardInterrupt:  # before the run started writing (Trainer.run handles it after)
        return watchdog.leave(130, "interrupted (Ctrl-C) before the run wrote anything: --out is as it was")
    except Exception as e:
        if not watchdog.active():
            raise
        if watchdog.is_peer_lost(e):  # a peer died mid-collective: the watchdog names it (no traceback)
            return watchdog.peer_lost(e)
        traceback.print_exc()  # a bug: its traceback, then the one line the other processes get too
        return watchdog.leave(1, f"error: {type(e).__name__}: {(str(e).splitlines() or [''])[0]}")
    return watchdog.leave(status, None)


def __getattr__(name):  # `run.Trainer` without importing the training loop before JAX is set up
    if name == "Trainer":
        from longstraw_jax.trainer.loop import Trainer

        return Trainer
    raise AttributeError(name)


if __name__ == "__main__":
    sys.exit(main())
