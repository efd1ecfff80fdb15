"""`capacity/hlo/`: per-device FLOPs, HBM bytes and collective bytes of compiled programs, loops multiplied by
their trip counts. Tiny programs on the 8 simulated CPU devices (tests/conftest.py); every expected number is
computed from the shapes and the formulas of the package's module docstrings, none is a recorded result."""
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from longstraw_jax.capacity.hardware import HARDWARE, breakdown, for_device, hardware, roofline
from longstraw_jax.capacity.hlo import (
    Cost,
    ExpertModel,
    group_size,
    hlo_cost,
    parse_instruction,
    program_cost,
    trip_count,
    xla_cost,
)
from tests.helpers import ROOT

F32 = 4
N_DEV = 8


def _compile(f, *shapes):
    return jax.jit(f).lower(*shapes).compile()


def _matmuls(x, ws):
    """x [B, D] through ws [N, D, D]: one matmul (2 B D D FLOPs) per scan step."""
    return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0]


@pytest.mark.parametrize("n, dtype", [(1, jnp.float32), (20, jnp.float32), (20, jnp.bfloat16)])
def test_a_scan_of_n_matmuls_costs_n_bodies(n, dtype):
    b, d = 4, 32
    compiled = _compile(_matmuls, jax.ShapeDtypeStruct((b, d), dtype), jax.ShapeDtypeStruct((n, d, d), dtype))
    cost = program_cost(compiled)
    assert cost.flops == n * 2 * b * d * d
    assert cost.unknown_loops == ()
    # each step reads its [D, D] slice of the stack (sliced, possibly converted to float32 on the CPU, then read by
    # the dot: <= 3 float32 layer-sized transfers) and a few [B, D] activations, never the whole [N, D, D] stack;
    # XLA:CPU may convert a bf16 stack to float32 once, before the loop
    itemsize = jnp.dtype(dtype).itemsize
    once = 0 if dtype == jnp.float32 else n * d * d * (itemsize + F32)
    assert 0 < cost.hbm_bytes <= n * (3 * d * d + 8 * b * d) * F32 + once
    if dtype == jnp.float32:  # XLA's own analysis counts the body once (bf16: plus its conversions' FLOPs)
        assert xla_cost(compiled)["flops"] == pytest.approx(2 * b * d * d, rel=0.05)


def _mesh():
    return jax.make_mesh((N_DEV,), ("x",))


def _sharded(mesh, n):
    return jax.ShapeDtypeStruct((n * N_DEV,), jnp.float32, sharding=NamedSharding(mesh, P("x")))


def _in_loop(collective, iterations, rows):
    """A shard_map over 8 devices whose fori_loop of `iterations` applies `collective` to a [rows] float32 block
    that depends on the carry (so nothing is hoisted out of the loop)."""
    mesh = _mesh()

    def local(x):
        def body(i, acc):
            return acc + collective(x * acc[:1]).sum()

        return jax.lax.fori_loop(0, iterations, body, x)

    f = jax.shard_map(local, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    return program_cost(_compile(f, _sharded(mesh, rows)))


@pytest.mark.parametrize("iterations", [1, 6])
def test_all_gather_in_a_fori_loop_moves_n_times_its_bytes(iterations):
    rows = 16
    cost = _in_loop(lambda y: jax.lax.all_gather(y, "x", tiled=True), iterations, rows)
    assert cost.collective_bytes == {"all-gather": iterations * (N_DEV - 1) * rows * F32}
    assert cost.unknown_loops == ()


@pytest.mark.parametrize("name, collective, per_device", [
    ("all-reduce", lambda y: jax.lax.psum(y, "x"), lambda b: 2 * (N_DEV - 1) / N_DEV * b),
    ("reduce-scatter", lambda y: jax.lax.psum_scatter(y, "x", tiled=True), lambda b: (N_DEV - 1) / N_DEV * b),
    ("collective-permute", lambda y: jax.lax.ppermute(y, "x", [(i, (i + 1) % N_DEV) for i in range(N_DEV)]),
     lambda b: b),
    ("all-to-all", lambda y: jax.lax.all_to_all(y, "x", 0, 0, tiled=True), lambda b: (N_DEV - 1) / N_DEV * b),
])
def test_each_collective_moves_its_formulas_bytes(name, collective, per_device):
    rows, iterations = 16, 3
    cost = _in_loop(collective, iterations, rows)
    assert cost.collective_bytes == {name: pytest.approx(iterations * per_device(rows * F32))}
    assert cost.collective_total == pytest.approx(iterations * per_device(rows * F32))


def test_loop_free_flops_agree_with_xla_cost_analysis():
    """A batched matmul chain, no loops: the dot FLOPs are XLA's FLOPs up to its elementwise ones (a few %)."""
    def f(a, b, c):
        return jax.nn.relu(jnp.einsum("bij,bjk->bik", a, b)) @ c

    compiled = _compile(f, jax.ShapeDtypeStruct((3, 32, 64), jnp.float32),
                        jax.ShapeDtypeStruct((3, 64, 48), jnp.float32), jax.ShapeDtypeStruct((48, 16), jnp.float32))
    cost, xla = program_cost(compiled), xla_cost(compiled)
    assert cost.flops == 2 * 3 * 32 * 64 * 48 + 2 * 3 * 32 * 48 * 16
    assert abs(cost.flops - xla["flops"]) <= 0.03 * xla["flops"]
    assert abs(cost.hbm_bytes - xla["bytes accessed"]) <= 0.25 * xla["bytes accessed"]


def test_a_rolled_scan_costs_what_xla_counts_for_it_unrolled():
    """The trip count applied to the rolled loop gives XLA's own FLOPs and bytes accessed of the same scan fully
    unrolled (loop-free), up to XLA's elementwise FLOPs and the rolled loop's own bookkeeping (a few %)."""
    b, d, n = 8, 64, 6

    def f(x, ws, unroll):
        return jax.lax.scan(lambda h, w: (jax.nn.relu(h @ w), None), x, ws, unroll=unroll)[0]

    shapes = jax.ShapeDtypeStruct((b, d), jnp.float32), jax.ShapeDtypeStruct((n, d, d), jnp.float32)
    rolled = program_cost(jax.jit(lambda x, ws: f(x, ws, 1)).lower(*shapes).compile())
    unrolled = jax.jit(lambda x, ws: f(x, ws, n)).lower(*shapes).compile()
    assert "while(" not in unrolled.as_text()
    xla = xla_cost(unrolled)
    assert rolled.flops == n * 2 * b * d * d
    assert abs(rolled.flops - xla["flops"]) <= 0.03 * xla["flops"]
    assert abs(rolled.hbm_bytes - xla["bytes accessed"]) <= 0.05 * xla["bytes accessed"]


def test_a_conditional_counts_its_costliest_branch():
    d = 32

    def f(p, x, w):
        return jax.lax.cond(p, lambda x: x @ w @ w, lambda x: x + 1.0, x)

    compiled = _compile(f, jax.ShapeDtypeStruct((), jnp.bool_), jax.ShapeDtypeStruct((d, d), jnp.float32),
                        jax.ShapeDtypeStruct((d, d), jnp.float32))
    assert program_cost(compiled).flops == 2 * (2 * d * d * d)


def test_nested_loops_multiply():
    d, outer, inner = 16, 3, 4

    def f(x, w):
        def inner_loop(h):
            return jax.lax.fori_loop(0, inner, lambda i, h: jnp.tanh(h @ w), h)
        return jax.lax.fori_loop(0, outer, lambda i, h: inner_loop(h), x)

    compiled = _compile(f, jax.ShapeDtypeStruct((d, d), jnp.float32), jax.ShapeDtypeStruct((d, d), jnp.float32))
    assert program_cost(compiled).flops == outer * inner * 2 * d * d * d


def test_an_unknown_trip_count_is_reported_or_taken_from_the_caller():
    """A while loop with a data-dependent bound has no known trip count: it is listed (counted once), and a
    caller's count for it replaces the 1."""
    d = 16

    def f(x, w, n):
        return jax.lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, jnp.tanh(c[1] @ w)), (0, x))[1]

    compiled = _compile(f, jax.ShapeDtypeStruct((d, d), jnp.float32), jax.ShapeDtypeStruct((d, d), jnp.float32),
                        jax.ShapeDtypeStruct((), jnp.int32))
    once = program_cost(compiled)
    assert len(once.unknown_loops) == 1 and once.flops == 2 * d ** 3
    seven = program_cost(compiled, {once.unknown_loops[0]: 7})
    assert seven.unknown_loops == () and seven.flops == 7 * 2 * d ** 3


