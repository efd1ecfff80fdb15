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
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

MIB = 2**20
GIB = 2**30
PREFIX = "BENCH_JSON "
ALL_MODES = ("naive", "detached", "exact")
QUICK = dict(prompt_len=512, response_len=16, group_size=2, reps=2, chunk_size=128)
QUICK_SWEEP = dict(sweep_g=[1, 2], sweep_p=[256, 512])


# ---------------------------------------------------------------------------------------------------------------
# Child side: build the model, compile (and optionally run) one or more cells, print one JSON line per cell.


def _proc_status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak_rss() -> bool:
    """Reset the kernel's RSS high-water mark (VmHWM) so that the run's peak can be told from the compile's."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _trim_heap() -> None:
    """Return freed heap pages to the OS (XLA's compiler leaves hundreds of MiB of freed arenas resident)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _load_config(path: str | None):
    """--config: a config.json (class chosen by its model_type), "tiny-glm" (Glm52Config.tiny()), or the Qwen3.6
    tiny preset by default."""
    from longstraw_jax import models

    if path == "tiny-glm":
        return models.Glm52Config.tiny()
    if path:
        try:
            return models.config_from_hf(path)
        except (FileNotFoundError, ValueError) as e:
            raise SystemExit(f"--config {path}: {e}") from None
    return models.Qwen36Config.tiny()


def _make_batch(vocab: int, p: int, r: int, g: int, seed: int):
    import numpy as np

    from longstraw_jax import GroupBatch

    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, vocab, p, dtype=np.int32)
    responses = rng.integers(0, vocab, (g, r), dtype=np.int32)
    lengths = rng.integers(max(1, r // 2), r + 1, g)
    mask = (np.arange(r)[None, :] < lengths[:, None]).astype(np.float32)
    rewards = rng.random(g).astype(np.float32)
    return GroupBatch(prompt=prompt, responses=responses, mask=mask, rewards=rewards,
                      old_logprobs=None, ref_logprobs=None)


def _lowerable(mode: str):
    """(jitted function, static-argument layout) for a mode: call as fn.lower(model, params, batch, cfg[, ...])."""
    import jax

    from longstraw_jax import naive_grpo_grads
    from longstraw_jax.engine.local import jitted_grpo_grads

    if mode == "naive":
        return lambda model, params, batch, cfg, chunk: jax.jit(naive_grpo_grads, static_argnums=(0, 3)).lower(
            model, params, batch, cfg)
    # jitted_grpo_grads is jax.jit(static_argnums=(0, 3, 4, 5)); grpo_grads is the same call after host-side checks.
    return lambda model, params, batch, cfg, chunk: jitted_grpo_grads.lower(model, params, batch, cfg, mode, chunk)


def child_main(spec_json: str) -> None:
    spec = json.loads(spec_json)
    import jax
    import jax.numpy as jnp
    import numpy as np

    import longstraw_jax
    from longstraw_jax import GRPOConfig, models
    from longstraw_jax.grpo import validate_batch

    lib_file = longstraw_jax.__file__
    lib_digest = source_digest(os.path.dirname(lib_file))
    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[spec["dtype"]]
    cfg_model = _load_config(spec.get("config"))
    model = models.build(cfg_model)
    grpo_cfg = GRPOConfig()
    key = jax.random.key(spec.get("seed", 0))
    params_abs = jax.eval_shape(lambda k: model.init(k, dtype=dtype), key)
    params = None
    stop_above = spec.get("stop_above_bytes")

    for job in spec["jobs"]:
        mode, p, r, g, chunk = job["mode"], job["P"], job["R"], job["G"], job["chunk"]
        batch_np = _make_batch(cfg_model.vocab_size, p, r, g, spec.get("seed", 0))
        validate_batch(batch_np, cfg_model.vocab_size)
        batch_abs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch_np)
        if job.get("train"):
            out = _train_cell(job, model, dtype, key, batch_np, batch_abs, grpo_cfg)
            out.update(jax=jax.__version__, lib=lib_file, lib_digest=lib_digest, backend=jax.default_backend(),
                       device=jax.devices()[0].device_kind,
                       ru_maxrss_kib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
            print(PREFIX + json.dumps(out), flush=True)
            continue
        rss_base = _proc_status_kib("VmRSS")
        t0 = time.perf_counter()
        lowered = _lowerable(mode)(model, params_abs, batch_abs, grpo_cfg, chunk)
        t1 = time.perf_counter()
        compiled = lowered.compile()
        t2 = time.perf_counter()
        ma = compiled.memory_analysis()
        out = dict(job, argument=ma.argument_size_in_bytes, output=ma.output_size_in_bytes,
                   temp=ma.temp_size_in_bytes, alias=ma.alias_size_in_bytes,
                   code=ma.generated_code_size_in_bytes, lower_s=t1 - t0, compile_s=t2 - t1,
                   rss_base_kib=rss_base, rss_after_compile_kib=_proc_status_kib("VmRSS"))
        out["total"] = out["argument"] + out["output"] + out["temp"]
        limit = job.get("max_run_bytes")
        if job.get("run") and limit is not None and out["total"] > limit:
            out["skipped_run"] = f"compiled total {fmt_bytes(out['total'])} > run limit {fmt_bytes(limit)}"
        elif job.get("run"):
            print(PREFIX + json.dumps(dict(out, stage="compiled")), flush=True)  # survives a crash in the run
            if params is None:
                params = jax.block_until_ready(model.init(key, dtype=dtype))
            batch = jax.device_put(batch_np)
            jax.block_until_ready(batch)
            _trim_heap()
            out["hwm_reset"] = _reset_peak_rss()
            rss_before = _proc_status_kib("VmRSS")
            t = time.perf_counter()
            loss, grads, _ = jax.block_until_ready(compiled(params, batch))  # warm-up
            out["first_call_s"] = time.perf_counter() - t
            times = []
            for _ in range(job["reps"]):
                t = time.perf_counter()
                jax.block_until_ready(compiled(params, batch))
                times.append(time.perf_counter() - t)
            leaves = [np.asarray(x, np.float64) for x in jax.tree.leaves(grads)]
            out.update(times_s=times, median_s=statistics.median(times), loss=float(loss),
                       grad_norm=float(np.sqrt(sum(float(np.sum(x * x)) for x in leaves))),
                       rss_before_run_kib=rss_before, run_hwm_kib=_proc_status_kib("VmHWM"))
            del loss, grads
            out["rss_after_run_kib"] = _proc_status_kib("VmRSS")
        out["ru_maxrss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        out["jax"] = jax.__version__
        out["lib"] = lib_file
        out["lib_digest"] = lib_digest
        out["backend"] = jax.default_backend()
        out["device"] = jax.devices()[0].device_kind
        print(PREFIX + json.dumps(out), flush=True)
        del lowered, compiled
        if stop_above is not None and out["total"] > stop_above:
            break  # the jobs are in increasing G: larger ones only cost more


def _train_cell(job, model, dtype, key, batch_np, batch_abs, grpo_cfg) -> dict:
    """One whole trainer update (`train.jitted_train_step_donated`: grpo_grads + clipping + AdamW, trainable params
    and optimizer state donated, as the trainer runs it) for job["train"]: "full" (every parameter trains) or "lora"
    (adapters of job["lora"] = {rank, alpha, targets} on a frozen base: `lora.add_adapters` + `trainable.split`, as
    `trainer/components.py:prepare_training` and `trainer/loop.py:Trainer` do). Compiled memory, and unless job["run"]
    is false the median time."""
    import jax
    import numpy as np

    from longstraw_jax import train
    from longstraw_jax.adapters import lora, trainable

    params = model.init(key, dtype=dtype)
    predicate = None
    if job["train"] == "lora":
        spec = job["lora"]
        paths = lora.resolve_targets(params, spec["targets"])
        params = lora.add_adapters(params, paths, spec["rank"], spec["alpha"], jax.random.fold_in(key, 0x10A))
        predicate = trainable.adapter_leaf
    part, frozen = (params, None) if predicate is None else trainable.split(params, predicate)
    optimizer = train.make_optimizer(1e-4)
    opt_state = optimizer.init(part)
    abstract = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
    step = train.jitted_train_step_donated
    count = lambda tree: sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))
    t0 = time.perf_counter()
    lowered = step.lower(model, abstract(part), abstract(opt_state), batch_abs, optimizer, grpo_cfg, job["mode"],
                         job["chunk"], None, None, None if frozen is None else abstract(frozen))
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    ma = compiled.memory_analysis()
    out = dict(job, argument=ma.argument_size_in_bytes, output=ma.output_size_in_bytes, temp=ma.temp_size_in_bytes,
               alias=ma.alias_size_in_bytes, code=ma.generated_code_size_in_bytes, lower_s=t1 - t0,
               compile_s=t2 - t1, trainable_params=count(part), params=count(params))
    out["total"] = out["argument"] + out["output"] + out["temp"] - out["alias"]
    if job.get("run"):
        batch = jax.device_put(batch_np)
        times = []
        for i in range(job["reps"] + 1):  # one warm-up call, then the timed ones
            t = time.perf_counter()
            part, opt_state, metrics = jax.block_until_ready(compiled(part, opt_state, batch, None, frozen))
            if i:
                times.append(time.perf_counter() - t)
        out.update(times_s=times, median_s=statistics.median(times), loss=float(metrics["loss"]),
                   grad_norm=float(metrics["grad_norm"]))
    return out


# ---------------------------------------------------------------------------------------------------------------
# Parent side: spawn children, collect, print tables.


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def source_digest(package_dir: str) -> str:
    """sha1 over the package's .py files (relative path + content): which library source a number came from."""
    h = hashlib.sha1()
    for root, dirs, files in os.walk(package_dir):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(root, name)
            h.update(os.path.relpath(path, package_dir).encode() + b"\0")
            with open(path, "rb") as f:
                h.update(f.read() + b"\0")
    return h.hexdigest()[:10]


def make_snapshot() -> str:
    """Copy longstraw_jax/ to a temporary directory that every child imports from (PYTHONPATH first), so that
    all modes of one run measure the same source even while the working tree is being edited."""
    snap = tempfile.mkdtemp(prefix="bench_step_lib_")
    shutil.copytree(os.path.join(REPO, "longstraw_jax"), os.path.join(snap, "longstraw_jax"),
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return snap


def spawn(jobs: list[dict], args, stop_above_bytes: int | None = None, env_extra: dict | None = None) -> list[dict]:
    spec = dict(jobs=jobs, dtype=args.dtype, config=args.config, seed=args.seed, stop_above_bytes=stop_above_bytes)
    cmd = [sys.executable, os.path.abspath(__file__), "--one", json.dumps(spec)]
    env = dict(os.environ)
    if args.snapshot_dir:
        env["PYTHONPATH"] = os.pathsep.join(x for x in (args.snapshot_dir, env.get("PYTHONPATH")) if x)
    for k, v in (env_extra or {}).items():
        env[k] = (env.get(k, "") + " " + v).strip() if k == "XLA_FLAGS" else v
    t = time.perf_counter()
    label = ", ".join(f"{j['mode']}{' ' + j['train'] if j.get('train') else ''} P={j['P']} G={j['G']}"
                      for j in jobs)
    _log(f"  child: {label} ...")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.child_timeout)
    except subprocess.TimeoutExpired as e:
        _log(f"  child timed out after {args.child_timeout} s: {label}")
        stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return [dict(r, failed=f"timed out after {args.child_timeout:.0f} s") for r in _parse(stdout)]
    results = _parse(proc.stdout)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-25:])
        why = "killed (SIGKILL: out of memory?)" if proc.returncode == -9 else f"rc={proc.returncode}"
        _log(f"  child failed ({why}) after {wall:.0f} s: {label}\n{tail}")
        results = [dict(r, failed=why) if r.get("stage") == "compiled" else r for r in results]
    for res in results:
        msg = f"    {res['mode']:8s} P={res['P']:<7d} G={res['G']:<3d} compiled {fmt_bytes(res['total'])} " \
              f"(lower {res['lower_s']:.1f} s, compile {res['compile_s']:.1f} s)"
        if "median_s" in res:
            msg += f", median {fmt_time(res['median_s'])}"
        if res.get("skipped_run") or res.get("failed"):
            msg += f", not timed: {res.get('skipped_run') or res.get('failed')}"
        _log(msg)
    _log(f"  child done in {wall:.0f} s")
    return results


