"""Tiny random transformers models saved with save_pretrained: the parity oracle.

Weights are re-randomised at O(1) scale (HF init leaves norms at identity and biases at zero, which would hide
bugs in norm placement, the (1 + w) convention, A_log/dt_bias handling and so on).
"""
import json
import os

import numpy as np
import torch
from safetensors.torch import load_file, save_file

torch.set_num_threads(2)


def qwen_hf_config(**overrides):
    from transformers import Qwen3_5TextConfig

    fields = dict(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=6,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        max_position_embeddings=4096, tie_word_embeddings=False,
    )
    fields.update(overrides)
    return Qwen3_5TextConfig(**fields)


def rerandomise_(model, seed: int):
    """In place: every parameter to an O(1)-scale random value appropriate to its role."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=gen)
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.rand(p.shape, generator=gen) * 4 + 0.25))
            elif name.endswith("dt_bias"):
                p.copy_(0.5 * r)
            elif "conv1d" in name:
                p.copy_(0.5 * r)
            elif name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.3 * r)
            elif p.ndim == 1:  # (1 + w) norms
                p.copy_(0.3 * r)
            elif "embed_tokens" in name:  # tied: it is also the LM head, so keep logits O(1)
                p.copy_(r / np.sqrt(p.shape[-1]) if model.config.tie_word_embeddings else r)
            else:  # [out, in] projections
                p.copy_(r / np.sqrt(p.shape[-1]))
    return model


def make_qwen_checkpoint(directory, seed=0, **overrides):
    """Build, re-randomise and save a Qwen3_5ForCausalLM; returns the torch model (float32, eval)."""
    from transformers import Qwen3_5ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(qwen_hf_config(**overrides)).float().eval()
    rerandomise_(model, seed)
    model.save_pretrained(directory)
    return model


def hf_logits(model, tokens) -> np.ndarray:
    with torch.no_grad():
        ids = torch.as_tensor(np.asarray(tokens), dtype=torch.long)[None]
        return model(ids).logits[0].float().numpy()


def to_multimodal_layout(src, dst):
    """Rewrite a `model.*` checkpoint as the published `qwen3_5` layout: keys under `model.language_model.`,
    config nested in `text_config`, plus `mtp.*` and `model.visual.*` tensors that a loader must skip."""
    os.makedirs(dst, exist_ok=True)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    renamed = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
               for k, v in tensors.items()}
    renamed["mtp.fc.weight"] = torch.zeros(4, 4)
    renamed["model.visual.patch_embed.proj.weight"] = torch.zeros(2, 3)
    half = len(renamed) // 2
    names = sorted(renamed)
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for file, keys in shards.items():
        save_file({k: renamed[k].contiguous() for k in keys}, os.path.join(dst, file), metadata={"format": "pt"})
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": {k: file for file, keys in shards.items() for k in keys}}, f)
    with open(os.path.join(src, "config.json")) as f:
        text = json.load(f)
    text["model_type"] = "qwen3_5_text"
    top = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": text,
           "vision_config": {"depth": 2}, "tie_word_embeddings": text.get("tie_word_embeddings", False)}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(top, f)
