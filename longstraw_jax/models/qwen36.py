"""Qwen3.5 / Qwen3.6 dense hybrid (Qwen3.6-27B): Gated DeltaNet layers + gated full attention, 3:1.

Read next to docs/models.md section 1; each layer function names the subsection it implements.

Layout. Layers repeat a block pattern (`LLLF` for Qwen3.6: three `linear_attention` then one `full_attention`).
Parameters of each kind are stacked `[num_blocks, per_block, ...]` and the model scans over blocks, so compile time
does not grow with depth. Weights keep the transformers orientation `[out_features, in_features]`.

Execution. Everything is one function of (params, state, tokens):
- `capture` walks the prompt in chunks of `chunk_size`, writing each chunk's keys/values, conv tail and recurrent
  matrix into a preallocated `Qwen36State`; it never touches the LM head.
- `extend` continues after a state without modifying it: attention = (prompt cache) merged with (new tokens, causal).
- `forward` is `extend` from an empty state.
"""
from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct, traverse_util

from longstraw_jax.engine import layerwise
from longstraw_jax.models import qwen36_mesh as sharded
from longstraw_jax.models.base import CausalLM, Slot, check_config_fields, read_json_config, state_capacity
from longstraw_jax.ops import attention as attn_ops
from longstraw_jax.ops.conv import causal_depthwise_conv
from longstraw_jax.ops.dtypes import accum_dtype
from longstraw_jax.ops.gated_delta import gated_delta_rule_chunked, gated_delta_rule_sequential
from longstraw_jax.ops.mlp import linear, swiglu
from longstraw_jax.ops.norms import l2_normalise, rms_norm_1p, rms_norm_gated
from longstraw_jax.ops.rope import RopeConfig, apply_partial_rope, cos_sin, inverse_frequencies, rope_positions

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
    # Execution choices (not part of the checkpoint): attention key block and GDN core implementation.
    attention_block_size: int = 512
    gdn_impl: str = "chunked"
    gdn_chunk_size: int = 64

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
        if not errors and not unknown:
            try:
                self.block_pattern  # noqa: B018  (validates periodicity)
            except ValueError as e:
                errors.append(str(e))
        if errors:
            raise ValueError("invalid Qwen36Config: " + "; ".join(errors))

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


# ---------------------------------------------------------------------------------------------------------------
# Layers (pure functions of one layer's parameters)


def gdn_inputs(cfg: Qwen36Config, p: dict, x: jax.Array):
    """Input projections of the Gated DeltaNet mixer (1.5). x [T, D] -> (mixed [T, conv_dim] before the conv,
    z [T, Hv, dv], beta [T, Hv], g [T, Hv] float32 log-decay <= 0)."""
    t, hv, dv = x.shape[0], cfg.linear_num_value_heads, cfg.linear_value_head_dim
    mixed = linear(x, p["in_proj_qkv"])  # [T, conv_dim]: q | k | v, head-major
    z = linear(x, p["in_proj_z"]).reshape(t, hv, dv)
    beta = jax.nn.sigmoid(linear(x, p["in_proj_b"]))
    core = accum_dtype(x.dtype)  # the delta-rule core runs in float32 whatever the model dtype
    a = linear(x, p["in_proj_a"])
    g = -jnp.exp(p["A_log"].astype(core)) * jax.nn.softplus(a.astype(core) + p["dt_bias"].astype(core))
    return mixed, z, beta, g


