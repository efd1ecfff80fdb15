"""The GLM-5.x model (`Glm52`): parameters (each layer group's leaves and their Hugging Face names), capture /
extend / decode, and the stages the engine's block-by-block backward runs on (blocks.py).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import traverse_util

from longstraw_jax.common.validation import check_tokens
from longstraw_jax.engine import layerwise
from longstraw_jax.models.base import CausalLM, Slot, state_capacity
from longstraw_jax.models.glm52.blocks import GlmBlocks, SegmentStage
from longstraw_jax.models.glm52.config import DENSE, FULL, Glm52Config, Glm52State
from longstraw_jax.models.glm52.layers import DecodeReader, decoder_chunk, decoder_layers
from longstraw_jax.models.glm52.mesh import Glm52Mesh
from longstraw_jax.ops.norms import rms_norm

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
        h, _, _ = decoder_chunk(self.config, params, state, tokens, state.length, remat, left_pad)
        return rms_norm(h, params["final_norm"], self.config.rms_norm_eps)

    @functools.partial(jax.jit, static_argnums=0)
    def _selection(self, params, tokens):
        return decoder_chunk(self.config, params, self.init_state(0, params["embed"].dtype), tokens, 0)[2]

    def decoder_layers(self, layers: dict, h: jax.Array, reader, k: int, remat: bool = False, by_layer: bool = False):
        """All layers over h [T, D], the prompt read through `reader` (a `PromptReader` or a sharded reader with the
        same methods): the layer code every engine runs (`decoder_layers`; by_layer when decoding)."""
        return decoder_layers(self.config, layers, h, reader, k, remat, by_layer)

    def mesh_adapter(self):
        """Capture, replay and prompt backward on a ("data", "seq") mesh: `models/glm52/mesh.py`."""
        return Glm52Mesh(self)

    # ----- block by block (longstraw_jax/engine/layerwise.py: the engine's backward) -----
    def block_stages(self) -> tuple[SegmentStage, ...]:
        """One `layerwise.Stage` per segment (a block = one repeat of its pattern), in layer order."""
        return tuple(SegmentStage(self.config, s, seg) for s, seg in enumerate(self.config.segments))

    def differentiable_state(self, state):
        """Every Glm52State in `state` (a Glm52State, a ShardedPromptState) with index_keys None: the indexer keys are
        read only by the top-k selection, which is not differentiable, so their cotangent is zero by construction
        and the state cotangent accumulator (`engine/replay.py`) has no buffer for them, nor does any block's vjp."""
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
        return decoder_chunk(self.config, params, state, tokens, start, left_pad=left_pad)[1]

    def advance(self, params: dict, state: Glm52State, tokens: jax.Array, start,
                left_pad=None) -> tuple[jax.Array, Glm52State]:
        """`capture_chunk` that also returns the final-normed hidden states [C, D] of the tokens (decoding; the
        state must have room: `init_state(capacity)` with capacity > the last position written)."""
        h, entries, _ = decoder_chunk(self.config, params, state, tokens, start, left_pad=left_pad)
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
        h, entries, _ = decoder_layers(c, params["layers"], params["embed"][jnp.reshape(token, (1,))], reader, k,
                                       by_layer=True)
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