def test_a_loop_bounded_by_an_outer_index_is_counted_exactly():
    """An inner while loop that runs i times in iteration i of an outer fori_loop (XLA knows no trip count for it):
    its bound is evaluated per outer iteration from the carried scalars, sum_i i = n (n - 1) / 2 matmuls."""
    d, n = 16, 6

    def f(x, w):
        def outer(i, h):
            return jax.lax.while_loop(lambda c: c[0] < i, lambda c: (c[0] + 1, jnp.tanh(c[1] @ w)), (0, h))[1]
        return jax.lax.fori_loop(0, n, outer, x)

    cost = program_cost(_compile(f, jax.ShapeDtypeStruct((d, d), jnp.float32),
                                 jax.ShapeDtypeStruct((d, d), jnp.float32)))
    assert cost.flops == n * (n - 1) // 2 * 2 * d ** 3
    assert cost.unknown_loops == () and cost.bounded_loops == ()


def test_a_loop_bounded_by_data_is_counted_at_its_bound_and_listed():
    """`while i < min(k, 5)` with k an input: at most 5 trips, counted as 5 and listed in bounded_loops."""
    d = 16

    def f(x, w, k):
        return jax.lax.while_loop(lambda c: c[0] < jnp.minimum(k, 5), lambda c: (c[0] + 1, jnp.tanh(c[1] @ w)),
                                  (0, x))[1]

    cost = program_cost(_compile(f, jax.ShapeDtypeStruct((d, d), jnp.float32),
                                 jax.ShapeDtypeStruct((d, d), jnp.float32), jax.ShapeDtypeStruct((), jnp.int32)))
    assert cost.flops == 5 * 2 * d ** 3
    assert cost.unknown_loops == () and len(cost.bounded_loops) == 1