def gdn_qkv(cfg: Qwen36Config, conv_out: jax.Array):
    """Conv output [T, conv_dim] (before the SiLU) -> q, k [T, Hv, dk] (l2-normalised float32, q scaled by
    dk**-0.5, expanded so value head j reads key head j // rep) and v [T, Hv, dv] (model dtype)."""
    t, hk, hv = conv_out.shape[0], cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    qkv = jax.nn.silu(conv_out)
    q = qkv[:, : cfg.key_dim].reshape(t, hk, dk)
    k = qkv[:, cfg.key_dim : 2 * cfg.key_dim].reshape(t, hk, dk)
    v = qkv[:, 2 * cfg.key_dim :].reshape(t, hv, dv)
    core = accum_dtype(conv_out.dtype)
    q = l2_normalise(q.astype(core)) * dk**-0.5
    k = l2_normalise(k.astype(core))
    return jnp.repeat(q, hv // hk, axis=1), jnp.repeat(k, hv // hk, axis=1), v


def gdn_core(cfg: Qwen36Config, q, k, v, g, beta, state):
    """The gated delta rule with the configured implementation: (o [T, Hv, dv'], state [Hv, dk, dv']) in float32.
    Linear in (v, state) jointly, so any value width dv' works (sharding/ appends identity columns). One token
    (decoding) takes the sequential rule whatever the configuration: the chunked one would pad it to a chunk."""
    if cfg.gdn_impl == "chunked" and q.shape[0] > 1:
        return gated_delta_rule_chunked(q, k, v, g, beta, state, cfg.gdn_chunk_size)
    return gated_delta_rule_sequential(q, k, v, g, beta, state)


def gdn_output(cfg: Qwen36Config, p: dict, o: jax.Array, z: jax.Array, dtype) -> jax.Array:
    """Core output o [T, Hv, dv] -> y [T, D]: gated RMSNorm with z, then out_proj (1.5)."""
    o = rms_norm_gated(o.astype(dtype), z, p["norm"], cfg.rms_norm_eps)
    return linear(o.reshape(o.shape[0], -1), p["out_proj"])


def real_rows(reader) -> jax.Array | None:
    """bool [T]: which of the reader's rows (at reader.positions) are not a left-padded prompt's pads (positions >=
    reader.left_pad); None when the prompt has no padding (reader.left_pad is None: nothing is masked)."""
    return None if reader.left_pad is None else reader.positions >= reader.left_pad


def gated_deltanet(cfg: Qwen36Config, p: dict, x: jax.Array, reader, j):
    """Gated DeltaNet mixer (1.5) of linear layer j of the block. x [T, D] at reader.positions.

    Rows at positions < reader.left_pad (a left-padded prompt's pads) get zero conv input, q, k, v, beta and decay
    g = 0: the conv window and the recurrent state after them are those of the unpadded prompt, exactly, and no
    cotangent reaches them from the real rows.

    The carried state before the tokens (conv tail [K-1, conv_dim], recurrent matrix [Hv, dk, dv] float32) is read
    through `reader.conv` and `reader.delta_rule`. Returns (y [T, D], (new conv tail, new recurrent matrix)).
    """
    mixed, z, beta, g = reader.rowwise(lambda x: gdn_inputs(cfg, p, x), x)
    real = real_rows(reader)
    if real is not None:  # pads: zero conv input, no write, no decay, so the state passes them unchanged
        mixed = jnp.where(real[:, None], mixed, 0)
    conv_out, tail = reader.conv(mixed, p["conv1d"], j)
    q, k, v = reader.rowwise(lambda c: gdn_qkv(cfg, c), conv_out)
    if real is not None:
        q, k, v = (jnp.where(real[:, None, None], a, 0) for a in (q, k, v))
        beta, g = (jnp.where(real[:, None], a, 0) for a in (beta, g))
    o, state = reader.delta_rule(functools.partial(gdn_core, cfg), q, k, v, g, beta, j)
    return reader.rowwise(lambda o, z: gdn_output(cfg, p, o, z, x.dtype), o, z), (tail, state)


def attention_inputs(cfg: Qwen36Config, p: dict, x: jax.Array, positions: jax.Array):
    """Projections of gated attention (1.6, 1.7). x [T, D]; positions int [T] -> (q [T, Hq, hd], gate [T, Hq*hd],
    k [T, Hkv, hd], v [T, Hkv, hd]); q and k after their norms and RoPE (k is what the cache stores)."""
    t, hq, hkv, hd = x.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    qg = linear(x, p["q_proj"]).reshape(t, hq, 2 * hd)  # per head [query | gate]
    q, gate = qg[..., :hd], qg[..., hd:].reshape(t, hq * hd)
    q = rms_norm_1p(q, p["q_norm"], cfg.rms_norm_eps)
    k = rms_norm_1p(linear(x, p["k_proj"]).reshape(t, hkv, hd), p["k_norm"], cfg.rms_norm_eps)
    v = linear(x, p["v_proj"]).reshape(t, hkv, hd)
    inv_freq, scaling = inverse_frequencies(cfg.rope, cfg.rotary_dim, cfg.max_position_embeddings)
    cos, sin = cos_sin(positions, inv_freq, scaling, x.dtype)
    return apply_partial_rope(q, cos, sin), gate, apply_partial_rope(k, cos, sin), v


def attention_output(cfg: Qwen36Config, p: dict, out: jax.Array, gate: jax.Array, dtype) -> jax.Array:
    """Attention output over all visible keys out [T, Hq, hd] -> y [T, D]: output gate sigmoid(gate), then o_proj
    (1.6)."""
    return linear(out.astype(dtype).reshape(gate.shape) * jax.nn.sigmoid(gate), p["o_proj"])


def gated_attention(cfg: Qwen36Config, p: dict, x: jax.Array, reader, j):
    """Gated full attention (1.6, 1.7) of full layer j of the block. x [T, D] at reader.positions.

    `reader.attend` gives softmax attention over every earlier position (the prompt cache) and, causally, over the
    tokens themselves. Returns (y [T, D], (keys [T, Hkv, hd] after norm + RoPE, values [T, Hkv, hd])): what the
    caller caches.
    """
    positions = rope_positions(reader.positions, reader.left_pad)  # real tokens at the unpadded prompt's positions
    q, gate, k, v = reader.rowwise(lambda x, pos: attention_inputs(cfg, p, x, pos), x, positions)
    attended = reader.attend(q, k, v, j, scale=cfg.head_dim**-0.5, block_size=cfg.attention_block_size)
    return reader.rowwise(lambda out, gate: attention_output(cfg, p, out, gate, x.dtype), attended.out, gate), (k, v)


class PromptReader(NamedTuple):
    """How a layer of one block reads what came before its tokens, on one device: `state` at positions <
    `cache_length` (None: every cached position), the carried GDN state as it is. tokens sit at `positions` [T]
    (contiguous). `prefix` locates the block in the state: (b,) in the whole state, () in a block's slice of it.
    left_pad (int32 [] or None): the prompt's pad positions 0..left_pad-1 are never attended (and `gated_deltanet`
    masks the rows at them).

    The sequence-parallel engine (`models/qwen36_mesh.py`) passes readers with the same methods that work on a
    shard's part of the prompt, so the layer code above is shared: `layer_params` (FSDP all-gathers there),
    `rowwise` (blocks of rows there), `conv` (a halo from the previous segment), `delta_rule` (the affine fold
    across segments), `attend` (ring / all-gather, log-sum-exp across shards).
    """

    state: Qwen36State
    prefix: tuple
    positions: jax.Array
    cache_length: Any = None
    left_pad: Any = None

    def layer_params(self, p: dict, group: str) -> dict:
        """One layer's parameters, whole (identity here)."""
        return p

    def rowwise(self, fn, *xs):
        """fn(*xs) for a row-wise fn (row t of every output depends only on row t of the inputs)."""
        return fn(*xs)

    def conv(self, mixed: jax.Array, weight: jax.Array, j):
        """Causal conv of mixed [T, conv_dim] after layer j's carried tail -> (out [T, conv_dim], new tail [K-1,
        conv_dim] in the state's dtype)."""
        out, tail = causal_depthwise_conv(mixed, weight, self.state.conv[self.prefix + (j,)])
        return out, tail.astype(self.state.conv.dtype)

    def delta_rule(self, core, q, k, v, g, beta, j):
        """core(q, k, v, g, beta, S_0) from layer j's carried recurrent matrix S_0 -> (o [T, Hv, dv], S_T float32)."""
        return core(q, k, v, g, beta, self.state.recurrent[self.prefix + (j,)])

    def attend(self, q, k, v, j, *, scale: float, block_size: int) -> attn_ops.Attended:
        """q [T, Hq, hd] over full layer j's cached keys/values, merged by log-sum-exp with causal attention over
        the tokens' own k, v [T, Hkv, hd]."""
        common = dict(q_positions=self.positions, scale=scale, block_size=block_size, left_pad=self.left_pad)
        cached = attn_ops.attend(q, self.state.keys, self.state.values, k_offset=0, causal=False,
                                 kv_length=self.cache_length, kv_index=self.prefix + (j,), **common)
        new = attn_ops.attend(q, k, v, k_offset=self.positions[0], causal=True, **common)
        return attn_ops.merge(cached, new)


class DecodeReader(NamedTuple):
    """How a layer reads what came before one decoded token, on one device: the prompt `state` (read-only, every
    position < state.length) and, through `local` (the tail's `PromptReader`, cache_length = the token's slot), the
    decoded positions state.length.. before the token and the carried GDN state. The sampler keeps the prompt
    apart from the tails so that many branches decode together over one prompt cache (`Qwen36.decode`).
    Attention is the log-sum-exp merge of the prompt cache (its pads < left_pad hidden) with local.attend (the tail,
    then the token itself)."""

    state: Qwen36State
    local: PromptReader
    left_pad: Any = None

    @property
    def positions(self):
        return self.local.positions

    def layer_params(self, p: dict, group: str) -> dict:
        return p

    def rowwise(self, fn, *xs):
        return fn(*xs)

    def conv(self, mixed, weight, j):
        return self.local.conv(mixed, weight, j)

    def delta_rule(self, core, q, k, v, g, beta, j):
        return self.local.delta_rule(core, q, k, v, g, beta, j)

    def attend(self, q, k, v, j, *, scale: float, block_size: int) -> attn_ops.Attended:
        prompt = attn_ops.attend(q, self.state.keys, self.state.values, k_offset=0, causal=False,
                                 kv_length=self.state.length, kv_index=self.local.prefix + (j,),
                                 q_positions=self.positions, scale=scale, block_size=block_size,
                                 left_pad=self.left_pad)
        return attn_ops.merge(prompt, self.local.attend(q, k, v, j, scale=scale, block_size=block_size))


def _runs(pattern: tuple[str, ...]) -> list[tuple[str, int, int]]:
    """Split a block pattern into runs of one kind: LLLF -> [(linear, 0, 3), (full, 0, 1)] as (kind, first, count),
    where `first` indexes the layers of that kind within the block."""
    runs, seen = [], {LINEAR: 0, FULL: 0}
    for kind in pattern:
        if runs and runs[-1][0] == kind:
            runs[-1][2] += 1
        else:
            runs.append([kind, seen[kind], 1])
        seen[kind] += 1
    return [tuple(r) for r in runs]


def _layer(cfg: Qwen36Config, kind: str, p: dict, h: jax.Array, reader, j):
    """Decoder layer (1.3): h + mixer(norm(h)), then h + mlp(norm(h)), for layer j of its kind in the block.
    Returns (h, the layer's new state entry): (conv tail, recurrent matrix) for a linear layer, (keys, values) of
    the new tokens for a full one."""
    eps = cfg.rms_norm_eps
    p = reader.layer_params(p, GROUP[kind])
    x = reader.rowwise(lambda h: rms_norm_1p(h, p["input_norm"], eps), h)
    y, entry = (gated_deltanet if kind == LINEAR else gated_attention)(cfg, p, x, reader, j)
    return reader.rowwise(lambda h, y: (h + y) + swiglu(p["mlp"], rms_norm_1p(h + y, p["post_norm"], eps)), h, y), entry


def _block(cfg: Qwen36Config, bp: dict, h: jax.Array, reader):
    """One repeat of `block_pattern` (e.g. LLLF) over hidden h [T, D]; the prompt is only read, through `reader`.
    bp: the block's parameters ({"linear": leaves [per_block, ...], "full": ...}).

    Consecutive layers of one kind run under `lax.scan` (one trace per run, not per layer). Returns h and the
    block's new state entries per kind, stacked over that kind's layers: {"linear": (tails, mats), "full": (keys,
    values)} (None for a kind the pattern lacks); recurrent matrices float32.
    """
    entries = {LINEAR: [], FULL: []}
    for kind, first, count in _runs(cfg.block_pattern):
        group = bp[GROUP[kind]]

        def step(h, j, kind=kind, group=group):
            return _layer(cfg, kind, jax.tree.map(lambda a: a[j], group), h, reader, j)

        if count == 1:
            h, entry = step(h, first)
            entry = jax.tree.map(lambda a: a[None], entry)
        else:
            h, entry = jax.lax.scan(step, h, first + jnp.arange(count))
        entries[kind].append(entry)
    return h, {GROUP[kind]: tuple(jnp.concatenate(parts) for parts in zip(*runs)) if runs else None
               for kind, runs in entries.items()}


def _layers(cfg: Qwen36Config, params: dict, state: Qwen36State, tokens: jax.Array, start, cache_length,
            remat: bool = False, left_pad=None):
    """All layers over tokens [T] at positions start.., reading `state` (a scan const: never copied or written);
    positions < left_pad (int32 [] or None) are a left-padded prompt's pads (`PromptReader`).
    Returns (h [T, D] before the final norm, new state entries stacked [num_blocks, per_block, ...]).

    remat: under autodiff keep only each block's input h [T, D] and recompute the block in the backward pass, so
    activation memory is one block's, not all layers' (costs one more forward of each block).
    """
    positions = start + jnp.arange(tokens.shape[0], dtype=jnp.int32)

    def body(h, xs):
        bp, b = xs
        return _block(cfg, bp, h, PromptReader(state, (b,), positions, cache_length, left_pad))

    body = jax.checkpoint(body) if remat else body
    return jax.lax.scan(body, params["embed"][tokens], (params["blocks"], jnp.arange(cfg.num_blocks)))


# ---------------------------------------------------------------------------------------------------------------
# Hugging Face names (docs/models.md 1.9): our leaf inside a layer of each kind -> name under `model.layers.{i}.`

_HF_LAYER_KEYS = {
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
for _kind in _HF_LAYER_KEYS.values():
    _kind.update({f"mlp/{n}": f"mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")})
_HF_TOP_KEYS = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight", "lm_head": "lm_head.weight"}


# ---------------------------------------------------------------------------------------------------------------
# The model


@dataclasses.dataclass(frozen=True)
class Qwen36(CausalLM):
    """Frozen, hashable: pass it as a static argument to `jax.jit`. Methods are pure functions of params."""

    config: Qwen36Config
    state_type = Qwen36State  # what `init_state` / `capture` return

    # ----- parameters -----
    def init(self, key: jax.Array, dtype=jnp.float32) -> dict:
        """Random parameters (normal(0, 0.02) matrices as in transformers; norms at their identity values)."""
        c = self.config
        nb, nl, nf = c.num_blocks, c.linear_per_block, c.full_per_block
        keys = iter(jax.random.split(key, 32))

        def normal(*shape, std=0.02):
            return (std * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)

        def zeros(*shape):
            return jnp.zeros(shape, dtype)

        def mlp_params(*lead):
            return {"gate_proj": normal(*lead, c.intermediate_size, c.hidden_size),
                    "up_proj": normal(*lead, c.intermediate_size, c.hidden_size),
                    "down_proj": normal(*lead, c.hidden_size, c.intermediate_size)}

        linear = {
            "input_norm": zeros(nb, nl, c.hidden_size), "post_norm": zeros(nb, nl, c.hidden_size),
            "in_proj_qkv": normal(nb, nl, c.conv_dim, c.hidden_size),
            "in_proj_z": normal(nb, nl, c.value_dim, c.hidden_size),
            "in_proj_b": normal(nb, nl, c.linear_num_value_heads, c.hidden_size),
            "in_proj_a": normal(nb, nl, c.linear_num_value_heads, c.hidden_size),
            "conv1d": normal(nb, nl, c.conv_dim, c.linear_conv_kernel_dim, std=c.linear_conv_kernel_dim**-0.5),
            "dt_bias": jnp.ones((nb, nl, c.linear_num_value_heads), dtype),
            "A_log": jnp.log(jax.random.uniform(next(keys), (nb, nl, c.linear_num_value_heads), jnp.float32,
                                                1e-2, 16.0)).astype(dtype),
            "norm": jnp.ones((nb, nl, c.linear_value_head_dim), dtype),
            "out_proj": normal(nb, nl, c.hidden_size, c.value_dim),
            "mlp": mlp_params(nb, nl),
        }
        full = {
            "input_norm": zeros(nb, nf, c.hidden_size), "post_norm": zeros(nb, nf, c.hidden_size),
            "q_proj": normal(nb, nf, 2 * c.num_attention_heads * c.head_dim, c.hidden_size),
            "k_proj": normal(nb, nf, c.num_key_value_heads * c.head_dim, c.hidden_size),
            "v_proj": normal(nb, nf, c.num_key_value_heads * c.head_dim, c.hidden_size),
            "o_proj": normal(nb, nf, c.hidden_size, c.num_attention_heads * c.head_dim),
            "q_norm": zeros(nb, nf, c.head_dim), "k_norm": zeros(nb, nf, c.head_dim),
            "mlp": mlp_params(nb, nf),
        }
        params = {"embed": normal(c.vocab_size, c.hidden_size), "blocks": {"linear": linear, "full": full},
                  "final_norm": zeros(c.hidden_size)}
        if not c.tie_word_embeddings:
            params["lm_head"] = normal(c.vocab_size, c.hidden_size)
        return params

    # ----- Hugging Face checkpoint layout (used by models/hf.py) -----
    # `model.language_model.*` is the published multimodal checkpoint, `model.*` what Qwen3_5ForCausalLM saves.
    hf_skipped_prefixes = ("mtp.", "model.visual.")
    hf_prefix_aliases = (("model.language_model.", "model."),)

    def hf_layout(self) -> dict:
        """HF name -> Slot(path, index, hf_shape). conv1d is [conv_dim, K] here and [conv_dim, 1, K] in PyTorch."""
        c = self.config
        flat = traverse_util.flatten_dict(jax.eval_shape(self.init, jax.random.key(0)), sep="/")
        layout = {name: Slot(top, (), flat[top].shape) for top, name in _HF_TOP_KEYS.items() if top in flat}
        for b in range(c.num_blocks):
            counters = {LINEAR: 0, FULL: 0}
            for offset, kind in enumerate(c.block_pattern):
                j, counters[kind] = counters[kind], counters[kind] + 1
                for leaf, suffix in _HF_LAYER_KEYS[kind].items():
                    path = f"blocks/{GROUP[kind]}/{leaf}"
                    shape = flat[path].shape[2:]
                    hf_shape = (shape[0], 1, shape[1]) if leaf == "conv1d" else shape
                    layout[f"model.layers.{b * len(c.block_pattern) + offset}.{suffix}"] = Slot(path, (b, j), hf_shape)
        return layout

    def init_state(self, length: int, dtype=jnp.float32, capacity: int | None = None) -> Qwen36State:
        """Zero state of `length` valid prompt positions (length 0: the state before any token), its keys/values
        sized `capacity` (default `length`; more leaves room to decode after the prompt: positions >= length are
        never read by `extend`, `branch_grads` or `chunk_grads`)."""
        c = self.config
        nb, nl, nf = c.num_blocks, c.linear_per_block, c.full_per_block
        kv_shape = (nb, nf, state_capacity(length, capacity), c.num_key_value_heads, c.head_dim)
        return Qwen36State(
            conv=jnp.zeros((nb, nl, c.linear_conv_kernel_dim - 1, c.conv_dim), dtype),
            recurrent=jnp.zeros((nb, nl, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim),
                                accum_dtype(dtype)),
            keys=jnp.zeros(kv_shape, dtype), values=jnp.zeros(kv_shape, dtype), length=length,
        )

    # ----- pure implementations (public entry points: models/base.py CausalLM) -----
    @functools.partial(jax.jit, static_argnums=0, static_argnames="remat")
    def _extend_hidden(self, params, state, tokens, remat: bool = False, left_pad=None):
        h, _ = _layers(self.config, params, state, tokens, state.length, cache_length=state.length, remat=remat,
                       left_pad=left_pad)
        return self.final_norm(params, h)

    # ----- block protocol (longstraw_jax/layerwise.py: the engine's block-by-block backward) -----
    @property
    def num_blocks(self) -> int:
        return self.config.num_blocks

    def embed(self, params: dict, tokens: jax.Array) -> jax.Array:
        """tokens [T] -> h [T, D] (the input of block 0)."""
        return params["embed"][tokens]

    def block_params(self, params: dict) -> dict:
        """The per-block parameters, every leaf stacked [num_blocks, ...]."""
        return params["blocks"]

    def with_block_params(self, params: dict, blocks: dict) -> dict:
        return dict(params, blocks=blocks)

    def block(self, bp: dict, h: jax.Array, state_block: Qwen36State, positions: jax.Array, cache_length,
              left_pad=None):
        """One block on h [T, D] at `positions`, reading `state_block` (every state leaf indexed at the block, e.g.
        keys [nf, P, Hkv, hd]), pads < left_pad masked. Returns (h, the block's entries as `chunk_entries` gives
        them, minus the block axis)."""
        return _block(self.config, bp, h, PromptReader(state_block, (), positions, cache_length, left_pad))

    def block_with_reader(self, bp: dict, h: jax.Array, reader) -> tuple[jax.Array, dict]:
        """One block on h [T, D], the prompt read through `reader` (a `PromptReader` or a sharded reader with the
        same methods): the layer code every engine runs. Returns (h, {"linear": ..., "full": ...} entries)."""
        return _block(self.config, bp, h, reader)

    def prompt_reader(self, state: Qwen36State, prefix: tuple, positions: jax.Array, cache_length=None,
                      left_pad=None):
        """The one-device reader of `state` for a block at `prefix` ((b,), or () in a block's slice)."""
        return PromptReader(state, prefix, positions, cache_length, left_pad)

    def branch_grads(self, params, state, tokens, head, grads, acc, left_pad=None):
        """One replayed branch, backpropagated block by block (`layerwise.branch_grads`)."""
        return layerwise.branch_grads(self, params, state, tokens, head, grads, acc, left_pad=left_pad)

    def chunk_grads(self, params, state, tokens, start, grads, acc, left_pad=None):
        """One prompt chunk of exact mode's backward, block by block (`layerwise.chunk_grads`)."""
        return layerwise.chunk_grads(self, params, state, tokens, start, grads, acc, left_pad=left_pad)

    def mesh_adapter(self):
        """Capture, replay and prompt backward on a ("data", "seq") mesh: `models/qwen36_mesh.py`."""
        return sharded.Qwen36Mesh(self)

    def final_norm(self, params: dict, h: jax.Array) -> jax.Array:
        return rms_norm_1p(h, params["final_norm"], self.config.rms_norm_eps)

    def carried(self, state: Qwen36State):
        """The part of the state each chunk overwrites (conv tails, recurrent matrices); KV is appended."""
        return (state.conv, state.recurrent)

    def with_carried(self, state: Qwen36State, carried) -> Qwen36State:
        conv, recurrent = carried
        return state.replace(conv=conv, recurrent=recurrent)

    def chunk_entries(self, params: dict, state: Qwen36State, tokens: jax.Array, start, left_pad=None) -> dict:
        """The state entries that tokens [C] at positions start.. produce, reading (not writing) `state`:
        conv [nb, nl, K-1, conv_dim], recurrent [nb, nl, Hv, dk, dv], keys/values [nb, nf, C, Hkv, hd].
        left_pad (int32 [] or None): positions < left_pad are the prompt's left pads (masked)."""
        return self._chunk(params, state, tokens, start, left_pad)[1]

    def advance(self, params: dict, state: Qwen36State, tokens: jax.Array, start,
                left_pad=None) -> tuple[jax.Array, Qwen36State]:
        """`capture_chunk` that also returns the final-normed hidden states [C, D] of the tokens: one decoding step
        (the state must have room: `init_state(capacity)` with capacity > the last position written)."""
        h, entries = self._chunk(params, state, tokens, start, left_pad)
        return self.final_norm(params, h), self.write_entries(state, entries, start)

    def init_tail(self, params: dict, state: Qwen36State, capacity: int) -> Qwen36State:
        """The decoding state after the prompt `state`: length 0, room for `capacity` decoded positions (keys / values
        [nb, nf, capacity, Hkv, hd]) and the prompt's carried GDN state (conv tails, recurrent matrices)."""
        tail = self.init_state(0, params["embed"].dtype, capacity=capacity)
        return self.with_carried(tail, self.carried(state))

    def decode(self, params: dict, state: Qwen36State, tail: Qwen36State, token, position, left_pad=None):
        """One token (int32 []) at `position` (traced; state.length <= position < state.length + tail capacity)
        after the prompt `state` (only read) and the tail's positions state.length..position-1 -> (final-normed
        hidden [1, D], the tail with the token's keys / values at slot position - state.length and its carried GDN
        state advanced). Equals `advance` on the prompt and tail concatenated; `jax.vmap` over (tail, token) decodes
        many branches with one read of the prompt cache. left_pad: the prompt's pads (never attended)."""
        slot = position - state.length
        positions = jnp.reshape(position, (1,)).astype(jnp.int32)

        def body(h, xs):
            bp, b = xs
            return _block(self.config, bp, h, DecodeReader(state, PromptReader(tail, (b,), positions, slot), left_pad))

        h, entries = jax.lax.scan(body, self.embed(params, jnp.reshape(token, (1,))),
                                  (params["blocks"], jnp.arange(self.config.num_blocks)))
        return self.final_norm(params, h), self.write_entries(tail, entries, slot)

    def _chunk(self, params, state, tokens, start, left_pad=None):
        return _layers(self.config, params, state, tokens, start, cache_length=start, left_pad=left_pad)

    def write_entries(self, state: Qwen36State, entries: dict, start) -> Qwen36State:
        """Carried parts are replaced; keys/values are written at positions start.. (in place). Works on the whole
        state and on one block's slice of it (positions are axis -3 of keys/values either way)."""
        if entries["linear"] is not None:
            state = state.replace(conv=entries["linear"][0], recurrent=entries["linear"][1])
        if entries["full"] is not None:
            write = lambda cache, new: jax.lax.dynamic_update_slice_in_dim(cache, new.astype(cache.dtype), start,
                                                                               cache.ndim - 3)
            keys, values = entries["full"]
            state = state.replace(keys=write(state.keys, keys), values=write(state.values, values))
        return state

    def read_entries(self, state: Qwen36State, start, size: int) -> dict:
        """The transpose of `write_entries`: the entries of positions start..start+size-1 (used on cotangents)."""
        c = self.config
        read = lambda cache: jax.lax.dynamic_slice_in_dim(cache, start, size, axis=cache.ndim - 3)
        return {"linear": (state.conv, state.recurrent) if c.linear_per_block else None,
                "full": (read(state.keys), read(state.values)) if c.full_per_block else None}
