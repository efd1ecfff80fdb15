"""Expert parallelism (`sharding/experts.py`) == all experts on one device (`ops.moe.grouped_swiglu`), in values and
gradients, on 8 simulated CPU devices: balanced and skewed routing (one device receives every row: many blocks; the
others skip all theirs), blocks smaller and larger than a device's rows, and tokens replicated over `seq`."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from longstraw_jax.ops.moe import grouped_swiglu
from longstraw_jax.sharding import mesh as mesh_lib
from longstraw_jax.sharding.experts import local_experts, routed_swiglu
from longstraw_jax.sharding.rules import FSDP

E, K, D, HIDDEN, T = 16, 3, 8, 6, 5  # 16 experts on 8 devices: 2 each; 5 tokens per device


def _inputs(skewed: bool, tokens: int):
    keys = jax.random.split(jax.random.key(0), 6)
    x = jax.random.normal(keys[0], (tokens, D))
    if skewed:  # every token to experts 0..2: devices 0 and 1 hold them all
        experts = jnp.tile(jnp.arange(K, dtype=jnp.int32), (tokens, 1))
    else:
        experts = jnp.argsort(jax.random.uniform(keys[1], (tokens, E)), axis=-1)[:, :K].astype(jnp.int32)
    weights = jax.random.uniform(keys[2], (tokens, K), minval=0.1)
    gate, up = (jax.random.normal(k, (E, HIDDEN, D)) for k in keys[3:5])
    down = jax.random.normal(keys[5], (E, D, HIDDEN))
    return x, experts, weights, gate, up, down


def _loss_and_grads(fn, args, cotangent):
    loss = lambda x, w, g, u, d: jnp.sum(fn(x, args[1], w, g, u, d) * cotangent)
    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))(args[0], *args[2:])


@pytest.mark.parametrize("skewed,block", [(False, None), (True, None), (True, 4), (False, 1000)])
def test_routed_swiglu_equals_one_device(skewed, block):
    mesh = mesh_lib.make_mesh("2x4")
    args = _inputs(skewed, 8 * T)
    cotangent = jax.random.normal(jax.random.key(9), (8 * T, D))
    spec = P(FSDP)
    sharded = jax.shard_map(lambda *a: routed_swiglu(*a, block=block), mesh=mesh, in_specs=(spec,) * 6,
                            out_specs=spec, check_vma=False)
    want = _loss_and_grads(grouped_swiglu, args, cotangent)
    got = jax.jit(lambda *a: _loss_and_grads(sharded, a, cotangent))(*args)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for g, w in zip(got[1], want[1]):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("skewed", [False, True])
def test_tokens_replicated_over_seq_are_sent_once(skewed):
    """Each data slice's 7 tokens are the same on its 4 seq shards (7: not a multiple of 4, so the slices are
    padded); the outputs and gradients equal one device's per slice, and each seq shard computes only its slice."""
    mesh = mesh_lib.make_mesh("2x4")
    x, experts, weights, gate, up, down = _inputs(skewed, 14)
    cotangent = jax.random.normal(jax.random.key(9), (14, D))
    sharded = jax.shard_map(lambda *a: routed_swiglu(*a, replicated_over_seq=True), mesh=mesh,
                            in_specs=(P("data"),) * 3 + (P(FSDP),) * 3, out_specs=P("data"), check_vma=False)
    want = _loss_and_grads(grouped_swiglu, (x, experts, weights, gate, up, down), cotangent)
    got = jax.jit(lambda *a: _loss_and_grads(sharded, a, cotangent))(x, experts, weights, gate, up, down)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for g, w in zip(got[1], want[1]):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)


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
        f = jax.shard_map(lambda *a: routed_swiglu(*a, block=2048), mesh=mesh, in_specs=(P(FSDP),) * 6,
                          out_specs=P(FSDP), check_vma=False)
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
