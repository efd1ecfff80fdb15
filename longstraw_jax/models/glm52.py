"""GLM-5 / GLM-5.1 / GLM-5.2 (`glm_moe_dsa`): MLA attention with DSA sparse selection and IndexShare, and MoE.

Read next to docs/models.md section 2; each function names the subsection it implements.

Layout. Every layer has MLA attention and an MLP; layers differ in two ways: the indexer (`full` layers run the DSA
indexer, `shared` layers reuse the top-k of the latest full layer of the same forward) and the MLP (`dense` SwiGLU
or `sparse` MoE). A layer's *group* is the pair, e.g. "shared_sparse". The layer sequence is split into *segments*,
each a short pattern of groups repeated (GLM-5.2: `full_dense` x 3, then (`shared_sparse` x 3, `full_sparse`) x 18,
then `shared_sparse` x 3); the model scans over each segment's repeats, so compile time depends on the pattern
lengths, not the depth. Parameters are stacked per segment and group, `[repeats, per_pattern, ...]`, in the
transformers orientation `[out_features, in_features]`; routed experts are stacked `[E, ...]` inside a layer.

Prompt state (docs/models.md 2.11): per layer and position, one row `[c | k_pe]` (normalised 512-wide latent and the
roped 64-wide rope key), and per full layer the indexer key. Attention is the absorbed form (`ops/mla.py`): keys and
values are never expanded per head. Execution mirrors Qwen36: `capture` walks the prompt in chunks, writing each
chunk's rows once after all layers; `extend` continues after a state without modifying it; `forward` is `extend`
from an empty state. The engine's backward goes block by block (`layerwise.py`): one `SegmentStage` per segment, a
block = one repeat of its pattern, the IndexShare selection carried with h, and no cotangent for the indexer keys
(`differentiable_state`).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct, traverse_util

from longstraw_jax.common.validation import check_tokens
from longstraw_jax.engine import layerwise
from longstraw_jax.models import glm52_mesh as sharded
from longstraw_jax.models.base import CausalLM, Slot, check_config_fields, read_json_config, state_capacity
from longstraw_jax.ops import attention as attn_ops
from longstraw_jax.ops.dsa import merge_candidates, select_topk, topk_over_keys
from longstraw_jax.ops.dtypes import at_least_f32
from longstraw_jax.ops.lora import materialize
from longstraw_jax.ops.mla import sparse_latent_attention, sparse_latent_attention_partial
from longstraw_jax.ops.mlp import linear, swiglu
from longstraw_jax.ops.moe import grouped_swiglu, route
from longstraw_jax.ops.norms import layer_norm, rms_norm
from longstraw_jax.ops.rope import RopeConfig, apply_rope_interleaved, cos_sin, inverse_frequencies, rope_positions

FULL, SHARED = "full", "shared"
DENSE, SPARSE = "dense", "sparse"
LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: the constructor default, not rms_norm_eps (docs/models.md 2.4)
INDEXER_NORM_EPS = 1e-6  # indexer k_norm LayerNorm
_HIGHEST = jax.lax.Precision.HIGHEST

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


def _segments(groups: tuple[str, ...]) -> tuple[Segment, ...]:
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
    # key block of the indexer's streaming top-k.
    query_block_size: int = 64
    index_key_block_size: int = 1024

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
        return _segments(self.layer_groups)

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


# ---------------------------------------------------------------------------------------------------------------
# Parameters of one layer of a group: leaf -> (shape, init), and the transformers name under `model.layers.{i}.`
# ({e}: one tensor per routed expert on disk, docs/models.md 2.1)


def _layer_leaves(c: Glm52Config, group: str) -> dict[str, tuple[tuple[int, ...], str]]:
    indexer, mlp_kind = group.split("_")
    d, h = c.hidden_size, c.num_attention_heads
    leaves = {
        "input_norm": ((d,), "ones"), "post_norm": ((d,), "ones"),
        "attn/q_a_proj": ((c.q_lora_rank, d), "normal"), "attn/q_a_norm": ((c.q_lora_rank,), "ones"),
        "attn/q_b_proj": ((h * c.qk_head_dim, c.q_lora_rank), "normal"),
        "attn/kv_a_proj": ((c.kv_row_dim, d), "normal"), "attn/kv_a_norm": ((c.kv_lora_rank,), "ones"),
        "attn/kv_b_proj": ((h * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank), "normal"),
        "attn/o_proj": ((d, h * c.v_head_dim), "normal"),
    }
    if indexer == FULL:
        leaves.update({
            "attn/indexer/wq_b": ((c.index_n_heads * c.index_head_dim, c.q_lora_rank), "normal"),
            "attn/indexer/wk": ((c.index_head_dim, d), "normal"),
            "attn/indexer/k_norm": ((c.index_head_dim,), "ones"),
            "attn/indexer/k_norm_bias": ((c.index_head_dim,), "zeros"),
            "attn/indexer/weights_proj": ((c.index_n_heads, d), "normal"),
        })
    if mlp_kind == DENSE:
        i = c.intermediate_size
        leaves.update({"mlp/gate_proj": ((i, d), "normal"), "mlp/up_proj": ((i, d), "normal"),
                       "mlp/down_proj": ((d, i), "normal")})
    else:
        e, i, shared = c.n_routed_experts, c.moe_intermediate_size, c.moe_intermediate_size * c.n_shared_experts
        leaves.update({
            "mlp/router": ((e, d), "normal"), "mlp/router_bias": ((e,), "zeros"),
            "mlp/experts_gate": ((e, i, d), "normal"), "mlp/experts_up": ((e, i, d), "normal"),
            "mlp/experts_down": ((e, d, i), "normal"),
            "mlp/shared/gate_proj": ((shared, d), "normal"), "mlp/shared/up_proj": ((shared, d), "normal"),
            "mlp/shared/down_proj": ((d, shared), "normal"),
        })
    return leaves


_HF_LAYER_NAMES = {
    "input_norm": "input_layernorm.weight", "post_norm": "post_attention_layernorm.weight",
    "attn/q_a_proj": "self_attn.q_a_proj.weight", "attn/q_a_norm": "self_attn.q_a_layernorm.weight",
    "attn/q_b_proj": "self_attn.q_b_proj.weight", "attn/kv_a_proj": "self_attn.kv_a_proj_with_mqa.weight",
    "attn/kv_a_norm": "self_attn.kv_a_layernorm.weight", "attn/kv_b_proj": "self_attn.kv_b_proj.weight",
    "attn/o_proj": "self_attn.o_proj.weight",
    "attn/indexer/wq_b": "self_attn.indexer.wq_b.weight", "attn/indexer/wk": "self_attn.indexer.wk.weight",
    "attn/indexer/k_norm": "self_attn.indexer.k_norm.weight",
    "attn/indexer/k_norm_bias": "self_attn.indexer.k_norm.bias",
    "attn/indexer/weights_proj": "self_attn.indexer.weights_proj.weight",
    "mlp/gate_proj": "mlp.gate_proj.weight", "mlp/up_proj": "mlp.up_proj.weight",
    "mlp/down_proj": "mlp.down_proj.weight",
    "mlp/router": "mlp.gate.weight", "mlp/router_bias": "mlp.gate.e_score_correction_bias",
    "mlp/experts_gate": "mlp.experts.{e}.gate_proj.weight", "mlp/experts_up": "mlp.experts.{e}.up_proj.weight",
    "mlp/experts_down": "mlp.experts.{e}.down_proj.weight",
    "mlp/shared/gate_proj": "mlp.shared_experts.gate_proj.weight",
    "mlp/shared/up_proj": "mlp.shared_experts.up_proj.weight",
    "mlp/shared/down_proj": "mlp.shared_experts.down_proj.weight",
}
_HF_TOP_NAMES = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight", "lm_head": "lm_head.weight"}


# ---------------------------------------------------------------------------------------------------------------
# Layers (pure functions of one layer's parameters)


def _rope_tables(c: Glm52Config, positions: jax.Array, dtype):
    """cos, sin [T, qk_rope_head_dim] (default RoPE over the rope slice; docs/models.md 2.7), in the model dtype."""
    inv_freq, scaling = inverse_frequencies(RopeConfig(theta=c.rope_theta), c.qk_rope_head_dim,
                                            c.max_position_embeddings)
    return cos_sin(positions, inv_freq, scaling, dtype)


class PromptReader(NamedTuple):
    """How a layer reads what came before its tokens, on one device: `state` at positions < start (docs/models.md 2.6,
    2.8). tokens sit at `positions` [T] = start + arange(T). The sequence-parallel engine (`models/glm52_mesh.py`)
    passes its own reader with the same four methods, so the layer code below is shared. left_pad (int32 [] or
    None): positions < left_pad are a left-padded prompt's pads, never selected (so never attended)."""

    state: Glm52State
    positions: jax.Array
    start: jax.Array | int
    left_pad: Any = None

    def layer_params(self, lp: dict, segment: int, group: str) -> dict:
        """One layer's parameters, whole (identity here; FSDP all-gathers them)."""
        return lp

    def routed_experts(self, x, experts, weights, p: dict) -> jax.Array:
        """The routed experts of a MoE layer (2.9) over x [T, D] with routing experts int [T, k], weights [T, k]:
        all E experts here (expert-parallel on a mesh: `parallel/experts.py`)."""
        return grouped_swiglu(x, experts, weights, p["experts_gate"], p["experts_up"], p["experts_down"])

    def select(self, c: Glm52Config, q, w, keys, full, k: int) -> jax.Array:
        """DSA top-k (2.8): q [T, Hi, Di], w [T, Hi] float32, keys [T, Di] this chunk's indexer keys -> int32
        [T, k] positions (-1: unused slot) among the cache's keys of full layer `full` and the causal new keys."""
        return select_topk(q, w, jax.lax.stop_gradient(self.state.index_keys), full, keys, self.positions,
                           self.start, k=k, scale=c.index_head_dim**-0.5, query_block=c.query_block_size,
                           key_block=c.index_key_block_size, left_pad=self.left_pad)

    def attend(self, c: Glm52Config, q_abs, rows, layer, selected) -> jax.Array:
        """Absorbed sparse attention (2.6): q_abs [T, H, Dk], rows [T, Dk] this chunk's cache rows -> latent
        output [T, H, kv_lora_rank] float32 over the selected positions of layer `layer`'s cache and the chunk."""
        return sparse_latent_attention(q_abs, self.state.kv, layer, rows, selected, self.start,
                                       scale=c.qk_head_dim**-0.5, value_dim=c.kv_lora_rank,
                                       block_size=c.query_block_size)