def test_a_bf16_all_gather_counts_bf16_bytes():
    """XLA:CPU runs a bf16 all-gather in float32 between converts; it is counted at 2 bytes per element."""
    rows, iterations = 16, 2
    mesh = _mesh()

    def local(x):
        def body(i, acc):
            return acc + jax.lax.all_gather(x * acc[:1], "x", tiled=True).sum()
        return jax.lax.fori_loop(0, iterations, body, x)

    f = jax.shard_map(local, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    bf16 = jax.ShapeDtypeStruct((rows * N_DEV,), jnp.bfloat16, sharding=NamedSharding(mesh, P("x")))
    cost = program_cost(_compile(f, bf16))
    assert cost.collective_bytes == {"all-gather": iterations * (N_DEV - 1) * rows * 2}


def test_parsing_helpers():
    assert group_size(", replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}", 8) == 4
    assert group_size(", replica_groups=[2,4]<=[8], dimensions={0}", 8) == 4
    assert group_size(", replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}", 8) == 2
    assert group_size(", replica_groups={}, to_apply=%add", 8) == 8
    text = """HloModule m, num_partitions=4

%body (p: (s32[], bf16[8,16])) -> (s32[], bf16[8,16]) {
  %p = (s32[], bf16[8,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = bf16[8,16]{1,0} get-tuple-element(%p), index=1
  %ag = bf16[32,16]{1,0} all-gather(%x), channel_id=1, replica_groups=[1,4]<=[4], dimensions={0}
  %s = bf16[8,16]{1,0} slice(%ag), slice={[0:8], [0:16]}
  ROOT %t = (s32[], bf16[8,16]{1,0}) tuple(%i, %s)
}

%cond (p.1: (s32[], bf16[8,16])) -> pred[] {
  %p.1 = (s32[], bf16[8,16]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (x.1: bf16[8,16]) -> bf16[8,16] {
  %x.1 = bf16[8,16]{1,0} parameter(0)
  %z = s32[] constant(0)
  %t.1 = (s32[], bf16[8,16]{1,0}) tuple(%z, %x.1)
  %w = (s32[], bf16[8,16]{1,0}) while(%t.1), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"10"}}
  ROOT %r = bf16[8,16]{1,0} get-tuple-element(%w), index=1
}
"""
    cost = hlo_cost(text)
    assert cost.collective_bytes == {"all-gather": 10 * 3 * 8 * 16 * 2}
    # the all-gather reads 256 B and writes 1024 B; the slice reads and writes 256 B: per iteration
    assert cost.hbm_bytes == 10 * (8 * 16 * 2 + 32 * 16 * 2 + 2 * 8 * 16 * 2)
    assert trip_count(parse_instruction(text.splitlines()[-3])) == 10


def test_a_cublas_gemm_custom_call_counts_its_flops():
    """XLA:GPU's dots are cuBLAS custom calls; their contraction is in the backend_config."""
    text = """HloModule g

ENTRY %main (a: bf16[64,128], b: bf16[128,32]) -> bf16[64,32] {
  %a = bf16[64,128]{1,0} parameter(0)
  %b = bf16[128,32]{1,0} parameter(1)
  %gemm = (bf16[64,32]{1,0}, s8[4194304]{0}) custom-call(%a, %b), custom_call_target="__cublas$lt$matmul", \
backend_config={"gemm_backend_config":{"alpha_real":1,"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],\
"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  ROOT %r = bf16[64,32]{1,0} get-tuple-element(%gemm), index=0
}
"""  # backslash-newlines join the custom call onto one line
    assert hlo_cost(text).flops == 2 * 64 * 32 * 128


def test_cost_arithmetic():
    a = Cost(1.0, 2.0, {"all-gather": 3.0})
    b = Cost(10.0, 20.0, {"all-gather": 1.0, "all-reduce": 5.0}, ("w",))
    s = a + b.scaled(2)
    assert (s.flops, s.hbm_bytes, dict(s.collective_bytes), s.unknown_loops) == \
        (21.0, 42.0, {"all-gather": 5.0, "all-reduce": 10.0}, ("w",))
    assert s.as_dict()["collective_bytes"] == 15.0


def test_roofline_arithmetic():
    """max(compute, memory) + collectives, each from the device's peaks; NVLink per direction is half of 900 GB/s."""
    h200 = hardware("H200")
    assert h200.link_per_s == 450e9 and h200.hbm_per_s == 4.8e12 and h200.flops_per_s == 989e12
    compute_bound = Cost(flops=2 * 989e12, hbm_bytes=4.8e12, collective_bytes={"all-gather": 450e9})
    assert roofline(compute_bound, h200) == pytest.approx(2.0 + 1.0)
    memory_bound = Cost(flops=989e12, hbm_bytes=3 * 4.8e12, collective_bytes={})
    assert roofline(memory_bound, h200) == pytest.approx(3.0)
    terms = breakdown(compute_bound, h200)
    assert terms == pytest.approx(dict(compute=2.0, memory=1.0, collectives=1.0, total=3.0))
    assert roofline(compute_bound.scaled(10), h200) == pytest.approx(30.0)
    h20 = hardware("h20")
    assert roofline(compute_bound, h20) > roofline(compute_bound, h200)  # 148 vs 989 TFLOP/s
    for hw in HARDWARE.values():
        assert hw.source and hw.flops_per_s > 0 and hw.hbm_per_s > 0 and hw.link_per_s > 0 and hw.hbm_bytes > 0
    with pytest.raises(ValueError, match="h100"):
        hardware("v100")
    # a JAX device's entry (tools/bench_device.py): by device kind, H200 before H20; XLA:CPU the rough cpu entry
    assert for_device("NVIDIA H200", "gpu") is HARDWARE["h200"] and for_device("NVIDIA H20", "gpu") is HARDWARE["h20"]
    assert for_device("NVIDIA H100 80GB HBM3", "gpu") is HARDWARE["h100"] and for_device("cpu", "cpu").name == "cpu"
    assert for_device("NVIDIA H100 PCIe", "gpu") is HARDWARE["h100-pcie"]  # H100 PCIe before H100, GB200 before B200
    assert for_device("NVIDIA GB200", "gpu").name == "gb200" and for_device("NVIDIA B200", "gpu").name == "b200"
    assert for_device("NVIDIA A100-SXM4-80GB", "gpu") is HARDWARE["a100"]  # the 80 GB SXM card only:
    assert for_device("NVIDIA A100-SXM4-40GB", "gpu") is None and for_device("NVIDIA A100 80GB PCIe", "gpu") is None
    assert for_device("NVIDIA H200 PCIe", "gpu") is None
    assert "ROUGH" in HARDWARE["cpu"].source


def test_a_model_forward_costs_its_analytic_flops_with_every_loop_counted():
    """Qwen3.6 `model.forward` with three full-attention layers (a layer scan of 3) over 2048 tokens (a key-block
    while loop whose trip count XLA does not know: the blocks up to max(q_positions) + 1, evaluated from the
    positions' iota): the dense and head FLOPs of tools/bench_device.py's analytic model (checked against XLA on a
    loop-free config in tests/tools/test_bench.py), plus the attention the block loop computes: every key block up to
    the last query, the whole [T, T] square (the analytic count is the causal T (T + 1) / 2 pairs)."""
    import importlib.util
    import os

    from longstraw_jax import models
    from longstraw_jax.models.qwen36.config import FULL, Qwen36Config

    path = os.path.join(ROOT, "tools", "bench_device.py")
    spec = importlib.util.spec_from_file_location("bench_device", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    tokens, layers = 2048, 3
    cfg = Qwen36Config.tiny(hidden_size=256, intermediate_size=1024, num_hidden_layers=layers,
                            layer_types=(FULL,) * layers)
    model = models.build(cfg)
    params = jax.eval_shape(model.init, jax.random.key(0))
    cost = program_cost(_compile(model.forward, params, jax.ShapeDtypeStruct((tokens,), jnp.int32)))
    analytic = bench.qwen36_flops(cfg, tokens, logits=True)
    square = analytic["attention"] * 2 * tokens // (tokens + 1)
    assert cost.unknown_loops == () and cost.bounded_loops == ()
    assert cost.flops == pytest.approx(analytic["dense"] + analytic["head"] + square, rel=1e-9)


# ----- routed experts: costed as a GPU's grouped matmul (hlo.ExpertModel) ----------------------------------------


def _expert_costs(compiled, routed, fraction=1.0):
    """(as compiled, as a GPU's grouped matmul) costs of one program."""
    return program_cost(compiled), program_cost(compiled, experts=ExpertModel(routed, fraction))


@pytest.mark.parametrize("gradient", [False, True], ids=["forward", "gradient"])
def test_glm_experts_cost_their_analytic_grouped_matmul_and_nothing_else_changes(gradient):
    """Tiny GLM-5.x `model.forward` on one device (4 MoE layers, E = 8 experts, top-2, T tokens), and its gradient:
    XLA:CPU runs every row through each of the E experts (`ops/moe._grouped_scan`), so the compiled expert FLOPs are
    E x the analytic T k x 6 D I per layer (x 3 with the backward: two grouped matmuls per projection); the GPU model
    counts the analytic FLOPs and, per layer and projection, the rows read and written plus the matrices of the
    min(E, T k) experts hit (read, or their gradient written), and leaves every other FLOP and byte as compiled."""
    from longstraw_jax import models
    from longstraw_jax.models.glm52 import Glm52Config

    tokens = 64
    cfg = Glm52Config.tiny()
    model = models.build(cfg)
    params = jax.eval_shape(model.init, jax.random.key(0))
    program = (lambda p, t: jax.grad(lambda p: model.forward(p, t).sum())(p)) if gradient else model.forward
    compiled = _compile(program, params, jax.ShapeDtypeStruct((tokens,), jnp.int32))
    cpu, gpu = _expert_costs(compiled, cfg.n_routed_experts)
    d, i, k, e, layers = (cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok, cfg.n_routed_experts,
                          cfg.num_hidden_layers)
    rows, passes = tokens * k, 3 if gradient else 1  # grouped matmuls per projection: forward (+ d rows, d matrix)
    analytic = passes * layers * rows * 3 * 2 * d * i  # gate, up, down: each 2 x rows x D x I
    assert cpu.expert_flops == pytest.approx(e * analytic, rel=1e-12)
    assert gpu.expert_flops == pytest.approx(analytic, rel=1e-12)
    # bytes: per layer, projection and grouped matmul, the rows in and out ((D + I) elements each) and min(E, rows)
    # matrices, float32
    assert gpu.expert_hbm_bytes == pytest.approx(passes * layers * 3 * (rows * (d + i) + min(e, rows) * d * i) * F32,
                                                 rel=1e-12)
    assert cpu.expert_hbm_bytes > gpu.expert_hbm_bytes
    assert gpu.flops - gpu.expert_flops == pytest.approx(cpu.flops - cpu.expert_flops, rel=1e-12)
    assert gpu.hbm_bytes - gpu.expert_hbm_bytes == pytest.approx(cpu.hbm_bytes - cpu.expert_hbm_bytes, rel=1e-12)
    assert 0 < cpu.flops - cpu.expert_flops < cpu.flops  # attention, router, shared expert, head: counted, not experts
    assert gpu.collective_bytes == cpu.collective_bytes


@pytest.mark.parametrize("fraction", [1.0, 0.25])
def test_the_gathered_exchange_costs_this_devices_share_of_the_rows(fraction):
    """`sharding/experts.routed_swiglu` (XLA:CPU's gathered exchange) on 8 devices, E = 16 experts (L = 2 local),
    top-4, T tokens per device: the compiled program runs all 8 devices' T k rows in blocks through both local
    experts (blocks past the local rows skipped at run time, counted at their bound); the GPU model counts this
    device's T k rows (x fraction: the real rows) once each, their bytes and the L local matrices per projection
    (bf16), once per call."""
    from longstraw_jax.sharding import experts

    mesh = _mesh()
    t, d, i, e, k = 16, 64, 32, 16, 4
    local = e // N_DEV

    def layer(x, ids, weights, gate, up, down):
        return experts.routed_swiglu(x, ids, weights, gate, up, down, axes="x", exchange=experts.gathered)

    f = jax.shard_map(layer, mesh=mesh, in_specs=(P("x"),) * 6, out_specs=P("x"), check_vma=False)
    shaped = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P("x")))
    compiled = _compile(f, shaped((N_DEV * t, d), jnp.bfloat16), shaped((N_DEV * t, k), jnp.int32),
                        shaped((N_DEV * t, k), jnp.float32), shaped((e, i, d), jnp.bfloat16),
                        shaped((e, i, d), jnp.bfloat16), shaped((e, d, i), jnp.bfloat16))
    cpu, gpu = _expert_costs(compiled, e, fraction)
    rows = t * k * fraction
    assert cpu.expert_flops == pytest.approx(N_DEV * t * k * local * 3 * 2 * d * i, rel=1e-12)
    assert gpu.expert_flops == pytest.approx(rows * 3 * 2 * d * i, rel=1e-12)
    assert gpu.expert_hbm_bytes == pytest.approx(3 * (rows * (d + i) + min(local, rows) * d * i) * 2, rel=1e-12)
    assert gpu.flops - gpu.expert_flops == pytest.approx(cpu.flops - cpu.expert_flops, rel=1e-12)
    assert gpu.hbm_bytes - gpu.expert_hbm_bytes == pytest.approx(cpu.hbm_bytes - cpu.expert_hbm_bytes, rel=1e-12)
    assert gpu.collective_bytes == cpu.collective_bytes  # the exchange's collectives: as compiled (hlo/experts.py)


