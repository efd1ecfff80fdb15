"""The Qwen3.5 / Qwen3.6 model (`Qwen36`): parameters, Hugging Face names, capture / extend / decode, and the block
protocol the engine's block-by-block backward runs on (engine/layerwise.py).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import traverse_util

from longstraw_jax.engine import layerwise
from longstraw_jax.models.base import CausalLM, Slot, state_capacity
from longstraw_jax.models.qwen36.config import FULL, GROUP, LINEAR, Qwen36Config, Qwen36State
from longstraw_jax.models.qwen36.layers import DecodeReader, PromptReader, decoder_block, decoder_layers
from longstraw_jax.models.qwen36.mesh import Qwen36Mesh
from longstraw_jax.ops.dtypes import accum_dtype
from longstraw_jax.ops.norms import rms_norm_1p

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
        h, _ = decoder_layers(self.config, params, state, tokens, state.length, cache_length=state.length, remat=remat,
                       left_pad=left_pad)
        return self.final_norm(params, h)

    # ----- block protocol (longstraw_jax/engine/layerwise.py: the engine's block-by-block backward) -----
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
        return decoder_block(self.config, bp, h, PromptReader(state_block, (), positions, cache_length, left_pad))

    def block_with_reader(self, bp: dict, h: jax.Array, reader, prefix: tuple = ()) -> tuple[jax.Array, dict]:
        """One block on h [T, D], the prompt read through `reader` (a `PromptReader` or a sharded reader with the
        same methods): the layer code every engine runs. Returns (h, {"linear": ..., "full": ...} entries). prefix
        (b,): bp is the whole stack of blocks, block b's read layer by layer (`decoder_block`)."""
        return decoder_block(self.config, bp, h, reader, prefix)

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
        """Capture, replay and prompt backward on a ("data", "seq") mesh: `models/qwen36/mesh.py`."""
        return Qwen36Mesh(self)

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
        many branches with one read of the prompt cache. left_pad: the prompt's pads (never attended). The tail's GDN
        states ride in the block scan's carry, block b's written in place (stacked as the scan's outputs, they were
        copied into the tail's layout at every step: under `jax.vmap` a per-branch cost). The scan runs over block
        numbers, each layer's weights sliced once from the whole stack (`decoder_block`'s prefix)."""
        slot = position - state.length
        positions = jnp.reshape(position, (1,)).astype(jnp.int32)
        as_stored = jax.default_backend() == "cpu"  # `ops.attention.attend`'s heads_as_stored: measured on XLA:CPU

        def body(carry, b):
            h, carried = carry
            local = PromptReader(self.with_carried(tail, carried), (b,), positions, slot, heads_as_stored=as_stored)
            reader = DecodeReader(state, local, left_pad)
            h, entries = decoder_block(self.config, params["blocks"], h, reader, (b,))
            if entries["linear"] is not None:  # block b's GDN states, written in place into the carried ones
                carried = tuple(c.at[b].set(new.astype(c.dtype)) for c, new in zip(carried, entries["linear"]))
            return (h, carried), entries["full"]

        (h, carried), full = jax.lax.scan(body, (self.embed(params, jnp.reshape(token, (1,))), self.carried(tail)),
                                          jnp.arange(self.config.num_blocks))
        return self.final_norm(params, h), self.write_entries(self.with_carried(tail, carried),
                                                              {"linear": None, "full": full}, slot)

    def _chunk(self, params, state, tokens, start, left_pad=None):
        return decoder_layers(self.config, params, state, tokens, start, cache_length=start, left_pad=left_pad)

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
