"""What each Pallas kernel asks of a GPU's streaming multiprocessor, read on a CPU host: registers per thread, bytes
spilled to local memory, shared memory, and how many of its programs one SM holds at once.

    pip install -e '.[triton]'                                  # the `triton` package (its compiler and ptxas)
    .venv/bin/python tools/triton_resources.py                   # sm_90 (H100 / H200 / H20), a Markdown table
    .venv/bin/python tools/triton_resources.py --arch 80 --json resources.json

Every kernel is lowered for CUDA at full-size shapes, with the library's default launch shapes and with each
candidate of tools/bench_device.py's tiles sweep (TILE_CANDIDATES): the flash-attention forward, dQ and dK / dV at
Qwen3.6-27B's attention (24 query / 4 KV heads of 256, bf16, a chunk of 8K over itself), the chunked Gated DeltaNet's
six kernels (48 value heads, dk = dv = 128, chunks of 64, 8K tokens) and GLM-5.2's sparse latent attention (64 heads,
512 + 64 channels, 2048 selected rows, bf16). Each kernel's Triton module is read back from the lowered program and
verified (`longstraw_jax.ops.triton_ir`), compiled for the target by the `triton` package's compiler, and its PTX
assembled by the ptxas that Triton ships, with `-v` (registers, spills). Programs per SM: the fewest that registers
(65,536 per SM), shared memory (SM_LIMITS) and warps (64) allow; 0 when one program does not fit (shared memory over
the per-block limit: the launch fails on the device).

The numbers are the pip `triton` compiler's (its version is printed), not those of the Triton inside XLA that the
device runs: a proxy, close where both lower the same module to the same MMA instructions, that says before a GPU is
lent which launch shapes spill or do not fit, and so which the device day need not time. `make test` installs it (the
test extra): tests/tools/test_triton_resources.py compiles every kernel at its defaults and asserts each fits.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile

import bench_device

# per compute capability: (shared memory per SM, the most one program (block) may use), bytes; registers per SM
SM_LIMITS = {80: (167936, 166912), 86: (102400, 101376), 89: (102400, 101376), 90: (233472, 232448)}
REGISTERS_PER_SM, MAX_WARPS_PER_SM, MAX_PROGRAMS_PER_SM = 65536, 64, 32


@dataclasses.dataclass(frozen=True)
class Case:
    """One program: `label` (the launch shapes tried), `program()` -> (a function, its arguments as
    ShapeDtypeStructs), and the kernels of it to report (None: all)."""
    label: str
    program: object
    kernels: tuple[str, ...] | None = None

    def lower(self):
        """The program jitted and lowered for CUDA from its shapes (nothing allocated or compiled)."""
        import jax

        fn, args = self.program()
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


def parse_ptxas(text: str) -> dict:
    """ptxas -v's report of one entry: {"registers", "spill_stores", "spill_loads"} (bytes spilled)."""
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    registers = re.search(r"Used (\d+) registers", text)
    if not (spills and registers):
        raise ValueError(f"no register / spill report in ptxas's output:\n{text[-2000:]}")
    return dict(registers=int(registers.group(1)), spill_stores=int(spills.group(1)),
                spill_loads=int(spills.group(2)))


