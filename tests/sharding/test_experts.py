"""Expert parallelism (`sharding/experts.py`) == all experts on one device (`ops.moe.grouped_swiglu`), in values and
gradients, on 8 simulated CPU devices (2x4), for both exchanges: the all-gather one (`gathered`, XLA:CPU's) and the
ragged all-to-all one (`ragged`, GPUs'), the latter with `jax.lax.ragged_all_to_all` replaced by an all-gather
emulation of its documented semantics (XLA:CPU cannot run the primitive; the emulation is itself checked against a
numpy transcription of the documentation). Balanced and skewed routing (one device receives every row: many blocks;
the others skip all theirs), blocks smaller and larger than a device's rows, tokens replicated over `seq`; and the
ragged path's program lowered for CUDA (StableHLO only: nothing here compiles or runs it for a GPU)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from longstraw_jax.ops.moe import grouped_swiglu
from longstraw_jax.sharding import mesh as mesh_lib, rules
from longstraw_jax.sharding.experts import exchange_for, gathered, local_experts, ragged, routed_swiglu
from longstraw_jax.sharding.groups import DATA
from longstraw_jax.sharding.rules import FSDP
from tests.helpers import emulated_ragged_all_to_all

E, K, D, HIDDEN, T = 16, 3, 8, 6, 5  # 16 experts on 8 devices: 2 each; 5 tokens per device


EMULATED = functools.partial(ragged, collective=emulated_ragged_all_to_all)


def _inputs(skewed: bool, tokens: int, num_experts: int = E):
    """skewed: every token to experts 0..K-1 (16 experts: devices 0 and 1 hold them; 32: device 0 alone)."""
    keys = jax.random.split(jax.random.key(0), 6)
    x = jax.random.normal(keys[0], (tokens, D))
    if skewed:
        experts = jnp.tile(jnp.arange(K, dtype=jnp.int32), (tokens, 1))
    else:
        experts = jnp.argsort(jax.random.uniform(keys[1], (tokens, num_experts)), axis=-1)[:, :K].astype(jnp.int32)
    weights = jax.random.uniform(keys[2], (tokens, K), minval=0.1)
    gate, up = (jax.random.normal(k, (num_experts, HIDDEN, D)) for k in keys[3:5])
    down = jax.random.normal(keys[5], (num_experts, D, HIDDEN))
    return x, experts, weights, gate, up, down


def _loss_and_grads(fn, args, cotangent):
    loss = lambda x, w, g, u, d: jnp.sum(fn(x, args[1], w, g, u, d) * cotangent)
    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))(args[0], *args[2:])


def _assert_close(got, want):
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for g, w in zip(got[1], want[1]):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("exchange,skewed,num_experts,block", [
    (gathered, False, E, None), (gathered, True, E, None), (gathered, True, E, 4), (gathered, False, E, 1000),
    (EMULATED, False, E, None), (EMULATED, True, 2 * E, None), (EMULATED, True, 2 * E, 4)],
    ids=["gathered", "gathered-skewed", "gathered-skewed-block4", "gathered-block1000", "ragged",
         "ragged-one-device", "ragged-one-device-block4"])
def test_routed_swiglu_equals_one_device(exchange, skewed, num_experts, block):
    mesh = mesh_lib.make_mesh("2x4")
    args = _inputs(skewed, 8 * T, num_experts)
    cotangent = jax.random.normal(jax.random.key(9), (8 * T, D))
    spec = P(FSDP)
    sharded = jax.shard_map(lambda *a: routed_swiglu(*a, block=block, exchange=exchange), mesh=mesh,
                            in_specs=(spec,) * 6, out_specs=spec, check_vma=False)
    want = jax.jit(lambda *a: _loss_and_grads(grouped_swiglu, a, cotangent))(*args)
    _assert_close(jax.jit(lambda *a: _loss_and_grads(sharded, a, cotangent))(*args), want)


@pytest.mark.parametrize("exchange,skewed", [(gathered, False), (gathered, True), (EMULATED, False),
                                             (EMULATED, True)], ids=["gathered", "gathered-skewed", "ragged",
                                                                     "ragged-skewed"])
def test_tokens_replicated_over_seq_are_sent_once(exchange, skewed):
    """Each data slice's 7 tokens are the same on its 4 seq shards (7: not a multiple of 4, so the slices are
    padded); the outputs and gradients equal one device's per slice, and each seq shard computes only its slice."""
    mesh = mesh_lib.make_mesh("2x4")
    x, experts, weights, gate, up, down = _inputs(skewed, 14)
    cotangent = jax.random.normal(jax.random.key(9), (14, D))
    sharded = jax.shard_map(lambda *a: routed_swiglu(*a, replicated_over_seq=True, exchange=exchange), mesh=mesh,
                            in_specs=(P("data"),) * 3 + (P(FSDP),) * 3, out_specs=P("data"), check_vma=False)
    want = jax.jit(lambda *a: _loss_and_grads(grouped_swiglu, a, cotangent))(x, experts, weights, gate, up, down)
    _assert_close(jax.jit(lambda *a: _loss_and_grads(sharded, a, cotangent))(x, experts, weights, gate, up, down),
                  want)