def test_the_expert_model_rejects_bad_input_and_a_program_without_experts_is_unchanged():
    with pytest.raises(ValueError, match="routed"):
        ExpertModel(0)
    with pytest.raises(ValueError, match="row_fraction"):
        ExpertModel(8, 0.0)
    b, d = 4, 32
    compiled = _compile(_matmuls, jax.ShapeDtypeStruct((b, d), jnp.float32), jax.ShapeDtypeStruct((3, d, d),
                                                                                                   jnp.float32))
    cpu, gpu = _expert_costs(compiled, 8)
    assert cpu == gpu and cpu.expert_flops == 0 and cpu.expert_hbm_bytes == 0


# ----- loops bounded by data and a constant; walks cached by the values their loops read ---------------------------


def test_a_loop_bounded_by_data_and_a_constant_is_counted_at_the_constant():
    """`while (i < n) & (i < 4)` with n an integer cast from a float (no value the scalar evaluation can know): the
    conjunction is false from i = 4 on, so the loop is counted 4 times and listed in bounded_loops; without the
    constant bound it is an unknown loop (counted once). `ops/attention.for_each_block` states its static bound so."""
    d = 16

    def loop(bounded):
        def f(x, w, n):
            n = n.astype(jnp.int32)
            cond = (lambda c: (c[0] < n) & (c[0] < 4)) if bounded else (lambda c: c[0] < n)
            return jax.lax.while_loop(cond, lambda c: (c[0] + 1, jnp.tanh(c[1] @ w)), (0, x))[1]
        return program_cost(_compile(f, jax.ShapeDtypeStruct((d, d), jnp.float32),
                                     jax.ShapeDtypeStruct((d, d), jnp.float32), jax.ShapeDtypeStruct((), jnp.float32)))

    bounded, unbounded = loop(True), loop(False)
    assert bounded.flops == 4 * 2 * d ** 3 and bounded.unknown_loops == () and len(bounded.bounded_loops) == 1
    assert unbounded.flops == 2 * d ** 3 and len(unbounded.unknown_loops) == 1


