"""Capacity planner: per-device memory of one whole trainer step (sampling, then the update), from shapes only.

The command line of `python -m longstraw_jax.plan` (tools/plan_capacity.py runs the same); what it computes and why:
docs/architecture.md section 6.

    python -m longstraw_jax.plan --config configs/qwen3.6-27b.json --mesh 1x8 -P 2100000,4460000 -G 2,8 \
        --modes exact,detached --device-gb 96 --markdown
    python -m longstraw_jax.plan --config configs/qwen3.6-27b.json --mesh 4x8 -P 2100000 --groups-per-step 4
    python -m longstraw_jax.plan --config configs/qwen3.6-27b.json --mesh 1x8 -G 8 --search --device-gb 96
    python -m longstraw_jax.plan --config configs/glm-5.2.json --mesh 4x8 -P 2M -G 2,8 --train lora \
        --lora-rank 64 --json glm_lora.json
    python -m longstraw_jax.plan --config configs/qwen3.6-27b.json --mesh 1x8 -P 256K -G 8 -R 1024 --modes exact \
        --time --hardware h20

Sizes (-P, -G, -R, -B, --chunk-size, --search-step) are counts with an optional binary suffix (`validation.parse_size`):
K = 1024, M = 2^20, a fraction rounded to the nearest integer (halves up): 2M = 2,097,152, 2.1M = 2,202,010.

`setup_jax` must run before JAX creates its CPU client (`main` does it once the mesh is known): the simulated device
count and the XLA flags the sizes are measured with.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import time

import jax

from longstraw_jax.capacity.gpu_target import INSTALL, TARGETS, compile_only_devices
from longstraw_jax.capacity.hardware import HARDWARE, hardware
from longstraw_jax.capacity.phases import local_groups
from longstraw_jax.capacity.planner import GIB, Planner
from longstraw_jax.capacity.report import format_rows, format_times, write_json
from longstraw_jax.common.validation import SIZE_RULE, size_arg, sizes_arg
from longstraw_jax.sharding.mesh import parse_mesh_spec


def setup_jax(devices: int) -> None:
    """Before JAX starts its backend: `devices` simulated CPU devices, no while-loop hoisting of whole-input
    conversions (otherwise the CPU compiler hoists a whole-input float32 conversion out of loops and overstates
    scratch memory), and no LLVM optimisation of the never-run code (after buffer assignment: compiles faster)."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    flags = os.environ.get("XLA_FLAGS", "")
    if "while-loop-invariant-code-motion" not in flags:
        flags += " --xla_disable_hlo_passes=while-loop-invariant-code-motion"
    if "xla_backend_optimization_level" not in flags:
        flags += " --xla_backend_optimization_level=0"
    os.environ["XLA_FLAGS"] = flags.strip()
    jax.config.update("jax_num_cpu_devices", devices)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog=f"sizes: {SIZE_RULE}",
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="HF config.json of the model (e.g. configs/qwen3.6-27b.json)")
    ap.add_argument("--mesh", required=True, help="AxB: data x seq devices (simulated on CPU)")
    ap.add_argument("--prompt-len", "-P", type=sizes_arg, default=[],
                    help="prompt lengths, a comma list of sizes, e.g. 2100000,4M (K = 1024, M = 2^20: below)")
    ap.add_argument("--group-size", "-G", type=sizes_arg, default=[8], help="comma list of group sizes G (default 8)")
    ap.add_argument("--response-len", "-R", type=size_arg, default=1024,
                    help="response tokens per branch, a size (default 1024)")
    ap.add_argument("--groups-per-step", "-B", type=size_arg, default=None,
                    help="groups per step, a multiple of the mesh's data size (default: the data size); each data "
                         "slice holds B / data groups' captured states at once")
    ap.add_argument("--decode-batch", type=int, default=None, metavar="N",
                    help="branches decoded together (a divisor of every G; default all G), as the trainer's")
    ap.add_argument("--replay-batch", type=int, default=1, metavar="K",
                    help="branches the update replays together (a divisor of every G; default 1), as the trainer's")
    ap.add_argument("--modes", default="exact,detached")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device-gb", type=float, default=96.0, help="device memory in GB (1e9 bytes; default 96)")
    ap.add_argument("--search", action="store_true", help="binary-search the longest prompt whose step fits")
    ap.add_argument("--search-step", type=size_arg, default=65536,
                    help="search resolution in positions, a size (default 64K = 65,536)")
    ap.add_argument("--chunk-size", type=size_arg, default=16384,
                    help="capture / prompt-backward round length in positions, a size (default 16K = 16,384: a round's "
                         "working set "
                         "is most of the exact step's transient memory)")
    ap.add_argument("--train", choices=("full", "lora"), default="full",
                    help="full: every parameter trains (AdamW + fp32 grads for all); lora: frozen base + adapters "
                         "(grads and AdamW for the adapters only), as the trainer's --train lora")
    ap.add_argument("--lora-rank", type=int, default=64, help="--train lora: adapter rank (default 64)")
    ap.add_argument("--lora-alpha", type=float, default=None, help="--train lora: alpha (default 2 x rank; no "
                    "effect on memory)")
    ap.add_argument("--lora-targets", default="all", help="--train lora: groups (attn, mlp, shared, experts, all) "
                    "or expressions, as the trainer's (default all: attention projections and every MLP / expert "
                    "matrix)")
    ap.add_argument("--kl-coef", type=float, default=0.0,
                    help="> 0: the trainer's KL to a reference policy while sampling: a reference phase (the prompt "
                         "captured again under the reference params, the branches replayed), the reference params "
                         "copy of full training held all step (LoRA: none), the update with the KL term")
    ap.add_argument("--time", action="store_true",
                    help="also estimate each phase's seconds per step (capture, sampling, update) from the compiled "
                         "programs' FLOPs, HBM bytes and collective bytes, loops multiplied by their trip counts: "
                         "a roofline on --hardware (capacity/timing.py); compiles a decode step and the update given "
                         "the sampler's capture")
    ap.add_argument("--hardware", choices=sorted(HARDWARE), default="h200",
                    help="--time: the device kind whose peaks the roofline uses (default h200; capacity/hardware.py)")
    ap.add_argument("--kernels", choices=("xla", "pallas"), default="xla",
                    help="--time: cost softmax attention, the chunked GDN and sparse latent attention as compiled "
                         "(xla: the XLA paths' unfused loops, the default) or as the Pallas kernels would run them "
                         "on a GPU (pallas: their FLOPs and compulsory HBM bytes; capacity/hlo/kernels.py); the "
                         "programs compiled are the same")
    ap.add_argument("--hlo-dir", metavar="DIR", help="--time: also write each costed program's compiled HLO text "
                    "into DIR (capacity/hlo can cost it again: `hlo_cost(open(file).read())`)")
    ap.add_argument("--compile-for", choices=sorted(TARGETS), default=None, metavar="KIND",
                    help="compile every program with XLA's own GPU compiler for this device kind (h100, h200, h20: "
                         "compile-only devices, no GPU needed; capacity/gpu_target.py) instead of XLA:CPU's; needs "
                         "jax's CUDA plugin: " + INSTALL)
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--unit", choices=("GiB", "MiB"), default="GiB", help="table unit (default GiB)")
    ap.add_argument("--json", metavar="FILE", help="also write every row as JSON (bytes per phase; 'fits' per row)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        data, seq = parse_mesh_spec(args.mesh)
        args.groups_per_step = data if args.groups_per_step is None else args.groups_per_step
        local_groups(args.groups_per_step, data)
        if args.compile_for:
            os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the host's; the plugin then registers its topology
            devices = compile_only_devices(args.compile_for, data * seq)
        else:
            setup_jax(data * seq)
            devices = None
        with _compiled_for(args.compile_for):
            planner = Planner(args.config, args.mesh, args.dtype, args.response_len, args.chunk_size, devices=devices,
                              train_mode=args.train, lora_rank=args.lora_rank, lora_alpha=args.lora_alpha,
                              lora_targets=args.lora_targets, decode_batch=args.decode_batch, hlo_dir=args.hlo_dir,
                              kl_coef=args.kl_coef, replay_batch=args.replay_batch, kernels=args.kernels,
                              compile_for=args.compile_for)
        for group in args.group_size:
            planner.branches_together(group)  # --decode-batch and --replay-batch must divide every G
    except (ValueError, NotImplementedError, RuntimeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with _compiled_for(args.compile_for):
        return _plan(args, planner)


def _compiled_for(kind: str | None):
    """Inside: the library's backend choices as on a GPU when compiling for one (`ops.triton_ir.reported_backend`)."""
    from longstraw_jax.ops import triton_ir

    return triton_ir.reported_backend("gpu") if kind else contextlib.nullcontext()


def _plan(args, planner) -> int:
    cfg = planner.model.config
    compiler = (f"{planner.mesh.size} x {args.compile_for.upper()}, compile-only, jax {jax.__version__}, XLA's GPU "
                f"compiler" if args.compile_for else f"simulated, jax {jax.__version__}, XLA:CPU")
    print(f"{type(cfg).__name__} from {args.config}: {planner.num_params / 1e9:.2f}B params at {args.dtype}; mesh "
          f"{args.mesh} ({compiler}); R={args.response_len}; "
          f"B={args.groups_per_step} groups per step; rounds of {args.chunk_size:,} positions; device "
          f"{args.device_gb:g} GB", flush=True)
    if planner.lora is not None:
        print(f"--train lora: rank {planner.lora['rank']} on {planner.lora['matrices']} stacked matrices "
              f"({args.lora_targets}); {planner.num_trainable / 1e6:.1f}M trainable parameters (adapters), base frozen",
              flush=True)
    rows, limit = [], int(args.device_gb * 1e9)
    for mode in args.modes.split(","):
        for group in args.group_size:
            for prompt_len in args.prompt_len:
                rows.append(planner.plan(prompt_len, group, mode, args.groups_per_step, limit))
                ref = rows[-1].get("reference")
                print(f"  {mode} G={group} P={prompt_len:,}: sampling {rows[-1]['sampling']['total'] / GIB:.2f} "
                      f"GiB, update {rows[-1]['update']['total'] / GIB:.2f} GiB"
                      + (f", reference {ref['total'] / GIB:.2f} GiB" if ref else "")
                      + f" (compile {rows[-1]['compile_s']:.0f} s)", flush=True)
            if args.search:
                longest, row = planner.search(group, mode, args.groups_per_step, limit, args.search_step, sys.stdout)
                print(f"  longest prompt whose step fits ({mode}, G={group}): {longest:,} positions", flush=True)
                if row is not None:
                    rows.append(dict(row, mode=mode + " (longest)"))
    print(format_rows(rows, args.device_gb, args.markdown, args.unit))
    timing = None
    if args.time:
        hw = hardware(args.hardware)
        timing = dict(hardware=dataclasses.asdict(hw), kernels=args.kernels, rows=[])
        for row in rows:
            if row["mode"] in args.modes.split(","):  # the searched rows ("... (longest)") are not timed
                start = time.perf_counter()
                try:
                    timing["rows"].append(planner.timing(row["P"], row["G"], row["mode"], row["B"], hw))
                except ValueError as e:  # a loop without any bound on its trip count (hlo/walk.py)
                    print(f"error: --time: {e}", file=sys.stderr)
                    return 2
                print(f"  timed {row['mode']} G={row['G']} P={row['P']:,} ({time.perf_counter() - start:.0f} s)",
                      flush=True)
        if args.kernels == "pallas":
            print("\nsoftmax attention, the chunked GDN and sparse latent attention costed as the Pallas kernels "
                  "(capacity/hlo/kernels.py)")
        print("\n" + format_times(timing["rows"], hw, args.markdown))
    if args.json:
        write_json(args.json, rows, args, planner, timing)
    for mode in args.modes.split(","):
        for prompt_len in args.prompt_len:
            cells = {row["G"]: row["peak"] for row in rows if row["mode"] == mode and row["P"] == prompt_len}
            if len(cells) > 1:
                lo, hi = min(cells), max(cells)
                print(f"{mode} P={prompt_len:,}: G {lo} -> {hi} costs {(cells[hi] - cells[lo]) / 1e9:+.4f} GB "
                      f"({cells[hi] - cells[lo]:+,} bytes) at the step's peak")
    return 0

