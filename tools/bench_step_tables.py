"""Tables 1 and 2 of tools/bench_step.py: the cells each table needs (run in children, `spawn`) and their rows, ratios
and notes.
"""
from __future__ import annotations

import statistics

from bench_step_format import GIB, Table, fmt_bytes, fmt_ratio, fmt_time
from bench_step_runner import spawn

ALL_MODES = ("naive", "detached", "exact")


def boundary_bytes(geo, p: int, chunk: int) -> int:
    """Exact mode keeps the GDN carried state before every chunk: ceil((P-1) / chunk) copies."""
    return -(-(p - 1) // chunk) * geo["carried"]


def table_modes(args, geo) -> tuple[Table, list[dict]]:
    """Table 1: one GRPO step per mode (--modes), each in its own child; ratios to naive (or the first mode)."""
    modes = args.modes
    jobs = [dict(mode=m, P=args.prompt_len, R=args.response_len, G=args.group_size, chunk=args.chunk_size,
                 reps=args.reps, run=not args.compile_only,
                 max_run_bytes=int(args.run_limit_gib * GIB)) for m in modes]
    results = {}
    for job in jobs:
        res = spawn([job], args)
        if res:
            results[job["mode"]] = res[0]
    base_mode = "naive" if "naive" in results else next((m for m in modes if m in results), None)
    base = results.get(base_mode, {})
    t = Table(f"Table 1 (modes): P={args.prompt_len}, R={args.response_len}, G={args.group_size}, "
              f"chunk={args.chunk_size}, median of {args.reps} runs after 1 warm-up; ratios to {base_mode}",
              ["mode", "argument", "output", "temp", "compiled total", "x mem", "peak RSS", "run peak RSS",
               "run ΔRSS", "x ΔRSS", "median step", "x time", "compile", "loss", "grad norm"])

    def run_rss(r):  # (peak during the run, peak during the run - RSS before it), bytes
        if not (r.get("run_hwm_kib") and r.get("hwm_reset")):
            return None, None
        return r["run_hwm_kib"] * 1024, (r["run_hwm_kib"] - r["rss_before_run_kib"]) * 1024

    base_delta = run_rss(base)[1]
    for m in modes:
        r = results.get(m)
        if r is None:
            t.add(m, *(["failed"] + ["—"] * 14)[:14])
            continue
        run_peak, delta = run_rss(r)
        why = r.get("skipped_run") or r.get("failed")
        if why:
            t.notes.append(f"{m}: not timed: {why}.")
        median = fmt_time(r["median_s"]) if "median_s" in r else ("not run" if r.get("skipped_run") else
                                                                  "failed" if r.get("failed") else "—")
        peak_rss = fmt_bytes(r["ru_maxrss_kib"] * 1024) if "ru_maxrss_kib" in r else "—"
        t.add(m, fmt_bytes(r["argument"]), fmt_bytes(r["output"]), fmt_bytes(r["temp"]), fmt_bytes(r["total"]),
              fmt_ratio(r["total"], base.get("total")), peak_rss, fmt_bytes(run_peak),
              fmt_bytes(delta), fmt_ratio(delta, base_delta), median,
              fmt_ratio(r.get("median_s"), base.get("median_s")), fmt_time(r["lower_s"] + r["compile_s"]),
              f"{r['loss']:.6g}" if "loss" in r else "—", f"{r['grad_norm']:.6g}" if "grad_norm" in r else "—")
    if not args.compile_only:
        t.notes.append(f"a mode whose compiled total is above --run-limit-gib={args.run_limit_gib:.1f} GiB is "
                       "compiled but not run.")
    kv, carried = geo["state_bytes"](args.prompt_len)
    kv32, carried32 = geo["state_bytes"](args.prompt_len, f32=True)
    t.notes.append("compiled = memory_analysis() of the jitted step (argument + output + temp). peak RSS = "
                   "ru_maxrss of the mode's own process, which includes the XLA compiler's peak. run peak RSS = "
                   "VmHWM reset after compile and malloc_trim, i.e. the process peak while running the step; "
                   "run ΔRSS = run peak - RSS just before the warm-up call (≈ what the step itself allocates).")
    t.notes.append(f"prompt state {fmt_bytes(kv + carried)} (KV {fmt_bytes(kv)}); exact mode adds its fp32 "
                   f"cotangent {fmt_bytes(kv32 + carried32)} and chunk boundaries "
                   f"{fmt_bytes(boundary_bytes(geo, args.prompt_len, args.chunk_size))}; "
                   f"params {fmt_bytes(geo['param_bytes'])}.")
    if "exact" in results and "detached" in results:
        d = results["exact"]["temp"] - results["detached"]["temp"]
        t.notes.append(f"exact temp - detached temp = {fmt_bytes(d)}.")
    times = {m: r.get("times_s") for m, r in results.items() if r.get("times_s")}
    if times:
        t.notes.append("step times (s): " + "; ".join(f"{m}: " + ", ".join(f"{x:.3f}" for x in v)
                                                        for m, v in times.items()))
    if "naive" in results and "exact" in results and "loss" in results["naive"] and "loss" in results["exact"]:
        t.notes.append("exact and naive should agree on loss and grad norm (same batch); "
                       "detached differs in grad norm.")
    return t, list(results.values())


def table_train(args, geo) -> tuple[Table, list[dict]]:
    """--train lora: the whole trainer update (grads + AdamW), full-parameter vs LoRA, for each engine mode; each
    cell in its own child; ratios LoRA / full of the same mode."""
    modes = [m for m in args.modes if m != "naive"]  # the trainer's update runs the engine (exact / detached)
    spec = dict(rank=args.lora_rank, alpha=args.lora_alpha if args.lora_alpha is not None else 2.0 * args.lora_rank,
                targets=args.lora_targets)
    results = {}
    for mode in modes:
        for kind in ("full", "lora"):
            job = dict(mode=mode, train=kind, lora=spec, P=args.prompt_len, R=args.response_len, G=args.group_size,
                       chunk=args.chunk_size, reps=args.reps, run=not args.compile_only)
            res = spawn([job], args)
            if res:
                results[mode, kind] = res[0]
    t = Table(f"Table 1 (train): the trainer's update (grpo_grads + AdamW, params and optimizer state donated), "
              f"full vs LoRA rank {spec['rank']} on {spec['targets']}; P={args.prompt_len}, R={args.response_len}, "
              f"G={args.group_size}, chunk={args.chunk_size}, median of {args.reps} runs after 1 warm-up; "
              "ratios LoRA / full",
              ["mode", "train", "trainable", "argument", "output", "temp", "compiled total", "x mem",
               "median step", "x time", "compile", "loss"], align="llrrrrrrrrrr")
    for mode in modes:
        base = results.get((mode, "full"), {})
        for kind in ("full", "lora"):
            r = results.get((mode, kind))
            if r is None:
                t.add(mode, kind, *(["failed"] + ["—"] * 9))
                continue
            t.add(mode, kind, f"{r['trainable_params'] / 1e6:.3f}M", fmt_bytes(r["argument"]),
                  fmt_bytes(r["output"]), fmt_bytes(r["temp"]), fmt_bytes(r["total"]),
                  fmt_ratio(r["total"], base.get("total")), fmt_time(r.get("median_s")),
                  fmt_ratio(r.get("median_s"), base.get("median_s")), fmt_time(r["lower_s"] + r["compile_s"]),
                  f"{r['loss']:.6g}" if "loss" in r else "—")
    if "naive" in args.modes:
        t.notes.append("naive has no trainer update (train_step runs exact / detached): left out.")
    counts = {kind: r["params"] for (_, kind), r in results.items()}
    if counts:
        t.notes.append(", ".join(f"{kind} {n / 1e6:.3f}M params" for kind, n in sorted(counts.items()))
                       + " (LoRA: frozen base + adapters); compiled total = "
                       "memory_analysis() argument + output + temp - donated aliases: full holds params, fp32 grads "
                       "and two AdamW moments of every parameter; LoRA the frozen base plus those of the adapters.")
    return t, list(results.values())


def run_sweep(args, geo) -> tuple[list[Table], list[dict]]:
    """Table 2 (--sweep): every (mode, P, G) cell compiled, one child per (mode, P) with its cells in increasing G
    (or per cell); naive dropped above --naive-limit-gib. Tables 2a/2b (compiled total, temp), 2c (exact's extra
    temp vs the design's budget) and 2d (times, --sweep-time)."""
    gs, ps = sorted(args.sweep_g), sorted(args.sweep_p)
    modes = [m for m in ALL_MODES if m in args.sweep_modes]
    results: dict[tuple, dict] = {}
    env = {"XLA_FLAGS": "--xla_backend_optimization_level=0"} if args.sweep_fast_compile else None
    naive_cap = None  # smallest G whose naive total passed the limit at a smaller P
    limit = int(args.naive_limit_gib * GIB)
    for p in ps:
        for mode in modes:
            g_list = gs if mode != "naive" else [g for g in gs if naive_cap is None or g < naive_cap]
            if not g_list:
                continue
            chunk = min(args.chunk_size, p - 1)
            jobs = [dict(mode=mode, P=p, R=args.response_len, G=g, chunk=chunk, reps=args.sweep_reps,
                         run=bool(args.sweep_time and p <= args.sweep_time_max_p),
                         max_run_bytes=int(args.run_limit_gib * GIB)) for g in g_list]
            cell_env = None if any(j["run"] for j in jobs) else env
            if args.sweep_one_child_per_cell:
                res = [r for j in jobs for r in spawn([j], args, limit if mode == "naive" else None, cell_env)]
            else:
                res = spawn(jobs, args, limit if mode == "naive" else None, cell_env)
            for r in res:
                results[(mode, p, r["G"])] = r
                if mode == "naive" and r["total"] > limit:
                    naive_cap = r["G"] if naive_cap is None else min(naive_cap, r["G"])

    def cell(mode, p, g, key):
        r = results.get((mode, p, g))
        if r is None or (mode == "naive" and r["total"] > limit):
            return None
        return r.get(key)

    g_cols = [f"G={g}" for g in gs]
    tables = []
    for key, what in (("total", "compiled total (argument + output + temp)"), ("temp", "compiled temp")):
        t = Table(f"Table 2{'a' if key == 'total' else 'b'} (sweep): {what}; R={args.response_len}, "
                  f"chunk={args.chunk_size}", ["P", "mode", "prompt state", *g_cols, "max/min over G"],
                  align="rl" + "r" * (len(g_cols) + 2))
        for p in ps:
            kv, carried = geo["state_bytes"](p)
            for mode in modes:
                vals = [cell(mode, p, g, key) for g in gs]
                known = [v for v in vals if v]
                spread = fmt_ratio(max(known), min(known)) if len(known) > 1 else "—"
                t.add(str(p), mode, fmt_bytes(kv + carried), *(fmt_bytes(v) for v in vals), spread)
        t.notes.append(f"— : not compiled (naive above --naive-limit-gib={args.naive_limit_gib:g} GiB, or implied "
                       "above it by a smaller cell) or failed.")
        tables.append(t)

    # Where does exact's extra memory go? Compare to the design's budget (docs/architecture.md 6).
    if "exact" in modes and "detached" in modes:
        t = Table("Table 2c (sweep): exact temp - detached temp vs fp32 state cotangent + boundaries "
                  f"(largest G with both; chunk={args.chunk_size})",
                  ["P", "G", "exact temp", "detached temp", "difference", "fp32 cotangent", "boundaries",
                   "difference - cot - bnd"])
        for p in ps:
            both = [g for g in gs
                    if cell("exact", p, g, "temp") is not None and cell("detached", p, g, "temp") is not None]
            if not both:
                continue
            g = both[-1]
            e, d = cell("exact", p, g, "temp"), cell("detached", p, g, "temp")
            kv32, c32 = geo["state_bytes"](p, f32=True)
            bnd = boundary_bytes(geo, p, min(args.chunk_size, p - 1))
            t.add(str(p), str(g), fmt_bytes(e), fmt_bytes(d), fmt_bytes(e - d), fmt_bytes(kv32 + c32),
                  fmt_bytes(bnd), fmt_bytes(e - d - kv32 - c32 - bnd))
        t.notes.append("the last column is what exact mode costs beyond the design budget's state-sized terms: "
                       "should be about one chunk's activations (+ recompute buffers), constant in P.")
        tables.append(t)

    if args.sweep_time:
        t = Table(f"Table 2d (sweep): median step time ({args.sweep_reps} runs after 1 warm-up) for "
                  f"P <= {args.sweep_time_max_p}", ["P", "mode", *g_cols, "x naive (largest G)"],
                  align="rl" + "r" * (len(g_cols) + 1))
        for p in [p for p in ps if p <= args.sweep_time_max_p]:
            for mode in modes:
                vals = [cell(mode, p, g, "median_s") for g in gs]
                gmax = next((g for g in reversed(gs) if cell(mode, p, g, "median_s") and
                             cell("naive", p, g, "median_s")), None)
                ratio = fmt_ratio(cell(mode, p, gmax, "median_s"), cell("naive", p, gmax, "median_s")) \
                    if gmax else "—"
                t.add(str(p), mode, *(fmt_time(v) for v in vals), ratio + (f" (G={gmax})" if gmax else ""))
        tables.append(t)
    compile_times = [r["lower_s"] + r["compile_s"] for r in results.values()]
    if compile_times:
        tables[0].notes.append(f"{len(compile_times)} cells compiled; lower+compile per cell median "
                               f"{statistics.median(compile_times):.1f} s, max {max(compile_times):.1f} s"
                               + (" (XLA backend optimisation level 0 for compile-only cells: halves "
                                  "compile time; memory_analysis moved < 0.1% where checked)"
                                  if args.sweep_fast_compile and any(not r.get("run") for r in results.values())
                                  else ""))
    return tables, list(results.values())