def test_local_experts_skip_blocks_without_local_rows():
    """Only the device's own rows are computed: with every row on other devices' experts, the block function never
    runs (an expert weight of NaN would poison the output if it did), and with some local rows the result is the
    masked one-device sum."""
    x, experts, weights, gate, up, down = _inputs(False, 12)
    nan = jnp.full_like(gate[:2], jnp.nan)
    out = local_experts(x, experts + 2, weights, nan, nan, jnp.full((2, D, HIDDEN), jnp.nan), block=4)  # ids >= 2
    assert out.shape == (12, D) and np.all(np.asarray(out) == 0)
    got = local_experts(x, experts, weights, gate[:2], up[:2], down[:2], block=5)
    mask = experts < 2
    want = grouped_swiglu(x, jnp.where(mask, experts, E), jnp.where(mask, weights, 0), gate[:2], up[:2], down[:2])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_memory_is_gathered_tokens_plus_one_block():
    """Compiled per-device temporaries of the forward + backward (T = 1024 tokens per device, k = 8, blocks of 2048
    rows): well under the n * T * k * (D + 3 I) floats of running every gathered (token, expert) row (160 MiB here),
    and growing with the gathered tokens (n * T * D), not with n * T * k."""
    mesh, k, d, i = mesh_lib.make_mesh("2x4"), 8, 256, 128

    def temp_mib(tokens):
        f = jax.shard_map(lambda *a: routed_swiglu(*a, block=2048, exchange=gathered), mesh=mesh,
                          in_specs=(P(FSDP),) * 6, out_specs=P(FSDP), check_vma=False)
        grads = lambda x, e, w, g, u, dn: jax.grad(lambda *a: jnp.sum(f(a[0], e, *a[1:]) ** 2),
                                                   argnums=(0, 1, 2, 3, 4))(x, w, g, u, dn)
        shapes = [((8 * tokens, d), jnp.float32), ((8 * tokens, k), jnp.int32), ((8 * tokens, k), jnp.float32),
                  ((E, i, d), jnp.float32), ((E, i, d), jnp.float32), ((E, d, i), jnp.float32)]
        compiled = jax.jit(grads).lower(*(jax.ShapeDtypeStruct(s, t) for s, t in shapes)).compile()
        return compiled.memory_analysis().temp_size_in_bytes / 2**20

    every_row = 8 * 1024 * k * (d + 3 * i) * 4 / 2**20
    small, large = temp_mib(512), temp_mib(1024)
    assert large < every_row / 2, (large, every_row)
    assert large - small < 6 * (8 * 512 * d * 4) / 2**20, (small, large)  # a few [n T, D] float32 buffers



