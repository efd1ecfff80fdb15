"""The GDN's causal depthwise conv: one decoded token (a product over the taps) equals the same token inside a
longer call (K shifted products), and the carried tail is the last K-1 inputs."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longstraw_jax.ops.conv import causal_depthwise_conv


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_one_token_equals_the_token_inside_a_longer_call(dtype):
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (5, 24)).astype(dtype)
    weight = jax.random.normal(keys[1], (24, 4)).astype(dtype)
    tail = jax.random.normal(keys[2], (3, 24)).astype(dtype)
    y_all, tail_all = causal_depthwise_conv(x, weight, tail)
    step_tail = tail
    for t in range(x.shape[0]):  # token by token, each one through the one-token path
        y_t, step_tail = causal_depthwise_conv(x[t : t + 1], weight, step_tail)
        np.testing.assert_allclose(np.asarray(y_t[0], np.float32), np.asarray(y_all[t], np.float32),
                                   rtol=1e-6 if dtype == jnp.float32 else 1e-2, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(step_tail, np.float32), np.asarray(tail_all, np.float32))
    np.testing.assert_array_equal(np.asarray(tail_all, np.float32), np.asarray(x[-3:], np.float32))
    naive = sum(np.asarray(jnp.concatenate([tail, x])[j : j + 5], np.float64) * np.asarray(weight[:, j], np.float64)
                for j in range(4))
    np.testing.assert_allclose(np.asarray(y_all, np.float64), naive, rtol=1e-5 if dtype == jnp.float32 else 2e-2,
                               atol=1e-5 if dtype == jnp.float32 else 5e-2)
