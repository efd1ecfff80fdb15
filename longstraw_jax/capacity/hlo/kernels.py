"""Softmax attention costed as the Pallas flash-attention kernels (`ops/flash_attention.py`) would run it on a GPU
(`KernelModel`), not as XLA's unfused lowering of the XLA path.

Why the XLA path's loops: the planner's programs are compiled by XLA:CPU (simulated meshes), where the kernels would
run interpreted (their grid unrolled into loops of slices, nothing like a GPU's traffic); a program lowered for CUDA
on the CPU host (`lower(lowering_platforms=("cuda",))`) holds the kernels as `__gpu$xla.gpu.triton` custom calls, but
as unoptimized HLO (no fusion: its bytes are no device's), and a custom call's operands say neither the causal mask
nor the visible length (scalars computed at run time). So the model re-costs the XLA path's attention where the
walker already counts it, loops multiplied by their trip counts: an *attention loop* is a while loop with matmuls in
its body under `ATTENTION_FUNCTIONS` in its stack frames (`ops.attention.for_each_block`'s key-block loop of one
`attend` call: forward, 2 matmuls per key block, QK^T and PV; backward, 5: QK^T, dP, dV, dQ, dK; under autodiff
only the outer frame `attend` is recorded, so the two are told apart by their matmul count). From its cost as
compiled and the model's shapes (Hq, Hkv, D, Dv: the config's, `KernelModel`):

      V = compiled FLOPs / (2 (D + Dv))  forward,  / (2 (3 D + 2 Dv))  backward
          the (query, key, query head) triples the XLA path visits: every query against every key of the key blocks
          up to the last one any query sees (512 keys a block); the kernels visit 64 x 64 tiles, so on a causal
          diagonal they skip up to T^2 / 2 pairs per call that V counts: kernel FLOPs <= the model's
      T = elements / Hq of the carried softmax statistics ([..., T, Hkv, rep]: the running max / the saved
          log-sum-exp), the queries;  L = V / (T Hq), the keys each query visits;
      S = the layer's keys, rows of the backward's float32 dK buffer [..., S, Hkv, D]

  forward (`flash_attention_forward`, one program per query block and head, key blocks up to the last visible):
      FLOPs  2 (D + Dv) V
      bytes  q T Hq D i + k, v L Hkv (D + Dv) i + out, lse T Hq (Dv + 1) 4
  backward (`flash_attention_dq`: the same key blocks; `flash_attention_dkv`: one program per key block of the
  layer, which loads its K / V rows and writes its dK / dV rows whatever it sees, and skips the key blocks past
  kv_length and the causal query blocks that end before it: the same tiles as dQ):
      FLOPs  2 (2 D + Dv) V  (dQ: QK^T, dP, dS K)  +  2 (2 D + 2 Dv) V  (dK / dV: QK^T, dP, P^T dO, dS^T Q)
      bytes  dQ:  q, dO T Hq (D + Dv) i + k, v L Hkv (D + Dv) i + lse, delta 2 T Hq 4 + dq T Hq D 4
             dKV: q, dO T Hq (D + Dv) i + k, v S Hkv (D + Dv) i + lse, delta 2 T Hq 4 + dk, dv S Hkv (D + Dv) 4

i: bytes per element of q, k, v, dO (`KernelModel.itemsize`, the params' dtype); outputs, dQ, dK, dV and the
statistics are float32 (the kernels' accumulators). HBM bytes are the compulsory traffic, each array read or written
once per kernel: a K / V tile re-read by the query blocks of one head (a Q tile by the key blocks, in dKV) is
assumed to hit L2 (the roofline's memory term is then a floor). Collectives are as compiled. Everything outside the
attention loops is unchanged: the static tail block (`for_each_block`'s `lax.cond`, when S is not a multiple of the
XLA block), delta = rowsum(dO O) - dLSE and the placement of a layer's dK / dV into the cache's cotangent are XLA ops
under either choice. Queries are not rounded up to the kernels' query block (T is a multiple of 64 in a capture
round; a decode step has no backward). Tested in tests/capacity/test_cost.py against these formulas on one `attend`
call and its gradient.
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping

from longstraw_jax.capacity.hlo.parse import Instruction, array_shapes, called
from longstraw_jax.capacity.hlo.program import Program
from longstraw_jax.capacity.hlo.totals import Cost

# the XLA path of softmax attention, by the "file:function" suffixes of an instruction's stack frames
ATTENTION_FUNCTIONS = ("ops/attention.py:attend",)
INTERPRETED_FUNCTIONS = ("ops/flash_attention.py:attend",)  # the kernels run interpreted: not the XLA path
FORWARD_MATMULS, BACKWARD_MATMULS = 2, 5  # matmuls in a key-block loop's body
ACCUM = 4  # bytes of the kernels' float32 outputs, statistics and gradients


@dataclasses.dataclass(frozen=True)
class KernelModel:
    """Cost softmax attention as the Pallas flash kernels (module docstring): the model's query heads, key/value
    heads, head dims and the bytes per element of q, k, v (its params' dtype: bf16 = 2)."""

    heads: int
    kv_heads: int
    head_dim: int
    value_dim: int
    itemsize: float = 2.0

    def __post_init__(self):
        for name in ("heads", "kv_heads", "head_dim", "value_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"KernelModel.{name} {value!r} must be a positive integer")
        if self.heads % self.kv_heads:
            raise ValueError(f"KernelModel: {self.heads} query heads are not a multiple of {self.kv_heads} kv heads")
        if not self.itemsize > 0:
            raise ValueError(f"KernelModel.itemsize {self.itemsize!r} must be > 0")

    @classmethod
    def for_config(cls, config, itemsize: float) -> "KernelModel":
        """The model of a config with softmax attention layers (Qwen3.6: num_attention_heads, num_key_value_heads,
        head_dim); ValueError for a family without softmax attention kernels (GLM-5.x's sparse latent attention)."""
        if not all(hasattr(config, a) for a in ("kernels", "num_attention_heads", "num_key_value_heads", "head_dim")):
            raise ValueError(f"{type(config).__name__}: no Pallas kernels for this family (--kernels pallas costs "
                             f"Qwen3.6's softmax attention only)")
        return cls(config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.head_dim,
                   float(itemsize))

    def forward(self, triples: float, queries: float) -> Cost:
        """The forward kernel over `triples` visited (query, key, head) triples of `queries` queries."""
        d, dv, i = self.head_dim, self.value_dim, self.itemsize
        keys = triples / (queries * self.heads)
        hbm = queries * self.heads * d * i + keys * self.kv_heads * (d + dv) * i + queries * self.heads * (dv + 1) \
            * ACCUM
        return Cost(2.0 * (d + dv) * triples, hbm)

    def backward(self, triples: float, queries: float, layer_keys: float) -> Cost:
        """The dQ and dK / dV kernels (module docstring); `layer_keys`: S, the keys of the layer's cache (the
        dK / dV kernel loads and writes all of its rows)."""
        d, dv, i, h, hkv = self.head_dim, self.value_dim, self.itemsize, self.heads, self.kv_heads
        keys = triples / (queries * h)
        flops = 2.0 * (2 * d + dv) * triples + 2.0 * (2 * d + 2 * dv) * triples
        rows = queries * h * (d + dv) * i + 2 * queries * h * ACCUM  # q, dO, lse, delta: read by each kernel
        dq = rows + keys * hkv * (d + dv) * i + queries * h * d * ACCUM
        dkv = rows + layer_keys * hkv * (d + dv) * (i + ACCUM)
        return Cost(flops, dq + dkv)


class FlashKernels:
    """The attention loops of `program` (by the stack frames `frames`, `parse.stack_functions`) and their cost: as
    compiled (`model` None) or as the flash kernels (`model`: a KernelModel)."""

    def __init__(self, program: Program, frames: Mapping[int, tuple[str, ...]], model: KernelModel | None = None):
        self.program, self.frames, self.model = program, frames, model

    def _in_stack(self, instr: Instruction, names: tuple[str, ...]) -> bool:
        m = re.search(r"stack_frame_id=(\d+)", instr.attrs)
        functions = self.frames.get(int(m.group(1)), ()) if m else ()
        return any(f == n or f.endswith("/" + n) for f in functions for n in names)

    def matmuls(self, instr: Instruction) -> int:
        """Dots and GEMM custom calls in a while loop's body (fusions and nested calls included)."""
        body = self.program.reachable(called(instr, "body"))
        return sum(i.opcode == "dot" or (i.opcode == "custom-call" and "cublas" in i.attrs)
                   for c in body for i in self.program.computations.get(c, []))

    def attention_loop(self, instr: Instruction) -> bool:
        """A key-block loop of the XLA path's `attend` (forward or backward)."""
        return (instr.opcode == "while" and self._in_stack(instr, ATTENTION_FUNCTIONS)
                and not self._in_stack(instr, INTERPRETED_FUNCTIONS)
                and self.matmuls(instr) in (FORWARD_MATMULS, BACKWARD_MATMULS))

    def _queries(self, instr: Instruction) -> float:
        """T: elements / Hq of the smallest float array of the carried tuple shaped [..., T, Hkv, rep] or
        [..., T, Hq] (the softmax statistics)."""
        m = self.model
        rep = m.heads // m.kv_heads
        found = [math.prod(dims) / m.heads for dtype, dims in array_shapes(instr.shape)
                 if dtype.startswith(("f", "bf")) and len(dims) >= 2
                 and (tuple(dims[-2:]) == (m.kv_heads, rep) or (dims[-1] == m.heads and len(dims) >= 2))]
        if not found:
            raise ValueError(f"attention loop {instr.name}: no softmax statistics [..., T, {m.kv_heads}, {rep}] in "
                             f"its carried tuple {instr.shape[:300]}: not a model with these heads")
        return min(found)

    def _layer_keys(self, instr: Instruction) -> float:
        """S: the rows of the backward's float32 dK buffer [..., S, Hkv, D] (the largest such array)."""
        m = self.model
        rep = m.heads // m.kv_heads
        found = [dims[-3] for dtype, dims in array_shapes(instr.shape)
                 if dtype == "f32" and len(dims) >= 3 and tuple(dims[-2:]) == (m.kv_heads, m.head_dim)
                 and not (len(dims) >= 4 and tuple(dims[-3:]) == (m.kv_heads, rep, m.head_dim))]
        if not found:
            raise ValueError(f"attention backward loop {instr.name}: no dK buffer [S, {m.kv_heads}, {m.head_dim}] "
                             f"in its carried tuple {instr.shape[:300]}")
        return float(max(found))

    def loop_cost(self, instr: Instruction, compiled: Cost) -> Cost:
        """The cost of while loop `instr` given its cost as compiled: an attention loop's re-costed as the kernels
        when there is a model (collectives and loop lists kept), anything else's unchanged."""
        if self.model is None or not self.attention_loop(instr):
            return compiled
        m, queries = self.model, self._queries(instr)
        if self.matmuls(instr) == FORWARD_MATMULS:
            kernel = m.forward(compiled.flops / (2.0 * (m.head_dim + m.value_dim)), queries)
        else:
            kernel = m.backward(compiled.flops / (2.0 * (3 * m.head_dim + 2 * m.value_dim)), queries,
                                self._layer_keys(instr))
        return dataclasses.replace(compiled, flops=kernel.flops, hbm_bytes=kernel.hbm_bytes)