def test_for_each_blocks_compiled_condition_is_false_at_its_static_bound_whatever_its_trips():
    """`ops/attention.for_each_block`'s loop condition, as compiled, states the static bound num_blocks: evaluated
    with only the counter known (the data-dependent `trips` unknown, as where XLA precomputes it into a vector: the
    GLM-5.2 replay's indexer loop over its own keys), it is false at num_blocks and undecided below."""
    from longstraw_jax.capacity.hlo.parse import called
    from longstraw_jax.capacity.hlo.walk import Walk
    from longstraw_jax.ops.attention import for_each_block

    blocks, size, d = 5, 8, 16

    def f(x, prefix):
        visit = lambda carry, start, n: (carry + jax.lax.dynamic_slice_in_dim(x, start, n).sum(), None)
        return for_each_block(blocks * size, size, jnp.float32(0), visit, prefix)[0]

    text = _compile(f, jax.ShapeDtypeStruct((blocks * size, d), jnp.float32),
                    jax.ShapeDtypeStruct((), jnp.int32)).as_text()
    module = Walk(text, {})
    computations = module.program.computations
    loops = [i for instrs in computations.values() for i in instrs if i.opcode == "while"]
    assert len(loops) == 1
    cond = called(loops[0], "condition")[0]
    root = next(i for i in computations[cond] if i.root)
    values = {}
    for slot in module.relevance.reads(cond, root.name):  # the counter and the trips: set one, the other unknown
        values[slot] = [module.scalars.value(cond, root.name, ((slot, (float(i), float(i))),)) for i in (0, blocks)]
    assert [(0.0, 1.0), (0.0, 0.0)] in values.values(), values


def _costs_both_ways(compiled, experts=None):
    """(cost with walks cached by the values their loops read, brute force: every walk keyed by all known values),
    asserted equal to 1e-9 relative, and the number of walks each evaluated."""
    from longstraw_jax.capacity.hlo.walk import Walk

    text = compiled.as_text()
    out = []
    for project in (True, False):
        module = Walk(text, {}, experts, project)
        out.append((module.walk(module.program.entry, False), len(module._walks)))
    (fast, fast_walks), (brute, brute_walks) = out
    assert fast.flops == pytest.approx(brute.flops, rel=1e-9) and fast.flops > 0
    assert fast.hbm_bytes == pytest.approx(brute.hbm_bytes, rel=1e-9)
    assert fast.collective_bytes.keys() == brute.collective_bytes.keys()
    for kind, moved in brute.collective_bytes.items():
        assert fast.collective_bytes[kind] == pytest.approx(moved, rel=1e-9)
    assert fast.expert_flops == pytest.approx(brute.expert_flops, rel=1e-9)
    assert fast.expert_hbm_bytes == pytest.approx(brute.expert_hbm_bytes, rel=1e-9)
    assert (fast.unknown_loops, set(fast.bounded_loops)) == (brute.unknown_loops, set(brute.bounded_loops))
    return fast, fast_walks, brute_walks


