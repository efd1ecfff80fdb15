"""Capacity planner: per-device memory of one sharded GRPO training step, compiled ahead of time from shapes only.

    .venv/bin/python tools/plan_capacity.py --config configs/qwen3.6-27b.json --mesh 1x8 \
        -P 2.1M,4.46M -G 2,8 --modes exact,detached --device-gb 96 --markdown
    .venv/bin/python tools/plan_capacity.py --config configs/qwen3.6-27b.json --mesh 1x8 -G 8 --search --device-gb 96

For each (mode, G, P) it AOT-compiles the trainer's step (`train._train_step`: sharded `grpo_grads` + AdamW with
global-norm clipping, params and optimizer state donated) on a simulated CPU mesh of A*B devices, from abstract
arrays (`jax.ShapeDtypeStruct` with the FSDP / sequence shardings): nothing of model size is ever allocated. It
prints the compiled `memory_analysis()` of the per-device program (arguments + outputs + temporaries - donated
aliases) next to a per-device breakdown:

    params      the device's FSDP shard of the parameters (sharding.rules.param_specs)
    optimizer   its shard of the AdamW moments (like the params)
    grads       the float32 gradient accumulator's shard (the engine accumulates in float32)
    state       the prompt state: position-indexed caches split along `seq` (Qwen3.6 KV, GLM-5.x latent rows and
                indexer keys), the GDN conv/recurrent state whole
    cotangent   exact mode: the float32 state cotangent (sharded like the state)
    rest        compiled total - the above: activations, gathered layers, the capture's block inputs (exact)

`--search` binary-searches the longest prompt (to --search-step positions) whose compiled total fits --device-gb.

Caveats: sizes come from XLA:CPU's buffer assignment for the per-device SPMD program; a GPU compile differs
(fusion, scheduling, collective buffers), so read them as estimates. bf16 sizing sets
`--xla_disable_hlo_passes=while-loop-invariant-code-motion` (otherwise the CPU compiler hoists a whole-input
float32 conversion out of loops and overstates scratch memory). Qwen3.6 and GLM-5.x configs are supported.

Imports of jax and the package are function-local on purpose: XLA_FLAGS and the simulated device count must be set
(`_setup_jax`) before JAX creates its CPU client, and `--help` should not pay for starting it.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time

MIB, GIB = 2**20, 2**30


def _count(text: str) -> int:
    """'2.1M' -> 2100000, '512K' -> 512000, '8192' -> 8192."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a count like 8192, 512K or 2.1M")
    return int(round(float(match[1]) * {"": 1, "k": 10**3, "m": 10**6}[match[2].lower()]))


def _counts(text: str) -> list[int]:
    return [_count(t) for t in text.split(",")]