class DecodeReader(NamedTuple):
    """How a layer reads what came before one decoded token at `positions` [1], on one device: the prompt `state`
    (read-only, rows < state.length) and the `tail` (rows of the decoded positions state.length.., `slot` of them
    before the token). The sampler keeps the prompt apart from the tails so that many branches decode together
    over one prompt cache (`Glm52.decode`). The indexer's top-k merges the prompt's candidates with the tail's and
    the token's (`glm52_mesh.tail_candidates`); attention merges the prompt's partial with theirs, as the mesh's
    decoder does over shards. The prompt's pads (< left_pad) are never candidates."""

    state: Glm52State
    tail: Glm52State
    slot: jax.Array
    positions: jax.Array
    left_pad: Any = None

    def layer_params(self, lp: dict, segment: int, group: str) -> dict:
        return lp

    def routed_experts(self, x, experts, weights, p: dict) -> jax.Array:
        return grouped_swiglu(x, experts, weights, p["experts_gate"], p["experts_up"], p["experts_down"])

    def select(self, c: Glm52Config, q, w, keys, full, k: int) -> jax.Array:
        common, length = sharded.topk_common(c, k), self.state.length
        slots = jnp.arange(self.state.index_keys.shape[1], dtype=jnp.int32)
        slots = jnp.where(slots < length, slots, jnp.iinfo(jnp.int32).max)  # never visible past the prompt
        prompt = topk_over_keys(q, w, jax.lax.stop_gradient(self.state.index_keys), slots, self.positions,
                                layer=full, left_pad=self.left_pad, **common)
        own = sharded.tail_candidates(q, w, keys, full, self.tail, self.slot, length, self.positions, common)
        return merge_candidates(*(jnp.concatenate(x, axis=-1) for x in zip(prompt, own)), k)[1]

    def attend(self, c: Glm52Config, q_abs, rows, layer, selected) -> jax.Array:
        common, length = sharded.attend_common(c), self.state.length
        in_prompt = jnp.where((selected >= 0) & (selected < length), selected, -1)
        prompt = sparse_latent_attention_partial(q_abs, self.state.kv, layer, rows, in_prompt,
                                                 self.state.kv.shape[1], **common)
        own = sharded.tail_partial(q_abs, rows, layer, jnp.where(selected >= length, selected - length, -1),
                                   self.tail, self.slot, common)
        return attn_ops.merge(prompt, own).out