def test_a_layer_loop_is_walked_once_per_round_when_only_the_round_bounds_its_block_loops():
    """Rounds r < n, each a loop over L layers, each a block loop of r trips (bounded by the round index only): the
    layer body is walked once per round (its layer index reaches no bound), not once per round and layer, and the
    cost is the brute force's: L x sum_r r matmuls."""
    d, rounds, layers = 16, 6, 5

    def f(x, w):
        def layer(r, j, h):
            return jax.lax.while_loop(lambda c: c[0] < r, lambda c: (c[0] + 1, jnp.tanh(c[1] @ w) + j), (0, h))[1]

        def round_(r, h):
            return jax.lax.fori_loop(0, layers, lambda j, h: layer(r, j.astype(h.dtype), h), h)
        return jax.lax.fori_loop(0, rounds, round_, x)

    cost, fast_walks, brute_walks = _costs_both_ways(_compile(f, jax.ShapeDtypeStruct((d, d), jnp.float32),
                                                              jax.ShapeDtypeStruct((d, d), jnp.float32)))
    assert cost.flops == layers * rounds * (rounds - 1) // 2 * 2 * d ** 3
    assert fast_walks < brute_walks - (layers - 1) * (rounds - 1)


@pytest.mark.parametrize("config", ["qwen3.6-tiny", "glm-5.2-tiny"])
def test_a_tiny_models_capture_costs_the_brute_forces_totals(config):
    """The sharded capture of a tiny model (1x4 mesh, 8 rounds of 64 positions: block loops whose trip counts
    grow with the round index, inside the layer loops): costed with walks cached by the values their loops read,
    it is the brute force's Cost to 1e-9 relative, with no more walks."""
    import os

    from longstraw_jax.capacity.planner import Planner

    path = os.path.join(ROOT, "configs", f"{config}.json")
    planner = Planner(path, "1x4", "bfloat16", 8, 64, devices=jax.devices()[:4])
    compiled = planner.capture_program(8 * 64 * 1 + 1)
    cost, fast_walks, brute_walks = _costs_both_ways(compiled, planner.expert_model("capture"))
    assert fast_walks <= brute_walks


@pytest.mark.slow  # compiles tiny GLM-5.2's exact update (the prompt backward over the rounds): ~2.5 min
def test_a_tiny_models_exact_update_costs_the_brute_forces_totals():
    """Tiny GLM-5.2's exact update given the capture (LoRA, 1x4, 8 rounds: the replay and the prompt backward's
    loops over the rounds, each round's block loops bounded by its index): the brute force's Cost to 1e-9."""
    import os

    from longstraw_jax.capacity.planner import Planner

    path = os.path.join(ROOT, "configs", "glm-5.2-tiny.json")
    planner = Planner(path, "1x4", "bfloat16", 8, 64, devices=jax.devices()[:4], train_mode="lora", lora_rank=4)
    _costs_both_ways(planner.update_program(8 * 64 + 1, 2, "exact"), planner.expert_model("update"))


# ----- softmax attention: costed as the Pallas flash kernels (hlo.KernelModel) -------------------------------------


def _one_attend(gradient):
    """One `ops.attention.attend` call (XLA path, 256 queries over 1024 keys, not causal: every key visible; 6 query /
    2 key-value heads of 32, bf16, key blocks of 256: a 4-trip loop), or the gradient of sum(out) + sum(lse)."""
    from longstraw_jax.ops import attention

    t, s, hq, hkv, d = 256, 1024, 6, 2, 32

    def f(q, k, v):
        a = attention.attend(q, k, v, q_positions=jnp.arange(t) + s, k_offset=0, scale=0.1, causal=False,
                             block_size=256)
        return jnp.sum(a.out) + jnp.sum(a.lse)

    shapes = [jax.ShapeDtypeStruct(shape, jnp.bfloat16) for shape in ((t, hq, d), (s, hkv, d), (s, hkv, d))]
    return _compile(jax.grad(f, argnums=(0, 1, 2)) if gradient else f, *shapes), (t, s, hq, hkv, d)


@pytest.mark.parametrize("gradient", [False, True], ids=["forward", "gradient"])
def test_attention_costs_the_flash_kernels_flops_and_fewer_bytes(gradient):
    """With a KernelModel the attention loops cost the kernels' analytic FLOPs (kernels.py: forward 2 (D + Dv) per
    visited (query, key, head) triple; backward dQ 2 (2 D + Dv) plus dK / dV 2 (2 D + 2 Dv) per triple) and their
    compulsory bytes (read once, written once) in place of XLA's unfused traffic; the
    program has no matmul outside those loops, so its FLOPs are exactly the kernels'."""
    from longstraw_jax.capacity.hlo import KernelModel

    compiled, (t, s, hq, hkv, d) = _one_attend(gradient)
    model = KernelModel(hq, hkv, d, d, 2.0)
    xla, kernels = program_cost(compiled), program_cost(compiled, kernels=model)
    triples = t * s * hq
    expected = model.forward(triples, t) + (model.backward(triples, t, s) if gradient else Cost())
    assert xla.flops == triples * (4 * d + (10 * d if gradient else 0))  # as compiled: XLA's 2 (+ 5) matmuls
    assert kernels.flops == expected.flops == triples * (4 * d + (6 * d + 8 * d if gradient else 0))
    # the loops' compulsory bytes plus the XLA ops around them (casts, delta, the cotangents' placement), far below
    # the unfused loops' score blocks
    assert expected.hbm_bytes < kernels.hbm_bytes < xla.hbm_bytes / 10
    assert kernels.unknown_loops == xla.unknown_loops == ()


