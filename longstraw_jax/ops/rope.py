"""Rotary position embeddings: frequency tables (default and YaRN, as transformers' `modeling_rope_utils`) and
the partial half-split (NeoX) rotation used by Qwen3.5 (docs/models.md 1.7).

Frequencies are computed with numpy from a static `RopeConfig`, so under `jit` they are constants.
"""
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """The fields of HF `rope_parameters` that change the math. `rope_type` is "default" or "yarn"."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self):
        if self.rope_type not in ("default", "yarn"):
            raise ValueError(f"rope_parameters.rope_type={self.rope_type!r} is not supported (use 'default' or 'yarn')")
        if self.rope_type == "yarn" and self.original_max_position_embeddings is None:
            raise ValueError("rope_parameters.original_max_position_embeddings is required for rope_type='yarn'")


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def inverse_frequencies(cfg: RopeConfig, rotary_dim: int, max_position_embeddings: int) -> tuple[np.ndarray, float]:
    """Returns `(inv_freq [rotary_dim // 2] float32, attention_scaling)`; cos/sin are multiplied by the scaling."""
    exponents = np.arange(0, rotary_dim, 2, dtype=np.float32) / np.float32(rotary_dim)
    pos_freqs = np.float32(cfg.theta) ** exponents
    inv_freq = (1.0 / pos_freqs).astype(np.float32)
    if cfg.rope_type == "default":
        return inv_freq, 1.0

    original = cfg.original_max_position_embeddings
    factor = cfg.factor if cfg.factor is not None else max_position_embeddings / original
    if cfg.attention_factor is not None:
        attention_factor = cfg.attention_factor
    elif cfg.mscale and cfg.mscale_all_dim:
        attention_factor = _yarn_mscale(factor, cfg.mscale) / _yarn_mscale(factor, cfg.mscale_all_dim)
    else:
        attention_factor = _yarn_mscale(factor)

    def correction_dim(num_rotations):
        return rotary_dim * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(cfg.theta))

    low, high = correction_dim(cfg.beta_fast), correction_dim(cfg.beta_slow)
    if cfg.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(rotary_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1.0 - ramp
    inv_freq = (inv_freq / factor) * (1 - extrapolation_weight) + inv_freq * extrapolation_weight
    return inv_freq.astype(np.float32), float(attention_factor)


def cos_sin(positions: jax.Array, inv_freq: np.ndarray, scaling: float, dtype) -> tuple[jax.Array, jax.Array]:
    """positions int [T] -> cos, sin [T, rotary_dim] (freqs repeated twice, half-split layout), cast to `dtype`."""
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return (jnp.cos(emb) * scaling).astype(dtype), (jnp.sin(emb) * scaling).astype(dtype)


def apply_partial_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate the first `rotary_dim` channels of x [T, H, hd] in half-split pairs (i, i + rotary_dim/2)."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated_half = jnp.concatenate([-x_rot[..., half:], x_rot[..., :half]], axis=-1)
    x_rot = x_rot * cos[:, None, :] + rotated_half * sin[:, None, :]
    return jnp.concatenate([x_rot, x_pass], axis=-1)


def apply_rope_interleaved(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """GLM / DeepSeek rotation (docs/models.md 2.7) of the first `rotary_dim` channels of x [T, H, width] (any width >=
    rotary_dim): pairs (2i, 2i+1) share frequency i, and the result is written in half-split order `[u1' | u2']` (as
    transformers does), followed by the pass-through channels. cos, sin: [T, rotary_dim] in the half-split layout of
    `cos_sin`."""
    rot = cos.shape[-1]
    c, s = cos[:, None, : rot // 2], sin[:, None, : rot // 2]
    u1, u2 = x[..., 0:rot:2], x[..., 1:rot:2]
    return jnp.concatenate([u1 * c - u2 * s, u2 * c + u1 * s, x[..., rot:]], axis=-1)


def rope_positions(positions: jax.Array, left_pad=None) -> jax.Array:
    """The positions RoPE rotates by: `positions` (int [T], natural: cache slots, causal masks) minus left_pad (int32
    [] or None), so a left-padded prompt's real tokens are rotated exactly as the unpadded prompt's tokens 0.. (the
    same float32 angles; pads get negative positions and are never attended). docs/architecture.md 4.6."""
    return positions if left_pad is None else positions - left_pad