def _documented_ragged_all_to_all(operands, outputs, input_offsets, output_offsets, recv_sizes):
    """numpy transcription of the `jax.lax.ragged_all_to_all` docstring's SEND / RECEIVE loops, for all n devices
    at once: every argument stacked over devices ([n, ...]). -> the n results."""
    n, slots = recv_sizes.shape
    per = slots // n
    results = outputs.copy()
    for me in range(n):
        sent = [operands[src][input_offsets[src, j]:][:recv_sizes[me, i]]  # what src sends to me in my slot i
                for i in range(slots) for src, j in [(i // per, me * per + i % per)]]
        received_at = [output_offsets[i // per, me * per + i % per] for i in range(slots)]  # all_to_all of offsets
        for i in range(slots):
            results[me, received_at[i]:received_at[i] + recv_sizes[me, i]] = sent[i]
    return results


@pytest.mark.parametrize("per", [1, 2])
def test_emulated_ragged_all_to_all_follows_the_documentation(per):
    """Random slices (per slots per device pair, sizes 0..3, anywhere in the operand, at disjoint random places of
    each receiver's buffer; 2x4 mesh, so the device order over ("data", "seq") is the emulation's too)."""
    n, rows, buffer, width = 8, 7, 64, 2
    rng = np.random.default_rng(0)
    recv_sizes = rng.integers(0, 4, (n, n * per))  # [receiver, slot]
    output_offsets = np.zeros((n, n * per), np.int64)  # [sender, slot]
    for me in range(n):  # disjoint places in me's buffer, in a random order, with random gaps
        place = 0
        for i in rng.permutation(n * per):
            place += rng.integers(0, 2)
            output_offsets[i // per, me * per + i % per] = place
            place += recv_sizes[me, i]
        assert place <= buffer
    send_sizes = np.array([[recv_sizes[j // per, src * per + j % per] for j in range(n * per)] for src in range(n)])
    input_offsets = rng.integers(0, rows - send_sizes + 1)
    operands = rng.normal(size=(n, rows, width)).astype(np.float32)
    outputs = rng.normal(size=(n, buffer, width)).astype(np.float32)
    want = _documented_ragged_all_to_all(operands, outputs, input_offsets, output_offsets, recv_sizes)

    def one(operand, output, *sizes_and_offsets):
        return emulated_ragged_all_to_all(operand, output, *(a.reshape(-1) for a in sizes_and_offsets),
                                          axis_name=FSDP)

    emulated = jax.shard_map(one, mesh=mesh_lib.make_mesh("2x4"), in_specs=P(FSDP), out_specs=P(FSDP),
                             check_vma=False)
    stack = lambda a: jnp.asarray(a.reshape((n * a.shape[1],) + a.shape[2:]), a.dtype)
    got = jax.jit(emulated)(stack(operands), stack(outputs),
                            *(jnp.asarray(a, jnp.int32) for a in (input_offsets, send_sizes, output_offsets,
                                                                  recv_sizes)))
    np.testing.assert_array_equal(np.asarray(got).reshape(want.shape), want)


@pytest.mark.parametrize("nested", [False, True], ids=["mesh", "inside-over-data"])
def test_ragged_exchange_lowers_for_cuda(monkeypatch, nested):
    """With the backend reported as "gpu", `routed_swiglu` picks the ragged exchange and `ops.moe` the grouped
    `ragged_dot`; the forward + backward program lowers for CUDA on this CPU-only machine (StableHLO: XLA:GPU never
    compiles it here) with the primitive's custom call over all 8 devices (3 exchanges forward, the 2 float ones
    transposed backward), grouped `ragged_dot`s and no reduce-scatter (the all-gather path's). nested: as inside
    `groups.over_data` (`data` manual outside, `seq` inside: `rules.shard_map`). On CPU the default is the
    all-gather exchange."""
    assert exchange_for("cpu") is gathered and exchange_for("gpu") is ragged and exchange_for("tpu") is ragged
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    mesh = mesh_lib.make_mesh("2x4")
    f = lambda *a: rules.shard_map(routed_swiglu, mesh, (P(FSDP),) * 6, P(FSDP))(*a)
    if nested:
        f = jax.shard_map(f, mesh=mesh, in_specs=P(DATA), out_specs=P(DATA), axis_names={DATA}, check_vma=False)
    grads = jax.grad(lambda x, e, *w: jnp.sum(f(x, e, *w) ** 2), argnums=(0, 2, 3, 4, 5))
    shapes = [((8 * T, D), jnp.float32), ((8 * T, K), jnp.int32), ((8 * T, K), jnp.float32),
              ((E, HIDDEN, D), jnp.float32), ((E, HIDDEN, D), jnp.float32), ((E, D, HIDDEN), jnp.float32)]
    lowered = jax.jit(grads).trace(*(jax.ShapeDtypeStruct(s, t) for s, t in shapes)).lower(
        lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert text.count("stablehlo.custom_call @ragged_all_to_all") == 5
    assert text.count("replica_groups = dense<[[0, 1, 2, 3, 4, 5, 6, 7]]>") >= 5
    assert "chlo.ragged_dot" in text and "reduce_scatter" not in text