def _parse(stdout: str) -> list[dict]:
    """Result lines of a child; a cell's final line replaces its earlier "compiled" line."""
    cells = {}
    for line in stdout.splitlines():
        if line.startswith(PREFIX):
            r = json.loads(line[len(PREFIX):])
            cells[(r["mode"], r["P"], r["R"], r["G"], r["chunk"], r.get("train"))] = r
    return list(cells.values())


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def fmt_bytes(b: float | None) -> str:
    if b is None:
        return "—"
    if abs(b) >= GIB:
        return f"{b / GIB:.2f} GiB"
    if abs(b) >= 10 * MIB:
        return f"{b / MIB:.0f} MiB"
    return f"{b / MIB:.1f} MiB"


def fmt_time(s: float | None) -> str:
    if s is None:
        return "—"
    if s >= 10:
        return f"{s:.1f} s"
    if s >= 1:
        return f"{s:.2f} s"
    return f"{s * 1e3:.1f} ms"


def fmt_ratio(x: float | None, base: float | None) -> str:
    if x is None or not base:
        return "—"
    r = x / base
    return f"{r:.2f}x" if r >= 0.01 else f"{r:.3f}x"


class Table:
    def __init__(self, title: str, columns: list[str], align: str | None = None):
        self.title, self.columns, self.rows, self.notes = title, columns, [], []
        self.align = align or "l" + "r" * (len(columns) - 1)

    def add(self, *cells):
        self.rows.append([str(c) for c in cells])

    def text(self) -> str:
        widths = [max(len(c), *(len(r[i]) for r in self.rows)) if self.rows else len(c)
                  for i, c in enumerate(self.columns)]

        def line(cells):
            return "  ".join(c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(cells, widths, self.align))

        out = [self.title, line(self.columns), "  ".join("-" * w for w in widths)]
        out += [line(r) for r in self.rows]
        out += [f"  {n}" for n in self.notes]
        return "\n".join(out)

    def markdown(self) -> str:
        sep = ["---" if a == "l" else "---:" for a in self.align]
        out = [f"**{self.title}**", "", "| " + " | ".join(self.columns) + " |", "| " + " | ".join(sep) + " |"]
        out += ["| " + " | ".join(r) + " |" for r in self.rows]
        if self.notes:
            out.append("")
            out += [f"- {n}" for n in self.notes]
        return "\n".join(out)


