"""Normalisations used by the models (docs/models.md 1.4 and 2.4).

Statistics always run in float32; each function states where it casts back to the input dtype, because the
placement of that cast is what makes bf16 results match transformers.
"""
import jax
import jax.numpy as jnp

from longstraw_jax.ops.dtypes import accum_dtype, at_least_f32


def _rms_normalise(x32: jax.Array, eps: float) -> jax.Array:
    return x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)


def rms_norm_1p(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Qwen3.5 zero-centred RMSNorm: `(x32 * rsqrt(mean(x32^2) + eps)) * (1 + w32)`, cast back after the multiply."""
    y = _rms_normalise(at_least_f32(x), eps) * (1.0 + weight.astype(accum_dtype(x.dtype)))
    return y.astype(x.dtype)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Llama-style RMSNorm (GLM): `w * (x32 * rsqrt(mean(x32^2) + eps)).to(dtype)`: cast back before the multiply."""
    return weight * _rms_normalise(at_least_f32(x), eps).astype(x.dtype)


def rms_norm_gated(x: jax.Array, gate: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Qwen3.5 GDN output norm, norm before gate: `(w * norm(x).to(dtype)) * silu(gate32)`, cast to x.dtype.

    x, gate: [..., dv]; weight: [dv] (plain w, initialised to 1).
    """
    y = weight * _rms_normalise(at_least_f32(x), eps).astype(x.dtype)
    return (y * jax.nn.silu(at_least_f32(gate))).astype(x.dtype)


def l2_normalise(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """FLA/HF l2norm over the last axis: `x * rsqrt(sum(x^2) + eps)` (eps on the sum, not the mean)."""
    return x * jax.lax.rsqrt(jnp.sum(jnp.square(x), axis=-1, keepdims=True) + eps)


def layer_norm(x: jax.Array, weight: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    """Mean-centred LayerNorm with affine weight and bias, statistics in float32 (GLM indexer k_norm)."""
    x32 = at_least_f32(x)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + eps)
    return (y * weight.astype(x32.dtype) + bias.astype(x32.dtype)).astype(x.dtype)