def indexer(c: Glm52Config, p: dict, x, q_resid, cos, sin, reader, full, k: int):
    """DSA lightning indexer (2.8) of full layer number `full`: returns (selected int32 [T, k], this chunk's indexer
    keys [T, index_head_dim]). Runs without gradient: its inputs are stop_gradient-ed (selection is discrete; the
    policy loss gives the indexer no gradient, as transformers' `torch.no_grad()`)."""
    p, x, q_resid = jax.lax.stop_gradient((p, x, q_resid))
    t, heads, dim = x.shape[0], c.index_n_heads, c.index_head_dim
    q = apply_rope_interleaved(linear(q_resid, p["wq_b"], _HIGHEST).reshape(t, heads, dim), cos, sin)
    key = layer_norm(linear(x, p["wk"], _HIGHEST), p["k_norm"], p["k_norm_bias"], INDEXER_NORM_EPS)
    key = apply_rope_interleaved(key[:, None], cos, sin)[:, 0]
    w = jnp.einsum("td,hd->th", at_least_f32(x), at_least_f32(p["weights_proj"]), precision=_HIGHEST) * heads**-0.5
    return reader.select(c, at_least_f32(q), w, key, full, k), key  # both float32 (float64 for a float64 model)


def mla_attention(c: Glm52Config, p: dict, x, reader, layer, full, selected):
    """MLA with DSA (2.6) for layer `layer` over x [T, D] at positions reader.positions.

    A full layer (p has "indexer") selects its own top-k; a shared one attends to `selected` from the latest full
    layer. Returns (y [T, D], this chunk's cache rows [T, kv_row_dim], indexer keys [T, Di] or None, selected).
    """
    t, heads = x.shape[0], c.num_attention_heads
    nope, lora = c.qk_nope_head_dim, c.kv_lora_rank
    q_resid = rms_norm(linear(x, p["q_a_proj"]), p["q_a_norm"], LATENT_NORM_EPS)
    q = linear(q_resid, p["q_b_proj"]).reshape(t, heads, c.qk_head_dim)  # per head [q_nope | q_pe]
    ckv = linear(x, p["kv_a_proj"])  # [T, lora + rope] = [latent | k_pe]
    cos, sin = _rope_tables(c, rope_positions(reader.positions, reader.left_pad), x.dtype)  # pads: shifted
    rows = jnp.concatenate([rms_norm(ckv[:, :lora], p["kv_a_norm"], LATENT_NORM_EPS),
                            apply_rope_interleaved(ckv[:, None, lora:], cos, sin)[:, 0]], axis=-1)
    # per head [W_UK (nope) | W_UV (v)]; an adapted kv_b_proj is merged here (one layer, transient: it is reshaped
    # per head, not applied as a linear)
    w_kv = materialize(p["kv_b_proj"]).reshape(heads, nope + c.v_head_dim, lora)
    q_abs = jnp.concatenate([jnp.einsum("thn,hnr->thr", q[..., :nope], w_kv[:, :nope]),
                             apply_rope_interleaved(q[..., nope:], cos, sin)], axis=-1)
    index_key = None
    if "indexer" in p:
        selected, index_key = indexer(c, p["indexer"], x, q_resid, cos, sin, reader, full, selected.shape[1])
    o = reader.attend(c, q_abs, rows, layer, selected)
    o = jnp.einsum("thr,hvr->thv", o.astype(x.dtype), w_kv[:, nope:])
    return linear(o.reshape(t, heads * c.v_head_dim), p["o_proj"]), rows, index_key, selected


