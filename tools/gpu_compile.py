"""XLA's own GPU compiler, run on a CPU host: every Pallas kernel and the trainer's capture and update compiled for an
H100 (H200, H20) without one, as the device would compile them, with the compiled programs' memory and time model.

    python3 -m venv /tmp/vgpu && /tmp/vgpu/bin/pip install -e '.[gpu-compile]'   # a venv of its own (below)
    JAX_PLATFORMS=cpu /tmp/vgpu/bin/python tools/gpu_compile.py --device h100 --tiles --json gpu_compile.json
    JAX_PLATFORMS=cpu /tmp/vgpu/bin/python tools/gpu_compile.py --measure programs --train lora --lens 64K

jax's CUDA plugin (the `gpu-compile` extra; no CUDA libraries, no GPU) compiles ahead of time for a GPU it is only
described: `capacity.gpu_target` builds compile-only devices from a target description (SM count, shared memory,
memory size and bandwidth), and a program lowered onto them goes through XLA's whole GPU pipeline, fusions, Triton
GEMMs and the Pallas kernels' Triton modules included (XLA refuses a kernel whose shared memory is over the
device's, as the device would). Nothing runs: no timing, no numerics. (In `.venv` the plugin would make every JAX
process look for a GPU first, hence its own venv; JAX_PLATFORMS=cpu keeps the host's platform the only one.)

Two tables:
- **kernels**: tools/triton_resources.py's full-size cases (flash attention forward + backward at Qwen3.6-27B's
  attention, the chunked Gated DeltaNet, GLM-5.2's sparse latent attention; the library's launch shapes; `--tiles`:
  also every candidate of bench_device's tiles sweep), each one compile: per kernel launch, XLA's grid, threads and
  shared memory (its dumped thunk sequence) and ptxas's registers and spills on XLA's own PTX (`kernel_resources`),
  or the compiler's error;
- **programs**: tools/bench_device.py's mid-size Qwen3.6 (the 27B widths, `--blocks` blocks, bf16) on one device,
  the capture of each `--lens` and the `--modes` updates at `--step-len` (G, R, chunk as bench_device's; `--train`
  full or LoRA), with `--kernels` xla and pallas: compile seconds, `memory_analysis()` (what the device must hold)
  and the planner's time model of the compiled GPU program (`capacity.hlo.program_cost`, every loop times its trip
  count, on the device's roofline; a Pallas program's kernels are custom calls the model costs at zero, so the XLA
  program's row also gives its cost with the kernels' FLOPs and bytes, as bench_device does).

Each compile runs in this process, one after another; `--json FILE` is rewritten after each row. The planner's own
programs compile the same way with `python -m longstraw_jax.plan --compile-for h20` (docs/benchmarks.md 7.3).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import bench_device
import triton_resources
from bench_device import FITS, GIB  # a program fits the device as bench_device decides

from longstraw_jax.capacity import gpu_target
from longstraw_jax.common.validation import size_arg, sizes_arg


def placed(tree, device):
    """`tree`'s ShapeDtypeStructs on `device` (a compile-only device), for lowering onto it."""
    import jax

    sharding = jax.sharding.SingleDeviceSharding(device)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
                        if isinstance(x, jax.ShapeDtypeStruct) else x, tree)


def compile_on(device, fn, args, static_argnums=(), donate_argnums=(), dump_to: str | None = None):
    """fn jitted and compiled for `device` from `args` (ShapeDtypeStructs; the static ones as they are) -> (the
    compiled executable, seconds taken). dump_to: a directory for XLA's dump of the compile (its thunk sequence and
    PTX: `kernel_resources`)."""
    import jax

    from longstraw_jax.ops import triton_ir

    statics = set(static_argnums)
    args = [a if i in statics else placed(a, device) for i, a in enumerate(args)]
    start = time.perf_counter()
    with triton_ir.reported_backend("gpu"):  # the library's backend choices as on the device
        lowered = jax.jit(fn, static_argnums=static_argnums, donate_argnums=donate_argnums).trace(*args).lower()
        compiled = lowered.compile(compiler_options={"xla_dump_to": dump_to} if dump_to else None)
    return compiled, time.perf_counter() - start


