"""The model families by Hugging Face `model_type`: the one table from the string in config.json to the config class,
the model class and how to read the config from an HF config dict.

Everything that dispatches on the family reads it: `config_from_hf` and `load_hf` (models/hf.py: config.json files,
including the trainer's `--model config.json`), `build` (models/__init__.py) and tools/bench_step.py's one-line
description (`describe`, each config's own).
Adding a family is one entry here (plus its `hf_layout` for checkpoints).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from longstraw_jax.models.glm52 import Glm52, Glm52Config
from longstraw_jax.models.qwen36 import Qwen36, Qwen36Config


@dataclasses.dataclass(frozen=True)
class ModelType:
    """One family: `read_config(hf_dict)` -> a `config_class` instance; `model_class(config)` is the model."""

    config_class: type
    model_class: type
    read_config: Callable[[dict], Any]


_QWEN36 = ModelType(Qwen36Config, Qwen36, Qwen36Config.from_hf)
# model_type in config.json -> family ("qwen3_5" is the multimodal checkpoint: its from_hf reads the text_config).
MODEL_TYPES: dict[str, ModelType] = {
    "qwen3_5": _QWEN36,
    "qwen3_5_text": _QWEN36,
    "glm_moe_dsa": ModelType(Glm52Config, Glm52, Glm52Config.from_hf),
}


def lookup(model_type, where: str = "config.json") -> ModelType:
    """The family of `model_type` (ValueError naming `where` and the supported types otherwise)."""
    if model_type not in MODEL_TYPES:
        raise ValueError(f"{where}: model_type={model_type!r}; supported: {', '.join(sorted(MODEL_TYPES))}")
    return MODEL_TYPES[model_type]


def read_config(raw: dict, where: str = "config.json"):
    """An HF config dict -> our config object (dispatch on its `model_type`)."""
    return lookup(raw.get("model_type"), where).read_config(raw)


def family(config) -> ModelType:
    """The family of a config object (TypeError for a config type no entry has)."""
    for entry in MODEL_TYPES.values():
        if isinstance(config, entry.config_class):
            return entry
    raise TypeError(f"no model for config type {type(config).__name__}")


def build(config):
    """The model for a config object (frozen and hashable: usable as a `jax.jit` static argument)."""
    return family(config).model_class(config)


def describe(config) -> str:
    """One line: the family and its main sizes (the config's own `describe`)."""
    family(config)  # a TypeError for a config of no registered family
    return config.describe()