def moe(c: Glm52Config, p: dict, x: jax.Array, reader) -> jax.Array:
    """MoE MLP (2.9): routed experts (sigmoid router, top-k; run by `reader.routed_experts`) plus the always-on
    shared expert. x [T, D]."""
    experts, weights = route(x, p["router"], p["router_bias"], top_k=c.num_experts_per_tok, n_group=c.n_group,
                             topk_group=c.topk_group, norm_topk_prob=c.norm_topk_prob,
                             scaling=c.routed_scaling_factor)
    return reader.routed_experts(x, experts, weights, p) + swiglu(p["shared"], x)


def _layer(c: Glm52Config, p: dict, h, selected, reader, layer, full):
    """Decoder layer (2.5): h + attn(norm(h)), then h + mlp(norm(h)). Returns (h, selected, rows, index key)."""
    y, rows, index_key, selected = mla_attention(c, p["attn"], rms_norm(h, p["input_norm"], c.rms_norm_eps),
                                                 reader, layer, full, selected)
    h = h + y
    x = rms_norm(h, p["post_norm"], c.rms_norm_eps)
    return h + (moe(c, p["mlp"], x, reader) if "router" in p["mlp"] else swiglu(p["mlp"], x)), selected, rows, index_key


def _runs(pattern: tuple[str, ...]) -> list[tuple[str, int, int, int]]:
    """Runs of one group in a pattern, as (group, position in pattern, index within the group, count)."""
    runs, seen = [], {}
    for pos, group in enumerate(pattern):
        if runs and runs[-1][0] == group:
            runs[-1][3] += 1
        else:
            runs.append([group, pos, seen.get(group, 0), 1])
        seen[group] = seen.get(group, 0) + 1
    return [tuple(r) for r in runs]


def _full_count(groups) -> int:
    return sum(g.startswith(FULL) for g in groups)