def geometry(args):
    """Header facts computed in the parent from abstract shapes (nothing is allocated)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from longstraw_jax import models

    cfg = _load_config(args.config)
    model = models.build(cfg)
    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[args.dtype]
    params = jax.eval_shape(lambda k: model.init(k, dtype=dtype), jax.random.key(0))
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    param_bytes = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(params))

    def state_bytes(p, f32=False):
        """(appended bytes: KV / latent rows, carried bytes: GDN state) of a state for a P-token prompt."""
        st = jax.eval_shape(lambda: model.init_state(p - 1, dtype))
        size = lambda x: int(np.prod(x.shape)) * (max(4, x.dtype.itemsize) if f32 else x.dtype.itemsize)
        carried = sum(size(x) for x in jax.tree.leaves(model.carried(st)))
        return sum(size(x) for x in jax.tree.leaves(st)) - carried, carried

    desc = f"{models.describe(cfg)}; {n_params / 1e6:.2f}M params ({fmt_bytes(param_bytes)})"
    kv1, carried = state_bytes(1025)
    kv_per_token = kv1 / 1024
    return dict(model=desc, state_bytes=state_bytes, kv_per_token=kv_per_token, carried=carried,
                param_bytes=param_bytes, jax=jax.__version__, backend=jax.default_backend(),
                device=jax.devices()[0].device_kind, n_devices=len(jax.devices()))


def _git_rev() -> str:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "longstraw_jax"],
                               cwd=root, capture_output=True, text=True, timeout=10).stdout.strip()
        return (rev or "?") + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "?"


def header(args, geo) -> str:
    label = os.path.basename(args.config) if args.config else "tiny preset"
    import longstraw_jax

    where = f"snapshot {source_digest(os.path.dirname(longstraw_jax.__file__))}" if args.snapshot_dir else "live tree"
    return (f"longstraw_jax {_git_rev()} ({where}) | jax {geo['jax']} | "
            f"backend {geo['backend']} ({geo['device']}, {geo['n_devices']} device(s), {os.cpu_count()} CPUs) | "
            f"model [{label}]: {geo['model']} | dtype {args.dtype} | "
            f"prompt state {geo['kv_per_token']:.0f} B/token KV + {fmt_bytes(geo['carried'])} GDN")


def boundary_bytes(geo, p: int, chunk: int) -> int:
    """Exact mode keeps the GDN carried state before every chunk: ceil((P-1) / chunk) copies."""
    return -(-(p - 1) // chunk) * geo["carried"]


def table_modes(args, geo) -> tuple[Table, list[dict]]:
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


def _mem_total_bytes() -> int:
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
    args.snapshot_dir = make_snapshot() if args.snapshot else None
    if args.snapshot_dir:
        sys.path.insert(0, args.snapshot_dir)
    try:
        _main(args, argv, start)
    finally:
        if args.snapshot_dir:
            shutil.rmtree(args.snapshot_dir, ignore_errors=True)


def _main(args, argv, start) -> None:
    geo = geometry(args)
    head = header(args, geo)
    _log(head)
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
