"""Hugging Face checkpoints <-> our parameter pytrees (safetensors only; never unpickle).

Model-agnostic: each model class provides `hf_layout()` (HF name -> Slot), `hf_skipped_prefixes` (on-disk tensors
it ignores, e.g. MTP and vision towers) and `hf_prefix_aliases` (alternative spellings of its names, e.g. Qwen3.6's
multimodal `model.language_model.*`); its config class provides `from_hf` and `to_hf`. Saving writes the canonical
layout with the config class's `to_hf()` config.json.
"""
from __future__ import annotations

import glob
import json
import logging
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util
from safetensors import safe_open
from safetensors.flax import save_file

from longstraw_jax.models.glm52 import Glm52Config
from longstraw_jax.models.qwen36 import Qwen36Config

# model_type in config.json -> config class (a nested text_config is handled by the class's from_hf).
CONFIG_CLASSES = {"qwen3_5": Qwen36Config, "qwen3_5_text": Qwen36Config, "glm_moe_dsa": Glm52Config}


class Slot(NamedTuple):
    """Where one HF tensor lives in our params: `flat[path][index]` (flat = flatten_dict(params, sep="/")),
    reshaped to `hf_shape` on disk. index is () for unstacked leaves, (block, j) or (layer, expert) for stacked."""

    path: str
    index: tuple[int, ...]
    hf_shape: tuple[int, ...]


def config_from_hf(directory: str | os.PathLike):
    """The config object for `directory/config.json` (dispatch on `model_type`)."""
    path = os.path.join(os.fspath(directory), "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no config.json")
    with open(path) as f:
        model_type = json.load(f).get("model_type")
    if model_type not in CONFIG_CLASSES:
        raise ValueError(f"{path}: model_type={model_type!r}; supported: {', '.join(sorted(CONFIG_CLASSES))}")
    return CONFIG_CLASSES[model_type].from_hf(path)


def checkpoint_layout(model) -> dict[str, Slot]:
    """HF tensor name -> Slot, from abstract shapes only (the model's `hf_layout()`)."""
    return model.hf_layout()


def _canonical_name(model, name: str) -> str | None:
    """The stored name in the layout's spelling, or None for tensors the model skips (e.g. MTP, vision)."""
    if name.startswith(model.hf_skipped_prefixes):
        return None
    for old, new in model.hf_prefix_aliases:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def _safetensor_files(directory: str) -> list[str]:
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(directory, f) for f in files]
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {directory} (only safetensors checkpoints are loaded)")
    return files


def load_hf(directory: str | os.PathLike, dtype=jnp.float32):
    """Read config.json and safetensors from `directory` -> (model, params in `dtype`).

    Raises ValueError listing every missing, unexpected or mis-shaped key before building anything.
    """
    directory = os.fspath(directory)
    from longstraw_jax.models import build

    model = build(config_from_hf(directory))
    layout = checkpoint_layout(model)
    found: dict[str, tuple[str, str]] = {}  # canonical name -> (file, stored name)
    skipped = []
    for path in _safetensor_files(directory):
        with safe_open(path, framework="flax") as f:
            for stored in f.keys():
                name = _canonical_name(model, stored)
                if name is None:
                    skipped.append(stored)
                else:
                    found[name] = (path, stored)
    if skipped:
        prefixes = sorted({p for p in model.hf_skipped_prefixes for name in skipped if name.startswith(p)})
        logging.getLogger(__name__).info("load_hf(%s): skipped %d tensors under %s (not used by %s)", directory,
                                         len(skipped), ", ".join(prefixes), type(model).__name__)

    missing = sorted(set(layout) - set(found))
    unexpected = sorted(set(found) - set(layout))
    misshaped = []
    handles = {}
    for name in sorted(set(layout) & set(found)):
        path, stored = found[name]
        handle = handles.setdefault(path, safe_open(path, framework="flax"))
        shape = tuple(handle.get_slice(stored).get_shape())
        if shape != layout[name].hf_shape:
            misshaped.append(f"{stored}: {shape} (expected {layout[name].hf_shape})")
    if missing or unexpected or misshaped:
        parts = [f"{label} ({len(items)}): {', '.join(items)}" for label, items in
                 (("missing keys", missing), ("unexpected keys", unexpected), ("mis-shaped keys", misshaped)) if items]
        raise ValueError(f"checkpoint {directory} does not match {model.config.__class__.__name__}: " + "; ".join(parts))

    shapes = jax.eval_shape(model.init, jax.random.key(0))
    flat = {k: np.zeros(v.shape, np.float32) for k, v in traverse_util.flatten_dict(shapes, sep="/").items()}
    for name, slot in layout.items():
        path, stored = found[name]
        value = np.asarray(handles[path].get_tensor(stored).astype(jnp.float32))
        target = flat[slot.path]
        target[slot.index] = value.reshape(target.shape[len(slot.index):])
    params = traverse_util.unflatten_dict({k: jnp.asarray(v, dtype) for k, v in flat.items()}, sep="/")
    return model, params


def save_hf(model, params: dict, directory: str | os.PathLike, dtype=None,
            max_shard_bytes: int = 4 << 30) -> None:
    """Write `directory/config.json` and safetensors (sharded with an index above `max_shard_bytes`)."""
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    flat = traverse_util.flatten_dict(params, sep="/")
    tensors = {}
    for name, slot in checkpoint_layout(model).items():
        value = flat[slot.path][slot.index]
        tensors[name] = jnp.asarray(value, dtype or value.dtype).reshape(slot.hf_shape)
    shards, current, size = [], {}, 0
    for name, value in tensors.items():
        if current and size + value.nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = value
        size += value.nbytes
    shards.append(current)
    if len(shards) == 1:
        save_file(shards[0], os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.path.join(directory, file), metadata={"format": "pt"})
            weight_map.update({name: file for name in shard})
        total = sum(v.nbytes for v in tensors.values())
        with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    config = model.config.to_hf()
    config["torch_dtype"] = str(jnp.dtype(dtype or params["embed"].dtype))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
