"""The PEFT export of LoRA adapters (`--export-peft`, docs/architecture.md 10): adapter_config.json +
adapter_model.safetensors under transformers' module names, which `peft` loads onto the transformers model of the
base weights."""
from __future__ import annotations

import json
import os
import re

import jax.numpy as jnp
import numpy as np

from longstraw_jax.adapters.lora import GROUPS, adapters, short_path
from longstraw_jax.models.hf import write_safetensors

# model types whose routed experts transformers 5 fuses into 3-d parameters, and for which PEFT (0.21) rewrites every
# `gate_proj` / `up_proj` / `down_proj` target into those parameters (`peft/utils/transformers_weight_conversion.py`:
# glm_moe_dsa maps to its "qwen2_moe" conversion): per-expert adapters saved under transformers 4's per-expert names
# are fused on load (A concatenated, B block-diagonal, rank and alpha doubled for gate_up_proj: the same scale), but
# an adapter on a dense MLP or a shared expert, whose names end the same way, is taken for an expert one.
_PEFT_FUSED_EXPERTS = ("glm_moe_dsa",)


def peft_layout(model, params) -> tuple[dict[str, tuple[str, tuple]], list[str]]:
    """(PEFT module name, e.g. "model.layers.3.self_attn.q_proj" or "model.layers.1.mlp.experts.5.gate_proj" -> (our
    adapted path, index into its stacked axes), the adapter config's target_modules). ValueError naming the targets
    PEFT cannot express (`_PEFT_FUSED_EXPERTS`: GLM-5.x's dense MLPs and shared experts, and a routed expert's
    gate_proj without its up_proj or the other way round)."""
    nodes = adapters(params)
    if not nodes:
        raise ValueError("--export-peft: the params have no LoRA adapters (train with --train lora)")
    fused = model.config.to_hf().get("model_type") in _PEFT_FUSED_EXPERTS
    if fused:
        bad = sorted(short_path(p) for p in nodes if GROUPS["mlp"].search(p) or GROUPS["shared"].search(p))
        if bad:
            raise ValueError(f"--export-peft: PEFT cannot express adapters on {', '.join(dict.fromkeys(bad))}: for "
                             f"this model type it loads every gate_proj / up_proj / down_proj adapter onto the routed "
                             f"experts (fused in transformers 5); choose --lora-targets without mlp and shared, e.g. "
                             f"attn,experts")
        for path in nodes:
            if path.endswith(("/experts_gate", "/experts_up")):
                other = path[: path.rindex("_")] + ("_up" if path.endswith("_gate") else "_gate")
                if other not in nodes:
                    raise ValueError(f"--export-peft: {short_path(path)} has adapters but {short_path(other)} has "
                                     "none; PEFT fuses the routed experts' gate and up projections (gate_up_proj), so "
                                     "adapt both or neither")
    by_path = {}
    for name, slot in model.hf_layout().items():
        if slot.path in nodes:
            by_path.setdefault(slot.path, []).append((name, slot))
    missing = sorted(set(nodes) - set(by_path))
    if missing:
        raise ValueError(f"--export-peft: no transformers module for {', '.join(missing)}")
    layout = {name[: -len(".weight")]: (path, slot.index) for path, entries in by_path.items()
              for name, slot in entries}
    experts = {m for m in layout if ".mlp.experts." in m}
    if experts and not fused:
        raise ValueError("--export-peft: routed-expert adapters of this model type have no PEFT layout")
    targets = sorted(set(layout) - experts, key=_natural)
    targets += sorted({m.rsplit(".", 1)[-1] for m in experts})  # gate_proj / up_proj / down_proj: PEFT fuses them
    return layout, targets


def check_peft(model, params) -> None:
    """Raises the ValueError `save_peft` would, without writing anything (abstract params suffice)."""
    peft_layout(model, params)


def save_peft(model, params, directory: str | os.PathLike, dtype=None) -> None:
    """Write a PEFT LoRA adapter into `directory` (must exist): adapter_config.json (r, lora_alpha, the exact module
    names as target_modules; routed experts by their projection name) and adapter_model.safetensors
    ("base_model.model.<module>.lora_A.weight" [r, in], ".lora_B.weight" [out, r]; routed experts one module per
    expert, transformers 4's names, which PEFT fuses on load). `peft.PeftModel.from_pretrained(<transformers model
    of the base weights>, directory)` then computes our adapted model's logits (scaling = lora_alpha / r, as
    ours)."""
    layout, targets = peft_layout(model, params)
    nodes = adapters(params)
    ranks = {x.rank for x in nodes.values()}
    scales = {x.scale for x in nodes.values()}
    if len(ranks) != 1 or len(scales) != 1:
        raise ValueError("--export-peft: every adapter must have the same rank and scale (one PEFT config)")
    rank, scale = ranks.pop(), scales.pop()
    tensors, values = [], {}
    for module in sorted(layout, key=_natural):
        path, index = layout[module]
        node = nodes[path]
        for part, array in (("lora_A", node.a[index]), ("lora_B", node.b[index])):
            value = np.asarray(jnp.asarray(array, dtype or array.dtype))
            name = f"base_model.model.{module}.{part}.weight"
            tensors.append((name, value.dtype, value.shape))
            values[name] = value
    directory = os.fspath(directory)
    write_safetensors(os.path.join(directory, "adapter_model.safetensors"), tensors, lambda name: [values[name]])
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": scale * rank,
        "target_modules": targets, "lora_dropout": 0.0, "bias": "none",
        "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "init_lora_weights": True,
        "inference_mode": True, "modules_to_save": None, "base_model_name_or_path": None,
    }
    with open(os.path.join(directory, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)


def _natural(name: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


__all__ = ["check_peft", "peft_layout", "save_peft"]