def _repeat(c: Glm52Config, s: int, seg: Segment, rp: dict, carry, reader, layer0, full0, remat=False):
    """One repeat of segment `s`'s pattern over carry (h [T, D], selected [T, k]): a scan over each run of one group.
    rp: the repeat's parameters (leaves [per_pattern, ...] per group). layer0 / full0: where the repeat's first layer
    and first full layer sit in the cache `reader` reads (in the whole state: their global numbers; in one repeat's
    slice of it, `SegmentStage`: 0). Returns (carry, (rows [plen, T, kv_row_dim], index keys [full per repeat, T, Di]
    or None, the full layers' selections [full per repeat, T, k] or None))."""
    outputs = []
    for group, pos, j, count in _runs(seg.pattern):
        def step(carry, xs, layer=layer0 + pos, full=full0 + _full_count(seg.pattern[:pos]), group=group):
            lp, i = xs
            lp = reader.layer_params(lp, s, group)
            h, selected, rows, key = _layer(c, lp, *carry, reader, layer + i, full + i)
            return (h, selected), (rows, key, selected if key is not None else None)

        run_params = jax.tree.map(lambda a: a[j : j + count], rp[group])
        carry, out = jax.lax.scan(jax.checkpoint(step) if remat else step, carry, (run_params, jnp.arange(count)))
        outputs.append(out)
    return carry, tuple(None if all(o[n] is None for o in outputs) else
                        jnp.concatenate([o[n] for o in outputs if o[n] is not None]) for n in range(3))


def _segment(c: Glm52Config, s: int, seg: Segment, seg_params: dict, h, selected, reader, remat=False):
    """Segment `s`: a scan over its repeats (`_repeat`). The prompt is only read (through `reader`). remat: under
    autodiff keep only each layer's inputs and recompute the layer in the backward pass (one layer's activations,
    and on a mesh one layer's gathered weights, live at a time).
    Returns (h, selected, rows [layers, T, kv_row_dim], index keys [full layers, T, Di] or None, the full layers'
    selections [full layers, T, k] or None)."""
    plen, full_per_repeat = len(seg.pattern), _full_count(seg.pattern)

    def repeat(carry, xs):
        rp, r = xs
        return _repeat(c, s, seg, rp, carry, reader, seg.first_layer + r * plen, seg.first_full + r * full_per_repeat,
                       remat)

    (h, selected), outs = jax.lax.scan(repeat, (h, selected), (seg_params, jnp.arange(seg.repeats)))
    flatten = lambda a: None if a is None else a.reshape((-1,) + a.shape[2:])
    return (h, selected) + tuple(flatten(a) for a in outs)


def decoder_layers(c: Glm52Config, layers: dict, h, reader, k: int, remat: bool = False):
    """All layers over h [T, D] (embedded tokens at reader.positions), reading the prompt through `reader`.
    k: the top-k width (slots beyond the visible keys hold -1). Returns (h [T, D] before the final norm, entries
    {"kv": [layers, T, kv_row_dim], "index_keys": [F, T, Di]}, selections [F, T, k])."""
    selected = jnp.full((h.shape[0], k), -1, jnp.int32)
    parts = []
    for s, seg in enumerate(c.segments):
        h, selected, *out = _segment(c, s, seg, layers[str(s)], h, selected, reader, remat)
        parts.append(out)
    rows, keys, selections = (jnp.concatenate([p[n] for p in parts if p[n] is not None]) for n in range(3))
    return h, {"kv": rows, "index_keys": keys}, selections


def _chunk(c: Glm52Config, params: dict, state: Glm52State, tokens: jax.Array, start, remat: bool = False,
           left_pad=None):
    """`decoder_layers` on one device over tokens [T] at positions start.., reading `state` (positions < start;
    never a row >= start, whatever the state's capacity: neither the indexer's top-k nor the attention visits one).
    Positions < left_pad (int32 [] or None) are pads: never selected."""
    t = tokens.shape[0]
    reader = PromptReader(state, start + jnp.arange(t, dtype=jnp.int32), start, left_pad)
    # every row gets k slots (-1 where fewer keys are visible); the state's capacity bounds start from above, so
    # k covers every visible key whenever fewer than index_topk are (decoding at start > state.length included)
    k = min(c.index_topk, state.kv.shape[1] + t)
    return decoder_layers(c, params["layers"], params["embed"][tokens], reader, k, remat)


# ---------------------------------------------------------------------------------------------------------------
# Block by block (longstraw_jax/layerwise.py): one stage per segment, a block = one repeat of its pattern


def _last_key(path) -> str:
    key = path[-1]
    return getattr(key, "name", None) or getattr(key, "key")


