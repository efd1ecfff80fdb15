"""GLM-5.x's layers as pure functions of one layer's parameters (docs/models.md 2.4-2.10: the DSA indexer, MLA
attention in the absorbed form, the MoE), the readers through which a layer sees the prompt state (capture,
replay, decoding), and the scans over a segment's repeats and over the whole layer stack.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from longstraw_jax.models.glm52 import mesh_forward
from longstraw_jax.models.glm52.config import FULL, Glm52Config, Glm52State, Segment
from longstraw_jax.ops import attention as attn_ops
from longstraw_jax.ops.dsa import merge_candidates, select_topk, topk_over_keys
from longstraw_jax.ops.dtypes import at_least_f32
from longstraw_jax.ops.lora import materialize
from longstraw_jax.ops.mla import sparse_latent_attention, sparse_latent_attention_partial
from longstraw_jax.ops.mlp import linear, swiglu
from longstraw_jax.ops.moe import decoding_swiglu, grouped_swiglu, route
from longstraw_jax.ops.norms import layer_norm, rms_norm
from longstraw_jax.ops.rope import RopeConfig, apply_rope_interleaved, cos_sin, inverse_frequencies, rope_positions

LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: the constructor default, not rms_norm_eps (docs/models.md 2.4)
INDEXER_NORM_EPS = 1e-6  # indexer k_norm LayerNorm
HIGHEST = jax.lax.Precision.HIGHEST
def rope_tables(c: Glm52Config, positions: jax.Array, dtype):
    """cos, sin [T, qk_rope_head_dim] (default RoPE over the rope slice; docs/models.md 2.7), in the model dtype."""
    inv_freq, scaling = inverse_frequencies(RopeConfig(theta=c.rope_theta), c.qk_rope_head_dim,
                                            c.max_position_embeddings)
    return cos_sin(positions, inv_freq, scaling, dtype)


class PromptReader(NamedTuple):
    """How a layer reads what came before its tokens, on one device: `state` at positions < start (docs/models.md 2.6,
    2.8). tokens sit at `positions` [T] = start + arange(T). The sequence-parallel engine (`models/glm52/mesh.py`)
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
        all E experts here (expert-parallel on a mesh: `sharding/experts.py`)."""
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
                                       block_size=c.query_block_size, kernels=c.kernels)


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
        """One token's experts (`decoding_swiglu`: gathered on a CPU, the grouped matmul elsewhere)."""
        return decoding_swiglu(x, experts, weights, p["experts_gate"], p["experts_up"], p["experts_down"])

    def select(self, c: Glm52Config, q, w, keys, full, k: int) -> jax.Array:
        common, length = mesh_forward.topk_common(c, k), self.state.length
        slots = jnp.arange(self.state.index_keys.shape[1], dtype=jnp.int32)
        slots = jnp.where(slots < length, slots, jnp.iinfo(jnp.int32).max)  # never visible past the prompt
        prompt = topk_over_keys(q, w, jax.lax.stop_gradient(self.state.index_keys), slots, self.positions,
                                layer=full, left_pad=self.left_pad, **common)
        own = mesh_forward.tail_candidates(q, w, keys, full, self.tail, self.slot, length, self.positions, common)
        return merge_candidates(*(jnp.concatenate(x, axis=-1) for x in zip(prompt, own)), k)[1]

    def attend(self, c: Glm52Config, q_abs, rows, layer, selected) -> jax.Array:
        common, length = mesh_forward.attend_common(c), self.state.length
        in_prompt = jnp.where((selected >= 0) & (selected < length), selected, -1)
        prompt = sparse_latent_attention_partial(q_abs, self.state.kv, layer, rows, in_prompt,
                                                 self.state.kv.shape[1], **common)
        own = mesh_forward.tail_partial(q_abs, rows, layer, jnp.where(selected >= length, selected - length, -1),
                                   self.tail, self.slot, common)
        return attn_ops.merge(prompt, own).out


def indexer(c: Glm52Config, p: dict, x, q_resid, cos, sin, reader, full, k: int):
    """DSA lightning indexer (2.8) of full layer number `full`: returns (selected int32 [T, k], this chunk's indexer
    keys [T, index_head_dim]). Runs without gradient: its inputs are stop_gradient-ed (selection is discrete; the
    policy loss gives the indexer no gradient, as transformers' `torch.no_grad()`)."""
    p, x, q_resid = jax.lax.stop_gradient((p, x, q_resid))
    t, heads, dim = x.shape[0], c.index_n_heads, c.index_head_dim
    q = apply_rope_interleaved(linear(q_resid, p["wq_b"], HIGHEST).reshape(t, heads, dim), cos, sin)
    key = layer_norm(linear(x, p["wk"], HIGHEST), p["k_norm"], p["k_norm_bias"], INDEXER_NORM_EPS)
    key = apply_rope_interleaved(key[:, None], cos, sin)[:, 0]
    w = jnp.einsum("td,hd->th", at_least_f32(x), at_least_f32(p["weights_proj"]), precision=HIGHEST) * heads**-0.5
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
    cos, sin = rope_tables(c, rope_positions(reader.positions, reader.left_pad), x.dtype)  # pads: shifted
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


def decoder_layer(c: Glm52Config, p: dict, h, selected, reader, layer, full):
    """Decoder layer (2.5): h + attn(norm(h)), then h + mlp(norm(h)). Returns (h, selected, rows, index key)."""
    y, rows, index_key, selected = mla_attention(c, p["attn"], rms_norm(h, p["input_norm"], c.rms_norm_eps),
                                                 reader, layer, full, selected)
    h = h + y
    x = rms_norm(h, p["post_norm"], c.rms_norm_eps)
    return h + (moe(c, p["mlp"], x, reader) if "router" in p["mlp"] else swiglu(p["mlp"], x)), selected, rows, index_key


