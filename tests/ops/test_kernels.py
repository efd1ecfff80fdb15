"""Ops against their plain references: chunked vs sequential gated delta rule, blockwise vs dense attention."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longstraw_jax.ops import attention
from longstraw_jax.ops.gated_delta import gated_delta_rule_chunked, gated_delta_rule_sequential
from longstraw_jax.ops.norms import l2_normalise


def _gdn_inputs(length, heads=3, dk=8, dv=12, seed=0):
    k = jax.random.split(jax.random.key(seed), 6)
    q = l2_normalise(jax.random.normal(k[0], (length, heads, dk))) * dk**-0.5
    key = l2_normalise(jax.random.normal(k[1], (length, heads, dk)))
    v = jax.random.normal(k[2], (length, heads, dv))
    g = -jnp.exp(jax.random.normal(k[3], (length, heads)))  # strong and weak decays
    beta = jax.nn.sigmoid(jax.random.normal(k[4], (length, heads)))
    state = jax.random.normal(k[5], (heads, dk, dv))
    return q, key, v, g, beta, state


@pytest.mark.parametrize("length,chunk", [(1, 64), (50, 64), (64, 64), (130, 64), (77, 16)])
def test_chunked_gated_delta_matches_sequential(length, chunk):
    args = _gdn_inputs(length)
    o_seq, s_seq = gated_delta_rule_sequential(*args)
    o_chk, s_chk = gated_delta_rule_chunked(*args, chunk_size=chunk)
    np.testing.assert_allclose(o_chk, o_seq, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(s_chk, s_seq, atol=2e-5, rtol=1e-4)


def test_a_short_input_is_one_unpadded_chunk():
    """T <= chunk_size (a decoded token, a short replay): one chunk of T rows, no loop and no padding to chunk_size
    (the doubling solve's matrices are [H, T, T])."""
    jaxpr = str(jax.make_jaxpr(lambda *a: gated_delta_rule_chunked(*a, chunk_size=64))(*_gdn_inputs(8)))
    assert "scan" not in jaxpr and "while" not in jaxpr and "64" not in jaxpr and "3,8,8" in jaxpr.replace(" ", "")
    assert "scan" in str(jax.make_jaxpr(lambda *a: gated_delta_rule_chunked(*a, chunk_size=4))(*_gdn_inputs(8)))


@pytest.mark.parametrize("length,chunk", [(90, 32), (7, 64)])
def test_chunked_gated_delta_gradients_match_sequential(length, chunk):
    args = _gdn_inputs(length)
    w_o = jax.random.normal(jax.random.key(9), (length, 3, 12))
    w_s = jax.random.normal(jax.random.key(10), (3, 8, 12))

    def loss(fn, *a):
        o, s = fn(*a)
        return jnp.sum(o * w_o) + jnp.sum(s * w_s)

    g_seq = jax.jit(jax.grad(lambda *a: loss(gated_delta_rule_sequential, *a), argnums=tuple(range(6))))(*args)
    g_chk = jax.jit(jax.grad(lambda *a: loss(lambda *b: gated_delta_rule_chunked(*b, chunk_size=chunk), *a),
                             argnums=tuple(range(6))))(*args)
    for name, a, b in zip("q k v g beta state".split(), g_chk, g_seq):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-3, err_msg=name)


def _dense_attention(q, k, v, q_pos, k_pos, scale):
    group = q.shape[1] // k.shape[1]
    k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
    s = jnp.einsum("thd,shd->ths", q, k) * scale
    s = jnp.where((k_pos[None, :] <= q_pos[:, None])[:, None, :], s, -jnp.inf)
    return jnp.einsum("ths,shd->thd", jax.nn.softmax(s, axis=-1), v)


