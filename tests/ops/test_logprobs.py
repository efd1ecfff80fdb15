"""Chunked token log-probs equal the plain full log_softmax (values and gradients) and never hold [T, V]."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longstraw_jax.ops.logprobs import token_logprobs

T, D, V = 48, 16, 97


def reference(hidden, head, targets):
    logp_all = jax.nn.log_softmax(hidden @ head.T, axis=-1)
    entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    return jnp.take_along_axis(logp_all, targets[:, None], axis=-1)[:, 0], entropy


@pytest.fixture(scope="module")
def inputs():
    k1, k2, k3, k4, k5 = jax.random.split(jax.random.key(0), 5)
    hidden = jax.random.normal(k1, (T, D))
    head = jax.random.normal(k2, (V, D)) * 0.5
    targets = jax.random.randint(k3, (T,), 0, V)
    # random cotangents so that the gradient check weights every token differently
    return hidden, head, targets, jax.random.normal(k4, (T,)), jax.random.normal(k5, (T,))


@pytest.mark.parametrize("chunk", [16, 48, 20, 7, 100])  # divides T, == T, does not divide, tiny, > T
def test_matches_full_log_softmax(inputs, chunk):
    hidden, head, targets, a, b = inputs
    logp, entropy = jax.jit(token_logprobs, static_argnums=3)(hidden, head, targets, chunk)
    ref_logp, ref_entropy = reference(hidden, head, targets)
    assert logp.shape == entropy.shape == (T,) and logp.dtype == entropy.dtype == jnp.float32
    assert ref_entropy.std() > 0.05 and ref_logp.std() > 0.5, "inputs too flat to be a meaningful test"
    np.testing.assert_allclose(logp, ref_logp, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(entropy, ref_entropy, atol=1e-5, rtol=1e-5)

    def objective(fn):
        def f(hidden, head):
            lp, ent = fn(hidden, head)
            return jnp.sum(a * lp) + jnp.sum(b * ent)
        return jax.jit(jax.grad(f, argnums=(0, 1)))(hidden, head)

    got = objective(lambda h, w: token_logprobs(h, w, targets, chunk))
    want = objective(lambda h, w: reference(h, w, targets))
    for g, w in zip(got, want):
        assert np.abs(w).max() > 1e-2
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5)


def test_bad_arguments_raise(inputs):
    hidden, head, targets, _, _ = inputs
    for chunk in (0, -4, 2.0, True):
        with pytest.raises(ValueError, match="chunk"):
            token_logprobs(hidden, head, targets, chunk)
    with pytest.raises(ValueError, match="same D"):
        token_logprobs(hidden, head[:, :-1], targets, 8)
    with pytest.raises(ValueError, match="targets"):
        token_logprobs(hidden, head, targets[:-1], 8)


def test_backward_never_holds_full_logits():
    t, d, v, chunk = 4096, 64, 32768, 256
    full_logits_bytes = t * v * 4  # 512 MiB

    def loss(hidden, head, targets):
        logp, entropy = token_logprobs(hidden, head, targets, chunk)
        return jnp.sum(logp) + jnp.sum(entropy)

    shapes = (jax.ShapeDtypeStruct((t, d), jnp.float32), jax.ShapeDtypeStruct((v, d), jnp.float32),
              jax.ShapeDtypeStruct((t,), jnp.int32))
    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(*shapes).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    # a handful of [chunk, V] blocks (32 MiB each; 4 seen on CPU); the same graph unchunked needs 4 x [T, V]
    block_bytes = chunk * v * 4
    message = (f"temp {temp / 2**20:.0f} MiB; [chunk, V] = {block_bytes / 2**20:.0f} MiB, "
               f"[T, V] = {full_logits_bytes / 2**20:.0f} MiB")
    assert temp <= 6 * block_bytes and temp < full_logits_bytes / 2.5, message