# a kernel launch in XLA's dumped thunk sequence: "] NAME grid: [x, y, z] threads: [x, y, z]  shared_memory: N bytes"
LAUNCH = re.compile(r"\] (\w+) grid: \[(\d+), (\d+), (\d+)\] threads: \[(\d+), (\d+), (\d+)\]\s+"
                    r"shared_memory: (\d+) bytes")


def kernel_resources(dump_dir: str, names: set[str], arch: int = 90) -> list[dict]:
    """What XLA's compile (dumped in `dump_dir` by `compile_on`) launches for each kernel named in `names`: grid,
    threads and shared memory from its thunk sequence, and registers and spills from ptxas -v on XLA's own PTX (the
    ptxas of the `triton` package; without it, None) -> one dict per kernel launch, in program order, with
    programs_per_sm (tools/triton_resources.py's arithmetic)."""
    launches = []
    for path in sorted(glob.glob(os.path.join(dump_dir, "*thunk_sequence.txt")))[:1]:
        with open(path) as f:
            for line in f:
                m = LAUNCH.search(line)
                if m and m.group(1) in names:
                    grid, block = [int(x) for x in m.group(2, 3, 4)], [int(x) for x in m.group(5, 6, 7)]
                    launches.append(dict(kernel=m.group(1), grid=grid, threads=block[0] * block[1] * block[2],
                                         shared=int(m.group(8))))
    registers = _ptxas_reports(dump_dir, names, arch)
    for launch in launches:
        launch.update(registers.get(launch["kernel"], dict(registers=None, spill_stores=None, spill_loads=None)))
        launch["programs_per_sm"] = None if launch["registers"] is None else triton_resources.programs_per_sm(
            launch["registers"], launch["threads"] // 32, launch["shared"], arch)
    return launches


def _ptxas_reports(dump_dir: str, names: set[str], arch: int) -> dict[str, dict]:
    """{kernel: ptxas's registers and spills} for the kernels in `names` found in XLA's dumped PTX."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas
    except ImportError:
        return {}
    out = {}
    for path in sorted(glob.glob(os.path.join(dump_dir, "*.ptx"))):
        with open(path) as f:
            entries = set(re.findall(r"\.entry (\w+)\(", f.read())) & names
        if not entries:
            continue
        report = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name=sm_{arch}a", path, "-o", os.devnull],
                                capture_output=True, text=True, check=True)
        for part in (report.stdout + report.stderr).split("Compiling entry function '")[1:]:
            name = part.split("'", 1)[0]
            if name in entries:
                out[name] = triton_resources.parse_ptxas(part)
    return out


def triton_kernels_in(compiled) -> list[str]:
    """The names of the Pallas (Triton) kernels in a compiled GPU program, in program order."""
    calls = [line for line in compiled.as_text().splitlines() if 'custom_call_target="__gpu$xla.gpu.triton"' in line]
    return [m.group(1) for line in calls for m in [re.search(r'name = "([^"]+)", num_stages', line)] if m]


def kernel_rows(device, echo=print, tiles: bool = False) -> list[dict]:
    """One row per full-size kernel case of tools/triton_resources.py (the defaults; tiles: also each candidate of
    bench_device's tiles sweep): compiled, with its kernels' launches, or the compiler's error."""
    cases = [(f"{family}: defaults", case) for family, case in zip(
        ("flash attention", "gated delta", "sparse latent attention"), triton_resources.default_cases(), strict=True)]
    if tiles:
        cases += [(f"flash attention: {case.label}", case) for case in triton_resources.tile_cases()]
    rows = []
    for label, case in cases:
        fn, args = case.program()
        row = dict(table="kernels", case=label)
        with tempfile.TemporaryDirectory() as dump:
            try:
                compiled, seconds = compile_on(device, fn, args, dump_to=dump)
                names = [n for n in triton_kernels_in(compiled) if case.kernels is None or n in case.kernels]
                row.update(ok=True, compile_s=seconds, kernels=names, resources=kernel_resources(dump, set(names)))
            except Exception as e:  # noqa: BLE001 - the compiler's refusal is the result
                row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:1500]}")
        rows.append(row)
        echo(row)
    return rows


