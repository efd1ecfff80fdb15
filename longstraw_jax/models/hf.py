"""Hugging Face checkpoints <-> our parameter pytrees (safetensors only; never unpickle).

Qwen3.5/3.6 key layouts accepted on load (MODELS.md 1.1): `model.language_model.*` (the published multimodal
checkpoint) and `model.*` (`Qwen3_5ForCausalLM.save_pretrained`). `mtp.*` and `model.visual.*` are skipped.
Saving writes the `model.*` layout with a `qwen3_5_text` config.json, which `Qwen3_5ForCausalLM` loads.
"""
from __future__ import annotations

import glob
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util
from safetensors import safe_open
from safetensors.flax import save_file

from longstraw_jax.models.qwen36 import FULL, LINEAR, Qwen36, Qwen36Config

_SKIPPED_PREFIXES = ("mtp.", "model.visual.")
_PREFIX_ALIASES = (("model.language_model.", "model."),)

# our leaf path inside a layer of each kind -> name under `model.layers.{i}.`
_LAYER_KEYS = {
    LINEAR: {
        "input_norm": "input_layernorm.weight", "post_norm": "post_attention_layernorm.weight",
        "in_proj_qkv": "linear_attn.in_proj_qkv.weight", "in_proj_z": "linear_attn.in_proj_z.weight",
        "in_proj_b": "linear_attn.in_proj_b.weight", "in_proj_a": "linear_attn.in_proj_a.weight",
        "conv1d": "linear_attn.conv1d.weight", "dt_bias": "linear_attn.dt_bias", "A_log": "linear_attn.A_log",
        "norm": "linear_attn.norm.weight", "out_proj": "linear_attn.out_proj.weight",
    },
    FULL: {
        "input_norm": "input_layernorm.weight", "post_norm": "post_attention_layernorm.weight",
        "q_proj": "self_attn.q_proj.weight", "k_proj": "self_attn.k_proj.weight",
        "v_proj": "self_attn.v_proj.weight", "o_proj": "self_attn.o_proj.weight",
        "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight",
    },
}
for _kind in _LAYER_KEYS.values():
    _kind.update({f"mlp/{n}": f"mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")})
_KIND_GROUP = {LINEAR: "linear", FULL: "full"}
_TOP_KEYS = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight", "lm_head": "lm_head.weight"}


def _to_hf_shape(leaf: str, shape: tuple) -> tuple:
    """conv1d is [C, K] here and [C, 1, K] in PyTorch; everything else is identical."""
    return (shape[0], 1, shape[1]) if leaf == "conv1d" else tuple(shape)


def checkpoint_layout(model: Qwen36) -> dict[str, tuple[tuple, tuple]]:
    """HF name -> (our path (group, leaf, block, index) or (top,), HF shape), from abstract shapes only."""
    cfg = model.config
    shapes = jax.eval_shape(model.init, jax.random.key(0))
    flat = traverse_util.flatten_dict(shapes, sep="/")
    layout = {}
    for top, name in _TOP_KEYS.items():
        if top in shapes:
            layout[name] = ((top,), tuple(shapes[top].shape))
    pattern = cfg.block_pattern
    for b in range(cfg.num_blocks):
        counters = {LINEAR: 0, FULL: 0}
        for offset, kind in enumerate(pattern):
            layer = b * len(pattern) + offset
            j = counters[kind]
            counters[kind] += 1
            group = _KIND_GROUP[kind]
            for leaf, suffix in _LAYER_KEYS[kind].items():
                shape = flat[f"blocks/{group}/{leaf}"].shape[2:]
                layout[f"model.layers.{layer}.{suffix}"] = ((group, leaf, b, j), _to_hf_shape(leaf, shape))
    return layout


def _canonical_name(name: str) -> str | None:
    if name.startswith(_SKIPPED_PREFIXES):
        return None
    for old, new in _PREFIX_ALIASES:
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
    model = Qwen36(Qwen36Config.from_hf(directory))
    layout = checkpoint_layout(model)
    found: dict[str, tuple[str, str]] = {}  # canonical name -> (file, stored name)
    for path in _safetensor_files(directory):
        with safe_open(path, framework="flax") as f:
            for stored in f.keys():
                name = _canonical_name(stored)
                if name is not None:
                    found[name] = (path, stored)

    missing = sorted(set(layout) - set(found))
    unexpected = sorted(set(found) - set(layout))
    misshaped = []
    handles = {}
    for name in sorted(set(layout) & set(found)):
        path, stored = found[name]
        handle = handles.setdefault(path, safe_open(path, framework="flax"))
        shape = tuple(handle.get_slice(stored).get_shape())
        if shape != layout[name][1]:
            misshaped.append(f"{stored}: {shape} (expected {layout[name][1]})")
    if missing or unexpected or misshaped:
        parts = [f"{label} ({len(items)}): {', '.join(items)}" for label, items in
                 (("missing keys", missing), ("unexpected keys", unexpected), ("mis-shaped keys", misshaped)) if items]
        raise ValueError(f"checkpoint {directory} does not match {model.config.__class__.__name__}: " + "; ".join(parts))

    shapes = jax.eval_shape(model.init, jax.random.key(0))
    flat = {k: np.zeros(v.shape, np.float32) for k, v in traverse_util.flatten_dict(shapes, sep="/").items()}
    for name, (where, _) in layout.items():
        path, stored = found[name]
        value = np.asarray(handles[path].get_tensor(stored).astype(jnp.float32))
        if len(where) == 1:
            flat[where[0]] = value
        else:
            group, leaf, b, j = where
            flat[f"blocks/{group}/{leaf}"][b, j] = value.reshape(flat[f"blocks/{group}/{leaf}"].shape[2:])
    params = traverse_util.unflatten_dict({k: jnp.asarray(v, dtype) for k, v in flat.items()}, sep="/")
    return model, params


def save_hf(model: Qwen36, params: dict, directory: str | os.PathLike, dtype=None,
            max_shard_bytes: int = 4 << 30) -> None:
    """Write `directory/config.json` and safetensors (sharded with an index above `max_shard_bytes`)."""
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    flat = traverse_util.flatten_dict(params, sep="/")
    tensors = {}
    for name, (where, hf_shape) in checkpoint_layout(model).items():
        value = flat[where[0]] if len(where) == 1 else flat[f"blocks/{where[0]}/{where[1]}"][where[2], where[3]]
        tensors[name] = jnp.asarray(value, dtype or value.dtype).reshape(hf_shape)
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
