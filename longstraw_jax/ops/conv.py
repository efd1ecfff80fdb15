"""Causal depthwise 1-D convolution with a carried tail (the GDN `conv1d`, docs/models.md 1.5 and 1.10)."""
import jax
import jax.numpy as jnp

from longstraw_jax.ops.dtypes import at_least_f32


def causal_depthwise_conv(x: jax.Array, weight: jax.Array, tail: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x: [T, conv_dim]; weight: [conv_dim, K] (tap K-1 multiplies the current token); tail: [K-1, conv_dim], the K-1
    inputs before x (zeros at the start of a sequence). Returns (y [T, conv_dim] before the activation, new tail
    [K-1, conv_dim]).

    One token (decoding) contracts its K taps as a product (a dot batched over the channels) rather than K shifted
    products: XLA fuses elementwise producers into their consumers, and the GDN's rank-one state update [H, dk, dv]
    would otherwise recompute this token's conv (and its SiLU and l2 norm) for each of its H x dk x dv elements, a
    per-branch cost that dominated a decoding step on XLA:CPU; a product is computed once. (A sum over the taps is
    too, but XLA:CPU hands a batch of branches' sums to a library reduction that cost 4-20x the product.)"""
    kernel = weight.shape[-1]
    extended = jnp.concatenate([tail.astype(x.dtype), x], axis=0)  # [K-1+T, conv_dim]
    length = x.shape[0]
    taps = at_least_f32(weight)
    if length == 1:  # one decoded token: a product over the K taps (see above)
        y = jnp.einsum("kc,ck->c", at_least_f32(extended), taps, precision=jax.lax.Precision.HIGHEST)[None]
    else:
        y = sum(at_least_f32(extended[j : j + length]) * taps[:, j] for j in range(kernel))  # fp32 accumulation
    return y.astype(x.dtype), extended[extended.shape[0] - (kernel - 1) :]
