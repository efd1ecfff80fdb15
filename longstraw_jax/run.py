"""`python -m longstraw_jax.run`: GRPO training on long shared prompts, end to end.

Each step: take a prompt (a task's prompt number `data_position`, or the next group of a rollout file), capture it
once and sample G branches from the captured state (rollout.py), score them with the reward function, then one
GRPO update (engine gradients, exact or detached; clipped AdamW). Writes to --out: metrics.jsonl (one line per
step), metrics.png (reward and loss over steps), checkpoints/ (Orbax: params, optimizer state, RNG key, data
position), and with --export-hf a safetensors checkpoint of the final params.

With no arguments: the embedded default, a tiny Qwen3.6 (vocabulary 32) on the synthetic retrieval task (a tool
log with a fact planted at a random depth), 40 exact-mode steps on CPU.

The parts: run_config.py (RunConfig: the options, their checks, the merge on --resume), run_outdir.py (what may be
written where: --out, the checkpoint to resume, --export-hf; incomplete saves and damaged checkpoints), run_setup.py
(mesh, model and params, optimizer, data source), run_loop.py (Trainer: the loop and checkpoints, Ctrl-C),
run_log.py (metrics records, progress lines, summary).
"""
from __future__ import annotations

import sys

from longstraw_jax.run_config import RunConfig, RunError, build_parser, parse_args
from longstraw_jax.run_loop import Trainer
from longstraw_jax.run_setup import raise_cpu_device_count

__all__ = ["main", "RunConfig", "RunError", "Trainer", "build_parser", "parse_args"]


def main(argv=None) -> int:
    """Train as the command line says; 0 when done, 2 (with a one-line error) on bad input or a file that cannot be
    read or written, 130 on Ctrl-C."""
    try:
        config, explicit = parse_args(argv)
        if config.mesh is not None:
            raise_cpu_device_count(config.mesh)
        return Trainer(config, explicit).run()
    except (RunError, ValueError, OSError, NotImplementedError) as e:  # OSError: FileNotFoundError, PermissionError..
        print(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before the run started writing (Trainer.run handles it after)
        print("interrupted (Ctrl-C) before the run wrote anything: --out is as it was", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
