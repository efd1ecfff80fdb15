"""FLOPs of one instruction, per device (the HLO is the per-device SPMD program).

`Cost.flops` counts dot, convolution and cuBLAS GEMM custom calls (XLA:GPU's dots) only, 2 x (result elements) x
(contracted elements), batch dimensions included (dot: 2 * batch * M * N * K); other custom calls (e.g. fused
attention kernels) count none. Elementwise and reduction arithmetic is not counted (it is what XLA's cost_analysis
adds on top: small next to the matmuls of a transformer; tests bound the difference). A fusion's FLOPs are those of
the instructions inside its fused computation (`walk.Walk.static`).
"""
from __future__ import annotations

import math
import re
from collections.abc import Mapping

from longstraw_jax.capacity.hlo.parse import Instruction, array_shapes, attr


def dot_flops(instr: Instruction, shapes: Mapping[str, str]) -> float:
    """2 x result elements x contracted elements of a dot (batch dims are in the result)."""
    result = array_shapes(instr.shape)[0][1]
    lhs = array_shapes(shapes[instr.operands[0]])[0][1]
    dims = attr(instr.attrs, "lhs_contracting_dims")
    contracted = math.prod(lhs[int(d)] for d in dims.strip("{}").split(",") if d.strip()) if dims else 1
    return 2.0 * math.prod(result) * contracted


def gemm_flops(instr: Instruction, shapes: Mapping[str, str]) -> float:
    """A GPU library GEMM (`custom-call` to `__cublas$gemm` / `__cublas$lt$matmul`, as XLA:GPU rewrites dots):
    2 x output elements x contracted elements, the contraction from its backend_config's dot_dimension_numbers;
    0 for any other custom call (their FLOPs are not counted)."""
    target = attr(instr.attrs, "custom_call_target") or ""
    if "cublas" not in target or not instr.operands:
        return 0.0
    m = re.search(r'"lhs_contracting_dimensions"\s*:\s*\[([^\]]*)\]', instr.attrs)
    lhs = array_shapes(shapes.get(instr.operands[0], ""))
    if m is None or not lhs:
        return 0.0
    contracted = math.prod(lhs[0][1][int(d.strip().strip('"'))] for d in m.group(1).split(",") if d.strip())
    return 2.0 * math.prod(array_shapes(instr.shape)[0][1]) * contracted  # the output (a tuple's first: + workspace)


def conv_flops(instr: Instruction, shapes: Mapping[str, str]) -> float:
    """2 x output elements x (kernel elements / output features): each output multiplies a window of the kernel's
    spatial size times its (per feature group) input features."""
    out = array_shapes(instr.shape)[0][1]
    kernel = array_shapes(shapes[instr.operands[1]])[0][1]
    labels = attr(instr.attrs, "dim_labels") or ""
    kernel_labels = labels.split("_")[1].split("->")[0] if "_" in labels else ""
    features = kernel[kernel_labels.index("o")] if "o" in kernel_labels else 1
    return 2.0 * math.prod(out) * math.prod(kernel) / max(features, 1)