def model_programs(cfg, opts: dict):
    """(name, P, fn, args, static_argnums, donate_argnums) of the capture of each length and each mode's update."""
    import jax
    import jax.numpy as jnp

    from longstraw_jax import GroupBatch, GRPOConfig, models, train

    model = models.build(cfg)
    dtype = jnp.dtype(opts["dtype"])
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), dtype))
    chunk = opts["chunk_size"]
    for n in opts["lens"]:
        yield ("capture", n + 1, lambda p, t: model.capture(p, t, chunk),
               (params, jax.ShapeDtypeStruct((n,), jnp.int32)), (), ())
    frozen = None
    if opts["train"] == "lora":  # as bench_device's steps (and the trainer) split them
        params, frozen = bench_device.lora_split(params, jax.eval_shape)
    optimizer = train.make_optimizer(1e-6)
    opt_state = jax.eval_shape(optimizer.init, params)
    p, g, r = opts["step_len"], opts["group_size"], opts["response_len"]
    s = jax.ShapeDtypeStruct
    batch = GroupBatch(prompt=s((p,), jnp.int32), responses=s((g, r), jnp.int32), mask=s((g, r), jnp.float32),
                       rewards=s((g,), jnp.float32), old_logprobs=s((g, r), jnp.float32), ref_logprobs=None)
    for mode in opts["modes"]:
        yield (mode, p, train.train_step_unvalidated, (model, params, opt_state, batch, optimizer, GRPOConfig(), mode,
                                                       chunk, None, None, frozen), train.STATIC_ARGNUMS,
               train.DONATE_ARGNUMS)


def program_rows(device, device_name: str, opts: dict, echo=print) -> list[dict]:
    """One row per program and kernels choice: compile seconds, memory_analysis and the time model on the device."""
    import jax.numpy as jnp

    from longstraw_jax.capacity import memory_total
    from longstraw_jax.capacity.hardware import HARDWARE, breakdown
    from longstraw_jax.capacity.hlo import Kernels, program_cost

    hw, rows = HARDWARE[device_name], []
    for impl in opts["kernels"]:
        cfg = bench_device.bench_config(opts["config"], opts["blocks"], impl)
        for name, p, fn, args, statics, donated in model_programs(cfg, opts):
            row = dict(table="programs", name=name, kernels=impl, P=p, blocks=opts["blocks"], train=opts["train"])
            try:
                compiled, seconds = compile_on(device, fn, args, statics, donated)
            except Exception as e:  # noqa: BLE001
                row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:1500]}")
                rows.append(row)
                echo(row)
                continue
            cost = program_cost(compiled)
            row.update(ok=True, compile_s=seconds, memory=memory_total(compiled),
                       triton=len(triton_kernels_in(compiled)), cost=cost.as_dict(), terms=breakdown(cost, hw))
            if impl == "xla":  # the same program costed with the kernels' FLOPs and bytes (capacity/hlo/kernels.py)
                kernels = Kernels.for_config(cfg, jnp.dtype(opts["dtype"]).itemsize)
                row["kernels_terms"] = breakdown(program_cost(compiled, kernels=kernels), hw)
            rows.append(row)
            echo(row)
    return rows