def _setup_jax(devices: int) -> None:
    """Before JAX starts: simulated CPU devices, no while-loop hoisting of whole-input conversions, and no LLVM
    optimisation of the never-run code."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    flags = os.environ.get("XLA_FLAGS", "")
    if "while-loop-invariant-code-motion" not in flags:
        flags += " --xla_disable_hlo_passes=while-loop-invariant-code-motion"
    if "xla_backend_optimization_level" not in flags:  # LLVM only (after buffer assignment): compiles much faster
        flags += " --xla_backend_optimization_level=0"
    os.environ["XLA_FLAGS"] = flags.strip()
    import jax

    jax.config.update("jax_num_cpu_devices", devices)


def _local_bytes(abstract_tree) -> int:
    """Bytes one device holds of a tree of sharded ShapeDtypeStructs (the largest shard of each leaf)."""
    import jax
    import numpy as np

    total = 0
    for leaf in jax.tree.leaves(abstract_tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
        total += int(np.prod(shape)) * leaf.dtype.itemsize
    return total


class Planner:
    def __init__(self, config_path: str, mesh_spec: str, dtype: str, response_len: int, chunk: int):
        import jax
        import jax.numpy as jnp

        from longstraw_jax import models, sharding, train
        from longstraw_jax.sharding import rules

        self.jax, self.rules, self.train = jax, rules, train
        self.model = models.build(models.config_from_hf(config_path))
        self.model.sequence_parallel()  # a family without a sharded path says so here
        self.mesh = sharding.make_mesh(mesh_spec)
        self.dtype = jnp.dtype(dtype)
        self.response_len, self.chunk = response_len, chunk
        params = jax.eval_shape(lambda key: self.model.init(key, self.dtype), jax.random.key(0))
        self.param_shardings = rules.named(rules.param_specs(params, self.mesh), self.mesh)
        self.params = jax.tree.map(lambda p, s: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=s), params,
                                   self.param_shardings)
        self.optimizer = train.make_optimizer(1e-6)
        opt = jax.eval_shape(self.optimizer.init, params)
        opt_specs = rules.like_params_specs(opt, params, rules.param_specs(params, self.mesh))
        self.opt_state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), opt,
                                      rules.named(opt_specs, self.mesh))
        self.num_params = sum(math.prod(p.shape) for p in jax.tree.leaves(params))
        self.step = jax.jit(train._train_step.__wrapped__, static_argnums=(0, 4, 5, 6, 7, 8), donate_argnums=(1, 2))

    def components(self, prompt_len: int, mode: str) -> dict[str, int]:
        """Analytic per-device bytes of what the step must hold (see the module docstring)."""
        import jax
        import jax.numpy as jnp

        out = {"params": _local_bytes(self.params), "optimizer": _local_bytes(self.opt_state),
               "grads": _local_bytes(jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, jnp.float32,
                                                                                 sharding=p.sharding), self.params))}
        state, cotangent = self._state_bytes(prompt_len - 1)
        out["state"] = state
        out["cotangent"] = 0 if mode == "detached" else cotangent
        return out

    def _state_bytes(self, prompt_positions: int) -> tuple[int, int]:
        """Per-device bytes of the prompt state at self.dtype and of its float32 cotangent: position-indexed fields
        (`rules.SEQ_AXES`, in the engine's padded round layout) split along `seq`, carried ones whole."""
        import dataclasses

        import jax
        import numpy as np

        from longstraw_jax.sharding.api import round_layout
        from longstraw_jax.sharding.rules import SEQ_AXES

        seq = self.mesh.shape["seq"]
        padded = round_layout(self.model, prompt_positions, seq, self.chunk).padded
        state = jax.eval_shape(lambda: self.model.init_state(padded, self.dtype))
        total = cotangent = 0
        for field in dataclasses.fields(state):
            leaf = getattr(state, field.name)
            if not isinstance(leaf, jax.ShapeDtypeStruct):
                continue
            count = int(np.prod(leaf.shape)) // (seq if field.name in SEQ_AXES else 1)
            total, cotangent = total + count * leaf.dtype.itemsize, cotangent + count * 4
        return total, cotangent

    def compile(self, prompt_len: int, group: int, mode: str) -> dict:
        import jax
        import jax.numpy as jnp

        from longstraw_jax import GroupBatch, GRPOConfig

        replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        arr = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=replicated)
        g, r = group, self.response_len
        batch = GroupBatch(prompt=arr((prompt_len,), jnp.int32), responses=arr((g, r), jnp.int32),
                           mask=arr((g, r), jnp.float32), rewards=arr((g,), jnp.float32),
                           old_logprobs=arr((g, r), jnp.float32), ref_logprobs=None)
        start = time.perf_counter()
        compiled = self.step.lower(self.model, self.params, self.opt_state, batch, self.optimizer, GRPOConfig(),
                                   mode, self.chunk, self.mesh).compile()
        seconds = time.perf_counter() - start
        m = compiled.memory_analysis()
        total = (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                 - m.alias_size_in_bytes)
        parts = self.components(prompt_len, mode)
        parts["rest"] = total - sum(parts.values())
        return dict(P=prompt_len, G=group, mode=mode, total=total, temp=m.temp_size_in_bytes,
                    arguments=m.argument_size_in_bytes, compile_s=seconds, **parts)

    def search(self, group: int, mode: str, limit: int, step: int, log) -> tuple[int, dict | None]:
        """Longest prompt (a multiple of `step`) whose compiled total is <= limit bytes: doubling, then bisection."""
        fits, best, lo, hi = lambda row: row["total"] <= limit, None, 0, step
        while True:
            row = self.compile(hi, group, mode)
            print(f"  search {mode} G={group} P={hi:,}: {row['total'] / GIB:.2f} GiB", file=log, flush=True)
            if not fits(row):
                break
            lo, best, hi = hi, row, hi * 2
        while hi - lo > step:
            mid = (lo + hi) // 2 // step * step
            row = self.compile(mid, group, mode)
            print(f"  search {mode} G={group} P={mid:,}: {row['total'] / GIB:.2f} GiB", file=log, flush=True)
            lo, best, hi = (mid, row, hi) if fits(row) else (lo, best, mid)
        return lo, best


COLUMNS = ("params", "optimizer", "grads", "state", "cotangent", "rest", "total")


