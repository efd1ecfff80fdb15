"""Qwen3.6's layers as pure functions of one layer's parameters (docs/models.md 1.5-1.8: Gated DeltaNet, gated
attention, the MLP), the readers through which a layer sees the prompt state (capture, replay, decoding), and the
block and layer-stack scans over them.
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from longstraw_jax.models.qwen36.config import FULL, GROUP, LINEAR, Qwen36Config, Qwen36State
from longstraw_jax.ops import attention as attn_ops, flash_gated_delta
from longstraw_jax.ops.conv import causal_depthwise_conv
from longstraw_jax.ops.dtypes import accum_dtype
from longstraw_jax.ops.gated_delta import gated_delta_rule_chunked, gated_delta_rule_sequential
from longstraw_jax.ops.mlp import linear, swiglu
from longstraw_jax.ops.norms import l2_normalise, rms_norm_1p, rms_norm_gated
from longstraw_jax.ops.rope import apply_partial_rope, cos_sin, inverse_frequencies, rope_positions


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
    """The gated delta rule with the configured implementation (chunked: XLA, or the Pallas kernels of
    `ops.flash_gated_delta` with kernels="pallas"): (o [T, Hv, dv'], state [Hv, dk, dv']) in float32.
    Linear in (v, state) jointly, so any value width dv' works (sharding/ appends identity columns). One token
    (decoding) takes the sequential rule whatever the configuration: the chunked one would pad it to a chunk."""
    if cfg.gdn_impl == "chunked" and q.shape[0] > 1:
        if cfg.kernels == "pallas":
            return flash_gated_delta.gated_delta_rule(q, k, v, g, beta, state, cfg.gdn_chunk)
        return gated_delta_rule_chunked(q, k, v, g, beta, state, cfg.gdn_chunk)
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
    attended = reader.attend(q, k, v, j, scale=cfg.head_dim**-0.5, block_size=cfg.attention_block_size,
                             kernels=cfg.kernels)
    return reader.rowwise(lambda out, gate: attention_output(cfg, p, out, gate, x.dtype), attended.out, gate), (k, v)


class PromptReader(NamedTuple):
    """How a layer of one block reads what came before its tokens, on one device: `state` at positions <
    `cache_length` (None: every cached position), the carried GDN state as it is. tokens sit at `positions` [T]
    (contiguous). `prefix` locates the block in the state: (b,) in the whole state, () in a block's slice of it.
    left_pad (int32 [] or None): the prompt's pad positions 0..left_pad-1 are never attended (and `gated_deltanet`
    masks the rows at them). heads_as_stored: `attn_ops.attend`'s, for one decoded token (`DecodeReader`).

    The sequence-parallel engine (`models/qwen36/mesh.py`) passes readers with the same methods that work on a
    shard's part of the prompt, so the layer code above is shared: `layer_params` (FSDP all-gathers there),
    `rowwise` (blocks of rows there), `conv` (a halo from the previous segment), `delta_rule` (the affine fold
    across segments), `attend` (ring / all-gather, log-sum-exp across shards).
    """

    state: Qwen36State
    prefix: tuple
    positions: jax.Array
    cache_length: Any = None
    left_pad: Any = None
    heads_as_stored: bool = False

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

    def attend(self, q, k, v, j, *, scale: float, block_size: int, kernels: str) -> attn_ops.Attended:
        """q [T, Hq, hd] over full layer j's cached keys/values, merged by log-sum-exp with causal attention over
        the tokens' own k, v [T, Hkv, hd]."""
        common = dict(q_positions=self.positions, scale=scale, block_size=block_size, left_pad=self.left_pad,
                      kernels=kernels, heads_as_stored=self.heads_as_stored)
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
    then the token itself). The tail is visited in TAIL_BLOCKS blocks (`tail_block`), so a step reads only the
    blocks holding the positions before its slot, not the whole R-position tail: each branch reads its own tail, so
    this is per-branch work, which a group's G branches pay G times. On a CPU `Qwen36.decode` sets the local
    reader's heads_as_stored (both parts then multiply the cached rows as stored: no head-major copy of the prompt
    cache or of the tail per step)."""

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

    def attend(self, q, k, v, j, *, scale: float, block_size: int, kernels: str) -> attn_ops.Attended:
        prompt = attn_ops.attend(q, self.state.keys, self.state.values, k_offset=0, causal=False,
                                 kv_length=self.state.length, kv_index=self.local.prefix + (j,),
                                 q_positions=self.positions, scale=scale, block_size=block_size,
                                 left_pad=self.left_pad, kernels=kernels, heads_as_stored=self.local.heads_as_stored)
        return attn_ops.merge(prompt, self.local.attend(q, k, v, j, scale=scale,
                                                        block_size=tail_block(self.local.state, block_size),
                                                        kernels=kernels))


TAIL_BLOCKS = 4  # the token at slot t visits ceil((t + 1) / (R / 4)) blocks of its tail: about t + R / 8 keys, not R


def tail_block(tail: Qwen36State, block_size: int) -> int:
    """The key block for a decoded token's attention over its tail (keys [..., R, Hkv, hd]): R / TAIL_BLOCKS rounded
    up (at most `block_size`): at most TAIL_BLOCKS blocks, of which those past the slot are never visited."""
    return max(1, min(block_size, -(-tail.keys.shape[-3] // TAIL_BLOCKS)))


def kind_runs(pattern: tuple[str, ...]) -> list[tuple[str, int, int]]:
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


def decoder_layer(cfg: Qwen36Config, kind: str, p: dict, h: jax.Array, reader, j):
    """Decoder layer (1.3): h + mixer(norm(h)), then h + mlp(norm(h)), for layer j of its kind in the block.
    Returns (h, the layer's new state entry): (conv tail, recurrent matrix) for a linear layer, (keys, values) of
    the new tokens for a full one."""
    eps = cfg.rms_norm_eps
    p = reader.layer_params(p, GROUP[kind])
    x = reader.rowwise(lambda h: rms_norm_1p(h, p["input_norm"], eps), h)
    y, entry = (gated_deltanet if kind == LINEAR else gated_attention)(cfg, p, x, reader, j)
    return reader.rowwise(lambda h, y: (h + y) + swiglu(p["mlp"], rms_norm_1p(h + y, p["post_norm"], eps)), h, y), entry


def decoder_block(cfg: Qwen36Config, bp: dict, h: jax.Array, reader, prefix: tuple = ()):
    """One repeat of `block_pattern` (e.g. LLLF) over hidden h [T, D]; the prompt is only read, through `reader`.
    bp: the block's parameters ({"linear": leaves [per_block, ...], "full": ...}); with prefix (b,), the whole
    stack's (leaves [num_blocks, per_block, ...]), of which block b's layers are read one at a time. Decoding passes
    the stack: a scan over blocks that slices block b's parameters copies them, and then each layer's slice copies
    them again (XLA:CPU materialises a dynamic slice that feeds a matmul), a second pass over every weight per
    decoded token.

    Consecutive layers of one kind run under `lax.scan` (one trace per run, not per layer). Returns h and the
    block's new state entries per kind, stacked over that kind's layers: {"linear": (tails, mats), "full": (keys,
    values)} (None for a kind the pattern lacks); recurrent matrices float32.
    """
    entries = {LINEAR: [], FULL: []}
    for kind, first, count in kind_runs(cfg.block_pattern):
        group = bp[GROUP[kind]]

        def step(h, j, kind=kind, group=group):
            return decoder_layer(cfg, kind, jax.tree.map(lambda a: a[prefix + (j,)], group), h, reader, j)

        if count == 1:
            h, entry = step(h, first)
            entry = jax.tree.map(lambda a: a[None], entry)
        else:
            h, entry = jax.lax.scan(step, h, first + jnp.arange(count))
        entries[kind].append(entry)
    return h, {GROUP[kind]: tuple(jnp.concatenate(parts) for parts in zip(*runs)) if runs else None
               for kind, runs in entries.items()}


def decoder_layers(cfg: Qwen36Config, params: dict, state: Qwen36State, tokens: jax.Array, start, cache_length,
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
        return decoder_block(cfg, bp, h, PromptReader(state, (b,), positions, cache_length, left_pad))

    body = jax.checkpoint(body) if remat else body
    return jax.lax.scan(body, params["embed"][tokens], (params["blocks"], jnp.arange(cfg.num_blocks)))
