"""Qwen3.5 / Qwen3.6 configuration (`Qwen36Config`: config.json in and out, presets) and the captured state
(`Qwen36State`); docs/models.md 1.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from longstraw_jax.models.base import check_config_fields, read_json_config
from longstraw_jax.ops import kernels as kernel_choice
from longstraw_jax.ops.flash_gated_delta import MAX_CHUNK
from longstraw_jax.ops.rope import RopeConfig

LINEAR, FULL = "linear_attention", "full_attention"
GROUP = {LINEAR: "linear", FULL: "full"}  # the params/entries key of each layer kind

# config.json keys that transformers' Qwen3_5TextConfig accepts but that do not change the math we implement.
_HF_KEYS_IGNORED = frozenset(
    """model_type architectures transformers_version torch_dtype dtype use_cache initializer_range attention_dropout
    pad_token_id bos_token_id eos_token_id output_hidden_states output_attentions return_dict is_encoder_decoder
    attn_output_gate output_gate_type mamba_ssm_dtype mtp_num_hidden_layers mtp_use_dedicated_embeddings
    mlp_only_layers tie_word_embeddings full_attention_interval layer_types rope_parameters rope_scaling rope_theta
    partial_rotary_factor max_position_embeddings base_config_key chunk_size_feed_forward problem_type
    id2label label2id tokenizer_class prefix sep_token_id decoder_start_token_id task_specific_params
    finetuning_task add_cross_attention cross_attention_hidden_size tie_encoder_decoder pruned_heads
    torchscript use_bfloat16 name_or_path _name_or_path _attn_implementation_autoset hidden_act
    attention_bias""".split()
)


@dataclasses.dataclass(frozen=True)
class Qwen36Config:
    """Every field that changes the math of `Qwen3_5ForCausalLM` (docs/models.md 1.2)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int = 4
    rms_norm_eps: float = 1e-6
    partial_rotary_factor: float = 0.25
    rope: RopeConfig = RopeConfig()
    max_position_embeddings: int = 262144
    tie_word_embeddings: bool = False
    # Execution choices (not part of the checkpoint): attention key block, GDN core implementation and chunk
    # (None: `gdn_chunk`'s rule), and whether softmax attention and the chunked GDN run as XLA or as Pallas kernels
    # (`ops.kernels`; the trainer's --kernels).
    attention_block_size: int = 512
    gdn_impl: str = "chunked"
    gdn_chunk_size: int | None = None
    kernels: str = "xla"

    def __post_init__(self):
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        errors = []
        if len(self.layer_types) != self.num_hidden_layers:
            errors.append(f"layer_types has {len(self.layer_types)} entries but "
                          f"num_hidden_layers={self.num_hidden_layers}")
        unknown = sorted(set(self.layer_types) - {LINEAR, FULL})
        if unknown:
            errors.append(f"layer_types contains {unknown}; allowed: {LINEAR!r}, {FULL!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            errors.append(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            errors.append(
                f"linear_num_value_heads={self.linear_num_value_heads} is not a multiple of "
                f"linear_num_key_heads={self.linear_num_key_heads}"
            )
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            errors.append(f"rotary dim = head_dim={self.head_dim} * partial_rotary_factor={self.partial_rotary_factor}"
                          " must be even and in (0, head_dim]")
        if self.gdn_impl not in ("chunked", "sequential"):
            errors.append(f"gdn_impl={self.gdn_impl!r}; allowed: 'chunked', 'sequential'")
        if kernel_error := kernel_choice.check(self.kernels, ""):
            errors.append(kernel_error)
        if self.gdn_chunk_size is not None and not (isinstance(self.gdn_chunk_size, int) and self.gdn_chunk_size > 0):
            errors.append(f"gdn_chunk_size={self.gdn_chunk_size!r}; must be a positive int or None (the default rule)")
        if not errors and not unknown:
            try:
                self.block_pattern  # noqa: B018  (validates periodicity)
            except ValueError as e:
                errors.append(str(e))
        if errors:
            raise ValueError("invalid Qwen36Config: " + "; ".join(errors))

    def gdn_chunk_for(self, kernels: str) -> int:
        """Tokens per chunk of the chunked gated delta rule run by `kernels` ("xla" / "pallas"): `gdn_chunk_size`, or
        by default 16 for the XLA path on a CPU backend and 64 for it elsewhere (XLA on a GPU: not measured, so the
        chunk it had); the Pallas kernels take at most `ops.flash_gated_delta.MAX_CHUNK` (32: a larger chunk needs
        more shared memory than an H100 block has at Qwen3.6's head dims), their default. On XLA:CPU a 64-token
        chunk's doubling solve (log2 Cg [Cg, Cg] matmuls) costs more than the state steps it saves: 16 was the
        fastest chunk, forward and gradient, at key/value head dims 16, 64 and 128, or within noise of it
        (docs/benchmarks.md 2, tools/bench_gated_delta.py)."""
        if kernels == "pallas":
            return min(self.gdn_chunk_size or MAX_CHUNK, MAX_CHUNK)
        if self.gdn_chunk_size is not None:
            return self.gdn_chunk_size
        return 16 if jax.default_backend() == "cpu" else 64

    @property
    def gdn_chunk(self) -> int:
        """The chunk of this config's own implementation (`kernels`): `gdn_chunk_for(self.kernels)`."""
        return self.gdn_chunk_for(self.kernels)

    # ----- derived sizes -----
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def block_pattern(self) -> tuple[str, ...]:
        """The repeating unit of `layer_types` (e.g. LLLF); the model scans over `num_blocks` copies of it."""
        types = self.layer_types
        for period in range(1, len(types) + 1):
            if len(types) % period == 0 and types == types[:period] * (len(types) // period):
                return types[:period]
        raise ValueError("unreachable")  # period == len(types) always matches

    @property
    def num_blocks(self) -> int:
        return self.num_hidden_layers // len(self.block_pattern)

    @property
    def linear_per_block(self) -> int:
        return self.block_pattern.count(LINEAR)

    @property
    def full_per_block(self) -> int:
        return self.block_pattern.count(FULL)

    def describe(self) -> str:
        """One line: the family and its main sizes (tools/bench_step.py prints it)."""
        pattern = "".join("F" if t == FULL else "L" for t in self.block_pattern)
        return (f"Qwen3.6 {self.num_hidden_layers} layers ({pattern} x {self.num_blocks}), hidden {self.hidden_size}, "
                f"mlp {self.intermediate_size}, vocab {self.vocab_size}, attn {self.num_attention_heads}q/"
                f"{self.num_key_value_heads}kv x {self.head_dim}, GDN {self.linear_num_key_heads}k/"
                f"{self.linear_num_value_heads}v x {self.linear_key_head_dim}/{self.linear_value_head_dim}")

    # ----- constructors -----
    @classmethod
    def tiny(cls, **overrides) -> "Qwen36Config":
        """Small preset for tests and the demo: 8 layers (LLLF x 2), both layer kinds, GQA 2:1, GDN 3 v per k head."""
        fields = dict(
            vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
            layer_types=(LINEAR, LINEAR, LINEAR, FULL) * 2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=16,
            linear_value_head_dim=16, linear_conv_kernel_dim=4, rms_norm_eps=1e-6, partial_rotary_factor=0.25,
            rope=RopeConfig(theta=10000.0), max_position_embeddings=1 << 20,
        )
        fields.update(overrides)
        return cls(**fields)

    @classmethod
    def from_hf(cls, source: str | os.PathLike | dict, *, strict: bool = False, **overrides) -> "Qwen36Config":
        """From a transformers config: a dict, a config.json path, or a checkpoint directory.

        Accepts `model_type` "qwen3_5" (multimodal checkpoint; reads the nested `text_config`) and "qwen3_5_text".
        Keys that transformers would read but we do not know are reported (a warning, or an error with strict=True).
        """
        raw = read_json_config(source)
        model_type = raw.get("model_type")
        if model_type == "qwen3_5":
            if not isinstance(raw.get("text_config"), dict):
                raise ValueError("config.json: model_type 'qwen3_5' needs a 'text_config' object")
            text = dict(raw["text_config"])
        elif model_type == "qwen3_5_text":
            text = dict(raw)
        else:
            raise ValueError(f"config.json: model_type={model_type!r} is not a Qwen3.5/3.6 model "
                             "(expected 'qwen3_5' or 'qwen3_5_text')")
        known = ({f.name for f in dataclasses.fields(cls)} | _HF_KEYS_IGNORED) - {"rope"}
        check_config_fields(text, known, strict, "text-config fields")
        if text.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json: hidden_act={text['hidden_act']!r}; only 'silu' is supported")
        if text.get("attention_bias", False):
            raise ValueError("config.json: attention_bias=true is not supported (Qwen3.5/3.6 have no biases)")
        for required in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                         "num_attention_heads", "num_key_value_heads"):
            if required not in text:
                raise ValueError(f"config.json: missing required field {required!r}")

        layers = text["num_hidden_layers"]
        layer_types = text.get("layer_types")
        if layer_types is None:
            interval = text.get("full_attention_interval", 4)
            layer_types = [LINEAR if (i + 1) % interval else FULL for i in range(layers)]
        rope_params = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
        partial = rope_params.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
        rope_type = rope_params.get("rope_type", rope_params.get("type", "default"))
        max_pos = text.get("max_position_embeddings", 32768)
        rope = RopeConfig(
            theta=float(rope_params.get("rope_theta", text.get("rope_theta", 10000.0))),
            rope_type=rope_type,
            factor=rope_params.get("factor"),
            original_max_position_embeddings=(
                rope_params.get("original_max_position_embeddings", max_pos) if rope_type == "yarn" else None),
            beta_fast=float(rope_params.get("beta_fast") or 32.0),
            beta_slow=float(rope_params.get("beta_slow") or 1.0),
            attention_factor=rope_params.get("attention_factor"),
            mscale=rope_params.get("mscale"),
            mscale_all_dim=rope_params.get("mscale_all_dim"),
            truncate=bool(rope_params.get("truncate", True)),
        )
        fields = dict(
            vocab_size=text["vocab_size"], hidden_size=text["hidden_size"],
            intermediate_size=text["intermediate_size"], num_hidden_layers=layers, layer_types=tuple(layer_types),
            num_attention_heads=text["num_attention_heads"], num_key_value_heads=text["num_key_value_heads"],
            head_dim=text.get("head_dim", 256),
            linear_num_key_heads=text.get("linear_num_key_heads", 16),
            linear_num_value_heads=text.get("linear_num_value_heads", 32),
            linear_key_head_dim=text.get("linear_key_head_dim", 128),
            linear_value_head_dim=text.get("linear_value_head_dim", 128),
            linear_conv_kernel_dim=text.get("linear_conv_kernel_dim", 4),
            rms_norm_eps=text.get("rms_norm_eps", 1e-6), partial_rotary_factor=float(partial), rope=rope,
            max_position_embeddings=max_pos, tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
        )
        fields.update(overrides)
        return cls(**fields)

    def to_hf(self) -> dict:
        """A `qwen3_5_text` config.json dict that `transformers.Qwen3_5ForCausalLM` loads."""
        rope: dict[str, Any] = {"rope_type": self.rope.rope_type, "rope_theta": self.rope.theta,
                                "partial_rotary_factor": self.partial_rotary_factor}
        if self.rope.rope_type == "yarn":
            rope.update(factor=self.rope.factor,
                        original_max_position_embeddings=self.rope.original_max_position_embeddings,
                        beta_fast=self.rope.beta_fast, beta_slow=self.rope.beta_slow, truncate=self.rope.truncate)
            for key in ("attention_factor", "mscale", "mscale_all_dim"):
                if getattr(self.rope, key) is not None:
                    rope[key] = getattr(self.rope, key)
        return {
            "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
            "layer_types": list(self.layer_types), "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "linear_num_key_heads": self.linear_num_key_heads, "linear_num_value_heads": self.linear_num_value_heads,
            "linear_key_head_dim": self.linear_key_head_dim, "linear_value_head_dim": self.linear_value_head_dim,
            "linear_conv_kernel_dim": self.linear_conv_kernel_dim, "rms_norm_eps": self.rms_norm_eps,
            "hidden_act": "silu", "attention_bias": False, "rope_parameters": rope,
            "max_position_embeddings": self.max_position_embeddings, "tie_word_embeddings": self.tie_word_embeddings,
        }


@struct.dataclass
class Qwen36State:
    """What later tokens need from a prompt of `length` tokens (docs/models.md 1.10), per layer of each kind.

    conv:      [num_blocks, linear_per_block, K-1, conv_dim]   last K-1 pre-conv `in_proj_qkv` outputs (model dtype)
    recurrent: [num_blocks, linear_per_block, Hv, dk, dv]      S_t after the last token t (float32)
    keys:      [num_blocks, full_per_block, length, Hkv, head_dim]  after k_norm and RoPE (model dtype)
    values:    [num_blocks, full_per_block, length, Hkv, head_dim]
    """

    conv: jax.Array
    recurrent: jax.Array
    keys: jax.Array
    values: jax.Array
    length: int = struct.field(pytree_node=False)

    def nbytes(self) -> int:
        return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(self))