def format_rows(rows: list[dict], device_gb: float, markdown: bool, unit: str = "GiB") -> str:
    scale = {"GiB": GIB, "MiB": MIB}[unit]
    head = ["mode", "G", "P"] + [f"{c} {unit}" for c in COLUMNS] + [f"fits {device_gb:g} GB"]
    lines = []
    for row in rows:
        lines.append([row["mode"], str(row["G"]), f"{row['P']:,}"] + [f"{row[c] / scale:.2f}" for c in COLUMNS]
                     + ["yes" if row["total"] <= device_gb * 1e9 else "no"])
    if markdown:
        out = ["| " + " | ".join(head) + " |", "| " + " | ".join(["---"] * 3 + ["---:"] * (len(head) - 3)) + " |"]
        return "\n".join(out + ["| " + " | ".join(line) + " |" for line in lines])
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(head)]
    fmt = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))
    return "\n".join([fmt(head)] + [fmt(line) for line in lines])


def write_json(path: str, rows: list[dict], args, planner) -> None:
    """{"setup": the run's options, "rows": one object per table row: mode, G, P, every component and the compiled
    total in bytes per device, compile seconds, and "fits" (total <= device_gb * 1e9)}."""
    limit = args.device_gb * 1e9
    setup = dict(config=args.config, mesh=args.mesh, dtype=args.dtype, response_len=args.response_len,
                 chunk=args.chunk, device_gb=args.device_gb, params=planner.num_params)
    out = [dict(row, fits=bool(row["total"] <= limit)) for row in rows]
    with open(path, "w") as f:
        json.dump(dict(setup=setup, rows=out), f, indent=1)
        f.write("\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="HF config.json of the model (e.g. configs/qwen3.6-27b.json)")
    ap.add_argument("--mesh", required=True, help="AxB: data x seq devices (simulated on CPU)")
    ap.add_argument("--prompt-len", "-P", type=_counts, default=[], help="comma list, e.g. 2.1M,4.46M")
    ap.add_argument("--group", "-G", type=_counts, default=[8], help="comma list of group sizes (default 8)")
    ap.add_argument("--response-len", "-R", type=_count, default=1024, help="response tokens per branch (1024)")
    ap.add_argument("--modes", default="exact,detached")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device-gb", type=float, default=96.0, help="device memory in GB (1e9 bytes; default 96)")
    ap.add_argument("--search", action="store_true", help="binary-search the longest prompt that fits")
    ap.add_argument("--search-step", type=_count, default=65536, help="search resolution in positions (64K)")
    ap.add_argument("--chunk", type=_count, default=16384,
                    help="capture / prompt-backward round length in positions (default 16K: a round's working set "
                         "is most of the exact step's transient memory)")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--unit", choices=("GiB", "MiB"), default="GiB", help="table unit (default GiB)")
    ap.add_argument("--json", metavar="FILE", help="also write every row as JSON (bytes; a boolean 'fits' per row)")
    args = ap.parse_args(argv)
    from longstraw_jax.sharding.mesh import parse_mesh_spec

    try:
        _setup_jax(math.prod(parse_mesh_spec(args.mesh)))
        planner = Planner(args.config, args.mesh, args.dtype, args.response_len, args.chunk)
    except (ValueError, NotImplementedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import jax

    cfg = planner.model.config
    print(f"{type(cfg).__name__} from {args.config}: {planner.num_params / 1e9:.2f}B params at {args.dtype}; mesh "
          f"{args.mesh} (simulated, jax {jax.__version__}, XLA:CPU); R={args.response_len}; rounds of "
          f"{args.chunk:,} positions; device "
          f"{args.device_gb:g} GB", flush=True)
    rows, limit = [], int(args.device_gb * 1e9)
    for mode in args.modes.split(","):
        for group in args.group:
            for prompt_len in args.prompt_len:
                rows.append(planner.compile(prompt_len, group, mode))
                print(f"  {mode} G={group} P={prompt_len:,}: {rows[-1]['total'] / GIB:.2f} GiB "
                      f"(compile {rows[-1]['compile_s']:.0f} s)", flush=True)
            if args.search:
                longest, row = planner.search(group, mode, limit, args.search_step, sys.stdout)
                print(f"  longest prompt that fits ({mode}, G={group}): {longest:,} positions", flush=True)
                if row is not None:
                    rows.append(dict(row, mode=mode + " (longest)"))
    print(format_rows(rows, args.device_gb, args.markdown, args.unit))
    if args.json:
        write_json(args.json, rows, args, planner)
    for mode in args.modes.split(","):
        for prompt_len in args.prompt_len:
            cells = {row["G"]: row["total"] for row in rows if row["mode"] == mode and row["P"] == prompt_len}
            if len(cells) > 1:
                lo, hi = min(cells), max(cells)
                print(f"{mode} P={prompt_len:,}: G {lo} -> {hi} costs {(cells[hi] - cells[lo]) / 1e9:+.4f} GB "
                      f"({cells[hi] - cells[lo]:+,} bytes)")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
