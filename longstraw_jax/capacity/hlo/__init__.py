"""Per-device cost of a compiled program, with loop trip counts applied: FLOPs, HBM bytes and collective bytes.

    cost = program_cost(jax.jit(f).lower(...).compile())     # or hlo_cost(compiled.as_text())
    cost.flops, cost.hbm_bytes, cost.collective_bytes        # collective_bytes: {kind: bytes}

XLA's `compiled.cost_analysis()` counts a while loop's body once. This package parses the compiled (post-SPMD, per
device) HLO text instead and walks the computations from ENTRY, multiplying each loop body by its trip count. Each
module's docstring states its part of the model:

    api.py          hlo_cost, program_cost, xla_cost: the entry points
    totals.py       Cost: per-device totals, added, scaled, the maximum over a conditional's branches
    parse.py        HLO text -> computations of Instructions; attributes, array shapes, stack frames
    walk.py         Walk: the computations from ENTRY, loops x trip counts, conditionals, calls, fusions
    program.py      Program: the parsed module's call structure, fixed trip counts, which computations are dynamic
    values.py       Scalars: interval values of integer instructions (data-dependent loop bounds)
    intervals.py    the interval arithmetic of HLO's integer ops
    relevance.py    Relevance: the parameter slots a walk reads (walks cached by those values only)
    flops.py        FLOPs of dots, convolutions, GEMM custom calls
    hbm.py          HBM bytes an instruction reads and writes
    collectives.py  bytes one device sends per collective
    widening.py     float32 values XLA:CPU widened from bf16, counted at bf16
    experts.py      ExpertModel: routed experts costed as a GPU's grouped matmul
    kernels.py      Kernels: softmax attention, the chunked GDN, sparse latent attention costed as the Pallas
                    kernels (KernelModel, GatedDeltaModel, SparseLatentModel)
"""
from longstraw_jax.capacity.hlo.api import hlo_cost, program_cost, xla_cost
from longstraw_jax.capacity.hlo.collectives import COLLECTIVES, collective_bytes, group_size
from longstraw_jax.capacity.hlo.experts import EXPERT_CALL_FUNCTIONS, EXPERT_LOOP_FUNCTIONS, ExpertModel
from longstraw_jax.capacity.hlo.flops import conv_flops, dot_flops, gemm_flops
from longstraw_jax.capacity.hlo.kernels import (
    ATTENTION_FUNCTIONS,
    GATED_DELTA_FUNCTIONS,
    LATENT_FUNCTIONS,
    GatedDeltaModel,
    KernelModel,
    Kernels,
    SparseLatentModel,
)
from longstraw_jax.capacity.hlo.parse import (
    Instruction,
    array_shapes,
    parse_instruction,
    parse_module,
    shape_bytes,
    stack_functions,
    trip_count,
)
from longstraw_jax.capacity.hlo.totals import Cost

__all__ = ["ATTENTION_FUNCTIONS", "COLLECTIVES", "Cost", "EXPERT_CALL_FUNCTIONS", "EXPERT_LOOP_FUNCTIONS",
           "ExpertModel", "GATED_DELTA_FUNCTIONS", "GatedDeltaModel", "LATENT_FUNCTIONS", "SparseLatentModel",
           "Instruction", "KernelModel", "Kernels", "array_shapes", "collective_bytes", "conv_flops", "dot_flops",
           "gemm_flops",
           "group_size", "hlo_cost", "parse_instruction", "parse_module", "program_cost", "shape_bytes",
           "stack_functions", "trip_count", "xla_cost"]
