"""Model registry: `build(config)` -> model; `load_hf(dir)` / `save_hf(model, params, dir)` for checkpoints."""
from longstraw_jax.models import glm52, qwen36
from longstraw_jax.models.glm52 import Glm52, Glm52Config, GlmState
from longstraw_jax.models.hf import config_from_hf, load_hf, save_hf
from longstraw_jax.models.base import PromptState
from longstraw_jax.models.qwen36 import Qwen36, Qwen36Config, Qwen36State


def build(config):
    """The model for a config object (frozen and hashable: usable as a `jax.jit` static argument)."""
    if isinstance(config, Qwen36Config):
        return Qwen36(config)
    if isinstance(config, Glm52Config):
        return Glm52(config)
    raise TypeError(f"no model for config type {type(config).__name__}")


__all__ = ["build", "config_from_hf", "load_hf", "save_hf", "qwen36", "Qwen36", "Qwen36Config", "Qwen36State", "PromptState",
           "glm52", "Glm52", "Glm52Config", "GlmState"]
