"""The XLA paths' hot loops costed as the Pallas kernels (`ops/flash_*.py`) would run them on a GPU (`Kernels`:
softmax attention, `KernelModel`; the chunked Gated DeltaNet, `GatedDeltaModel`; GLM-5.x's sparse latent attention,
`SparseLatentModel`), not as XLA's unfused lowering of the XLA paths.

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

**The chunked Gated DeltaNet** (`GatedDeltaModel`, `ops/flash_gated_delta.py`). A *GDN loop* is a while loop under
`GATED_DELTA_FUNCTIONS` (`ops.gated_delta.gated_delta_rule_chunked`'s scan over `_chunk`, one trip a chunk): the
backward when its op_name says `transpose(` outside a `rematted_computation` (the scan's transpose; a rematted
forward recomputed under the backward is a forward). From its carried tuple and the model's dk: N = its trip count
(the chunks), the state [..., dk, dv'] (the smallest float array shaped so: U = its elements / (dk dv') the state
matrices, the value heads times any batch, dv' its width: the sequence-parallel fold appends identity columns to v),
C = the kernels' chunk (`gdn_chunk_for("pallas")`; N counts the XLA loop's trips in chunks of C: trips x its own
chunk / C); P = N C U token-head rows (T padded to chunks, as both paths do),
s = ceil(log2 C) doubling steps, nb = ceil(dv' / COLUMN_BLOCK) column blocks. FLOPs per (chunk, state matrix), the
kernels' matmuls (the vjp's recomputed forward products included):

      forward  stage A  2 C^2 dk + s 2 C^2 (dk + dv') + (s - 1) 2 C^3   (A = (beta k) k^T, the doubling products)
               stage B  4 C dk dv'                                      (u = value - w S, the state update)
               stage C  2 C dk dv' + nb 2 C^2 dk + 2 C^2 dv'            (q S; q k^T per column block; scores u)
      backward stage C  4 C dk dv' + 4 C^2 dv' + nb 6 C^2 dk            (q k^T again, dq, dk; dS, d(qe), du, dscores)
               stage B  10 C dk dv'                                     (u again; du, dw, dS, d(ke))
               stage A  6 C^2 dk + 4 s C^3 + 4 C^2 (dk + dv')          (A again and its transpose; T = (Id - A)^-1
                                                                        by doubling; dT, dA = T^T dT T^T, T^T d(rhs))

(the recurrent form's count is 6 dk dv' per token and head; the chunked form does several times that, mostly the
doubling solve). HBM bytes, float32 (`ACCUM`), each array read or written once per kernel, a state S = U dk dv':

      forward  A reads k, v, g, beta, writes value, w, gamma: P (2 dk + 2 dv' + 3)
               B reads value, w, k, gamma and the state, writes u, the N chunk-start states, the final state:
                 P (2 dk + 2 dv' + 1) + (N + 2) S
               C reads q, k, u, gamma, the starts, writes o: P (2 dk + 2 dv' + 1) + N S
      backward C reads q, k, u, gamma, dO and the starts, writes nb partial dq, dk, dgamma, du, d starts:
                 P (2 dk + 3 dv' + 1) + nb P (2 dk + 1) + 2 N S
               B reads value, w, k, gamma, du, the starts and their cotangents, d final, writes dvalue, nb partial dw,
                 dk, dgamma, d state: P (2 dk + 3 dv' + 1) + nb P (2 dk + 1) + 2 N S + 2 S
               the partials summed (XLA, outside the kernels): reads (4 nb + 1) P dk + 2 nb P, writes 3 P dk + P
               A reads k, v, g, beta, dvalue, dw, dgamma, writes dk, dv, dg, dbeta: P (3 dk + 3 dv' + 5)

Head widths are not padded to the kernels' tiles (Qwen3.6's 128 need none). A prompt of at most C tokens is one
chunk without a loop and a decoded token one step of the recurrence (both XLA under either choice): as compiled.
Tested in tests/capacity/test_cost.py against these formulas on one call, its gradient and its rematerialised
gradient (with one column block the forward's FLOPs are also XLA's own: the same matmuls).

**Sparse latent attention** (`SparseLatentModel`, `ops/flash_mla.py`). A *latent attention loop* is a while loop
under `LATENT_FUNCTIONS` (`ops.mla.sparse_latent_attention_partial`: the `lax.map` over query blocks of the forward,
2 matmuls a block; the custom backward's scan, 5) but not under the Pallas kernels' own functions. From the model's
H, Dl (kv_lora_rank), Dr (qk_rope_head_dim), Dk = Dl + Dr, its carried tuple and its cost as compiled: T = the
elements / (H Dk) of its query blocks [..., W, H, Dk] (the queries, padded to blocks of W), k = compiled FLOPs /
(2 T H (2 Dl + Dr)) forward, / (2 T H (5 Dl + 3 Dr)) backward (the selected slots: the XLA path's matmuls are the
kernels', so its FLOPs are unchanged; XLA rewrites the selected positions into gather indices, no longer [T, k]).
With i the bytes per element of q, the cache and dO (the params' dtype):

  forward (one program per query, its k rows gathered in blocks of 16):
      FLOPs  2 T H k (2 Dl + Dr)          (scores over Dl + Dr, p c over Dl; the XLA path's matmuls exactly)
      bytes  q T H Dk i + selected T k 4 + the gathered rows T k Dk i + out, lse T H (Dl + 1) 4
  backward (one program per query and n = ceil(H / BACKWARD_HEADS) blocks of heads; each row's cotangent
  atomically added):
      FLOPs  2 T H k (5 Dl + 3 Dr)        (scores again, dO c, dq = ds [c | k_pe], ds^T q, p^T dO)
      bytes  q, dO T H (Dk + Dl) i + lse, delta 2 T H 4 + dq T H Dk 4
             + n (selected T k 4 + the gathered rows T k Dk i + the rows' cotangents T k Dk 4)
             (each head block gathers the rows and adds its share of their cotangents: one float32 add a row)

The rows are gathered per query: no reuse between queries is assumed (each query's k rows are its own), nor for
the atomic adds. Queries are not rounded (T is the XLA path's, its blocks of 64 padded; a capture chunk is a multiple
of 64); a call of one query block (T <= W: decoding) compiles without a loop and stays as compiled. Tested in
tests/capacity/test_cost.py against these formulas on one call and its gradient.
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping

from longstraw_jax.capacity.hlo.parse import Instruction, array_shapes, called
from longstraw_jax.capacity.hlo.program import Program
from longstraw_jax.capacity.hlo.totals import Cost

# the XLA paths, by the "file:function" suffixes of an instruction's stack frames
ATTENTION_FUNCTIONS = ("ops/attention.py:attend",)
GATED_DELTA_FUNCTIONS = ("ops/gated_delta.py:gated_delta_rule_chunked",)
LATENT_FUNCTIONS = ("ops/mla.py:sparse_latent_attention_partial",)
# the kernels run interpreted (a CPU): not the XLA paths
INTERPRETED_FUNCTIONS = ("ops/flash_attention.py:attend", "ops/flash_gated_delta.py:gated_delta_rule",
                         "ops/flash_mla.py:sparse_latent_attention_partial")
FORWARD_MATMULS, BACKWARD_MATMULS = 2, 5  # matmuls in a key-block loop's body (and in a latent attention loop's)
ACCUM = 4  # bytes of the kernels' float32 outputs, statistics and gradients (and of the GDN's every array)
COLUMN_BLOCK = 32  # value columns per program of the GDN kernels' stages B and C (`ops.flash_gated_delta`)
BACKWARD_HEADS = 16  # heads per program of the latent attention's backward (`ops.flash_mla`; each regathers)


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


def _positive(obj, names):
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{type(obj).__name__}.{name} {value!r} must be a positive integer")


@dataclasses.dataclass(frozen=True)
class GatedDeltaModel:
    """Cost the chunked gated delta rule as the Pallas kernels of `ops.flash_gated_delta` (module docstring): the
    model's key width dk, value width dv (a loop's own dv' is read from its state) and the kernels' chunk C.
    `compiled_chunk`: the chunk of the XLA loops being re-costed (one trip each; None: C), so that a loop of N trips
    holds N compiled_chunk / C of the kernels' chunks. Float32 throughout."""

    key_dim: int
    value_dim: int
    chunk: int = 32  # the kernels' default (`ops.flash_gated_delta.MAX_CHUNK`)
    compiled_chunk: int | None = None

    def __post_init__(self):
        _positive(self, ("key_dim", "value_dim", "chunk"))
        if self.compiled_chunk is not None:
            _positive(self, ("compiled_chunk",))

    def kernel_chunks(self, trips: float) -> float:
        """The kernels' chunks in a compiled GDN loop of `trips` trips (same tokens, the kernels' chunk)."""
        return trips * (self.compiled_chunk or self.chunk) / self.chunk

    def flops(self, chunks: float, units: float, value_dim: int | None = None, backward: bool = False) -> float:
        """The kernels' matmul FLOPs over `chunks` chunks of `units` state matrices (value heads x batch): the
        forward's, or with `backward` the backward kernels' (module docstring)."""
        c, k, v = self.chunk, self.key_dim, value_dim or self.value_dim
        steps, blocks = (c - 1).bit_length(), -(-v // COLUMN_BLOCK)
        if not backward:
            solve = 2 * c * c * k + steps * 2 * c * c * (k + v) + max(steps - 1, 0) * 2 * c**3
            per_chunk = solve + 4 * c * k * v + 2 * c * k * v + blocks * 2 * c * c * k + 2 * c * c * v
        else:
            solve = 6 * c * c * k + 4 * steps * c**3 + 4 * c * c * (k + v)
            per_chunk = (4 * c * k * v + 4 * c * c * v + blocks * 6 * c * c * k) + 10 * c * k * v + solve
        return float(per_chunk) * chunks * units

    def hbm(self, chunks: float, units: float, value_dim: int | None = None, backward: bool = False) -> float:
        """The kernels' compulsory HBM bytes (module docstring)."""
        k, v = self.key_dim, value_dim or self.value_dim
        blocks, rows, state = -(-v // COLUMN_BLOCK), chunks * self.chunk * units, units * k * v
        if not backward:
            elements = rows * (2 * k + 2 * v + 3) + rows * (2 * k + 2 * v + 1) + (chunks + 2) * state \
                + rows * (2 * k + 2 * v + 1) + chunks * state
        else:
            partials = blocks * rows * (2 * k + 1)
            elements = (rows * (2 * k + 3 * v + 1) + partials + 2 * chunks * state
                        + rows * (2 * k + 3 * v + 1) + partials + 2 * chunks * state + 2 * state
                        + (4 * blocks + 1) * rows * k + 2 * blocks * rows + 3 * rows * k + rows
                        + rows * (3 * k + 3 * v + 5))
        return float(elements) * ACCUM

    def forward(self, chunks: float, units: float, value_dim: int | None = None) -> Cost:
        """Stages A, B, C over `chunks` chunks of `units` state matrices."""
        return Cost(self.flops(chunks, units, value_dim), self.hbm(chunks, units, value_dim))

    def backward(self, chunks: float, units: float, value_dim: int | None = None) -> Cost:
        """The backward kernels (C, B in reverse, A) and the sums of their partial cotangents."""
        return Cost(self.flops(chunks, units, value_dim, True), self.hbm(chunks, units, value_dim, True))


@dataclasses.dataclass(frozen=True)
class SparseLatentModel:
    """Cost GLM-5.x's sparse latent attention as the Pallas kernels of `ops.flash_mla` (module docstring): the
    query heads H, the latent width Dl (kv_lora_rank), the rope width Dr (qk_rope_head_dim) and the bytes per
    element of q, the cache and dO (the params' dtype: bf16 = 2)."""

    heads: int
    latent_dim: int
    rope_dim: int
    itemsize: float = 2.0

    def __post_init__(self):
        _positive(self, ("heads", "latent_dim", "rope_dim"))
        if not self.itemsize > 0:
            raise ValueError(f"SparseLatentModel.itemsize {self.itemsize!r} must be > 0")

    def forward(self, queries: float, slots: float) -> Cost:
        """The forward kernel: `queries` queries, each over its `slots` selected rows."""
        dl, dr, i, heads = self.latent_dim, self.rope_dim, self.itemsize, self.heads
        dk, triples = dl + dr, queries * heads * slots
        hbm = queries * heads * dk * i + queries * slots * (4 + dk * i) + queries * heads * (dl + 1) * ACCUM
        return Cost(2.0 * (2 * dl + dr) * triples, hbm)

    def backward(self, queries: float, slots: float) -> Cost:
        """The backward kernel (dq and the rows' cotangents, atomically added), in blocks of BACKWARD_HEADS heads."""
        dl, dr, i, heads = self.latent_dim, self.rope_dim, self.itemsize, self.heads
        dk, triples, head_blocks = dl + dr, queries * heads * slots, -(-heads // BACKWARD_HEADS)
        hbm = (queries * heads * (dk + dl) * i + 2 * queries * heads * ACCUM + queries * heads * dk * ACCUM
               + head_blocks * queries * slots * (4 + dk * i + dk * ACCUM))
        return Cost(2.0 * (5 * dl + 3 * dr) * triples, hbm)


@dataclasses.dataclass(frozen=True)
class Kernels:
    """Which of the XLA paths' loops to cost as Pallas kernels, and how: softmax attention (`KernelModel`), the
    chunked GDN (`GatedDeltaModel`), sparse latent attention (`SparseLatentModel`); None: that path as compiled."""

    attention: KernelModel | None = None
    gated_delta: GatedDeltaModel | None = None
    sparse_latent: SparseLatentModel | None = None

    @classmethod
    def of(cls, model: "Kernels | KernelModel | None") -> "Kernels":
        """A Kernels from what `hlo_cost(kernels=...)` accepts: a Kernels, a KernelModel (attention alone), None."""
        if model is None:
            return cls()
        return model if isinstance(model, Kernels) else cls(attention=model)

    @classmethod
    def for_config(cls, config, itemsize: float) -> "Kernels":
        """The kernels of a config's family at the params' bytes per element: Qwen3.6, softmax attention and (with
        gdn_impl "chunked") the GDN; GLM-5.x, sparse latent attention. ValueError for a config without kernels."""
        if hasattr(config, "kv_lora_rank") and hasattr(config, "qk_rope_head_dim") and hasattr(config, "kernels"):
            return cls(sparse_latent=SparseLatentModel(config.num_attention_heads, config.kv_lora_rank,
                                                       config.qk_rope_head_dim, float(itemsize)))
        attention = KernelModel.for_config(config, itemsize)
        gdn = None
        if getattr(config, "gdn_impl", None) == "chunked" and hasattr(config, "linear_key_head_dim"):
            gdn = GatedDeltaModel(config.linear_key_head_dim, config.linear_value_head_dim,
                                  config.gdn_chunk_for("pallas"), config.gdn_chunk)
        return cls(attention=attention, gated_delta=gdn)


class FlashKernels:
    """The kernels' loops of `program` (by the stack frames `frames`, `parse.stack_functions`) and their cost: as
    compiled (`model` None) or as the Pallas kernels (`model`: a Kernels, or a KernelModel for attention alone)."""

    def __init__(self, program: Program, frames: Mapping[int, tuple[str, ...]],
                 model: Kernels | KernelModel | None = None):
        self.program, self.frames = program, frames
        self.kernels = Kernels.of(model)
        self.model = self.kernels.attention  # softmax attention's

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

    def gated_delta_loop(self, instr: Instruction) -> bool:
        """The chunk loop of the XLA path's `gated_delta_rule_chunked` (forward or backward)."""
        return (instr.opcode == "while" and self._in_stack(instr, GATED_DELTA_FUNCTIONS)
                and not self._in_stack(instr, INTERPRETED_FUNCTIONS) and self.matmuls(instr) > 0)

    def latent_loop(self, instr: Instruction) -> bool:
        """A query-block loop of the XLA path's `sparse_latent_attention_partial` (forward or backward)."""
        return (instr.opcode == "while" and self._in_stack(instr, LATENT_FUNCTIONS)
                and not self._in_stack(instr, INTERPRETED_FUNCTIONS)
                and self.matmuls(instr) in (FORWARD_MATMULS, BACKWARD_MATMULS))

    @staticmethod
    def transposed(instr: Instruction) -> bool:
        """Whether a loop is a backward pass by its op_name: JAX's `transpose(` of a jvp, not a rematted forward
        recomputed under it."""
        m = re.search(r'op_name="([^"]*)"', instr.attrs)
        name = m.group(1) if m else ""
        return "transpose(" in name and "rematted_computation" not in name

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

    def _gated_delta_shape(self, instr: Instruction) -> tuple[float, float, int]:
        """(N chunks, U state matrices, dv') of a GDN loop: its trip count in the kernels' chunks and its carried
        state [..., dk, dv'] (the smallest float array of rank >= 3 shaped so, dv' >= the model's dv)."""
        m = self.kernels.gated_delta
        chunks = self.program.fixed_trips(instr)
        states = [dims for dtype, dims in array_shapes(instr.shape)
                  if dtype.startswith(("f", "bf")) and len(dims) >= 3 and dims[-2] == m.key_dim
                  and dims[-1] >= m.value_dim]
        if chunks is None or not states:
            raise ValueError(f"GDN loop {instr.name}: no trip count or no state [..., {m.key_dim}, >= {m.value_dim}] "
                             f"in its carried tuple {instr.shape[:300]}: not a model with these widths")
        state = min(states, key=math.prod)
        return m.kernel_chunks(float(chunks)), math.prod(state) / (state[-1] * state[-2]), state[-1]

    def _latent_queries(self, instr: Instruction) -> float:
        """T: the queries of a latent attention loop, elements / (H Dk) of its query blocks [..., W, H, Dk] (the
        smallest float array of the carried tuple shaped so)."""
        m = self.kernels.sparse_latent
        found = [math.prod(dims[:-2]) for dtype, dims in array_shapes(instr.shape)
                 if dtype.startswith(("f", "bf")) and len(dims) >= 3
                 and tuple(dims[-2:]) == (m.heads, m.latent_dim + m.rope_dim)]
        if not found:
            raise ValueError(f"latent attention loop {instr.name}: no queries [..., W, {m.heads}, "
                             f"{m.latent_dim + m.rope_dim}] in its carried tuple {instr.shape[:300]}")
        return float(min(found))

    def loop_cost(self, instr: Instruction, compiled: Cost) -> Cost:
        """The cost of while loop `instr` given its cost as compiled: an attention, GDN or latent attention loop's
        re-costed as the kernels when there is a model for it (collectives and loop lists kept), anything else's
        unchanged."""
        if instr.opcode != "while":
            return compiled
        if self.model is not None and self.attention_loop(instr):
            m, queries = self.model, self._queries(instr)
            if self.matmuls(instr) == FORWARD_MATMULS:
                kernel = m.forward(compiled.flops / (2.0 * (m.head_dim + m.value_dim)), queries)
            else:
                kernel = m.backward(compiled.flops / (2.0 * (3 * m.head_dim + 2 * m.value_dim)), queries,
                                    self._layer_keys(instr))
        elif self.kernels.gated_delta is not None and self.gated_delta_loop(instr):
            chunks, units, width = self._gated_delta_shape(instr)
            pass_ = self.kernels.gated_delta.backward if self.transposed(instr) else self.kernels.gated_delta.forward
            kernel = pass_(chunks, units, width)
        elif self.kernels.sparse_latent is not None and self.latent_loop(instr):
            m, queries = self.kernels.sparse_latent, self._latent_queries(instr)
            dl, dr = m.latent_dim, m.rope_dim
            if self.matmuls(instr) == FORWARD_MATMULS:
                kernel = m.forward(queries, compiled.flops / (2.0 * (2 * dl + dr) * queries * m.heads))
            else:
                kernel = m.backward(queries, compiled.flops / (2.0 * (5 * dl + 3 * dr) * queries * m.heads))
        else:
            return compiled
        return dataclasses.replace(compiled, flops=kernel.flops, hbm_bytes=kernel.hbm_bytes)
