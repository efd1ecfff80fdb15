"""The Triton kernels of a program lowered for CUDA, each kernel's module parsed and verified on the host.

Pallas's Triton lowering writes every kernel as MLIR bytecode into a `__gpu$xla.gpu.triton` custom call of the
lowered program, with its launch (grid, warps, stages), and does not verify it: XLA's GPU compiler parses, and so
verifies, the module only on the device. A module that breaks an MLIR rule (an `scf.for` whose bounds have
different types, say) lowers on a CPU host and fails to compile on the GPU. `triton_kernels` parses each module with
jaxlib's Triton dialect (no GPU and no `triton` package needed), which runs MLIR's verifier, and returns each
kernel's text: what the tests assert on, and what `tools/triton_resources.py` compiles for a GPU to read the
kernel's registers and shared memory.
"""
from __future__ import annotations

import contextlib
import dataclasses

import jax

CALL_TARGET = "__gpu$xla.gpu.triton"


class InvalidTritonModule(ValueError):
    """A kernel's Triton module fails MLIR's verifier (the message names the kernel and the verifier's error)."""


@dataclasses.dataclass(frozen=True)
class TritonKernel:
    name: str
    grid: tuple[int, int, int]
    num_warps: int
    num_stages: int
    module: str  # the verified Triton-dialect module, MLIR text


@contextlib.contextmanager
def h100_target_without_a_gpu():
    """Inside, CUDA lowerings on a host without a GPU lower Pallas's Triton kernels for an H100 (sm_90): jax >= 0.11's
    lowering asks the default device for its GPU's description (0.10's did not, and a GPU has its own): nothing
    changes there."""
    if jax.__version_info__ < (0, 11) or jax.default_backend() == "gpu":
        yield
        return
    from jax._src.pallas.triton import gpu_info

    real = gpu_info.get_gpu_info
    gpu_info.get_gpu_info = lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H100)
    try:
        yield
    finally:
        gpu_info.get_gpu_info = real


@contextlib.contextmanager
def reported_backend(backend: str):
    """Inside: `jax.default_backend()` (which every backend choice of the library reads: `ops.kernels.resolve`, the
    kernels' interpret mode, the decode step's products) returns `backend`, so a program traced on a CPU host for a
    GPU takes the GPU's branches. JAX's caches are cleared on entry and on exit, so that no trace made for one
    backend (loop bodies are cached) is reused under the other."""
    jax.clear_caches()
    real = jax.default_backend
    jax.default_backend = lambda: backend
    try:
        yield
    finally:
        jax.default_backend = real
        jax.clear_caches()


def _backend_config(op):
    from jax._src.lib.mlir import ir

    for key in ("mhlo.backend_config", "backend_config"):  # where jaxlib 0.10 / 0.11 put it
        if key in op.attributes:
            try:
                return ir.DictAttr(op.attributes[key])
            except ValueError:
                continue
    raise ValueError(f"a {CALL_TARGET} custom call without a backend config dictionary")


def _custom_calls(operation):
    """The `stablehlo.custom_call`s to the Triton target under `operation`, in program order."""
    from jax._src.lib.mlir import ir

    for region in operation.regions:
        for block in region.blocks:
            for op in block.operations:
                if (op.operation.name == "stablehlo.custom_call"
                        and ir.StringAttr(op.attributes["call_target_name"]).value == CALL_TARGET):
                    yield op
                yield from _custom_calls(op.operation)


def parse_module(name: str, bytecode: bytes) -> str:
    """The text of a kernel's Triton module, parsed from its bytecode (and so verified); InvalidTritonModule if the
    verifier rejects it."""
    from jax._src.lib.mlir import ir
    from jaxlib.triton import dialect

    context = ir.Context()
    dialect.register_dialect(context)
    with context:
        try:
            return ir.Module.parse(bytecode).operation.get_asm()
        except ir.MLIRError as e:  # its first lines (the notes after them print the whole failing op)
            error = str(e).split("\n note:")[0]
            raise InvalidTritonModule(f"Triton kernel {name!r}: its module fails verification: {error}") from None


def triton_kernels(lowered: jax.stages.Lowered) -> list[TritonKernel]:
    """Every Triton kernel a program lowered for CUDA (`jit(f).trace(...).lower(lowering_platforms=("cuda",))`)
    calls, in program order, each module verified (InvalidTritonModule names the first that is not)."""
    from jax._src.lib.mlir import ir

    kernels = []
    for op in _custom_calls(lowered.compiler_ir("stablehlo").operation):
        config = _backend_config(op)
        name = ir.StringAttr(config["name"]).value
        integer = lambda key, config=config: ir.IntegerAttr(config[key]).value
        kernels.append(TritonKernel(name=name, grid=(integer("grid_x"), integer("grid_y"), integer("grid_z")),
                                    num_warps=integer("num_warps"), num_stages=integer("num_stages"),
                                    module=parse_module(name, ir.StringAttr(config["ir"]).value_bytes)))
    return kernels