def test_the_kernel_model_leaves_a_program_without_attention_and_the_default_unchanged():
    from longstraw_jax.capacity.hlo import KernelModel

    compiled = _compile(_matmuls, jax.ShapeDtypeStruct((4, 32), jnp.float32),
                        jax.ShapeDtypeStruct((5, 32, 32), jnp.float32))
    assert program_cost(compiled, kernels=KernelModel(6, 2, 32, 32)) == program_cost(compiled)
    attend, _ = _one_attend(False)
    assert program_cost(attend, kernels=None) == program_cost(attend)
    with pytest.raises(ValueError, match="multiple"):
        KernelModel(6, 4, 32, 32)
    with pytest.raises(ValueError, match="positive"):
        KernelModel(0, 1, 32, 32)


def test_the_planners_kernel_option():
    """Planner(kernels=...): "xla" costs as compiled (no model), "pallas" the config's Kernels at the params' dtype
    (Qwen3.6: softmax attention and the chunked GDN; GLM-5.x: sparse latent attention); a config without kernels,
    or another name, is refused."""
    import os

    from longstraw_jax.capacity.hlo import GatedDeltaModel, KernelModel, Kernels, SparseLatentModel
    from longstraw_jax.capacity.planner import Planner

    path = lambda name: os.path.join(ROOT, "configs", f"{name}.json")
    devices = jax.devices()[:1]
    assert Planner(path("qwen3.6-tiny"), "1x1", "bfloat16", 8, 64, devices=devices).kernel_model() is None
    planner = Planner(path("qwen3.6-tiny"), "1x1", "bfloat16", 8, 64, devices=devices, kernels="pallas")
    # the kernels' chunk (32) and the XLA loops' own chunk the planner compiles (16): tiny() sets no gdn_chunk_size
    assert planner.kernel_model() == Kernels(KernelModel(4, 2, 32, 32, 2.0), GatedDeltaModel(16, 16, 32, 16))
    glm = Planner(path("glm-5.2-tiny"), "1x1", "bfloat16", 8, 64, devices=devices, kernels="pallas")
    assert glm.kernel_model() == Kernels(sparse_latent=SparseLatentModel(4, 32, 8, 2.0))
    with pytest.raises(ValueError, match="no Pallas kernels"):
        Kernels.for_config(object(), 2)
    with pytest.raises(ValueError, match="expected xla or pallas"):
        Planner(path("qwen3.6-tiny"), "1x1", "bfloat16", 8, 64, devices=devices, kernels="triton")


# ----- the chunked GDN and sparse latent attention: costed as their Pallas kernels (hlo.Kernels) -------------------


