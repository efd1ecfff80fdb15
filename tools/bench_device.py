"""Device benchmark: capture throughput (tokens/s, MFU), train_step times and peak memory next to the planner's.

    .venv/bin/python tools/bench_device.py                   # on an accelerator: Qwen3.6-27B width, 1 block
    .venv/bin/python tools/bench_device.py --tiny            # tiny sizes (the default on CPU): a smoke run
    .venv/bin/python tools/bench_device.py --blocks 2 --capture-len 1M --step-len 64K --json bench.json

On one device, with the public API, it measures
- **capture**: `model.capture(params, tokens, chunk_size)` of N tokens (the prompt[:-1] a step captures) for a model
  of the 27B config's widths (hidden 5120, 24 query / 4 KV heads of 256, GDN 16 k / 48 v heads of 128, MLP 17408,
  vocabulary 248320) with only `--blocks` blocks of its LLLF pattern (4 layers each), bf16. N doubles from
  --capture-start while the compiled program fits 90% of the device's memory, N <= --capture-max and the next
  capture is predicted to finish within the time budget (or N = --capture-len). Reported: median seconds, tokens/s,
  model TFLOP/s and MFU against the device's peak dense bf16 FLOP/s (its datasheet entry in
  `longstraw_jax.capacity.hardware`, `for_device_kind`; a device without one, XLA:CPU included: "n/a");
- **detached / exact**: `train.train_step` (jitted with params and optimizer state donated, as the planner compiles
  it) on one group of G branches of R tokens after a prompt of --step-len tokens: median seconds and tokens/s;
- **memory**: the device's `memory_stats()["peak_bytes_in_use"]` (each measurement runs in its own child process,
  so the peak is its own; CPU: "n/a"), the compiled `memory_analysis()` of the executable that ran, and the
  planner's estimate for the same shapes (`longstraw_jax.capacity.Planner` on a 1x1 mesh: `Planner.capture` for
  the capture, `Planner.compile` for a step; with --mesh the bench runs that mesh's sharded path, the planner the
  same program).

Model FLOPs are counted analytically (`qwen36_flops`): 2 x the weight-matrix parameters per token, causal softmax
attention (QK^T and PV over every earlier position) and the GDN delta rule in its recurrent form (6 dk dv per value
head per token); not counted: elementwise work and implementation overhead (flash tiles' masked halves, the chunked
delta rule's intra-chunk products). XLA's `cost_analysis()` counts a loop body once, so it is only a check on a
loop-free config (tests/tools/test_bench.py).

**Time model vs measured**: each program timed (the capture reported, each train_step) is also costed by the
planner's time model (`longstraw_jax.capacity`: `hlo.program_cost` of the compiled executable that ran, loops
multiplied by their trip counts, and `hardware.breakdown`, the roofline max(FLOPs / FLOP/s, HBM bytes / HBM B/s) +
collective bytes / link B/s) on the device's entry (`hardware.for_device`: h200, h100, b200, ... by the device kind; on
XLA:CPU the `cpu` entry, whose peaks are rough round numbers; "n/a" for a device without an entry); a second table
prints the estimate next to the measured median and measured / estimated.

Two markdown tables (medians and ratios; the time model) on stdout; `--json FILE` writes every measurement. The
parent process only orchestrates (no JAX backend of its own); each measurement is this script run with a hidden
`--one` flag (tools/bench_harness.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

import bench_harness

from longstraw_jax.common.validation import SIZE_RULE, size_arg

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # configs/ are found under it
GIB = 2**30
FULL_SIZE = dict(config="configs/qwen3.6-27b.json", dtype="bfloat16", capture_start=65536, capture_max=4 * 2**20,
                 step_len=32768, group_size=4, response_len=256, chunk_size=8192, reps=3)
TINY = dict(config="configs/qwen3.6-tiny.json", dtype="float32", capture_start=256, capture_max=512,
            step_len=256, group_size=2, response_len=8, chunk_size=64, reps=2)


def peak_flops(device_kind: str) -> float | None:
    """Peak dense bf16 FLOP/s of a device from its `device_kind` string (its datasheet entry in
    `longstraw_jax.capacity.hardware`), or None without one (XLA:CPU's rough entry is no datasheet: no MFU)."""
    from longstraw_jax.capacity.hardware import for_device_kind

    hw = for_device_kind(device_kind)
    return None if hw is None else hw.flops_per_s


def qwen36_flops(cfg, tokens: int, cached: int = 0, logits: bool = False) -> dict[str, int]:
    """Model FLOPs of running `tokens` new positions after `cached` earlier ones through a Qwen3.6 config (forward
    only): {"dense", "attention", "gdn", "head", "total"}.

    dense     2 x the weight-matrix parameters of every layer per token (projections, MLP, the depthwise conv)
    attention per full-attention layer, 2 x 2 x H x head_dim per (query, visible key) pair: QK^T and PV, causal
              (query at position t sees t + 1 keys)
    gdn       per GDN layer, 6 x dk x dv per value head per token: k^T S, the rank-1 update, q^T S (recurrent form)
    head      2 x vocab x hidden per token when `logits` (capture computes none)
    """
    d, i = cfg.hidden_size, cfg.intermediate_size
    mlp = 3 * d * i
    linear = (d * cfg.conv_dim + d * cfg.value_dim + 2 * d * cfg.linear_num_value_heads + cfg.value_dim * d
              + cfg.conv_dim * cfg.linear_conv_kernel_dim + mlp)
    heads = cfg.num_attention_heads * cfg.head_dim
    full = d * 2 * heads + 2 * d * cfg.num_key_value_heads * cfg.head_dim + heads * d + mlp  # q_proj has the gate
    n_linear, n_full = cfg.num_blocks * cfg.linear_per_block, cfg.num_blocks * cfg.full_per_block
    pairs = tokens * cached + tokens * (tokens + 1) // 2
    out = dict(dense=2 * tokens * (n_linear * linear + n_full * full), attention=n_full * 4 * heads * pairs,
               gdn=n_linear * 6 * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
               * tokens, head=2 * cfg.vocab_size * d * tokens if logits else 0)
    out["total"] = sum(out.values())
    return out


def bench_config(path: str, blocks: int):
    """The config at `path` (HF config.json) with only `blocks` copies of its repeating layer pattern."""
    from longstraw_jax import models

    cfg = models.config_from_hf(os.path.join(ROOT, path) if not os.path.isabs(path) else path)
    if not isinstance(blocks, int) or blocks < 1 or blocks > cfg.num_blocks:
        raise ValueError(f"--blocks {blocks!r} must be in [1, {cfg.num_blocks}] (the config's blocks)")
    return dataclasses.replace(cfg, num_hidden_layers=blocks * len(cfg.block_pattern),
                               layer_types=cfg.block_pattern * blocks)


# ---------------------------------------------------------------------------------------------------------------
# Child side: one measurement in a fresh process, one JSON line.


def _device_memory(device) -> dict:
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    stats = stats or {}
    return dict(peak=stats.get("peak_bytes_in_use"), limit=stats.get("bytes_limit"))


def _timed(fn, reps: int) -> list[float]:
    """Wall seconds of `reps` calls of fn() (each blocks until its results are ready)."""
    import jax

    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return times


def time_model(compiled, device) -> dict:
    """The planner's time model of one compiled program on `device`: {"model_cost": its per-device cost
    (`capacity.hlo.program_cost`, as a dict), "model_hardware": the device's entry (`capacity.hardware.for_device`)
    or None, "model_terms": the roofline's terms in seconds (compute, memory, collectives, total) or None}."""
    from longstraw_jax.capacity.hardware import breakdown, for_device
    from longstraw_jax.capacity.hlo import program_cost

    hw = for_device(device.device_kind, device.platform)
    c = program_cost(compiled)
    return dict(model_cost=c.as_dict(), model_hardware=None if hw is None else hw.name,
                model_terms=None if hw is None else breakdown(c, hw))


def with_time_model(row: dict, compiled, device) -> dict:
    """`row` (a measurement with its median "seconds") plus `time_model` of the executable that ran and
    "model_s" (the estimate) and "model_ratio" (measured / estimated), None without a hardware entry."""
    row.update(time_model(compiled, device))
    row["model_s"] = row["model_terms"]["total"] if row["model_terms"] else None
    row["model_ratio"] = row["seconds"] / row["model_s"] if row["model_s"] else None
    return row


class _Child:
    def __init__(self, opts: dict):
        import jax

        from longstraw_jax import models, sharding

        self.jax, self.opts = jax, opts
        self.cfg = bench_config(opts["config"], opts["blocks"])
        self.model = models.build(self.cfg)
        self.device = jax.devices()[0]
        self.mesh = sharding.make_mesh(opts["mesh"]) if opts["mesh"] else None
        self.params = self._init_params()

    def _init_params(self):
        import jax
        import jax.numpy as jnp

        from longstraw_jax.sharding import rules

        init = jax.jit(lambda key: self.model.init(key, jnp.dtype(self.opts["dtype"])))
        if self.mesh is not None:
            shapes = jax.eval_shape(init, jax.random.key(0))
            init = jax.jit(init, out_shardings=rules.named(rules.param_specs(shapes, self.mesh), self.mesh))
        return jax.block_until_ready(init(jax.random.key(0)))

    def planner(self, response_len: int):
        from longstraw_jax.capacity import Planner

        return Planner(self.cfg, self.opts["mesh"] or "1x1", self.opts["dtype"], response_len, self.opts["chunk_size"],
                       devices=self.jax.devices()[:1] if not self.opts["mesh"] else None)

    def tokens(self, n: int, seed: int = 0):
        import numpy as np

        return self.jax.numpy.asarray(np.random.default_rng(seed).integers(0, self.cfg.vocab_size, n), np.int32)

    def capture_fn(self):
        import jax

        from longstraw_jax.engine.capture import capture_on_mesh

        chunk = self.opts["chunk_size"]
        if self.mesh is None:
            return jax.jit(lambda params, tokens: self.model.capture(params, tokens, chunk))
        return jax.jit(lambda params, tokens: capture_on_mesh(self.model, params, tokens, self.mesh, chunk_size=chunk))

    def capture(self) -> dict:
        """Capture N tokens for N doubling from capture_start (or N = capture_len), while it fits and the time budget
        allows; the longest N's row (and every N tried in "search")."""
        from longstraw_jax import capacity

        o, start_time = self.opts, time.perf_counter()
        fn, limit = self.capture_fn(), _device_memory(self.device)["limit"]
        n, search, last = o["capture_len"] or o["capture_start"], [], None
        while True:
            tokens = self.tokens(n)
            t0 = time.perf_counter()
            compiled = fn.lower(self.params, tokens).compile()
            compile_s = time.perf_counter() - t0
            memory = capacity.memory_total(compiled)
            if limit and memory["total"] > 0.9 * limit:
                if last is None:
                    raise RuntimeError(f"capturing {n:,} tokens needs {memory['total'] / GIB:.1f} GiB > 90% of the "
                                       f"device's {limit / GIB:.1f} GiB: lower --capture-start / --capture-len")
                break  # the doubled capture would not fit: keep the last one
            jax_out = compiled(self.params, tokens)  # warm-up
            self.jax.block_until_ready(jax_out)
            del jax_out
            times = _timed(lambda: compiled(self.params, tokens), o["reps"])
            seconds = statistics.median(times)
            flops = qwen36_flops(self.cfg, n)["total"]
            last = with_time_model(dict(name="capture", P=n + 1, tokens=n, seconds=seconds, times=times,
                                        tokens_per_s=n / seconds, flops=flops, compiled_bytes=memory["total"],
                                        compile_s=compile_s), compiled, self.device)
            search.append(dict(last))
            elapsed = time.perf_counter() - start_time
            next_s = compile_s + (o["reps"] + 1) * 4 * seconds  # at most quadratic in N
            if o["capture_len"] or 2 * n > o["capture_max"] or elapsed + next_s > o["budget_s"]:
                break
            n *= 2
        last["peak_bytes"] = _device_memory(self.device)["peak"]
        last["planner_bytes"] = self.planner(1).capture(last["P"])["total"] if o["planner"] else None
        last["search"] = search
        return last

    def step(self, mode: str) -> dict:
        """One train_step (donated params and optimizer state) on a prompt of step_len tokens and G x R responses."""
        import jax
        import jax.numpy as jnp
        import numpy as np

        from longstraw_jax import GroupBatch, GRPOConfig, capacity, train
        from longstraw_jax.sharding import rules

        o = self.opts
        p, g, r = o["step_len"], o["group_size"], o["response_len"]
        optimizer = train.make_optimizer(1e-6)
        opt_state = jax.jit(optimizer.init)(self.params)
        if self.mesh is not None:
            specs = rules.param_specs(self.params, self.mesh)
            opt_specs = rules.like_params_specs(opt_state, self.params, specs)
            opt_state = jax.device_put(opt_state, rules.named(opt_specs, self.mesh))
        rng = np.random.default_rng(1)
        batch = GroupBatch(prompt=self.tokens(p, 2), responses=jnp.asarray(rng.integers(0, self.cfg.vocab_size,
                                                                                            (g, r)), jnp.int32),
                           mask=jnp.ones((g, r), jnp.float32), rewards=jnp.asarray(rng.uniform(size=g), jnp.float32),
                           old_logprobs=jnp.full((g, r), -1.0, jnp.float32), ref_logprobs=None)
        step = jax.jit(train.train_step, static_argnums=(0, 4, 5, 6, 7, 8), donate_argnums=(1, 2))
        t0 = time.perf_counter()
        compiled = step.lower(self.model, self.params, opt_state, batch, optimizer, GRPOConfig(), mode, o["chunk_size"],
                              self.mesh).compile()
        compile_s = time.perf_counter() - t0
        memory = capacity.memory_total(compiled)
        state = [self.params, opt_state]

        def run():
            state[0], state[1], metrics = compiled(state[0], state[1], batch)
            return metrics["loss"], state[0]

        run()  # warm-up
        times = _timed(run, o["reps"])
        seconds = statistics.median(times)
        row = with_time_model(dict(name=mode, P=p, G=g, R=r, seconds=seconds, times=times,
                                   tokens_per_s=(p + g * r) / seconds, flops=None, compiled_bytes=memory["total"],
                                   compile_s=compile_s, peak_bytes=_device_memory(self.device)["peak"]),
                              compiled, self.device)
        row["planner_bytes"] = self.planner(r).compile(p, g, mode)["total"] if o["planner"] else None
        return row


def _child(opts: dict) -> int:
    import jax

    child = _Child(opts)
    row = child.capture() if opts["item"] == "capture" else child.step(opts["item"])
    device = jax.devices()[0]
    row.update(device=device.device_kind, platform=device.platform, jax=jax.__version__)
    bench_harness.emit(row)
    return 0


# ---------------------------------------------------------------------------------------------------------------
# Parent side: run each measurement in a child, print the table, write JSON.


def _run_child(opts: dict, timeout: float) -> dict:
    """One measurement (`opts["item"]`) in its own process: its result row; RuntimeError if it failed."""
    child = bench_harness.run_child(__file__, opts, timeout, cwd=ROOT)
    if child.returncode is None:
        raise RuntimeError(f"{opts['item']} timed out after {timeout:.0f} s:\n{child.stderr[-3000:]}")
    if child.returncode or not child.rows:
        raise RuntimeError(f"{opts['item']} failed (exit {child.returncode}):\n{child.stderr[-3000:]}")
    return child.rows[-1]


def _fmt(x, spec: str = ".2f", scale: float = 1.0) -> str:
    return "n/a" if x is None else format(x / scale, spec)


def format_table(rows: list[dict], peak: float | None) -> str:
    """The markdown table: one row per measurement, medians, model TFLOP/s and MFU (capture), memory and ratios."""
    sizes = [row.get(key) or 0 for row in rows for key in ("peak_bytes", "compiled_bytes", "planner_bytes")]
    unit, scale = ("GiB", GIB) if max(sizes, default=0) >= GIB else ("MiB", 2**20)
    head = ["measurement", "P", "G x R", "median s", "x detached", "tokens/s", "TFLOP/s", "MFU", f"peak {unit}",
            f"compiled {unit}", f"planner {unit}", "peak / planner"]
    detached = next((row["seconds"] for row in rows if row["name"] == "detached"), None)
    lines = ["| " + " | ".join(head) + " |", "| --- | " + " | ".join(["---:"] * (len(head) - 1)) + " |"]
    for row in rows:
        tflops = row["flops"] / row["seconds"] if row.get("flops") else None
        ratio = (row["peak_bytes"] / row["planner_bytes"]
                 if row.get("peak_bytes") and row.get("planner_bytes") else None)
        cells = [row["name"], f"{row['P']:,}", f"{row['G']} x {row['R']}" if "G" in row else "-",
                 f"{row['seconds']:.3g}", _fmt(row["seconds"] / detached if detached and row["name"] != "capture"
                                               else None),
                 f"{row['tokens_per_s']:,.0f}", _fmt(tflops, ".3g", 1e12),
                 _fmt(tflops / peak if tflops and peak else None, ".1%"), _fmt(row.get("peak_bytes"), ".2f", scale),
                 _fmt(row["compiled_bytes"], ".2f", scale), _fmt(row.get("planner_bytes"), ".2f", scale),
                 _fmt(ratio, ".2f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_model_table(rows: list[dict]) -> str:
    """The time model next to the measurements: per program its per-device model cost (GFLOP, HBM GB, collective
    GB), the roofline's bound and estimate on the device's hardware entry, the measured median and measured /
    estimated ("n/a" without an entry; "*": loops without a trip count, the estimate a lower bound)."""
    head = ["measurement", "hardware", "model GFLOP", "model HBM GB", "model collective GB", "bound", "estimate s",
            "measured s", "measured / estimate"]
    align = ["---", "---", "---:", "---:", "---:", "---", "---:", "---:", "---:"]
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join(align) + " |"]
    for row in rows:
        c, terms = row["model_cost"], row["model_terms"]
        bound = max(("compute", "memory", "collectives"), key=terms.get) if terms else "n/a"
        star = "*" if c["unknown_loops"] else ""
        lines.append("| " + " | ".join([
            row["name"], row["model_hardware"] or "n/a", f"{c['flops'] / 1e9:.4g}", f"{c['hbm_bytes'] / 1e9:.4g}",
            f"{c['collective_bytes'] / 1e9:.4g}", bound, _fmt(row["model_s"], ".3g") + star,
            f"{row['seconds']:.3g}", _fmt(row["model_ratio"], ".3g")]) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--one"]:
        return _child(json.loads(argv[1]))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog=f"sizes (--capture-*, --step-len, -R, --chunk-size): {SIZE_RULE}",
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", default=None,
                    help="tiny config and sizes (the default when no accelerator is present)")
    ap.add_argument("--full", dest="tiny", action="store_false", help="the 27B widths even on CPU (slow)")
    ap.add_argument("--config", help="HF config.json (default: configs/qwen3.6-27b.json; --tiny: the tiny preset)")
    ap.add_argument("--blocks", type=int, default=1, help="blocks of the config's layer pattern to keep (1)")
    ap.add_argument("--dtype", help="parameter dtype (bfloat16; --tiny: float32)")
    ap.add_argument("--mesh", default=None, help="AxB: bench the sharded path on that mesh (default: one device)")
    ap.add_argument("--capture-len", type=size_arg, default=0, help="capture exactly this many tokens (no search)")
    ap.add_argument("--capture-start", type=size_arg, help="first capture length of the doubling search")
    ap.add_argument("--capture-max", type=size_arg, help="longest capture the search tries")
    ap.add_argument("--step-len", type=size_arg, help="prompt length of the train_step measurements")
    ap.add_argument("-G", "--group-size", type=int)
    ap.add_argument("-R", "--response-len", type=size_arg)
    ap.add_argument("--chunk-size", type=size_arg, help="capture chunk / round length")
    ap.add_argument("--reps", type=int, help="timed calls per measurement (after one warm-up)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="wall-clock budget of the whole run (420 s)")
    ap.add_argument("--modes", default="detached,exact", help="train_step modes to time (detached,exact)")
    ap.add_argument("--no-planner", dest="planner", action="store_false", help="skip the planner's estimates")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    if args.tiny is None:
        args.tiny = not _has_accelerator()
    defaults = TINY if args.tiny else FULL_SIZE
    opts = {key: getattr(args, key, None) if getattr(args, key, None) is not None else value
            for key, value in defaults.items()}
    opts.update(blocks=args.blocks, mesh=args.mesh, capture_len=args.capture_len, planner=args.planner)
    for name in ("group_size", "reps", "blocks"):
        if opts[name] < 1:
            raise SystemExit(f"error: --{name.replace('_', '-')} {opts[name]} must be >= 1")
    start = time.perf_counter()
    rows = []
    for mode in [m for m in args.modes.split(",") if m]:
        remaining = args.budget_s - (time.perf_counter() - start)
        rows.append(_run_child(dict(opts, item=mode, budget_s=remaining), timeout=max(remaining, 60)))
        print(f"  {mode}: {rows[-1]['seconds']:.3g} s per step", flush=True)
    remaining = args.budget_s - (time.perf_counter() - start)
    capture = _run_child(dict(opts, item="capture", budget_s=0.6 * remaining), timeout=max(remaining, 0) + 90)
    print(f"  capture: {capture['tokens']:,} tokens in {capture['seconds']:.3g} s", flush=True)
    rows.insert(0, capture)
    device, peak = capture["device"], peak_flops(capture["device"])
    cfg = bench_config(opts["config"], opts["blocks"])
    print(f"{device} ({capture['platform']}, jax {capture['jax']}); peak bf16 "
          f"{'n/a' if peak is None else f'{peak / 1e12:.0f} TFLOP/s'}; {cfg.describe()}; {opts['dtype']}; "
          f"mesh {opts['mesh'] or 'none (one device)'}; chunk {opts['chunk_size']:,}; "
          f"{time.perf_counter() - start:.0f} s")
    print(format_table(rows, peak))
    print("\nTime model (longstraw_jax.capacity: per-device roofline of the compiled program) vs measured")
    print(format_model_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=device, platform=capture["platform"], peak_flops=peak, options=opts, rows=rows), f,
                      indent=1)
            f.write("\n")
    return 0


def _has_accelerator() -> bool:
    """Whether JAX would start on an accelerator, asked in a child (the parent starts no backend)."""
    probe = subprocess.run([sys.executable, "-c", "import jax; print(jax.default_backend())"], capture_output=True,
                           text=True, timeout=300)
    return probe.stdout.strip() not in ("", "cpu")


if __name__ == "__main__":
    sys.exit(main())