def group_runs(pattern: tuple[str, ...]) -> list[tuple[str, int, int, int]]:
    """Runs of one group in a pattern, as (group, position in pattern, index within the group, count)."""
    runs, seen = [], {}
    for pos, group in enumerate(pattern):
        if runs and runs[-1][0] == group:
            runs[-1][3] += 1
        else:
            runs.append([group, pos, seen.get(group, 0), 1])
        seen[group] = seen.get(group, 0) + 1
    return [tuple(r) for r in runs]


def full_count(groups) -> int:
    return sum(g.startswith(FULL) for g in groups)


def pattern_repeat(c: Glm52Config, s: int, seg: Segment, rp: dict, carry, reader, layer0, full0, remat=False,
                   prefix: tuple = ()):
    """One repeat of segment `s`'s pattern over carry (h [T, D], selected [T, k]): a scan over each run of one group.
    rp: the repeat's parameters (leaves [per_pattern, ...] per group); with prefix (r,), the segment's (leaves
    [repeats, per_pattern, ...]), of which repeat r's layers are read one at a time (decoding: see
    `decoder_layers`). layer0 / full0: where the repeat's first layer and first full layer sit in the cache `reader`
    reads (in the whole state: their global numbers; in one repeat's slice of it, `SegmentStage`: 0). Returns (carry,
    (rows [plen, T, kv_row_dim], index keys [full per repeat, T, Di] or None, the full layers' selections [full per
    repeat, T, k] or None))."""
    outputs = []
    for group, pos, j, count in group_runs(seg.pattern):
        def step(carry, xs, layer=layer0 + pos, full=full0 + full_count(seg.pattern[:pos]), group=group, j=j):
            lp, i = xs if not prefix else (jax.tree.map(lambda a: a[prefix + (j + xs,)], rp[group]), xs)
            lp = reader.layer_params(lp, s, group)
            h, selected, rows, key = decoder_layer(c, lp, *carry, reader, layer + i, full + i)
            return (h, selected), (rows, key, selected if key is not None else None)

        xs = jnp.arange(count)
        if not prefix:
            xs = (jax.tree.map(lambda a: a[j : j + count], rp[group]), xs)
        carry, out = jax.lax.scan(jax.checkpoint(step) if remat else step, carry, xs)
        outputs.append(out)
    return carry, tuple(None if all(o[n] is None for o in outputs) else
                        jnp.concatenate([o[n] for o in outputs if o[n] is not None]) for n in range(3))


def decoder_segment(c: Glm52Config, s: int, seg: Segment, seg_params: dict, h, selected, reader, remat=False,
                    by_layer: bool = False):
    """Segment `s`: a scan over its repeats (`pattern_repeat`). The prompt is only read (through `reader`). remat:
    under autodiff keep only each layer's inputs and recompute the layer in the backward pass (one layer's
    activations, and on a mesh one layer's gathered weights, live at a time). by_layer: see `decoder_layers`.
    Returns (h, selected, rows [layers, T, kv_row_dim], index keys [full layers, T, Di] or None, the full layers'
    selections [full layers, T, k] or None)."""
    plen, full_per_repeat = len(seg.pattern), full_count(seg.pattern)

    def repeat(carry, xs):
        rp, r = (seg_params, xs) if by_layer else xs
        return pattern_repeat(c, s, seg, rp, carry, reader, seg.first_layer + r * plen,
                              seg.first_full + r * full_per_repeat, remat, (r,) if by_layer else ())

    xs = jnp.arange(seg.repeats) if by_layer else (seg_params, jnp.arange(seg.repeats))
    (h, selected), outs = jax.lax.scan(repeat, (h, selected), xs)
    flatten = lambda a: None if a is None else a.reshape((-1,) + a.shape[2:])
    return (h, selected) + tuple(flatten(a) for a in outs)


def decoder_layers(c: Glm52Config, layers: dict, h, reader, k: int, remat: bool = False, by_layer: bool = False):
    """All layers over h [T, D] (embedded tokens at reader.positions), reading the prompt through `reader`.
    k: the top-k width (slots beyond the visible keys hold -1). Returns (h [T, D] before the final norm, entries
    {"kv": [layers, T, kv_row_dim], "index_keys": [F, T, Di]}, selections [F, T, k]).

    by_layer (decoding, never differentiated): the scans run over repeat and layer numbers and each layer's weights
    are sliced once from its segment's stack. Otherwise the stacks are the scans' inputs: a repeat's parameters are
    sliced (copied) and then each layer's again (XLA:CPU materialises a dynamic slice that feeds a matmul), a
    second pass over every weight per decoded token; under autodiff the inputs' form keeps each layer's weight
    cotangent a slice of the stack's, not a whole-stack accumulation per layer."""
    selected = jnp.full((h.shape[0], k), -1, jnp.int32)
    parts = []
    for s, seg in enumerate(c.segments):
        h, selected, *out = decoder_segment(c, s, seg, layers[str(s)], h, selected, reader, remat, by_layer)
        parts.append(out)
    rows, keys, selections = (jnp.concatenate([p[n] for p in parts if p[n] is not None]) for n in range(3))
    return h, {"kv": rows, "index_keys": keys}, selections


def decoder_chunk(c: Glm52Config, params: dict, state: Glm52State, tokens: jax.Array, start, remat: bool = False,
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