def _one_gated_delta(pass_, chunk: int = 64):
    """One `gated_delta_rule_chunked` call (XLA path, T = 256 tokens in 4 chunks of 64 (or 256 / chunk of chunk), 3
    value heads, dk 16, dv 32, float32), or the gradient of sum(o) + sum(state) in every input, or that loss and its
    gradient with the call rematerialised (`jax.checkpoint`: its forward runs for the loss, then again under the
    backward)."""
    from longstraw_jax.ops.gated_delta import gated_delta_rule_chunked

    t, h, dk, dv = 256, 3, 16, 32
    core = lambda *a: gated_delta_rule_chunked(*a, chunk_size=chunk)
    core = jax.checkpoint(core) if pass_ == "remat" else core

    def loss(*a):
        o, state = core(*a)
        return jnp.sum(o) + jnp.sum(state)

    shapes = [jax.ShapeDtypeStruct(s, jnp.float32) for s in ((t, h, dk), (t, h, dk), (t, h, dv), (t, h), (t, h),
                                                              (h, dk, dv))]
    program = core if pass_ == "forward" else (jax.value_and_grad if pass_ == "remat" else jax.grad)(
        loss, argnums=tuple(range(6)))
    return _compile(program, *shapes), (t // 64, h, dk, dv)


@pytest.mark.parametrize("pass_", ["forward", "gradient", "remat"])
def test_the_gated_delta_rule_costs_its_kernels_flops_and_fewer_bytes(pass_):
    """With a GatedDeltaModel the chunk loops cost the kernels' analytic FLOPs and compulsory bytes (kernels.py:
    per chunk and state matrix, stages A, B, C forward; their vjps backward, found by the loop's op_name; a
    rematerialised forward under the backward is a forward again). The program has no matmul outside the loops, so
    its FLOPs are exactly the kernels'; with one column block (dv <= 32) the forward's are also XLA's own (the same
    matmuls: A, the doubling solve, u, q S, q k^T, scores u, the state update)."""
    from longstraw_jax.capacity.hlo import GatedDeltaModel, Kernels

    compiled, (n, h, dk, dv) = _one_gated_delta(pass_)
    model = GatedDeltaModel(dk, dv, 64)
    xla, kernels = program_cost(compiled), program_cost(compiled, kernels=Kernels(gated_delta=model))
    c, s = 64, 6  # chunk, doubling steps
    solve = 2 * c * c * dk + s * 2 * c * c * (dk + dv) + (s - 1) * 2 * c**3
    forward = n * h * (solve + 6 * c * dk * dv + 2 * c * c * dk + 2 * c * c * dv)
    solve_vjp = 6 * c * c * dk + 4 * s * c**3 + 4 * c * c * (dk + dv)  # stage A's backward, the inverse in closed form
    backward = n * h * (solve_vjp + 14 * c * dk * dv + 4 * c * c * dv + 6 * c * c * dk)
    expected = {"forward": model.forward(n, h), "gradient": model.forward(n, h) + model.backward(n, h),
                "remat": model.forward(n, h).scaled(2) + model.backward(n, h)}[pass_]
    assert kernels.flops == expected.flops == {"forward": forward, "gradient": forward + backward,
                                               "remat": 2 * forward + backward}[pass_]
    if pass_ == "forward":
        assert xla.flops == forward
    assert expected.hbm_bytes < kernels.hbm_bytes < xla.hbm_bytes / 3
    assert kernels.unknown_loops == xla.unknown_loops == ()


@pytest.mark.parametrize("pass_", ["forward", "gradient"])
def test_the_gated_delta_kernels_cost_does_not_depend_on_the_xla_chunk(pass_):
    """The XLA path runs its own chunk (16 by default, `Qwen36Config.gdn_chunk_for`), the kernels theirs (64): a
    GatedDeltaModel told the compiled chunk counts a loop of 16 trips of 16 tokens as 4 of the kernels' chunks, so
    the program costs what the chunk-64 program costs as the kernels; told nothing, it would count 16 chunks."""
    from longstraw_jax.capacity.hlo import GatedDeltaModel, Kernels

    (compiled64, (_, _, dk, dv)), (compiled16, _) = _one_gated_delta(pass_), _one_gated_delta(pass_, chunk=16)
    as_kernels = lambda compiled, model: program_cost(compiled, kernels=Kernels(gated_delta=model))
    reference = as_kernels(compiled64, GatedDeltaModel(dk, dv, 64))
    assert as_kernels(compiled16, GatedDeltaModel(dk, dv, 64, 16)).flops == reference.flops
    assert as_kernels(compiled16, GatedDeltaModel(dk, dv, 64)).flops == 4 * reference.flops
    assert program_cost(compiled16).flops < program_cost(compiled64).flops  # the smaller chunk's own matmuls: fewer


def _one_latent_attention(gradient):
    """One `sparse_latent_attention_partial` call (XLA path, T = 128 queries in blocks of 64, 4 heads, Dl 32, Dr 16,
    k = 64 slots over a 512-row layer of a 2-layer cache and the new rows, bf16), or the gradient of sum(out) +
    sum(lse) in q, the cache and the new rows."""
    from longstraw_jax.ops.mla import sparse_latent_attention_partial

    t, h, dl, dr, s, k = 128, 4, 32, 16, 512, 64

    def f(q, cache, new, selected):
        a = sparse_latent_attention_partial(q, cache, 1, new, selected, s, scale=0.1, value_dim=dl, block_size=64)
        return jnp.sum(a.out) + jnp.sum(a.lse)

    shapes = [jax.ShapeDtypeStruct(shape, jnp.bfloat16) for shape in ((t, h, dl + dr), (2, s, dl + dr), (t, dl + dr))]
    shapes.append(jax.ShapeDtypeStruct((t, k), jnp.int32))
    return _compile(jax.grad(f, argnums=(0, 1, 2)) if gradient else f, *shapes), (t, h, dl, dr, k)


@pytest.mark.parametrize("gradient", [False, True], ids=["forward", "gradient"])
def test_sparse_latent_attention_costs_its_kernels_flops_and_fewer_bytes(gradient):
    """With a SparseLatentModel the query-block loops cost the kernels' FLOPs (2 T H k (2 Dl + Dr) forward, 2 T H k
    (5 Dl + 3 Dr) backward: the XLA path's own matmuls, so its FLOPs are unchanged) and their compulsory bytes (q,
    the selected positions, the gathered rows T k (Dl + Dr), out and lse; the backward's dq and the rows'
    cotangents) in place of XLA's materialised [W, k, Dk] gathers and score blocks."""
    from longstraw_jax.capacity.hlo import Kernels, SparseLatentModel

    compiled, (t, h, dl, dr, k) = _one_latent_attention(gradient)
    model = SparseLatentModel(h, dl, dr, 2.0)
    xla, kernels = program_cost(compiled), program_cost(compiled, kernels=Kernels(sparse_latent=model))
    expected = model.forward(t, k) + (model.backward(t, k) if gradient else Cost())
    assert kernels.flops == expected.flops == xla.flops == 2 * t * h * k * (2 * dl + dr + (5 * dl + 3 * dr
                                                                                        if gradient else 0))
    gathered = t * k * (dl + dr) * 2
    assert expected.hbm_bytes > gathered * (2 if gradient else 1)
    assert expected.hbm_bytes < kernels.hbm_bytes < xla.hbm_bytes / 3
    assert kernels.unknown_loops == xla.unknown_loops == ()


def test_the_kernels_leave_other_loops_and_the_default_unchanged():
    """A Kernels without a model for a path costs that path as compiled (attention alone: the GDN's and the latent
    attention's loops unchanged); kernels=None and an empty Kernels are the default."""
    from longstraw_jax.capacity.hlo import GatedDeltaModel, KernelModel, Kernels, SparseLatentModel

    gdn, _ = _one_gated_delta("gradient")
    latent, _ = _one_latent_attention(True)
    for compiled in (gdn, latent):
        default = program_cost(compiled)
        assert program_cost(compiled, kernels=None) == program_cost(compiled, kernels=Kernels()) == default
        assert program_cost(compiled, kernels=KernelModel(6, 2, 32, 32)) == default
    assert program_cost(gdn, kernels=Kernels(sparse_latent=SparseLatentModel(4, 32, 16))) == program_cost(gdn)
    assert program_cost(latent, kernels=Kernels(gated_delta=GatedDeltaModel(16, 32))) == program_cost(latent)
    with pytest.raises(ValueError, match="positive"):
        GatedDeltaModel(0, 32)
    with pytest.raises(ValueError, match="positive"):
        SparseLatentModel(4, 32, 0)


def test_the_kernel_models_launch_constants_are_the_kernels():
    """The time model's copies of the kernels' launch constants (GDN column blocks and default chunk, the latent
    backward's heads per program) are the kernels' own."""
    from longstraw_jax.capacity.hlo import kernels
    from longstraw_jax.ops import flash_gated_delta, flash_mla

    assert kernels.COLUMN_BLOCK == flash_gated_delta.COLUMN_BLOCK
    assert kernels.GatedDeltaModel(16, 16).chunk == flash_gated_delta.MAX_CHUNK
    assert kernels.BACKWARD_HEADS == flash_mla.BACKWARD_HEADS