@pytest.mark.parametrize("block", [4, 7, 64])
def test_blockwise_attention_prefix_plus_local_matches_dense(block):
    keys = jax.random.split(jax.random.key(1), 5)
    prefix, new, hq, hkv, d = 37, 11, 4, 2, 8
    q = jax.random.normal(keys[0], (new, hq, d))
    k = jax.random.normal(keys[1], (prefix + new, hkv, d)) * 2
    v = jax.random.normal(keys[2], (prefix + new, hkv, d))
    q_pos = prefix + jnp.arange(new)
    common = dict(q_positions=q_pos, scale=d**-0.5, block_size=block)
    a = attention.attend(q, k[:prefix], v[:prefix], k_offset=0, causal=False, **common)
    b = attention.attend(q, k[prefix:], v[prefix:], k_offset=prefix, causal=True, **common)
    got = attention.merge(a, b).out
    want = _dense_attention(q, k, v, q_pos, jnp.arange(prefix + new), d**-0.5)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_blockwise_attention_respects_kv_length_and_stacked_index():
    keys = jax.random.split(jax.random.key(2), 3)
    q = jax.random.normal(keys[0], (5, 2, 8))
    cache_k = jax.random.normal(keys[1], (3, 2, 40, 1, 8))  # [blocks, layers, S, Hkv, D]
    cache_v = jax.random.normal(keys[2], (3, 2, 40, 1, 8))
    valid = 23
    got = attention.attend(q, cache_k, cache_v, q_positions=jnp.full((5,), 100), k_offset=0, scale=0.3,
                           causal=False, kv_length=valid, block_size=8, kv_index=(2, 1)).out
    want = _dense_attention(q, cache_k[2, 1, :valid], cache_v[2, 1, :valid], jnp.full((5,), 100),
                            jnp.arange(valid), 0.3)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_blockwise_attention_gradients_match_dense_autodiff():
    """The flash-style custom VJP (recompute tiles from the saved log-sum-exp) equals autodiff of dense softmax
    attention, through a merge of a stacked-cache prefix and a causal local part (so d(lse) matters)."""
    keys = jax.random.split(jax.random.key(3), 6)
    prefix, new, hq, hkv, d = 29, 9, 4, 2, 8
    q = jax.random.normal(keys[0], (new, hq, d))
    cache_k = jax.random.normal(keys[1], (2, 3, prefix, hkv, d))
    cache_v = jax.random.normal(keys[2], (2, 3, prefix, hkv, d))
    k_new = jax.random.normal(keys[3], (new, hkv, d))
    v_new = jax.random.normal(keys[4], (new, hkv, d))
    weight = jax.random.normal(keys[5], (new, hq, d))
    q_pos = prefix + jnp.arange(new)

    def blockwise(q, cache_k, cache_v, k_new, v_new):
        common = dict(q_positions=q_pos, scale=d**-0.5, block_size=8)
        a = attention.attend(q, cache_k, cache_v, k_offset=0, causal=False, kv_index=(1, 2), kv_length=25, **common)
        b = attention.attend(q, k_new, v_new, k_offset=prefix, causal=True, **common)
        return jnp.sum(attention.merge(a, b).out * weight)

    def dense(q, cache_k, cache_v, k_new, v_new):
        k = jnp.concatenate([cache_k[1, 2, :25], k_new])
        v = jnp.concatenate([cache_v[1, 2, :25], v_new])
        k_pos = jnp.concatenate([jnp.arange(25), prefix + jnp.arange(new)])
        return jnp.sum(_dense_attention(q, k, v, q_pos, k_pos, d**-0.5) * weight)

    args = (q, cache_k, cache_v, k_new, v_new)
    np.testing.assert_allclose(blockwise(*args), dense(*args), rtol=1e-5)
    # each gradient jitted whole: one compile, not one per primitive (eager op-by-op dispatch)
    got = jax.jit(jax.grad(blockwise, argnums=range(5)))(*args)
    for name, a, b in zip(["q", "cache_k", "cache_v", "k_new", "v_new"], got,
                          jax.jit(jax.grad(dense, argnums=range(5)))(*args)):
        np.testing.assert_allclose(a, b, atol=1e-5, err_msg=name)
    assert float(jnp.abs(got[1][1, 2, 25:]).max()) == 0.0  # beyond kv_length
