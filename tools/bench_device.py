"""Device benchmark: capture throughput (tokens/s, MFU), train_step times and peak memory next to the planner's.

    .venv/bin/python tools/bench_device.py --json bench.json # on an accelerator: the issue-41 run, <= 8 minutes
    .venv/bin/python tools/bench_device.py --tiny            # tiny sizes (the default on CPU): a smoke run
    .venv/bin/python tools/bench_device.py --kernels xla --measure capture --capture-len 1M --json bench.json

On one device, with the public API, it measures
- **capture**: `model.capture(params, tokens, chunk_size)` of N tokens (the prompt[:-1] a step captures) for a model
  of the 27B config's widths (hidden 5120, 24 query / 4 KV heads of 256, GDN 16 k / 48 v heads of 128, MLP 17408,
  vocabulary 248320) with only `--blocks` blocks of its LLLF pattern (4 layers each), bf16. N doubles from
  --capture-start while the compiled program fits 90% of the device's memory, N <= --capture-max and the next
  capture is predicted to finish within the time budget (or N = --capture-len). Reported: median seconds, tokens/s,
  model TFLOP/s and MFU against the device's peak dense bf16 FLOP/s (its datasheet entry in
  `longstraw_jax.capacity.hardware`, `for_device_kind`; a device without one, XLA:CPU included: "n/a");
- **detached / exact**: `train.train_step` (jitted with params and optimizer state donated, as the planner compiles
  it) on one group of G branches of R tokens after a prompt of --step-len tokens: median seconds and tokens/s. It
  trains every parameter (`--train full`, --tiny's default) or LoRA adapters of rank LORA_RANK on every matrix
  (`--train lora`, the full size's default: XLA's own GPU compile of the 2-block model's full-parameter exact step at
  32K needs 92 GiB with the kernels and 103 GiB without, more than an H100 has; with LoRA 54 GiB without the kernels,
  tools/gpu_compile.py). A step whose compiled memory is over FITS of the device's limit is a failed row, not run;
  the children may take GPU_MEMORY_FRACTION of a GPU (XLA_PYTHON_CLIENT_MEM_FRACTION, unless the environment sets
  it: JAX's own default, 75 %, would leave an H100 60 GB);
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

**Kernels** (issue 41; `--kernels xla,pallas`, the default on an accelerator): every capture and train_step runs
once per softmax-attention implementation (`ops.kernels`: the XLA path, the Pallas flash kernels), each in its own
child, and a table gives XLA / Pallas per measurement next to the time model's estimate of the Pallas program (the
XLA program costed with the kernels' FLOPs and bytes, `capacity.hlo.KernelModel`). First, the **kernel table**
(`kernel_table`): the flash-attention kernel against the XLA path at Qwen3.6-27B's attention shapes (24 query / 4 KV
heads of 256, bf16; `KERNEL_SHAPES`) for a chunk over itself, a chunk over a 32K cache, 8 decoded tokens over a 64K
cache and a decode step of 8 branches over one 64K cache (vmapped, as the sampler runs it), causal, forward and
forward + backward: the largest error relative to the XLA output's scale, both medians,
TFLOP/s by the analytic count (forward 4 x visible pairs x Hq x D; the backward 2.5x the forward) and the fraction of
the device's bf16 peak. After the attention rows, the same columns for the chunked Gated DeltaNet
(`ops.flash_gated_delta` vs `ops.gated_delta.gated_delta_rule_chunked` at Qwen3.6-27B's GDN: 48 value heads,
dk = dv = 128, chunks of 32, float32, 8K and 32K tokens; `GDN_SHAPES`; FLOPs the time model's kernel count,
`gated_delta_flops`) and GLM-5.2's sparse latent attention (`ops.flash_mla` vs `ops.mla`: 64 heads, 512 + 64
channels, 2048 selected rows a query, bf16; 4K queries over a 64K cache, 8 decoded; `LATENT_SHAPES`; FLOPs
`latent_flops`), each set in its own child (at most KERNEL_SET_S); a failing case is a row saying so. On CPU
(`--tiny`) the kernels run interpreted at the tiny presets' shapes, the four sets in one child: a smoke test.

**Tiles** (the fourth set, `tiles_table`, its own child of at most TILES_S): the flash kernels' launch shapes
(`ops.flash_attention.FlashTiles`: per kernel block_q, block_k, num_warps, num_stages) at the chunk over itself,
TILE_CANDIDATES (the default first): each forward candidate's forward, each (dQ, dK / dV) candidate's forward +
backward; and at 8 decoded tokens over the cache, the forward with its keys split over programs below each
`min_programs` value (1: never split); each against the XLA path's result (measured once per case and pass); a candidate
that does not fit the GPU (shared memory, registers) is a failed row. The JSON's "fastest_tiles" names the fastest
of each sweep and how much slower the default is: what the library's DEFAULT_TILES are to be set from.

The GPU day's run (one device, <= 8 minutes; defaults on an accelerator: `--blocks 2`, captures of 64K, 32K and 128K
tokens, the exact step at 32K, both implementations): the measurements run in priority order (kernel table, the 64K
captures, the tiles, the other captures, steps) within `--budget-s` (420 s); one running past the budget is killed
and recorded as failed, one that cannot start with MIN_CHILD_S left is recorded as skipped. The JSON summary holds
the device kind, the jax version, the kernel table, every row, the XLA vs Pallas comparison, the failed / skipped
measurements, the fastest tiles and the **targets** (attention forward >= 50 % of the bf16 peak, on H100, with the
fastest forward tiles' fraction beside it; capture >= 2x the XLA path at 64K tokens), each pass / fail / not-run.

Markdown tables (the kernel table; medians and ratios; the time model; XLA vs Pallas) on stdout; `--json FILE` writes
every measurement, rewritten after each one ("complete": false) so that a run killed from outside keeps what it
measured, and at the end with the targets and the comparison ("complete": true). The parent process only
orchestrates (no JAX backend of its own); each measurement is this script run with a hidden `--one` flag
(tools/bench_harness.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import subprocess
import sys
import time

import bench_harness

from longstraw_jax.common.validation import SIZE_RULE, size_arg, sizes_arg

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # configs/ are found under it
GIB = 2**30
FITS = 0.9  # a program runs when its compiled memory_analysis total is at most this fraction of the device's limit
LORA_RANK = 64  # --train lora: adapters of this rank (alpha 2x) on every matrix
GPU_MEMORY_FRACTION = 0.92  # XLA_PYTHON_CLIENT_MEM_FRACTION for the children, unless the environment sets it
FULL_SIZE = dict(config="configs/qwen3.6-27b.json", dtype="bfloat16", capture_start=65536, capture_max=4 * 2**20,
                 step_len=32768, group_size=4, response_len=256, chunk_size=8192, reps=3, blocks=2, modes="exact",
                 kernels="xla,pallas", capture_lens=[65536, 32768, 131072], planner=False, train="lora")
TINY = dict(config="configs/qwen3.6-tiny.json", dtype="float32", capture_start=256, capture_max=512,
            step_len=256, group_size=2, response_len=8, chunk_size=64, reps=2, blocks=1, modes="detached,exact",
            kernels="xla", capture_lens=[], planner=True, train="full")
# The kernel table (issue 41): flash attention at Qwen3.6-27B's attention shapes (24 query / 4 KV heads of 256,
# bf16) on an accelerator, the tiny preset's (4 / 2 heads of 32, float32, interpreted kernels) on CPU. Each case:
# (label, T queries, S keys[, N branches]); the queries are the last T positions of the S keys, causal (a capture chunk
# over itself, a chunk over a cache ending with it, tokens decoded after a cache); with N, a decode step of N branches
# over one shared cache (`jax.vmap` over N single queries at position S - 1, the cache unbatched: the sampler's form).
KERNEL_SHAPES = dict(full=dict(heads=24, kv_heads=4, head_dim=256, dtype="bfloat16", reps=5,
                               cases=[("chunk over itself", 8192, 8192), ("chunk over a 32K cache", 4096, 32768),
                                      ("8 decoded over a 64K cache", 8, 65536),
                                      ("8 branches' tokens over one 64K cache", 1, 65536, 8)]),
                     tiny=dict(heads=4, kv_heads=2, head_dim=32, dtype="float32", reps=2,
                               cases=[("chunk over itself", 64, 64), ("8 decoded over a cache", 8, 256),
                                      ("4 branches' tokens over one cache", 1, 256, 4)]))
# The GDN and sparse latent attention rows of the kernel table, after the attention rows: the shapes are the configs'
# (GDN: value heads, dk, dv, chunk of `config`, here Qwen3.6-27B's 48 heads of 128 x 128 in chunks of 32, float32;
# latent: GLM-5.2's heads, kv_lora_rank + qk_rope_head_dim, index_topk, query block, bf16), the cases these. GDN:
# (label, T tokens); latent: (label, T queries, S cached rows), the queries at positions S.. S + T - 1.
GDN_SHAPES = dict(full=dict(config="configs/qwen3.6-27b.json", reps=3, cases=[("8K tokens", 8192),
                                                                                ("32K tokens", 32768)]),
                  tiny=dict(config="configs/qwen3.6-tiny.json", reps=2, cases=[("a padded tail", 100)]))
LATENT_SHAPES = dict(full=dict(config="configs/glm-5.2.json", dtype="bfloat16", reps=3,
                               cases=[("4K queries over a 64K cache", 4096, 65536),
                                      ("8 decoded over a 64K cache", 8, 65536)]),
                     tiny=dict(config="configs/glm-5.2-tiny.json", dtype="float32", reps=2,
                               cases=[("32 queries over a cache", 32, 128)]))
# The flash-attention kernels' launch shapes tried at the first KERNEL_SHAPES case (`ops.flash_attention.KernelTiles`:
# block_q, block_k, num_warps, num_stages; the first of each list is the library's default): forward tiles, timed by
# the forward; (dQ tiles, dK / dV tiles), timed by forward + backward with the default forward. At head dim 256 a
# [64, 256] float32 accumulator is 64 registers a thread at 8 warps (dK / dV holds two): which tiles fit the
# registers and the shared memory (q, and num_stages x k, v tiles), and which is fastest, only the device can say.
# "decode": `FlashTiles.min_programs` values at the first decode case (8 decoded tokens' forward; 1: keys never split).
TILE_CANDIDATES = dict(
    full=dict(forward=[(64, 64, 8, 2), (128, 64, 8, 2), (128, 64, 16, 2), (128, 32, 8, 2), (64, 32, 8, 3),
                       (64, 64, 4, 2)],
              backward=[((64, 64, 8, 2), (64, 64, 8, 2)), ((64, 32, 8, 2), (64, 32, 8, 2)),
                        ((128, 32, 8, 2), (32, 32, 4, 2)), ((64, 32, 8, 2), (32, 64, 8, 2)),
                        ((64, 32, 4, 3), (32, 32, 4, 3))],
              decode=[128, 1, 512]),
    tiny=dict(forward=[(64, 64, 4, 2), (32, 16, 4, 2)], backward=[((64, 64, 4, 2), (64, 64, 4, 2)),
                                                                  ((16, 32, 4, 2), (32, 16, 4, 2))],
              decode=[128, 1]))
TILE_SWEEPS = ("forward", "decode", "backward")  # the tiles table's parts in order (the costliest compiles last)
KERNEL_SETS = ("attention", "gated_delta", "sparse_latent", "attention_tiles")  # the kernel table's children, in
# this order (the tiles after the first capture length's pair; --tiny: one child for all, the smoke's start-ups saved)
KERNEL_SET_S = 90.0  # at most this long for the GDN's or the latent attention's child (attention: the budget's)
TILES_S = 100.0  # ... and for the tiles' child (each candidate compiles its kernels: a few seconds each)
BACKWARD_FLOPS = 2.5  # the backward's FLOPs per forward FLOP (FlashAttention-2's count: 5 matmuls against 2)
TARGET_ATTENTION_PEAK = 0.5  # issue 41: attention forward >= 50 % of the bf16 peak (H100)
TARGET_CAPTURE_SPEEDUP, TARGET_CAPTURE_TOKENS = 2.0, 65536  # ... and the capture >= 2x the XLA path's at 64K
MIN_CHILD_S = 20.0  # a measurement is not started with less of the budget left (recorded as skipped)


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


def bench_config(path: str, blocks: int, kernels: str = "xla"):
    """The config at `path` (HF config.json) with only `blocks` copies of its repeating layer pattern, its softmax
    attention run by `kernels` ("xla" or "pallas": `ops.kernels`)."""
    from longstraw_jax import models

    cfg = models.config_from_hf(os.path.join(ROOT, path) if not os.path.isabs(path) else path)
    if not isinstance(blocks, int) or blocks < 1 or blocks > cfg.num_blocks:
        raise ValueError(f"--blocks {blocks!r} must be in [1, {cfg.num_blocks}] (the config's blocks)")
    return dataclasses.replace(cfg, num_hidden_layers=blocks * len(cfg.block_pattern),
                               layer_types=cfg.block_pattern * blocks, kernels=kernels)


def lora_split(params, evaluate=None):
    """(the trainable LoRA adapters of rank LORA_RANK on every matrix, the frozen base) of `params`, as the trainer
    splits them (`trainable.split`); evaluate(fn, *args): how the adapters are made (default: a jitted call, for
    arrays; `jax.eval_shape` for shapes)."""
    import jax

    from longstraw_jax.adapters import lora, trainable

    paths = lora.resolve_targets(params, "all")
    evaluate = evaluate or (lambda fn, *args: jax.jit(fn)(*args))
    with_adapters = evaluate(lambda p, key: lora.add_adapters(p, paths, LORA_RANK, 2.0 * LORA_RANK, key), params,
                             jax.random.key(3))
    return trainable.split(with_adapters, trainable.adapter_leaf)


def visible_pairs(queries: int, keys: int) -> int:
    """(query, key) pairs a causal query sees when the T queries are the last positions of the S keys:
    sum over t of min(S - T + t + 1, S)."""
    first = keys - queries + 1  # keys the first query sees
    return queries * first + queries * (queries - 1) // 2 if first > 0 else \
        sum(max(0, min(keys - queries + t + 1, keys)) for t in range(queries))


def attention_flops(queries: int, keys: int, heads: int, head_dim: int) -> dict[str, float]:
    """Analytic FLOPs of one causal attention call (the kernel table's rule): forward 4 x visible pairs x Hq x D
    (QK^T and PV), backward BACKWARD_FLOPS (2.5) x the forward (dQ, dK, dV and dP: 5 matmuls against 2; the kernels'
    recomputation of QK^T and P not counted): {"forward", "forward_backward"}."""
    forward = 4.0 * visible_pairs(queries, keys) * heads * head_dim
    return dict(forward=forward, forward_backward=forward * (1 + BACKWARD_FLOPS))


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


def with_time_model(row: dict, compiled, device, kernel_model=None) -> dict:
    """`row` (a measurement with its median "seconds") plus `time_model` of the executable that ran and
    "model_s" (the estimate) and "model_ratio" (measured / estimated), None without a hardware entry. With
    `kernel_model` (an `hlo.Kernels`; the XLA path's rows) also "model_kernels_s": the same program's estimate
    with its attention and GDN costed as the Pallas kernels (`capacity/hlo/kernels.py`), what the Pallas row is compared
    with (a program that ran the kernels holds them as custom calls of no FLOPs: its own estimate leaves them out)."""
    from longstraw_jax.capacity.hardware import breakdown, for_device
    from longstraw_jax.capacity.hlo import program_cost

    row.update(time_model(compiled, device))
    row["model_s"] = row["model_terms"]["total"] if row["model_terms"] else None
    row["model_ratio"] = row["seconds"] / row["model_s"] if row["model_s"] else None
    if kernel_model is not None:
        hw = for_device(device.device_kind, device.platform)
        try:  # the measurement is kept whatever the model makes of this backend's HLO
            cost = program_cost(compiled, kernels=kernel_model)
        except ValueError as e:
            row.update(model_kernels_cost=None, model_kernels_s=None, model_kernels_error=str(e)[:1000])
            return row
        row["model_kernels_cost"] = cost.as_dict()
        row["model_kernels_s"] = None if hw is None else breakdown(cost, hw)["total"]
    return row


class _Child:
    def __init__(self, opts: dict):
        import jax

        from longstraw_jax import models, sharding

        self.jax, self.opts = jax, opts
        self.cfg = bench_config(opts["config"], opts["blocks"], opts.get("impl", "xla"))
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

    def kernel_model(self):
        """The time model's Kernels for the XLA path's rows (softmax attention and the chunked GDN; None for the
        Pallas path's)."""
        from longstraw_jax.capacity.hlo import Kernels

        if self.cfg.kernels != "xla":
            return None
        return Kernels.for_config(self.cfg, self.jax.numpy.dtype(self.opts["dtype"]).itemsize)

    def planner(self, response_len: int):
        from longstraw_jax.capacity import Planner

        return Planner(self.cfg, self.opts["mesh"] or "1x1", self.opts["dtype"], response_len, self.opts["chunk_size"],
                       devices=self.jax.devices()[:1] if not self.opts["mesh"] else None,
                       train_mode=self.opts["train"], lora_rank=LORA_RANK)

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
            if limit and memory["total"] > FITS * limit:
                if last is None:
                    raise RuntimeError(f"capturing {n:,} tokens needs {memory['total'] / GIB:.1f} GiB > {FITS:.0%} "
                                       f"of the device's {limit / GIB:.1f} GiB: lower --capture-start / --capture-len")
                break  # the doubled capture would not fit: keep the last one
            jax_out = compiled(self.params, tokens)  # warm-up
            self.jax.block_until_ready(jax_out)
            del jax_out
            times = _timed(lambda: compiled(self.params, tokens), o["reps"])
            seconds = statistics.median(times)
            flops = qwen36_flops(self.cfg, n)["total"]
            last = with_time_model(dict(name="capture", P=n + 1, tokens=n, seconds=seconds, times=times,
                                        tokens_per_s=n / seconds, flops=flops, compiled_bytes=memory["total"],
                                        compile_s=compile_s), compiled, self.device, self.kernel_model())
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
        params, frozen = self.params, None
        if o["train"] == "lora":
            params, frozen = lora_split(self.params)
        optimizer = train.make_optimizer(1e-6)
        opt_state = jax.jit(optimizer.init)(params)
        if self.mesh is not None:
            specs = rules.param_specs(params, self.mesh)
            opt_specs = rules.like_params_specs(opt_state, params, specs)
            opt_state = jax.device_put(opt_state, rules.named(opt_specs, self.mesh))
        rng = np.random.default_rng(1)
        batch = GroupBatch(prompt=self.tokens(p, 2), responses=jnp.asarray(rng.integers(0, self.cfg.vocab_size,
                                                                                            (g, r)), jnp.int32),
                           mask=jnp.ones((g, r), jnp.float32), rewards=jnp.asarray(rng.uniform(size=g), jnp.float32),
                           old_logprobs=jnp.full((g, r), -1.0, jnp.float32), ref_logprobs=None)
        step = jax.jit(train.train_step_unvalidated, static_argnums=train.STATIC_ARGNUMS,
                       donate_argnums=train.DONATE_ARGNUMS)
        t0 = time.perf_counter()
        compiled = step.lower(self.model, params, opt_state, batch, optimizer, GRPOConfig(), mode, o["chunk_size"],
                              self.mesh, None, frozen).compile()
        compile_s = time.perf_counter() - t0
        memory = capacity.memory_total(compiled)
        limit = _device_memory(self.device)["limit"]
        if limit and memory["total"] > FITS * limit:  # refused before it runs out of memory (no run to time)
            raise RuntimeError(f"the {mode} step ({o['train']}) needs {memory['total'] / GIB:.1f} GiB (compiled "
                               f"memory_analysis) > {FITS:.0%} of the device's {limit / GIB:.1f} GiB: lower "
                               "--step-len or --blocks, or --train lora")
        state = [params, opt_state]

        def run():
            state[0], state[1], metrics = compiled(state[0], state[1], batch, None, frozen)
            return metrics["loss"], state[0]

        run()  # warm-up
        times = _timed(run, o["reps"])
        seconds = statistics.median(times)
        row = with_time_model(dict(name=mode, train=o["train"], P=p, G=g, R=r, seconds=seconds, times=times,
                                   tokens_per_s=(p + g * r) / seconds, flops=None, compiled_bytes=memory["total"],
                                   compile_s=compile_s, peak_bytes=_device_memory(self.device)["peak"]),
                              compiled, self.device, self.kernel_model())
        row["planner_bytes"] = self.planner(r).compile(p, g, mode)["total"] if o["planner"] else None
        return row


def _relative_error(ref, got) -> float:
    """max |got - ref| over each output, relative to that XLA output's largest |value|; the largest over outputs."""
    import jax.numpy as jnp

    return max(float(jnp.max(jnp.abs(g.astype(jnp.float32) - r.astype(jnp.float32))))
               / max(float(jnp.max(jnp.abs(r.astype(jnp.float32)))), 1e-30) for r, g in zip(ref, got))


def _passes(forward, args: tuple, cotangents: tuple, reps: int, kinds=("forward", "forward_backward")) -> dict:
    """{kind: (outputs, median s, times, compile s)} of `forward(*args)` per pass in `kinds`: "forward" (jitted) and
    "forward_backward" (the outputs and the vjp of the fixed `cotangents`), each compiled, warmed up and timed `reps`
    calls."""
    import jax

    def both(*a):
        outputs, vjp = jax.vjp(forward, *a)
        return tuple(outputs) + tuple(vjp(cotangents))

    results = {}
    for kind in kinds:
        fn = jax.jit(forward if kind == "forward" else both)
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*args))  # compile + warm-up
        compile_s = time.perf_counter() - t0
        times = _timed(lambda fn=fn: fn(*args), reps)
        results[kind] = (out, statistics.median(times), times, compile_s)
    return results


def _kernel_row(label: str, kind: str, xla: tuple, pallas: tuple, flops: float, peak, **fields) -> dict:
    """A kernel-table row: one pass of one case, the XLA and Pallas `_passes` results compared."""
    (ref, xla_s, xla_times, _), (got, pallas_s, pallas_times, compile_s) = xla, pallas
    return dict(fields, name="kernel", case=label, kind=kind, flops=flops, error=_relative_error(ref, got),
                xla_s=xla_s, pallas_s=pallas_s, xla_times=xla_times, pallas_times=pallas_times,
                pallas_compile_s=compile_s, xla_tflops=flops / xla_s / 1e12, pallas_tflops=flops / pallas_s / 1e12,
                xla_peak=None if peak is None else flops / xla_s / peak,
                pallas_peak=None if peak is None else flops / pallas_s / peak, speedup=xla_s / pallas_s)


def _compare(label: str, forward_fns: dict, args: tuple, cotangents: tuple, reps: int, flops: dict, peak,
             **fields):
    """The kernel table's rows of one case: per pass (forward; forward + backward, the vjp of the outputs for the
    fixed `cotangents`) and implementation ("xla", "pallas": `forward_fns[impl](*args)`) compile, warm up and time
    `reps` calls; yield one row per pass (the error, both medians, XLA / Pallas, TFLOP/s by the analytic `flops`
    {"forward", "forward_backward"} and the fraction of `peak`) with `fields`."""
    results = {impl: _passes(forward, args, cotangents, reps) for impl, forward in forward_fns.items()}
    for kind in ("forward", "forward_backward"):
        yield _kernel_row(label, kind, results["xla"][kind], results["pallas"][kind], flops[kind], peak, **fields)


def kernel_table(opts: dict):
    """The kernel table's rows of one kernel set (`opts["kernel"]`, KERNEL_SETS, or "all" of them; default
    attention), yielded case by case: `attention_table`, `gated_delta_table`, `latent_table`. A case that fails (out
    of memory, a kernel that does not compile) yields a row with "failed" (its error) and the table goes on."""
    import jax

    from longstraw_jax.capacity.hardware import for_device_kind

    hw = for_device_kind(jax.devices()[0].device_kind)
    peak = None if hw is None else hw.flops_per_s
    tables = dict(attention=attention_table, gated_delta=gated_delta_table, sparse_latent=latent_table,
                  attention_tiles=tiles_table)
    kernel = opts.get("kernel", "attention")
    size = "tiny" if opts["tiny"] else "full"
    for kernel in KERNEL_SETS if kernel == "all" else (kernel,):
        for label, case in tables[kernel](size, peak):
            try:
                for row in case():
                    yield dict(row, kernel=kernel)
            except Exception as e:  # noqa: BLE001 - recorded, the next case still runs
                yield dict(name="kernel", kernel=kernel, case=label, failed=f"{type(e).__name__}: {e}"[:2000])


def attention_table(size: str, peak):
    """The flash-attention kernel against the XLA path (`ops.attention.attend`, kernels "pallas" vs "xla") at the
    KERNEL_SHAPES of the run (full: Qwen3.6-27B's attention, bf16; tiny: interpreted on CPU): per case and pass
    (forward; forward + backward, the vjp of the outputs and their log-sum-exp for fixed random cotangents) the
    largest |Pallas - XLA| over each output relative to the XLA output's largest |value| ("error"), median seconds of
    both, the analytic FLOPs (`attention_flops`), TFLOP/s, the fraction of the device's bf16 peak
    (`hardware.for_device_kind`; None without an entry) and XLA / Pallas. Yields (label, a function yielding the
    case's rows)."""
    from longstraw_jax.ops import attention

    shape = KERNEL_SHAPES[size]
    hq, hkv, d = shape["heads"], shape["kv_heads"], shape["head_dim"]
    for label, t, s, *branches in shape["cases"]:
        def case(t=t, s=s, label=label, n=branches[0] if branches else None):
            args, cotangents, attend = _attention_case(shape, t, s, n)

            def forward(impl):
                return attend(lambda q, k, v, **options: attention.attend(q, k, v, **options, kernels=impl))

            flops = {kind: (n or 1) * f for kind, f in attention_flops(t, s, hq, d).items()}
            yield from _compare(label, {impl: forward(impl) for impl in ("xla", "pallas")}, args, cotangents,
                                shape["reps"], flops, peak, T=t, S=s, heads=hq, kv_heads=hkv, head_dim=d,
                                dtype=shape["dtype"], pairs=(n or 1) * visible_pairs(t, s),
                                **({} if n is None else dict(branches=n)))
        yield label, case


def _attention_case(shape: dict, t: int, s: int, n: int | None = None):
    """One attention case of `shape` (KERNEL_SHAPES): ((q, k, v), fixed cotangents of (out, lse), attend), random
    normal inputs (seed 0). attend(impl) -> f(q, k, v) = (out, lse) of impl(q, k, v, **options) for T causal queries
    at the last T of the S key positions (vmapped over N branches' queries when n, the cache shared)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    hq, hkv, d, dtype = shape["heads"], shape["kv_heads"], shape["head_dim"], jnp.dtype(shape["dtype"])
    rng = np.random.default_rng(0)
    normal = lambda shape, dt: jnp.asarray(rng.standard_normal(shape), dt)
    lead = () if n is None else (n,)
    args = normal(lead + (t, hq, d), dtype), normal((s, hkv, d), dtype), normal((s, hkv, d), dtype)
    cotangents = (normal(lead + (t, hq, d), jnp.float32), normal(lead + (t, hq), jnp.float32))
    options = dict(q_positions=jnp.arange(t, dtype=jnp.int32) + (s - t), k_offset=0, scale=d**-0.5, causal=True)

    def attend(impl):
        def f(q, k, v):
            a = impl(q, k, v, **options)
            return a.out, a.lse
        return f if n is None else jax.vmap(f, in_axes=(0, None, None))

    return args, cotangents, attend


def tile_label(sweep: str, candidate) -> str:
    """A candidate's name: "fwd 128x32 w8 s3", "bwd dq 64x32 w8 s2, dkv 32x32 w4 s2" (block_q x block_k, warps,
    stages) or "decode, split below 128 programs" / "decode, never split"."""
    name = lambda t: f"{t[0]}x{t[1]} w{t[2]} s{t[3]}"
    if sweep == "forward":
        return f"fwd {name(candidate)}"
    if sweep == "backward":
        return f"bwd dq {name(candidate[0])}, dkv {name(candidate[1])}"
    return "decode, never split" if candidate == 1 else f"decode, split below {candidate} programs"


def tiles_table(size: str, peak):
    """The flash-attention kernels' launch shapes (TILE_CANDIDATES of the size, `ops.flash_attention.attend(...,
    tiles=FlashTiles(...))`), three sweeps: per forward candidate the forward and per backward candidate forward +
    backward at the attention table's first case (a chunk over itself), per `min_programs` value the forward at its
    first decode case (8 tokens over the cache: keys split over programs or not). Each a kernel-table row (error
    against the XLA path, measured once per case and pass; medians, TFLOP/s, % of peak) with "sweep", "tiles"
    {forward | dq, dkv: [block_q, block_k, num_warps, num_stages] | min_programs} and "default" (the sweep's first
    candidate, the library's default); a candidate that does not compile (shared memory, registers) is a failed row.
    Yields (label, a function yielding the candidate's row)."""
    from longstraw_jax.ops import attention, flash_attention

    shape = KERNEL_SHAPES[size]
    hq, hkv, d = shape["heads"], shape["kv_heads"], shape["head_dim"]
    chunk = shape["cases"][0][1:3]
    decode = next(c[1:3] for c in shape["cases"] if len(c) == 3 and c[1] <= 8)
    inputs, xla = {}, {}  # per case (T, S): its inputs, and per pass the XLA path's result, each made once

    def measure(sweep, flash_tiles, label, t, s, **fields):
        kind = "forward_backward" if sweep == "backward" else "forward"
        if (t, s) not in inputs:
            inputs[t, s] = _attention_case(shape, t, s)
        args, cotangents, attend = inputs[t, s]
        if (t, s, kind) not in xla:
            xla[t, s, kind] = _passes(attend(lambda *a, **o: attention.attend(*a, **o, kernels="xla")), args,
                                      cotangents, shape["reps"], kinds=(kind,))[kind]
        tiled = attend(lambda *a, **o: flash_attention.attend(*a, **o, tiles=flash_tiles))
        got = _passes(tiled, args, cotangents, shape["reps"], kinds=(kind,))[kind]
        yield _kernel_row(label, kind, xla[t, s, kind], got, attention_flops(t, s, hq, d)[kind], peak, T=t, S=s,
                          heads=hq, kv_heads=hkv, head_dim=d, dtype=shape["dtype"], sweep=sweep, **fields)

    kernel = lambda c: flash_attention.KernelTiles(*c)
    candidates = TILE_CANDIDATES[size]
    for sweep in TILE_SWEEPS:
        for i, c in enumerate(candidates[sweep]):
            if sweep == "forward":
                tiles, record, (t, s) = flash_attention.FlashTiles(forward=kernel(c)), dict(forward=list(c)), chunk
            elif sweep == "backward":
                tiles, record = flash_attention.FlashTiles(dq=kernel(c[0]), dkv=kernel(c[1])), dict(
                    dq=list(c[0]), dkv=list(c[1]))
                t, s = chunk
            else:
                tiles, record, (t, s) = flash_attention.FlashTiles(min_programs=c), dict(min_programs=c), decode
            label = tile_label(sweep, c)
            yield label, functools.partial(measure, sweep, tiles, label, t, s, tiles=record, default=i == 0)


def gated_delta_flops(tokens: int, heads: int, key_dim: int, value_dim: int, chunk: int) -> dict[str, float]:
    """Analytic FLOPs of one chunked gated delta rule call, the time model's count (`capacity.hlo.GatedDeltaModel`):
    the Pallas kernels' matmuls per (chunk, value head), forward: stage A 2 C^2 dk + s 2 C^2 (dk + dv) +
    (s - 1) 2 C^3 (the WY matrix and the doubling solve, s = ceil(log2 C)), stage B 4 C dk dv (u = value - w S, the
    state update), stage C 2 C dk dv + nb 2 C^2 dk + 2 C^2 dv (q S, q k^T per column block of 32, scores u); the
    backward: their vjps (capacity/hlo/kernels.py), over ceil(T / C) chunks: {"forward", "forward_backward",
    "recurrent"} (recurrent: the recurrent form's 6 dk dv per token and head, for reference)."""
    from longstraw_jax.capacity.hlo import GatedDeltaModel

    model, chunks = GatedDeltaModel(key_dim, value_dim, chunk), -(-tokens // chunk)
    forward = model.flops(chunks, heads)
    return dict(forward=forward, forward_backward=forward + model.flops(chunks, heads, backward=True),
                recurrent=6.0 * key_dim * value_dim * tokens * heads)


def gated_delta_table(size: str, peak):
    """The chunked gated delta rule, Pallas (`ops.flash_gated_delta.gated_delta_rule`) against the XLA path
    (`ops.gated_delta.gated_delta_rule_chunked`), at GDN_SHAPES (full: Qwen3.6-27B's 48 value heads, dk = dv = 128,
    chunks of 32; tiny: the tiny preset's, interpreted), float32: l2-normalised q (scaled by dk^-1/2) and k, decays
    log sigmoid(x + 4), beta sigmoid(x), a random carried state; forward (o and the state) and forward + backward
    (the vjp in all six inputs); FLOPs by `gated_delta_flops`. Yields (label, a function yielding its rows)."""
    import jax
    import jax.numpy as jnp

    from longstraw_jax import models
    from longstraw_jax.ops import flash_gated_delta
    from longstraw_jax.ops.gated_delta import gated_delta_rule_chunked

    shape = GDN_SHAPES[size]
    cfg = models.config_from_hf(os.path.join(ROOT, shape["config"]))
    # both sides at the kernels' chunk (64 unless the config sets one): the XLA path's own default is CPU-only
    h, dk, dv, chunk = (cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                        cfg.gdn_chunk_for("pallas"))
    for label, t in shape["cases"]:
        def case(t=t, label=label):
            keys = iter(jax.random.split(jax.random.key(0), 10))
            normal = lambda *shape: jax.random.normal(next(keys), shape, jnp.float32)
            unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
            args = (unit(normal(t, h, dk)) * dk**-0.5, unit(normal(t, h, dk)), normal(t, h, dv),
                    jax.nn.log_sigmoid(normal(t, h) + 4.0), jax.nn.sigmoid(normal(t, h)), 0.1 * normal(h, dk, dv))
            cotangents = (normal(t, h, dv), normal(h, dk, dv))
            fns = dict(xla=lambda *a: gated_delta_rule_chunked(*a, chunk),
                       pallas=lambda *a: flash_gated_delta.gated_delta_rule(*a, chunk))
            flops = gated_delta_flops(t, h, dk, dv, chunk)
            yield from _compare(label, fns, args, cotangents, shape["reps"], flops, peak, T=t, heads=h, key_dim=dk,
                                value_dim=dv, chunk=chunk, dtype="float32", flops_recurrent=flops["recurrent"])
        yield label, case


def latent_flops(queries: int, heads: int, slots: int, latent: int, rope: int) -> dict[str, float]:
    """Analytic FLOPs of one sparse latent attention call, the time model's count (`capacity.hlo.SparseLatentModel`):
    forward 2 T H k (2 Dl + Dr) (the scores over Dl + Dr channels, p c over Dl), backward 2 T H k (5 Dl + 3 Dr)
    (the scores again, dO c, dq, the rows' cotangents): {"forward", "forward_backward"}."""
    from longstraw_jax.capacity.hlo import SparseLatentModel

    model = SparseLatentModel(heads, latent, rope)
    forward = model.forward(queries, slots).flops
    return dict(forward=forward, forward_backward=forward + model.backward(queries, slots).flops)


def latent_selection(queries: int, cached: int, slots: int, seed: int = 0):
    """int32 [T, k]: query t (at position cached + t) selects k distinct positions <= its own, as a top-k would:
    (base + shift_t) mod (cached + t + 1) for k distinct bases < cached and a random shift per query (most in the
    cache, some among the new rows)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    base = rng.choice(cached, slots, replace=False)
    visible = cached + np.arange(queries) + 1
    shift = rng.integers(0, visible)
    return ((base[None, :] + shift[:, None]) % visible[:, None]).astype(np.int32)


def latent_table(size: str, peak):
    """GLM-5.x's sparse latent attention, Pallas (`ops.flash_mla`) against the XLA path (`ops.mla`, query blocks of
    the config's query_block_size), at LATENT_SHAPES (full: GLM-5.2's 64 heads, kv_lora_rank 512 + rope 64, index_topk
    2048 selected rows, bf16; tiny: the tiny preset's, float32, interpreted): T queries after S cached rows of one
    layer, each over its k distinct selected positions (`latent_selection`); forward (out and lse) and forward +
    backward (the vjp in q, the cache and the new rows); FLOPs by `latent_flops`. Yields (label, a function yielding
    its rows)."""
    import jax
    import jax.numpy as jnp

    from longstraw_jax import models
    from longstraw_jax.ops.mla import sparse_latent_attention_partial

    shape = LATENT_SHAPES[size]
    cfg = models.config_from_hf(os.path.join(ROOT, shape["config"]))
    h, dl, dr, k, dtype = (cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.index_topk,
                           jnp.dtype(shape["dtype"]))
    for label, t, s in shape["cases"]:
        def case(t=t, s=s, label=label):
            keys = iter(jax.random.split(jax.random.key(0), 10))
            normal = lambda dt, *shape: jax.random.normal(next(keys), shape, jnp.float32).astype(dt)
            args = (normal(dtype, t, h, dl + dr), normal(dtype, 1, s, dl + dr), normal(dtype, t, dl + dr))
            selected = jnp.asarray(latent_selection(t, s, k))
            cotangents = (normal(jnp.float32, t, h, dl), normal(jnp.float32, t, h))

            def forward(impl):
                def f(q, cache, new):
                    a = sparse_latent_attention_partial(q, cache, 0, new, selected, s, scale=cfg.qk_head_dim**-0.5,
                                                        value_dim=dl, block_size=cfg.query_block_size, kernels=impl)
                    return a.out, a.lse
                return f

            yield from _compare(label, {impl: forward(impl) for impl in ("xla", "pallas")}, args, cotangents,
                                shape["reps"], latent_flops(t, h, k, dl, dr), peak, T=t, S=s, heads=h, slots=k,
                                latent_dim=dl, rope_dim=dr, dtype=str(dtype))
        yield label, case


def _child(opts: dict) -> int:
    import jax

    device = jax.devices()[0]
    info = dict(device=device.device_kind, platform=device.platform, jax=jax.__version__)
    if opts["item"] == "kernels":
        for row in kernel_table(opts):
            bench_harness.emit(dict(row, **info))
        return 0
    child = _Child(opts)
    row = child.capture() if opts["item"] == "capture" else child.step(opts["item"])
    row.update(kernels=child.cfg.kernels, **info)
    bench_harness.emit(row)
    return 0


# ---------------------------------------------------------------------------------------------------------------
# Parent side: run each measurement in a child, print the table, write JSON.


class ChildFailed(RuntimeError):
    """A measurement's child failed or timed out; `rows`: what it printed before (the kernel table's finished
    cases)."""

    def __init__(self, message: str, rows: list[dict]):
        super().__init__(message)
        self.rows = rows


def _run_child(opts: dict, timeout: float) -> list[dict]:
    """One measurement (`opts["item"]`) in its own process: its result rows; ChildFailed if it failed."""
    child = bench_harness.run_child(__file__, opts, timeout, cwd=ROOT)
    if child.returncode is None:
        raise ChildFailed(f"{opts['item']} timed out after {timeout:.0f} s:\n{child.stderr[-3000:]}", child.rows)
    if child.returncode or not child.rows:
        raise ChildFailed(f"{opts['item']} failed (exit {child.returncode}):\n{child.stderr[-3000:]}", child.rows)
    return child.rows


def _fmt(x, spec: str = ".2f", scale: float = 1.0) -> str:
    return "n/a" if x is None else format(x / scale, spec)


def format_table(rows: list[dict], peak: float | None) -> str:
    """The markdown table: one row per measurement, medians, model TFLOP/s and MFU (capture), memory and ratios."""
    sizes = [row.get(key) or 0 for row in rows for key in ("peak_bytes", "compiled_bytes", "planner_bytes")]
    unit, scale = ("GiB", GIB) if max(sizes, default=0) >= GIB else ("MiB", 2**20)
    head = ["measurement", "P", "G x R", "median s", "x detached", "tokens/s", "TFLOP/s", "MFU", f"peak {unit}",
            f"compiled {unit}", f"planner {unit}", "peak / planner"]
    detached_s = {row.get("kernels"): row["seconds"] for row in rows if row["name"] == "detached"}
    lines = ["| " + " | ".join(head) + " |", "| --- | " + " | ".join(["---:"] * (len(head) - 1)) + " |"]
    for row in rows:
        detached = detached_s.get(row.get("kernels"))
        tflops = row["flops"] / row["seconds"] if row.get("flops") else None
        ratio = (row["peak_bytes"] / row["planner_bytes"]
                 if row.get("peak_bytes") and row.get("planner_bytes") else None)
        cells = [row.get("label", row["name"]), f"{row['P']:,}", f"{row['G']} x {row['R']}" if "G" in row else "-",
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
            row.get("label", row["name"]), row["model_hardware"] or "n/a", f"{c['flops'] / 1e9:.4g}",
            f"{c['hbm_bytes'] / 1e9:.4g}",
            f"{c['collective_bytes'] / 1e9:.4g}", bound, _fmt(row["model_s"], ".3g") + star,
            f"{row['seconds']:.3g}", _fmt(row["model_ratio"], ".3g")]) + " |")
    return "\n".join(lines)


# per kernel set: the kernel table's title and its shape columns (row keys)
KERNEL_TABLES = dict(
    attention=("Flash attention, Pallas vs XLA (`ops.attention.attend`; FLOPs: forward 4 x visible pairs x Hq x D, "
               f"backward {BACKWARD_FLOPS:g}x that)", ("T", "S")),
    gated_delta=("Chunked Gated DeltaNet, Pallas vs XLA (`ops.gated_delta.gated_delta_rule_chunked`; float32; FLOPs: "
                 "the kernels' matmuls per chunk and head, the time model's GatedDeltaModel; % of the bf16 peak)",
                 ("T", "heads")),
    sparse_latent=("Sparse latent attention, Pallas vs XLA (`ops.mla.sparse_latent_attention_partial`; FLOPs: "
                   "forward 2 T H k (2 Dl + Dr), backward 2 T H k (5 Dl + 3 Dr))", ("T", "S", "slots")),
    attention_tiles=("Flash attention's launch shapes (`ops.flash_attention.KernelTiles`: block_q x block_k, warps, "
                     "stages; fwd: the forward's, timed by the forward; bwd: dQ's and dK / dV's, timed by forward + "
                     "backward; decode: `FlashTiles.min_programs`, the decode forward's key split), the first of each "
                     "the default", ("T", "S")))


def kernel_kind(row: dict) -> str:
    """The kernel set of a kernel-table row (rows without one: attention, the first table)."""
    return row.get("kernel", "attention")


def format_kernel_table(rows: list[dict], columns: tuple[str, ...] = ("T", "S")) -> str:
    """The kernel table (`kernel_table` rows of one kernel set): per case and pass its shape `columns`, the error,
    both medians, XLA / Pallas, TFLOP/s and the fraction of the bf16 peak; a failed case: its error."""
    head = ["case", *columns, "pass", "max rel error", "XLA s", "Pallas s", "XLA / Pallas", "XLA TFLOP/s",
            "Pallas TFLOP/s", "Pallas % of peak"]
    lines = ["| " + " | ".join(head) + " |",
             "| --- | " + " | ".join(["---:"] * len(columns)) + " | --- | " + " | ".join(["---:"] * 7) + " |"]
    for r in rows:
        if "failed" in r:
            lines.append("| " + " | ".join([r["case"]] + ["-"] * len(columns) + ["failed: " + r["failed"][:200]]
                                           + ["-"] * 7) + " |")
            continue
        lines.append("| " + " | ".join([
            r["case"], *(f"{r[c]:,}" for c in columns), "fwd" if r["kind"] == "forward" else "fwd+bwd",
            f"{r['error']:.2e}", f"{r['xla_s']:.3g}", f"{r['pallas_s']:.3g}", f"{r['speedup']:.2f}",
            f"{r['xla_tflops']:.3g}", f"{r['pallas_tflops']:.3g}", _fmt(r["pallas_peak"], ".1%")]) + " |")
    return "\n".join(lines)


def compare(rows: list[dict]) -> list[dict]:
    """XLA vs Pallas per measurement (same name and P): both medians, XLA / Pallas, and the time model's estimate of
    the Pallas program (the XLA program costed with the kernels: "model_kernels_s") with measured / estimate."""
    by = {(r["name"], r["P"], r.get("kernels")): r for r in rows}
    out = []
    for (name, p, impl), xla in by.items():
        pallas = by.get((name, p, "pallas"))
        if impl != "xla" or pallas is None:
            continue
        estimate = xla.get("model_kernels_s")
        out.append(dict(name=name, P=p, tokens=xla.get("tokens"), xla_s=xla["seconds"], pallas_s=pallas["seconds"],
                        speedup=xla["seconds"] / pallas["seconds"], model_kernels_s=estimate,
                        pallas_model_ratio=pallas["seconds"] / estimate if estimate else None))
    return out


def format_comparison(pairs: list[dict]) -> str:
    head = ["measurement", "P", "XLA s", "Pallas s", "XLA / Pallas", "kernel-model estimate s", "Pallas / estimate"]
    lines = ["| " + " | ".join(head) + " |", "| --- | " + " | ".join(["---:"] * (len(head) - 1)) + " |"]
    for c in pairs:
        lines.append("| " + " | ".join([c["name"], f"{c['P']:,}", f"{c['xla_s']:.3g}", f"{c['pallas_s']:.3g}",
                                         f"{c['speedup']:.2f}", _fmt(c["model_kernels_s"], ".3g"),
                                         _fmt(c["pallas_model_ratio"], ".3g")]) + " |")
    return "\n".join(lines)


def fastest_tiles(kernel_rows: list[dict]) -> dict:
    """Per sweep of the tiles' rows (TILE_SWEEPS): the fastest candidate that ran {"case", "tiles", "pallas_s",
    "pallas_peak", "error", "default_over_best": the default's median / its (None when the default failed)}, or
    None when none ran. What `ops.flash_attention.DEFAULT_TILES` is to be set from."""
    out = {}
    for sweep in TILE_SWEEPS:
        rows = [r for r in kernel_rows if kernel_kind(r) == "attention_tiles" and r.get("sweep") == sweep
                and "failed" not in r]
        best = min(rows, key=lambda r: r["pallas_s"], default=None)
        default = next((r for r in rows if r["default"]), None)
        out[sweep] = None if best is None else dict(
            case=best["case"], tiles=best["tiles"], pallas_s=best["pallas_s"], pallas_peak=best["pallas_peak"],
            error=best["error"], default_over_best=None if default is None else default["pallas_s"] / best["pallas_s"])
    return out


def targets(kernel_rows: list[dict], pairs: list[dict], device: str | None) -> dict:
    """Issue 41's targets for the GPU day, each {"target", "value", "status": pass / fail / not-run, ...}: the
    attention forward's fraction of the bf16 peak (the attention kernel table's forward of the most FLOPs, the
    default tiles) >= 50 % (stated for H100; evaluated on any device with a peak entry, its kind recorded), with the
    fastest forward tiles' fraction beside it ("tuned": {"case", "value"}, `fastest_tiles`); the capture's XLA /
    Pallas at 64K tokens >= 2."""
    forward = [r for r in kernel_rows if kernel_kind(r) == "attention" and r.get("kind") == "forward"]
    best = max(forward, key=lambda r: r["flops"], default=None)
    value = None if best is None else best["pallas_peak"]
    tuned = fastest_tiles(kernel_rows)["forward"]
    attention = dict(target=f">= {TARGET_ATTENTION_PEAK:.0%} of the bf16 peak (H100)", value=value,
                     case=None if best is None else best["case"], device=device,
                     tuned=None if tuned is None else dict(case=tuned["case"], value=tuned["pallas_peak"]),
                     status="not-run" if value is None else "pass" if value >= TARGET_ATTENTION_PEAK else "fail")
    capture = next((c for c in pairs if c["name"] == "capture" and c["tokens"] == TARGET_CAPTURE_TOKENS), None)
    speedup = None if capture is None else capture["speedup"]
    return dict(attention_forward_peak=attention,
                capture_speedup_64k=dict(target=f">= {TARGET_CAPTURE_SPEEDUP:g}x the XLA path at "
                                                f"{TARGET_CAPTURE_TOKENS:,} tokens", value=speedup, device=device,
                                         status="not-run" if speedup is None
                                         else "pass" if speedup >= TARGET_CAPTURE_SPEEDUP else "fail"))


def plan_measurements(opts: dict, measure: list[str], impls: list[str]) -> list[dict]:
    """The children to run, in priority order (the budget skips the last): the kernel table (one child per kernel
    set: attention, the GDN, sparse latent attention; --tiny: one for all, the tiles' sweep included), the captures
    (each length, each implementation; none given: one doubling search) with the attention tiles' sweep after the
    first length's (the target's 64K), the train_step modes."""
    kernels = ["all"] if opts.get("tiny") else [k for k in KERNEL_SETS if k != "attention_tiles"]
    plan = [dict(item="kernels", kernel=k) for k in kernels] if "kernels" in measure else []
    tiles = [dict(item="kernels", kernel="attention_tiles")] if "kernels" in measure and not opts.get("tiny") else []
    if "capture" in measure:
        lengths = opts["capture_lens"] or [opts["capture_len"]]
        plan += [dict(item="capture", impl=impl, capture_len=n) for n in lengths[:1] for impl in impls]
        plan += tiles + [dict(item="capture", impl=impl, capture_len=n) for n in lengths[1:] for impl in impls]
    else:
        plan += tiles
    if "steps" in measure:
        plan += [dict(item=mode, impl=impl) for mode in opts["modes"].split(",") if mode for impl in impls]
    return plan


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
    ap.add_argument("--blocks", type=int, help="blocks of the config's layer pattern to keep (2; --tiny: 1)")
    ap.add_argument("--dtype", help="parameter dtype (bfloat16; --tiny: float32)")
    ap.add_argument("--mesh", default=None, help="AxB: bench the sharded path on that mesh (default: one device)")
    ap.add_argument("--kernels", help="softmax attention implementations to measure, a comma list of xla, pallas "
                    "(xla,pallas; --tiny: xla): each capture and train_step runs once per implementation")
    ap.add_argument("--measure", default="kernels,capture,steps",
                    help="what to measure, a comma list of kernels (the flash-attention kernel table), capture, "
                         "steps (the --modes train_steps); default all, in that order")
    ap.add_argument("--capture-len", type=size_arg, default=0, help="capture exactly this many tokens (no search)")
    ap.add_argument("--capture-lens", type=sizes_arg, help="capture each of these lengths, one child each "
                    "(64K,32K,128K; --tiny: none, the doubling search)")
    ap.add_argument("--capture-start", type=size_arg, help="first capture length of the doubling search")
    ap.add_argument("--capture-max", type=size_arg, help="longest capture the search tries")
    ap.add_argument("--step-len", type=size_arg, help="prompt length of the train_step measurements")
    ap.add_argument("-G", "--group-size", type=int)
    ap.add_argument("-R", "--response-len", type=size_arg)
    ap.add_argument("--chunk-size", type=size_arg, help="capture chunk / round length")
    ap.add_argument("--reps", type=int, help="timed calls per measurement (after one warm-up)")
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="wall-clock budget of the whole run (420 s): a measurement is killed when it runs past it, "
                         f"and none starts with less than {MIN_CHILD_S:.0f} s left (JSON: skipped)")
    ap.add_argument("--modes", help="train_step modes to time (exact; --tiny: detached,exact)")
    ap.add_argument("--train", choices=("full", "lora"),
                    help="what the train_steps train: every parameter (AdamW) or LoRA adapters of rank "
                         f"{LORA_RANK} on every matrix (lora; --tiny: full)")
    ap.add_argument("--planner", dest="planner", action="store_true", default=None,
                    help="the planner's memory estimates next to the measured (default on --tiny only: it compiles "
                         "each program again)")
    ap.add_argument("--no-planner", dest="planner", action="store_false", help="skip the planner's estimates")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    # the children's JAX may take this much of a GPU (JAX's default preallocates 75 %: 60 GB of an H100's 80)
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", str(GPU_MEMORY_FRACTION))
    if args.tiny is None:
        args.tiny = not _has_accelerator()
    defaults = TINY if args.tiny else FULL_SIZE
    opts = {key: getattr(args, key, None) if getattr(args, key, None) is not None else value
            for key, value in defaults.items()}
    opts.update(mesh=args.mesh, capture_len=args.capture_len, tiny=args.tiny)
    if args.capture_len and args.capture_lens is None:
        opts["capture_lens"] = []  # one fixed length
    for name in ("group_size", "reps", "blocks"):
        if opts[name] < 1:
            raise SystemExit(f"error: --{name.replace('_', '-')} {opts[name]} must be >= 1")
    impls = [k for k in opts["kernels"].split(",") if k]
    measure = [m for m in args.measure.split(",") if m]
    if not impls or set(impls) - {"xla", "pallas"} or set(measure) - {"kernels", "capture", "steps"}:
        raise SystemExit(f"error: --kernels {opts['kernels']!r} (xla, pallas) or --measure {args.measure!r} "
                         "(kernels, capture, steps)")
    start = time.perf_counter()
    rows, kernel_rows, failed, skipped = [], [], [], []

    def run_identity():
        """(device kind, platform, jax version) as the first measurement reported them (None before any)."""
        first = (rows or kernel_rows or [{}])[0]
        return first.get("device"), first.get("platform"), first.get("jax")

    def write_json(complete: bool, **summary):
        """Every measurement so far to --json (replaced atomically): after each one with complete false, so that a
        run killed from outside (the GPU machine's command limit) leaves what it measured; at the end with the
        targets and the XLA vs Pallas comparison, complete true."""
        if not args.json:
            return
        device, platform, jax_version = run_identity()
        with open(args.json + ".partial", "w") as f:
            json.dump(dict(device=device, platform=platform, jax=jax_version,
                           peak_flops=peak_flops(device) if device else None, options=opts,
                           wall_s=time.perf_counter() - start, complete=complete, **summary, kernel_table=kernel_rows,
                           rows=rows, failed=failed, skipped=skipped), f, indent=1)
            f.write("\n")
        os.replace(args.json + ".partial", args.json)

    def measure_one(spec: dict) -> None:
        """Run one planned measurement in its child; its rows, or its failure or skip, join the lists above."""
        label = spec["item"] + (f" ({spec['impl']})" if "impl" in spec and len(impls) > 1 else "") \
            + (f" ({spec['kernel']})" if "kernel" in spec else "")
        if spec["item"] == "capture" and spec["capture_len"]:
            label += f" {spec['capture_len']:,}"
        remaining = args.budget_s - (time.perf_counter() - start)
        if remaining < MIN_CHILD_S:
            skipped.append(dict(spec, label=label, status="skipped", reason=f"{remaining:.0f} s of the budget left"))
            print(f"  {label}: skipped ({remaining:.0f} s left)", flush=True)
            return
        child_opts = dict(opts, **spec, budget_s=0.6 * remaining if spec["item"] == "capture" else remaining)
        cap = dict(gated_delta=KERNEL_SET_S, sparse_latent=KERNEL_SET_S, attention_tiles=TILES_S)
        timeout = min(remaining, cap.get(spec.get("kernel"), remaining))
        try:
            result = _run_child(child_opts, timeout=timeout)
        except ChildFailed as e:
            failed.append(dict(spec, label=label, status="failed", error=str(e)[-3000:]))
            print(f"  {label}: FAILED {str(e).splitlines()[0]}", flush=True)
            kernel_rows.extend(e.rows if spec["item"] == "kernels" else [])  # its finished cases
            return
        if spec["item"] == "kernels":
            kernel_rows.extend(result)
            lost = [r for r in result if "failed" in r]
            print(f"  kernel table ({spec['kernel']}): {len(result)} rows" + (f", {len(lost)} failed" if lost else ""),
                  flush=True)
            return
        row = dict(result[-1], status="ok", label=result[-1]["name"] + (f" ({spec['impl']})" if len(impls) > 1
                                                                          else ""))
        rows.append(row)
        print(f"  {label}: {row['seconds']:.3g} s" + (f" for {row['tokens']:,} tokens" if "tokens" in row else
                                                       " per step"), flush=True)

    for spec in plan_measurements(opts, measure, impls):
        measure_one(spec)
        write_json(False)
    device, platform, jax_version = run_identity()
    peak = peak_flops(device) if device else None
    cfg = bench_config(opts["config"], opts["blocks"])
    print(f"{device or 'no measurement'} ({platform}, jax {jax_version}); peak bf16 "
          f"{'n/a' if peak is None else f'{peak / 1e12:.0f} TFLOP/s'}; {cfg.describe()}; {opts['dtype']}; "
          f"mesh {opts['mesh'] or 'none (one device)'}; chunk {opts['chunk_size']:,}; kernels {','.join(impls)}; "
          f"{time.perf_counter() - start:.0f} s")
    for kernel, (title, columns) in KERNEL_TABLES.items():
        table = [r for r in kernel_rows if kernel_kind(r) == kernel]
        if table:
            print("\n" + title)
            print(format_kernel_table(table, columns))
    if rows:
        print()
        print(format_table(rows, peak))
        print("\nTime model (longstraw_jax.capacity: per-device roofline of the compiled program) vs measured")
        print(format_model_table(rows))
    pairs = compare(rows)
    if pairs:
        print("\nXLA vs Pallas (the kernel-model estimate: the XLA program costed with the kernels' FLOPs and bytes)")
        print(format_comparison(pairs))
    goals, tiles = targets(kernel_rows, pairs, device), fastest_tiles(kernel_rows)
    print("\nTargets: " + "; ".join(f"{name} {t['status']} ({_fmt(t['value'], '.3g')}; {t['target']})"
                                     for name, t in goals.items()))
    for sweep, best in tiles.items():
        if best:
            print(f"Fastest tiles, {sweep}: {best['case']} ({best['pallas_s']:.3g} s, "
                  f"{_fmt(best['pallas_peak'], '.1%')} of peak; the default {_fmt(best['default_over_best'])}x its "
                  "time)")
    for item in failed + skipped:
        print(f"  {item['label']}: {item['status']}" + (f": {item['reason']}" if "reason" in item else ""))
    write_json(True, targets=goals, fastest_tiles=tiles, comparison=pairs)
    return 1 if failed and not (rows or kernel_rows) else 0


def _has_accelerator() -> bool:
    """Whether JAX would start on an accelerator, asked in a child (the parent starts no backend)."""
    probe = subprocess.run([sys.executable, "-c", "import jax; print(jax.default_backend())"], capture_output=True,
                           text=True, timeout=300)
    return probe.stdout.strip() not in ("", "cpu")


if __name__ == "__main__":
    sys.exit(main())
