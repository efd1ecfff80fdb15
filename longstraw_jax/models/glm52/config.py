"""GLM-5 / 5.1 / 5.2 configuration (`Glm52Config`: config.json in and out, presets, the layer groups and their
segments) and the captured state (`Glm52State`); docs/models.md 2.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from longstraw_jax.models.base import check_config_fields, read_json_config
from longstraw_jax.ops import kernels as kernel_choice

FULL, SHARED = "full", "shared"
DENSE, SPARSE = "dense", "sparse"
# config.json keys that transformers' GlmMoeDsaConfig accepts but that do not change the math we implement
# (docs/models.md 2.2: "not read by HF modeling"), or that are read below under another name.
_HF_KEYS_IGNORED = frozenset(
    """model_type architectures transformers_version torch_dtype dtype use_cache initializer_range attention_dropout
    pad_token_id bos_token_id eos_token_id output_hidden_states output_attentions return_dict output_router_logits
    scoring_func topk_method rope_interleave indexer_rope_interleave index_share_for_mtp_iteration moe_layer_freq
    ep_size moe_router_dtype pretraining_tp num_key_value_heads head_dim layer_types qk_head_dim mlp_bias
    index_topk_freq index_skip_topk_offset index_topk_pattern first_k_dense_replace rope_parameters rope_scaling
    rope_theta num_experts num_local_experts hidden_act attention_bias quantization_config
    chunk_size_feed_forward problem_type id2label label2id tokenizer_class prefix sep_token_id decoder_start_token_id
    task_specific_params finetuning_task add_cross_attention cross_attention_hidden_size tie_encoder_decoder
    pruned_heads torchscript use_bfloat16 name_or_path _name_or_path _attn_implementation_autoset""".split()
)


class Segment(NamedTuple):
    """`pattern` (layer groups) repeated `repeats` times, starting at layer `first_layer`, whose first full layer is
    full layer number `first_full`."""

    pattern: tuple[str, ...]
    repeats: int
    first_layer: int
    first_full: int


def segments_of(groups: tuple[str, ...]) -> tuple[Segment, ...]:
    """Greedy split of the layer groups into repeated patterns: at each layer take the (period, repeats) covering the
    most layers (repeats >= 2, or a single layer), shortest period on ties."""
    segments, i, full = [], 0, 0
    while i < len(groups):
        best = (1, 1)
        for period in range(1, len(groups) - i + 1):
            unit, repeats = groups[i : i + period], 1
            while groups[i + repeats * period : i + (repeats + 1) * period] == unit:
                repeats += 1
            if repeats > 1 and period * repeats > best[0] * best[1]:
                best = (period, repeats)
        period, repeats = best
        segments.append(Segment(groups[i : i + period], repeats, i, full))
        full += sum(g.startswith(FULL) for g in groups[i : i + period * repeats])
        i += period * repeats
    return tuple(segments)


def indexer_types_from_hf(raw: dict, num_layers: int) -> list[str]:
    """docs/models.md 2.3: explicit `indexer_types`, else `index_topk_pattern` (F/S), else `index_topk_freq` /
    `index_skip_topk_offset` (layer i is full iff max(i - offset + 1, 0) % freq == 0)."""
    if raw.get("indexer_types") is not None:
        return list(raw["indexer_types"])
    pattern = raw.get("index_topk_pattern")
    if pattern is not None:
        if isinstance(pattern, str):
            unknown = sorted(set(pattern) - {"F", "S"})
            if unknown:
                raise ValueError(f"config.json: index_topk_pattern has characters {unknown}; allowed: F, S")
            return [{"F": FULL, "S": SHARED}[ch] for ch in pattern]
        return list(pattern)
    freq = max(int(raw.get("index_topk_freq", 1)), 1)
    offset = int(raw.get("index_skip_topk_offset", 2))
    return [FULL if max(i - offset + 1, 0) % freq == 0 else SHARED for i in range(num_layers)]


@dataclasses.dataclass(frozen=True)
class Glm52Config:
    """Every field that changes the math of `GlmMoeDsaForCausalLM` (docs/models.md 2.2)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    index_topk: int
    index_n_heads: int
    index_head_dim: int
    indexer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 202752
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0  # MTP layers stored after the last layer on disk: skipped when loading
    # Execution choices (not part of the checkpoint): query block of the sparse attention and of the indexer,
    # key block of the indexer's streaming top-k, and whether the sparse latent attention runs as XLA or as the
    # Pallas kernels (`ops.kernels`; the trainer's --kernels sets it).
    query_block_size: int = 64
    index_key_block_size: int = 1024
    kernels: str = "xla"

    def __post_init__(self):
        object.__setattr__(self, "indexer_types", tuple(self.indexer_types))
        object.__setattr__(self, "mlp_layer_types", tuple(self.mlp_layer_types))
        errors = []
        for name, allowed in (("indexer_types", (FULL, SHARED)), ("mlp_layer_types", (DENSE, SPARSE))):
            values = getattr(self, name)
            if len(values) != self.num_hidden_layers:
                errors.append(f"{name} has {len(values)} entries but num_hidden_layers={self.num_hidden_layers}")
            unknown = sorted(set(values) - set(allowed))
            if unknown:
                errors.append(f"{name} contains {unknown}; allowed: {', '.join(map(repr, allowed))}")
        if self.indexer_types and self.indexer_types[0] != FULL:
            errors.append("indexer_types[0] must be 'full' (a shared layer reuses the top-k of an earlier full layer)")
        if self.n_routed_experts % self.n_group:
            errors.append(f"n_routed_experts={self.n_routed_experts} is not a multiple of n_group={self.n_group}")
        elif self.n_group > 1 and self.n_routed_experts // self.n_group < 2:
            errors.append("group-limited routing needs at least 2 experts per group (n_routed_experts / n_group)")
        if not 1 <= self.topk_group <= self.n_group:
            errors.append(f"topk_group={self.topk_group} must be in [1, n_group={self.n_group}]")
        elif not 1 <= self.num_experts_per_tok <= self.topk_group * self.n_routed_experts // self.n_group:
            errors.append(f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, experts in the "
                          f"topk_group={self.topk_group} kept groups]")
        if self.qk_rope_head_dim % 2 or not 0 < self.qk_rope_head_dim <= self.index_head_dim:
            errors.append(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even and in (0, "
                          f"index_head_dim={self.index_head_dim}]")
        if self.index_topk < 1:
            errors.append(f"index_topk={self.index_topk} must be >= 1")
        for name in ("query_block_size", "index_key_block_size"):
            if getattr(self, name) < 1:
                errors.append(f"{name}={getattr(self, name)} must be >= 1")
        if kernel_error := kernel_choice.check(self.kernels, ""):
            errors.append(kernel_error)
        if errors:
            raise ValueError("invalid Glm52Config: " + "; ".join(errors))

    # ----- derived sizes -----
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_row_dim(self) -> int:
        """Width of one cached row [c | k_pe]: kv_lora_rank + qk_rope_head_dim (576 for GLM-5.x)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def layer_groups(self) -> tuple[str, ...]:
        return tuple(f"{a}_{m}" for a, m in zip(self.indexer_types, self.mlp_layer_types))

    @property
    def segments(self) -> tuple[Segment, ...]:
        return segments_of(self.layer_groups)

    @property
    def num_full_layers(self) -> int:
        return self.indexer_types.count(FULL)

    # ----- constructors -----
    def describe(self) -> str:
        """One line: the family and its main sizes (tools/bench_step.py prints it)."""
        pattern = "".join("F" if t == FULL else "S" for t in self.indexer_types)
        return (f"GLM-5.x {self.num_hidden_layers} layers (indexers {pattern}, "
                f"{self.mlp_layer_types.count(DENSE)} dense), hidden {self.hidden_size}, vocab {self.vocab_size}, "
                f"MLA {self.num_attention_heads} heads latent {self.kv_lora_rank}+{self.qk_rope_head_dim}, DSA top-"
                f"{self.index_topk} ({self.index_n_heads}x{self.index_head_dim}), MoE {self.n_routed_experts} experts "
                f"top-{self.num_experts_per_tok} x {self.moe_intermediate_size} + {self.n_shared_experts} shared")

    @classmethod
    def tiny(cls, **overrides) -> "Glm52Config":
        """Small preset for tests and the demo: 4 MoE layers with indexers F S F S (IndexShare: one segment of two
        layer groups, so it compiles fast), index_topk 16 (sparsity is active beyond 16 tokens), 8 experts top-2
        plus a shared expert. Dense first layers and several segments are covered by the transformers parity."""
        layers = 4
        fields = dict(
            vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=layers,
            num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
            v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, index_topk=16,
            index_n_heads=16, index_head_dim=16,
            indexer_types=tuple(indexer_types_from_hf({"index_topk_freq": 2, "index_skip_topk_offset": 1}, layers)),
            mlp_layer_types=(SPARSE,) * layers, routed_scaling_factor=2.5, rms_norm_eps=1e-5,
            rope_theta=10000.0, max_position_embeddings=1 << 20,
        )
        fields.update(overrides)
        return cls(**fields)

    @classmethod
    def from_hf(cls, source, *, strict: bool = False, **overrides) -> "Glm52Config":
        """From a transformers `glm_moe_dsa` config: a dict, a config.json path, or a checkpoint directory.

        Applies transformers' derivations (docs/models.md 2.2, 2.3): `indexer_types` from `index_topk_pattern` or
        `index_topk_freq` / `index_skip_topk_offset`, `mlp_layer_types` from `first_k_dense_replace`; `head_dim` is
        ignored (transformers overwrites it with qk_rope_head_dim). Unknown keys warn (error with strict=True).
        """
        raw = dict(read_json_config(source))
        if raw.get("model_type") != "glm_moe_dsa":
            raise ValueError(f"config.json: model_type={raw.get('model_type')!r} is not a GLM-5.x model "
                             "(expected 'glm_moe_dsa')")
        check_config_fields(raw, {f.name for f in dataclasses.fields(cls)} | _HF_KEYS_IGNORED, strict)
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json: hidden_act={raw['hidden_act']!r}; only 'silu' is supported")
        if raw.get("attention_bias", False):
            raise ValueError("config.json: attention_bias=true is not supported (GLM-5.x has no attention biases)")
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"config.json: rope_parameters.rope_type={rope_type!r}; only 'default' is supported "
                             "(GLM-5.x)")
        layers = raw.get("num_hidden_layers", 78)
        mlp_types = raw.get("mlp_layer_types")
        if mlp_types is None:
            dense = min(int(raw.get("first_k_dense_replace", 3)), layers)
            mlp_types = [DENSE] * dense + [SPARSE] * (layers - dense)
        # transformers' defaults are GLM-5 (docs/models.md 2.2), used for absent keys as transformers does
        get = lambda key, default: raw.get(key, default)
        experts = raw.get("n_routed_experts", raw.get("num_experts", raw.get("num_local_experts", 256)))
        fields = dict(
            vocab_size=get("vocab_size", 154880), hidden_size=get("hidden_size", 6144),
            intermediate_size=get("intermediate_size", 12288), moe_intermediate_size=get("moe_intermediate_size", 2048),
            num_hidden_layers=layers, num_attention_heads=get("num_attention_heads", 64),
            q_lora_rank=get("q_lora_rank", 2048), kv_lora_rank=get("kv_lora_rank", 512),
            qk_nope_head_dim=get("qk_nope_head_dim", 192), qk_rope_head_dim=get("qk_rope_head_dim", 64),
            v_head_dim=get("v_head_dim", 256), n_routed_experts=experts,
            num_experts_per_tok=get("num_experts_per_tok", 8), n_shared_experts=get("n_shared_experts", 1),
            index_topk=get("index_topk", 2048), index_n_heads=get("index_n_heads", 32),
            index_head_dim=get("index_head_dim", 128), indexer_types=tuple(indexer_types_from_hf(raw, layers)),
            mlp_layer_types=tuple(mlp_types), n_group=get("n_group", 1), topk_group=get("topk_group", 1),
            norm_topk_prob=bool(get("norm_topk_prob", True)),
            routed_scaling_factor=float(get("routed_scaling_factor", 2.5)), rms_norm_eps=get("rms_norm_eps", 1e-5),
            rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
            max_position_embeddings=get("max_position_embeddings", 202752),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            num_nextn_predict_layers=get("num_nextn_predict_layers", 0),
        )
        fields.update(overrides)
        return cls(**fields)

    def to_hf(self) -> dict:
        """A `glm_moe_dsa` config.json dict that `transformers.GlmMoeDsaForCausalLM` loads."""
        return {
            "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "moe_intermediate_size": self.moe_intermediate_size,
            "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads, "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank, "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim, "v_head_dim": self.v_head_dim,
            "head_dim": self.qk_rope_head_dim, "n_routed_experts": self.n_routed_experts,
            "num_experts_per_tok": self.num_experts_per_tok, "n_shared_experts": self.n_shared_experts,
            "n_group": self.n_group, "topk_group": self.topk_group, "norm_topk_prob": self.norm_topk_prob,
            "routed_scaling_factor": self.routed_scaling_factor, "index_topk": self.index_topk,
            "index_n_heads": self.index_n_heads, "index_head_dim": self.index_head_dim,
            "indexer_types": list(self.indexer_types), "mlp_layer_types": list(self.mlp_layer_types),
            "rms_norm_eps": self.rms_norm_eps, "hidden_act": "silu", "attention_bias": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "max_position_embeddings": self.max_position_embeddings, "tie_word_embeddings": self.tie_word_embeddings,
            "num_nextn_predict_layers": self.num_nextn_predict_layers,
        }


@struct.dataclass
class Glm52State:
    """What later tokens need from a prompt of `length` tokens (docs/models.md 2.11).

    kv:         [num_hidden_layers, length, kv_lora_rank + qk_rope_head_dim]  per layer [c | k_pe]: the latent after
                kv_a_layernorm and the rope key after RoPE (half-split order), model dtype
    index_keys: [num_full_layers, length, index_head_dim]  indexer keys after LayerNorm and RoPE (full layers only)
    """

    kv: jax.Array
    index_keys: jax.Array
    length: int = struct.field(pytree_node=False)

    def nbytes(self) -> int:
        return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(self))
