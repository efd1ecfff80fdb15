"""The models: `build(config)` -> model (dispatch on the config's family, models/registry.py); `load_hf(dir)` /
`save_hf(model, params, dir)` for checkpoints. The contracts every family implements are in models/base.py."""
from longstraw_jax.models import glm52, qwen36, registry
from longstraw_jax.models.base import PromptState
from longstraw_jax.models.glm52 import Glm52, Glm52Config, Glm52State
from longstraw_jax.models.hf import config_from_hf, load_hf, save_hf
from longstraw_jax.models.qwen36 import Qwen36, Qwen36Config, Qwen36State
from longstraw_jax.models.registry import MODEL_TYPES, build, describe

__all__ = ["build", "describe", "MODEL_TYPES", "config_from_hf", "load_hf", "save_hf", "registry", "qwen36", "Qwen36",
           "Qwen36Config", "Qwen36State", "PromptState", "glm52", "Glm52", "Glm52Config", "Glm52State"]
