"""The parent side of tools/bench_step.py's processes: the snapshot of the package the children import, one child per
list of cells (`spawn`), and the run's header (geometry of the model, library revision, device). The parent compiles
nothing it measures: each child is a fresh `bench_step.py --one SPEC` process (tools/bench_harness.py).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time

import bench_harness
from bench_step_child import load_config
from bench_step_format import fmt_bytes, fmt_time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_step.py")  # what each child runs


def make_snapshot() -> str:
    """Copy longstraw_jax/ to a temporary directory that every child imports from (PYTHONPATH first), so that
    all modes of one run measure the same source even while the working tree is being edited."""
    snap = tempfile.mkdtemp(prefix="bench_step_lib_")
    shutil.copytree(os.path.join(REPO, "longstraw_jax"), os.path.join(snap, "longstraw_jax"),
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return snap


def spawn(jobs: list[dict], args, stop_above_bytes: int | None = None, env_extra: dict | None = None) -> list[dict]:
    """Run the cells `jobs` (in this order) in one child; its results, one per cell it reached ("failed": why a
    cell that compiled was not finished: the child timed out, crashed or was killed). `stop_above_bytes`: the child
    stops after a cell compiled above it; `env_extra`: environment variables for it (XLA_FLAGS appended to)."""
    spec = dict(jobs=jobs, dtype=args.dtype, config=args.config, seed=args.seed, stop_above_bytes=stop_above_bytes)
    env = dict(os.environ)
    if args.snapshot_dir:
        env["PYTHONPATH"] = os.pathsep.join(x for x in (args.snapshot_dir, env.get("PYTHONPATH")) if x)
    for k, v in (env_extra or {}).items():
        env[k] = (env.get(k, "") + " " + v).strip() if k == "XLA_FLAGS" else v
    t = time.perf_counter()
    label = ", ".join(f"{j['mode']}{' ' + j['train'] if j.get('train') else ''} P={j['P']} G={j['G']}"
                      for j in jobs)
    log(f"  child: {label} ...")
    child = bench_harness.run_child(SCRIPT, spec, args.child_timeout, env=env)
    results = _cells(child.rows)
    if child.returncode is None:
        log(f"  child timed out after {args.child_timeout} s: {label}")
        return [dict(r, failed=f"timed out after {args.child_timeout:.0f} s") for r in results]
    wall = time.perf_counter() - t
    if child.returncode != 0:
        tail = "\n".join(child.stderr.strip().splitlines()[-25:])
        why = "killed (SIGKILL: out of memory?)" if child.returncode == -9 else f"rc={child.returncode}"
        log(f"  child failed ({why}) after {wall:.0f} s: {label}\n{tail}")
        results = [dict(r, failed=why) if r.get("stage") == "compiled" else r for r in results]
    for res in results:
        msg = f"    {res['mode']:8s} P={res['P']:<7d} G={res['G']:<3d} compiled {fmt_bytes(res['total'])} " \
              f"(lower {res['lower_s']:.1f} s, compile {res['compile_s']:.1f} s)"
        if "median_s" in res:
            msg += f", median {fmt_time(res['median_s'])}"
        if res.get("skipped_run") or res.get("failed"):
            msg += f", not timed: {res.get('skipped_run') or res.get('failed')}"
        log(msg)
    log(f"  child done in {wall:.0f} s")
    return results


def _cells(rows: list[dict]) -> list[dict]:
    """A child's result rows, one per cell: a cell's final row replaces its earlier "compiled" one."""
    cells = {}
    for r in rows:
        cells[(r["mode"], r["P"], r["R"], r["G"], r["chunk"], r.get("train"))] = r
    return list(cells.values())


def log(msg: str) -> None:
    """Progress on stderr (stdout holds the tables)."""
    print(msg, file=sys.stderr, flush=True)


def geometry(args):
    """Header facts computed in the parent from abstract shapes (nothing is allocated)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from longstraw_jax import models

    cfg = load_config(args.config)
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
    """This checkout's short revision, "+dirty" when longstraw_jax/ has uncommitted changes; "?" without git."""
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "longstraw_jax"],
                               cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
        return (rev or "?") + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "?"


def header(args, geo) -> str:
    """The run's one-line header: library revision and source (the snapshot's digest, as the children report it),
    JAX, device, model geometry, dtype."""
    from longstraw_jax.trainer.agreement import source_digest

    label = os.path.basename(args.config) if args.config else "tiny preset"
    snapshot = os.path.join(args.snapshot_dir, "longstraw_jax") if args.snapshot_dir else None
    where = f"snapshot {source_digest(snapshot)}" if snapshot else "live tree"
    return (f"longstraw_jax {_git_rev()} ({where}) | jax {geo['jax']} | "
            f"backend {geo['backend']} ({geo['device']}, {geo['n_devices']} device(s), {os.cpu_count()} CPUs) | "
            f"model [{label}]: {geo['model']} | dtype {args.dtype} | "
            f"prompt state {geo['kv_per_token']:.0f} B/token KV + {fmt_bytes(geo['carried'])} GDN")