def format_programs(rows: list[dict], device: str) -> str:
    """One line per compiled program: memory against the device's (FITS of it: bench_device's rule), the time model
    as compiled (a Pallas program's kernels are uncosted custom calls: "+ kernels") and, for the XLA program, with
    its attention and GDN costed as the kernels (what the Pallas program is expected to take)."""
    from longstraw_jax.capacity.hardware import HARDWARE

    capacity = HARDWARE[device].hbm_bytes
    out = [f"| program | P | kernels | compile s | arguments GiB | temporaries GiB | total GiB | fits {device} "
           f"({FITS:.0%} of {capacity / 1e9:.0f} GB) | Triton kernels | model s as compiled (compute / memory) | "
           "model s, the kernels' costs |",
           "| --- | ---: | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |"]
    for r in rows:
        if not r["ok"]:
            out.append(f"| {r['name']} | {r['P']:,} | {r['kernels']} | failed: {r['error'][:200]} | | | | | | | |")
            continue
        m, t, k = r["memory"], r["terms"], r.get("kernels_terms")
        plus = " + kernels" if r["kernels"] == "pallas" else ""
        with_kernels = f"{k['total']:.3f}" if k else ""
        fits = "yes" if m["total"] <= FITS * capacity else "no"
        out.append(f"| {r['name']} | {r['P']:,} | {r['kernels']} | {r['compile_s']:.0f} | {m['arguments'] / GIB:.1f} | "
                   f"{m['temp'] / GIB:.1f} | {m['total'] / GIB:.1f} | {fits} "
                   f"| {r['triton']} | {t['total']:.3f}{plus} ({t['compute']:.3f} / {t['memory']:.3f}) | "
                   f"{with_kernels} |")
    return "\n".join(out)


def format_kernels(rows: list[dict]) -> str:
    """One line per kernel launch XLA compiled (a case that failed: one line with the compiler's error)."""
    out = ["| case | kernel | grid | threads | shared KiB | registers / thread | spilled B (store / load) "
           "| programs / SM |",
           "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        if not r["ok"]:
            out.append(f"| {r['case']} | failed: {r['error'][:300]} | | | | | | |")
        for k in r.get("resources", []):
            out.append(f"| {r['case']} | {k['kernel']} | {'x'.join(map(str, k['grid']))} | {k['threads']} | "
                       f"{k['shared'] / 1024:.0f} | {k['registers']} | {k['spill_stores']} / {k['spill_loads']} | "
                       f"{k['programs_per_sm']} |")
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=sorted(gpu_target.TARGETS), default="h100")
    parser.add_argument("--measure", default="kernels,programs", help="kernels, programs (a comma list)")
    parser.add_argument("--tiles", action="store_true", help="the kernels table also compiles each tiles candidate")
    full = bench_device.FULL_SIZE
    parser.add_argument("--config", default=full["config"])
    parser.add_argument("--blocks", type=int, default=full["blocks"])
    parser.add_argument("--dtype", default=full["dtype"])
    parser.add_argument("--kernels", default=full["kernels"])
    parser.add_argument("--lens", type=sizes_arg, default="32K,64K", help="capture lengths (tokens)")
    parser.add_argument("--modes", default="detached,exact")
    parser.add_argument("--train", choices=("full", "lora"), default="full",
                        help="the updates train every parameter (AdamW) or LoRA adapters of rank "
                             f"{bench_device.LORA_RANK} on every matrix (bench_device.lora_split)")
    parser.add_argument("--step-len", type=size_arg, default=full["step_len"])
    parser.add_argument("-G", "--group-size", type=int, default=full["group_size"])
    parser.add_argument("-R", "--response-len", type=int, default=full["response_len"])
    parser.add_argument("--chunk-size", type=int, default=full["chunk_size"])
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    opts = dict(vars(args), kernels=args.kernels.split(","), modes=args.modes.split(","))
    import jax

    device = gpu_target.compile_only_devices(args.device, 1)[0]
    summary = dict(device=args.device, target=device.device_kind, jax=jax.__version__, rows=[])

    def echo(row):
        summary["rows"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("cost",)}), file=sys.stderr, flush=True)
        if args.json:
            with open(args.json + ".tmp", "w") as f:
                json.dump(summary, f, indent=1)
            os.replace(args.json + ".tmp", args.json)

    measure = args.measure.split(",")
    if "kernels" in measure:
        print(format_kernels(kernel_rows(device, echo, args.tiles)), flush=True)
    if "programs" in measure:
        print(format_programs(program_rows(device, args.device, opts, echo), args.device), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