@dataclasses.dataclass(frozen=True)
class SegmentStage:
    """`layerwise.Stage` of segment `s`: block r is repeat r of the segment's pattern, layers first_layer + r * plen
    .. (+ plen) and full layers first_full + r * (full per repeat) ... The block carry is (h, selected): a shared
    layer may reuse the selection of a full layer in an earlier block or segment, so the selection travels with h
    (integer: no cotangent). A block reads its slice of the state: kv [plen, S, Dk], index_keys [full per repeat,
    S, Di] (layer indices local to the slice). `at` / `set_at` / `stacked` work on a Glm52State, a ShardedPromptState
    and a dict of entries alike (by field name, layer axis first), None leaves (the cotangent has no index_keys)
    staying None."""

    config: Glm52Config
    s: int
    seg: Segment

    @property
    def num_blocks(self) -> int:
        return self.seg.repeats

    def block_params(self, params: dict) -> dict:
        return params["layers"][str(self.s)]

    def with_block_params(self, params: dict, blocks: dict) -> dict:
        return dict(params, layers=dict(params["layers"], **{str(self.s): blocks}))

    def block(self, bp: dict, carry, state_block: Glm52State, positions: jax.Array, cache_length, left_pad=None):
        """One repeat on carry (h [T, D], selected [T, k]) at `positions`, reading `state_block` at positions <
        cache_length (pads < left_pad never selected). Returns (carry, {"kv": rows [plen, T, Dk], "index_keys": keys
        [full per repeat, T, Di] or None})."""
        return self.block_with_reader(bp, carry, PromptReader(state_block, positions, cache_length, left_pad))

    def block_with_reader(self, bp: dict, carry, reader):
        """`block` with the prompt read through `reader` (one block's slice of it; the sharded replay's reader)."""
        carry, (rows, keys, _) = _repeat(self.config, self.s, self.seg, bp, carry, reader, 0, 0)
        return carry, {"kv": rows, "index_keys": keys}

    def _rows(self, path) -> tuple[int, int]:
        """(first layer of block 0, layers per block) on the layer axis of the leaf at `path`."""
        seg, name = self.seg, _last_key(path)
        if name == "kv":
            return seg.first_layer, len(seg.pattern)
        if name == "index_keys":
            return seg.first_full, _full_count(seg.pattern)
        raise ValueError(f"no layer axis known for a state field {name!r}")

    def at(self, tree, b):
        def one(path, a):
            first, size = self._rows(path)
            return jax.lax.dynamic_slice_in_dim(a, first + b * size, size, axis=0)
        return jax.tree_util.tree_map_with_path(one, tree)

    def set_at(self, tree, b, sub):
        def one(path, a, x):
            first, size = self._rows(path)
            return jax.lax.dynamic_update_slice_in_dim(a, x.astype(a.dtype), first + b * size, axis=0)
        return jax.tree_util.tree_map_with_path(one, tree, sub)

    def stacked(self, entries):
        def one(path, a):
            first, size = self._rows(path)
            return a[first : first + self.num_blocks * size].reshape((self.num_blocks, size) + a.shape[1:])
        return jax.tree_util.tree_map_with_path(one, entries)


class GlmBlocks(NamedTuple):
    """What `layerwise` needs of GLM-5.x besides its stages: the block carry is (h, selected), selected starting as
    -1 (layer 0 is a full layer: it selects before any layer reads). `visible`: the key positions before the tokens
    that the top-k width covers, k = min(index_topk, visible + T) (one device: the state's capacity, as `_chunk`)."""

    model: "Glm52"
    visible: int

    def embed(self, params: dict, tokens: jax.Array):
        k = min(self.model.config.index_topk, self.visible + tokens.shape[0])
        return params["embed"][tokens], jnp.full((tokens.shape[0], k), -1, jnp.int32)

    def final_norm(self, params: dict, carry) -> jax.Array:
        return rms_norm(carry[0], params["final_norm"], self.model.config.rms_norm_eps)

    def read_entries(self, state, start, size: int) -> dict:
        return self.model.read_entries(state, start, size)

    def carried(self, state):
        return self.model.carried(state)

    def with_carried(self, state, carried):
        return self.model.with_carried(state, carried)


# ---------------------------------------------------------------------------------------------------------------
# The model