def programs_per_sm(registers: int, num_warps: int, shared: int, arch: int) -> int:
    """How many programs (thread blocks) of this kernel one SM of `arch` holds at once: the fewest that registers
    (allocated per warp in units of 256), shared memory and warps allow; 0 if one program's shared memory is over
    the per-block limit."""
    per_sm, per_block = SM_LIMITS[arch]
    if shared > per_block:
        return 0
    per_warp = -(-registers * 32 // 256) * 256
    by_registers = REGISTERS_PER_SM // (per_warp * num_warps)
    by_shared = per_sm // shared if shared else MAX_PROGRAMS_PER_SM
    return min(by_registers, by_shared, MAX_WARPS_PER_SM // num_warps, MAX_PROGRAMS_PER_SM)


def _attention(tiles, forward_only: bool):
    """The program of the flash-attention kernels with `tiles` at bench_device's first attention case (a chunk over
    itself, causal): the forward alone, or its gradient (forward, dQ, dK / dV)."""
    import jax
    import jax.numpy as jnp

    from longstraw_jax.ops import flash_attention

    shape = bench_device.KERNEL_SHAPES["full"]
    _, t, s = shape["cases"][0]
    dtype = jnp.dtype(shape["dtype"])
    q = jax.ShapeDtypeStruct((t, shape["heads"], shape["head_dim"]), dtype)
    kv = jax.ShapeDtypeStruct((s, shape["kv_heads"], shape["head_dim"]), dtype)

    def loss(q, k, v):
        r = flash_attention.attend(q, k, v, q_positions=jnp.arange(t, dtype=jnp.int32) + s - t, k_offset=0,
                                   scale=shape["head_dim"] ** -0.5, causal=True, interpret=False, tiles=tiles)
        return jnp.sum(r.out.astype(jnp.float32)) + jnp.sum(r.lse)

    return lambda: (loss if forward_only else jax.grad(loss, argnums=(0, 1, 2)), (q, kv, kv))


def _gated_delta():
    import jax
    import jax.numpy as jnp

    from longstraw_jax import models
    from longstraw_jax.ops import flash_gated_delta

    shape = bench_device.GDN_SHAPES["full"]
    cfg = models.config_from_hf(os.path.join(bench_device.ROOT, shape["config"]))
    h, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    t = shape["cases"][0][1]
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)

    def loss(*args):
        o, state = flash_gated_delta.gated_delta_rule(*args, chunk_size=cfg.gdn_chunk_for("pallas"), interpret=False)
        return jnp.sum(o) + jnp.sum(state)

    args = (f32(t, h, dk), f32(t, h, dk), f32(t, h, dv), f32(t, h), f32(t, h), f32(h, dk, dv))
    return lambda: (jax.grad(loss, argnums=tuple(range(6))), args)


def _sparse_latent():
    import jax
    import jax.numpy as jnp

    from longstraw_jax import models
    from longstraw_jax.ops import flash_mla

    shape = bench_device.LATENT_SHAPES["full"]
    cfg = models.config_from_hf(os.path.join(bench_device.ROOT, shape["config"]))
    _, t, s = shape["cases"][0]
    width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    dtype = jnp.dtype(shape["dtype"])

    def loss(q, cache, new, selected):
        r = flash_mla.sparse_latent_attention_partial(q, cache, 0, new, selected, s, scale=0.1,
                                                      value_dim=cfg.kv_lora_rank, interpret=False)
        return jnp.sum(r.out.astype(jnp.float32)) + jnp.sum(r.lse)

    args = (jax.ShapeDtypeStruct((t, cfg.num_attention_heads, width), dtype),
            jax.ShapeDtypeStruct((1, s, width), dtype), jax.ShapeDtypeStruct((t, width), dtype),
            jax.ShapeDtypeStruct((t, cfg.index_topk), jnp.int32))
    return lambda: (jax.grad(loss, argnums=(0, 1, 2)), args)


def default_cases() -> list[Case]:
    """Every kernel of the three families with the library's defaults."""
    from longstraw_jax.ops import flash_attention

    return [Case("default", _attention(flash_attention.DEFAULT_TILES, forward_only=False)),
            Case("default", _gated_delta()), Case("default", _sparse_latent())]


def tile_cases() -> list[Case]:
    """Each forward and backward tiles candidate of bench_device but its first (the default)."""
    from longstraw_jax.ops import flash_attention

    candidates, out = bench_device.TILE_CANDIDATES["full"], []
    for c in candidates["forward"][1:]:
        tiles = flash_attention.FlashTiles(forward=flash_attention.KernelTiles(*c))
        out.append(Case(bench_device.tile_label("forward", c), _attention(tiles, forward_only=True),
                        ("flash_attention_forward",)))
    for c in candidates["backward"][1:]:
        tiles = flash_attention.FlashTiles(dq=flash_attention.KernelTiles(*c[0]),
                                           dkv=flash_attention.KernelTiles(*c[1]))
        out.append(Case(bench_device.tile_label("backward", c), _attention(tiles, forward_only=False),
                        ("flash_attention_dq", "flash_attention_dkv")))
    return out


def compile_kernel(kernel, arch: int, workdir: str) -> dict:
    """One verified kernel (`ops.triton_ir.TritonKernel`) compiled for sm_`arch` by the `triton` package: its shared
    memory (bytes) and ptxas's registers and spills."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas  # the ptxas Triton itself assembles the PTX with

    path = os.path.join(workdir, f"{kernel.name}.ttir")
    with open(path, "w") as f:
        f.write(kernel.module)
    compiled = triton.compile(path, target=GPUTarget("cuda", arch, 32),
                              options=dict(num_warps=kernel.num_warps, num_stages=kernel.num_stages))
    with open(path + ".ptx", "w") as f:
        f.write(compiled.asm["ptx"])
    gpu = f"sm_{arch}{'a' if arch >= 90 else ''}"
    report = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name={gpu}", path + ".ptx", "-o", os.devnull],
                            capture_output=True, text=True, check=True)
    return dict(shared=int(compiled.metadata.shared), **parse_ptxas(report.stdout + report.stderr))


def measure(arch: int, cases: list[Case], echo: bool = True) -> list[dict]:
    """One row per kernel of each case: its launch and `compile_kernel`'s resources with `programs_per_sm`, or
    "failed" (the compiler's error)."""
    from longstraw_jax.ops import triton_ir

    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for case in cases:
            for kernel in triton_ir.triton_kernels(case.lower()):
                if case.kernels is not None and kernel.name not in case.kernels:
                    continue
                row = dict(kernel=kernel.name, tiles=case.label, grid=list(kernel.grid), num_warps=kernel.num_warps,
                           num_stages=kernel.num_stages)
                try:
                    row.update(compile_kernel(kernel, arch, workdir))
                except Exception as e:  # noqa: BLE001 - recorded, the next kernel still compiles
                    row["failed"] = f"{type(e).__name__}: {e}"[:2000]
                else:
                    row["programs_per_sm"] = programs_per_sm(row["registers"], kernel.num_warps, row["shared"], arch)
                rows.append(row)
                if echo:
                    print(format_row(row), flush=True)
    return rows


HEADER = ("| kernel | launch shapes | grid | warps | stages | registers / thread | spilled B (store / load) | "
          "shared KiB | programs / SM |\n| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")


def format_row(row: dict) -> str:
    head = f"| {row['kernel']} | {row['tiles']} | {'x'.join(map(str, row['grid']))} | {row['num_warps']} | " \
           f"{row['num_stages']} |"
    if "failed" in row:
        return head + f" failed: {row['failed'].splitlines()[0][:120]} | | | |"
    return head + f" {row['registers']} | {row['spill_stores']} / {row['spill_loads']} | " \
                  f"{row['shared'] / 1024:.0f} | {row['programs_per_sm']} |"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90, choices=sorted(SM_LIMITS),
                    help="compute capability to compile for (90: H100 / H200 / H20)")
    ap.add_argument("--json", metavar="FILE", help="write the rows, the triton and jax versions here")
    args = ap.parse_args(argv)
    try:
        import triton
    except ImportError:
        raise SystemExit("error: this tool needs the `triton` package: pip install -e '.[triton]'") from None
    import jax

    from longstraw_jax.ops import triton_ir

    print(f"triton {triton.__version__}, jax {jax.__version__}, sm_{args.arch}\n\n{HEADER}", flush=True)
    with triton_ir.h100_target_without_a_gpu():  # jax >= 0.11 on a CPU host: the lowering's own target (sm_90)
        rows = measure(args.arch, default_cases() + tile_cases())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(triton=triton.__version__, jax=jax.__version__, arch=args.arch, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
