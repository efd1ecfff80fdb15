"""The XLA path's gated delta rule chunk: forward and gradient time per chunk size, per head width, on this backend.

    .venv/bin/python tools/bench_gated_delta.py                       # T 1024, dk = dv 16 / 64 / 128, chunks 8-64
    .venv/bin/python tools/bench_gated_delta.py --dims 128 --heads 8 --tokens 4096 --markdown

What `Qwen36Config.gdn_chunk_for("xla")` is chosen by: `ops.gated_delta.gated_delta_rule_chunked` on q, k [T, H, dk]
(unit rows), v [T, H, dv], g = log sigmoid(x + 4), beta = sigmoid(x) and a state [H, dk, dv], float32, jitted once per
(width, chunk); the forward, and the gradient of sum(o * cos o) + sum(state^2) in all six inputs. Medians of --reps
calls after one warm-up; every chunk of a width in turn per rep (so a load spike hits them alike); the ratio is the
chunk's median over the largest chunk's, in one run. Outputs agree across chunks up to float32 round-off (the max
difference from the largest chunk is printed: the same recurrence, chunked differently).
"""
from __future__ import annotations

import argparse
import statistics
import time

from bench_sampling import render_table


def _int_list(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", "-T", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=4, help="value heads H (q/k already expanded to them)")
    ap.add_argument("--dims", type=_int_list, default=[16, 64, 128], help="head widths dk = dv (comma list)")
    ap.add_argument("--chunks", type=_int_list, default=[8, 16, 32, 64], help="chunk sizes (comma list)")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--markdown", action="store_true")
    return ap.parse_args(argv)


def inputs(tokens: int, heads: int, dim: int, seed: int = 0):
    """(q, k, v, g, beta, state) as the model hands them to the core: unit q / k rows (q scaled by dk^-1/2)."""
    import jax
    import jax.numpy as jnp

    keys = iter(jax.random.split(jax.random.key(seed), 6))
    normal = lambda *shape: jax.random.normal(next(keys), shape, jnp.float32)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
    return (unit(normal(tokens, heads, dim)) * dim**-0.5, unit(normal(tokens, heads, dim)), normal(tokens, heads, dim),
            jax.nn.log_sigmoid(normal(tokens, heads) + 4.0), jax.nn.sigmoid(normal(tokens, heads)),
            0.1 * normal(heads, dim, dim))


def programs(args_, chunk: int):
    """(forward, gradient) compiled for `args_` at `chunk`."""
    import jax
    import jax.numpy as jnp

    from longstraw_jax.ops.gated_delta import gated_delta_rule_chunked

    core = lambda *a: gated_delta_rule_chunked(*a, chunk_size=chunk)

    def loss(*a):
        o, state = core(*a)
        return jnp.sum(o * jnp.cos(o)) + jnp.sum(state**2)

    return tuple(jax.jit(f).lower(*args_).compile() for f in (core, jax.grad(loss, argnums=tuple(range(6)))))


def measure(args) -> list[dict]:
    """One row per (width, chunk): median forward / gradient seconds, ratios to the largest chunk, max differences."""
    import jax
    import jax.numpy as jnp

    rows = []
    for dim in args.dims:
        args_ = inputs(args.tokens, args.heads, dim)
        compiled = {c: programs(args_, c) for c in args.chunks}
        results = {c: [jax.block_until_ready(p(*args_)) for p in compiled[c]] for c in args.chunks}
        times = {(c, i): [] for c in args.chunks for i in range(2)}
        for _ in range(args.reps):
            for c in args.chunks:
                for i, program in enumerate(compiled[c]):
                    start = time.perf_counter()
                    jax.block_until_ready(program(*args_))
                    times[c, i].append(time.perf_counter() - start)
        base = max(args.chunks)
        for c in args.chunks:
            diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(results[c]),
                                                                      jax.tree.leaves(results[base])))
            forward, gradient = (statistics.median(times[c, i]) for i in range(2))
            rows.append(dict(dim=dim, chunk=c, forward_s=forward, gradient_s=gradient,
                             forward_ratio=forward / statistics.median(times[base, 0]),
                             gradient_ratio=gradient / statistics.median(times[base, 1]), max_diff=diff))
    return rows


def render(rows: list[dict], markdown: bool) -> str:
    head = ["dk = dv", "chunk", "forward ms", "/ largest", "gradient ms", "/ largest", "max |diff|"]
    body = [[str(r["dim"]), str(r["chunk"]), f"{r['forward_s'] * 1e3:.2f}", f"{r['forward_ratio']:.2f}x",
             f"{r['gradient_s'] * 1e3:.2f}", f"{r['gradient_ratio']:.2f}x", f"{r['max_diff']:.1e}"] for r in rows]
    return render_table(head, body, markdown)


def main(argv=None) -> None:
    args = parse_args(argv)
    import jax

    print(f"gated delta rule, XLA path: T {args.tokens}, H {args.heads}, float32, medians of {args.reps}, "
          f"backend {jax.default_backend()}, jax {jax.__version__}")
    print(render(measure(args), args.markdown))


if __name__ == "__main__":
    main()