@dataclasses.dataclass(frozen=True)
class Glm52(CausalLM):
    """Frozen, hashable: pass it as a static argument to `jax.jit`. Methods are pure functions of params."""

    config: Glm52Config
    state_type = Glm52State  # what `init_state` / `capture` return

    # ----- parameters -----
    def init(self, key: jax.Array, dtype=jnp.float32) -> dict:
        """Random parameters: normal(0, 0.02) matrices as in transformers, norms at 1, biases at 0."""
        c = self.config
        counter = iter(range(1 << 30))

        def make(shape, kind):
            if kind == "normal":
                sample = jax.random.normal(jax.random.fold_in(key, next(counter)), shape, jnp.float32)
                return (0.02 * sample).astype(dtype)
            return (jnp.ones if kind == "ones" else jnp.zeros)(shape, dtype)

        layers = {}
        for s, seg in enumerate(c.segments):
            layers[str(s)] = {
                group: traverse_util.unflatten_dict(
                    {leaf: make((seg.repeats, seg.pattern.count(group)) + shape, kind)
                     for leaf, (shape, kind) in _layer_leaves(c, group).items()}, sep="/")
                for group in dict.fromkeys(seg.pattern)}
        params = {"embed": make((c.vocab_size, c.hidden_size), "normal"), "layers": layers,
                  "final_norm": make((c.hidden_size,), "ones")}
        if not c.tie_word_embeddings:
            params["lm_head"] = make((c.vocab_size, c.hidden_size), "normal")
        return params

    # ----- Hugging Face checkpoint layout (used by models/hf.py) -----
    hf_prefix_aliases = ()

    @property
    def hf_skipped_prefixes(self) -> tuple[str, ...]:
        """The MTP (next-n) layers stored after the last decoder layer (`model.layers.78.*` for GLM-5.x)."""
        c = self.config
        return tuple(f"model.layers.{c.num_hidden_layers + i}." for i in range(c.num_nextn_predict_layers))

    def hf_layout(self) -> dict:
        """HF name -> Slot(path, index, hf_shape); per-expert tensors are slices [repeat, j, expert] of the stacks."""
        c = self.config
        flat = traverse_util.flatten_dict(jax.eval_shape(self.init, jax.random.key(0)), sep="/")
        layout = {name: Slot(top, (), flat[top].shape) for top, name in _HF_TOP_NAMES.items() if top in flat}
        for s, seg in enumerate(c.segments):
            for r in range(seg.repeats):
                for pos, group in enumerate(seg.pattern):
                    j, layer = seg.pattern[:pos].count(group), seg.first_layer + r * len(seg.pattern) + pos
                    for leaf in _layer_leaves(c, group):
                        path, suffix = f"layers/{s}/{group}/{leaf}", _HF_LAYER_NAMES[leaf]
                        shape = flat[path].shape[2:]
                        if "{e}" in suffix:
                            for e in range(shape[0]):
                                layout[f"model.layers.{layer}.{suffix.format(e=e)}"] = Slot(path, (r, j, e), shape[1:])
                        else:
                            layout[f"model.layers.{layer}.{suffix}"] = Slot(path, (r, j), shape)
        return layout

    def init_state(self, length: int, dtype=jnp.float32, capacity: int | None = None) -> Glm52State:
        """Zero state of `length` valid prompt positions (length 0: the state before any token), its rows sized
        `capacity` (default `length`; more leaves room to decode after the prompt: rows >= length are never read or
        selected by `extend` and the replay)."""
        c = self.config
        rows = state_capacity(length, capacity)
        return Glm52State(kv=jnp.zeros((c.num_hidden_layers, rows, c.kv_row_dim), dtype),
                        index_keys=jnp.zeros((c.num_full_layers, rows, c.index_head_dim), dtype), length=length)

    def index_selection(self, params: dict, tokens) -> jax.Array:
        """The positions each full layer's indexer selects in `forward(tokens)`: int32 [num_full_layers, T, k]
        (k = min(index_topk, T); -1 marks unused slots). Shared layers use the latest full layer's selection."""
        return self._selection(params, check_tokens(tokens, self.config.vocab_size))

    # ----- pure implementations (public entry points: models/base.py CausalLM) -----
    @functools.partial(jax.jit, static_argnums=0, static_argnames="remat")
    def _extend_hidden(self, params, state, tokens, remat: bool = False, left_pad=None):
        h, _, _ = _chunk(self.config, params, state, tokens, state.length, remat, left_pad)
        return rms_norm(h, params["final_norm"], self.config.rms_norm_eps)

    @functools.partial(jax.jit, static_argnums=0)
    def _selection(self, params, tokens):
        return _chunk(self.config, params, self.init_state(0, params["embed"].dtype), tokens, 0)[2]

    def decoder_layers(self, layers: dict, h: jax.Array, reader, k: int, remat: bool = False):
        """All layers over h [T, D], the prompt read through `reader` (a `PromptReader` or a sharded reader with the
        same methods): the layer code every engine runs (`decoder_layers`)."""
        return decoder_layers(self.config, layers, h, reader, k, remat)

    def mesh_adapter(self):
        """Capture, replay and prompt backward on a ("data", "seq") mesh: `models/glm52_mesh.py`."""
        return sharded.Glm52Mesh(self)

    # ----- block by block (longstraw_jax/layerwise.py: the engine's backward) -----
    def block_stages(self) -> tuple[SegmentStage, ...]:
        """One `layerwise.Stage` per segment (a block = one repeat of its pattern), in layer order."""
        return tuple(SegmentStage(self.config, s, seg) for s, seg in enumerate(self.config.segments))

    def differentiable_state(self, state):
        """Every Glm52State in `state` (a Glm52State, a ShardedPromptState) with index_keys None: the indexer keys are
        read only by the top-k selection, which is not differentiable, so their cotangent is zero by construction
        and the state cotangent accumulator (`replay.py`) has no buffer for them, nor does any block's vjp."""
        return jax.tree.map(lambda s: s.replace(index_keys=None), state, is_leaf=lambda x: isinstance(x, Glm52State))

    def layerwise_blocks(self, visible: int) -> GlmBlocks:
        """What `layerwise` needs besides the stages, with the top-k width for `visible` earlier key positions."""
        return GlmBlocks(self, visible)

    def branch_grads(self, params, state, tokens, head, grads, acc, left_pad=None):
        """One replayed branch, backpropagated block by block (`layerwise.branch_grads`, one stage per segment)."""
        return layerwise.branch_grads(self.layerwise_blocks(state.kv.shape[1]), params, state, tokens, head, grads,
                                      acc, stages=self.block_stages(), left_pad=left_pad)

    def chunk_grads(self, params, state, tokens, start, grads, acc, left_pad=None):
        """One prompt chunk of exact mode's backward, block by block (`layerwise.chunk_grads`)."""
        return layerwise.chunk_grads(self.layerwise_blocks(state.kv.shape[1]), params, state, tokens, start, grads,
                                     acc, stages=self.block_stages(), left_pad=left_pad)

    def carried(self, state: Glm52State):
        """Nothing is overwritten chunk to chunk: every part of the state is appended (pure attention)."""
        return ()

    def with_carried(self, state: Glm52State, carried) -> Glm52State:
        return state

    def chunk_entries(self, params: dict, state: Glm52State, tokens: jax.Array, start, left_pad=None) -> dict:
        """The state rows that tokens [C] at positions start.. produce, reading (not writing) `state`:
        kv [layers, C, kv_row_dim], index_keys [F, C, Di] (the latter carry no gradient). Positions < left_pad
        (int32 [] or None) are a left-padded prompt's pads."""
        return _chunk(self.config, params, state, tokens, start, left_pad=left_pad)[1]

    def advance(self, params: dict, state: Glm52State, tokens: jax.Array, start,
                left_pad=None) -> tuple[jax.Array, Glm52State]:
        """`capture_chunk` that also returns the final-normed hidden states [C, D] of the tokens (decoding; the
        state must have room: `init_state(capacity)` with capacity > the last position written)."""
        h, entries, _ = _chunk(self.config, params, state, tokens, start, left_pad=left_pad)
        return rms_norm(h, params["final_norm"], self.config.rms_norm_eps), self.write_entries(state, entries, start)

    def init_tail(self, params: dict, state: Glm52State, capacity: int) -> Glm52State:
        """The decoding state after the prompt `state`: length 0, room for `capacity` decoded positions (kv [layers,
        capacity, Dk], index_keys [F, capacity, Di]); GLM carries nothing else."""
        return self.init_state(0, params["embed"].dtype, capacity=capacity)

    def decode(self, params: dict, state: Glm52State, tail: Glm52State, token, position, left_pad=None):
        """One token (int32 []) at `position` (traced; state.length <= position < state.length + tail capacity)
        after the prompt `state` (only read) and the tail's positions state.length..position-1 -> (final-normed
        hidden [1, D], the tail with the token's row and indexer keys at slot position - state.length). Equals
        `advance` on the prompt and tail concatenated; `jax.vmap` over (tail, token) decodes many branches with one
        read of the prompt cache. left_pad: the prompt's pads (never selected)."""
        c = self.config
        slot = position - state.length
        reader = DecodeReader(state, tail, slot, jnp.reshape(position, (1,)).astype(jnp.int32), left_pad)
        k = min(c.index_topk, state.length + tail.kv.shape[1])  # >= every visible key count, as `_chunk`'s
        h, entries, _ = decoder_layers(c, params["layers"], params["embed"][jnp.reshape(token, (1,))], reader, k)
        return rms_norm(h, params["final_norm"], c.rms_norm_eps), self.write_entries(tail, entries, slot)

    def write_entries(self, state: Glm52State, entries: dict, start) -> Glm52State:
        """Rows are written at positions start.. (in place)."""
        write = lambda cache, new: jax.lax.dynamic_update_slice_in_dim(cache, new.astype(cache.dtype), start, axis=1)
        return state.replace(kv=write(state.kv, entries["kv"]),
                             index_keys=write(state.index_keys, entries["index_keys"]))

    def read_entries(self, state: Glm52State, start, size: int) -> dict:
        """The transpose of `write_entries`: the rows of positions start..start+size-1 (used on cotangents)."""
        read = lambda cache: None if cache is None else jax.lax.dynamic_slice_in_dim(cache, start, size, axis=1)
        return {"kv": read(state.kv), "index_keys": read(state.index_keys)}
