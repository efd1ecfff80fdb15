"""Sequence-parallel capture and sharded replay for Qwen3.6 (MODELS.md 1) on a ("data", "seq") mesh.

Capture: the prompt is laid out by `SeqLayout` (two segments per `seq` shard, padded at the end), parameters stay
FSDP-sharded and each layer is all-gathered inside the layer scan just before use. Per layer, every shard works on
its own segments only:
- gated attention: `sequence.causal_attention` (ring or all-gather of keys/values);
- Gated DeltaNet: the conv reads a K-1 row halo from the previous segment; the delta rule runs once per segment
  from the augmented state [0 | I] with values [v | 0] (the rule is linear in (values, state) jointly), which yields
  in one pass the local outputs o0, the segment's affine map S_out = A S_in + B (B and A are the two column blocks
  of the final state) and q'_t = A_{<=t}^T q_t (the last dk output columns). `sequence.affine_fold` gives the
  incoming state S_in, and the exact outputs are o_t = o0_t + S_in^T q'_t: no second pass, no shard idles.
Rounds (`RoundLayout`): a long prompt is captured round by round, each round laid out as above; a round's queries
also attend over the cache of all earlier rounds, and the GDN carries its state (and conv tail) across rounds. Only
one round's activations are live; position-wise work runs in blocks of ROWS rows (`_by_rows`).
Replay (`extend_hidden`): the branch runs on every shard; the GDN state is replicated, and attention over the
seq-sharded prompt cache is merged across shards by log-sum-exp (`sequence.psum_merge`).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from longstraw_jax.models.qwen36 import (FULL, LINEAR, PromptState, Qwen36, attention_inputs, attention_output,
                                         gated_deltanet, gdn_core, gdn_inputs, gdn_output, gdn_qkv)
from longstraw_jax.ops import attention as attn_ops
from longstraw_jax.ops.conv import causal_depthwise_conv
from longstraw_jax.ops.dtypes import accum_dtype
from longstraw_jax.ops.mlp import swiglu
from longstraw_jax.ops.norms import rms_norm_1p
from longstraw_jax.sharding import sequence
from longstraw_jax.sharding.layout import RoundLayout, SeqLayout, ShardedPromptState
from longstraw_jax.sharding.rules import gather_layer, param_specs, prompt_state_specs
from longstraw_jax.validation import check_tokens

_GROUP = {LINEAR: "linear", FULL: "full"}


def min_segment(cfg) -> int:
    """The shortest segment a layout may use: the causal conv reads a K-1 row halo from the previous segment."""
    return cfg.linear_conv_kernel_dim - 1


def _pattern(cfg):
    """[(kind, index within that kind's stacked group)] for one block, in layer order."""
    seen = {LINEAR: 0, FULL: 0}
    out = []
    for kind in cfg.block_pattern:
        out.append((kind, seen[kind]))
        seen[kind] += 1
    return out


def _layers(cfg, bp, block_specs):
    """(kind, index within its group, the layer's parameters gathered whole) for one block's layers, in order.
    bp: the block's FSDP-sharded parameters ({group: leaves [per_block, ...]}); one layer is gathered at a time."""
    for kind, j in _pattern(cfg):
        group = _GROUP[kind]
        yield kind, j, gather_layer(jax.tree.map(lambda a: a[j], bp[group]), block_specs[group])


ROWS = 4096  # position-wise work (projections, norms, MLP) runs over at most this many local positions at a time


def _by_rows(fn, *xs, rows: int | None = None):
    """fn(*xs) for a row-wise fn (row i of every output depends only on row i of every input), computed over blocks
    of `rows` leading-axis rows in a `lax.map` (the last block zero-padded), so that fn's intermediates exist for one
    block at a time: at P / seq positions per device the wide ones (MLP, GDN projections) would not fit whole."""
    t, rows = xs[0].shape[0], rows or ROWS
    if t <= rows:
        return fn(*xs)
    n = -(-t // rows)
    blocks = [jnp.pad(x, [(0, n * rows - t)] + [(0, 0)] * (x.ndim - 1)).reshape((n, rows) + x.shape[1:]) for x in xs]
    out = jax.lax.map(lambda args: fn(*args), tuple(blocks))
    return jax.tree.map(lambda y: y.reshape((n * rows,) + y.shape[2:])[:t], out)


def _residual(cfg, p, h, mixer):
    """Decoder layer (1.3) around a mixer: h + mixer(norm(h)) then h + mlp(norm(h)); returns (h, mixer's entry)."""
    y, entry = mixer(_by_rows(lambda h: rms_norm_1p(h, p["input_norm"], cfg.rms_norm_eps), h))
    return _by_rows(lambda h, y: (h + y) + swiglu(p["mlp"], rms_norm_1p(h + y, p["post_norm"], cfg.rms_norm_eps)),
                    h, y), entry


# ----- capture -------------------------------------------------------------------------------------------------


def _gdn_segments(cfg, p, x, positions, layout: SeqLayout, conv_in, state_in):
    """Sequence-parallel Gated DeltaNet over this shard's segments of one round. x [2L, D]; positions [2, L] within
    the round; conv_in [K-1, C] and state_in [Hv, dk, dv] float32: the carried state before the round.
    Returns (y [2L, D], (final conv tail [K-1, C], final state [Hv, dk, dv])), the state entries replicated."""
    seg, km1 = layout.segment, cfg.linear_conv_kernel_dim - 1
    hv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    mixed, z, beta, g = _by_rows(lambda x: gdn_inputs(cfg, p, x), x)
    mixed = mixed.reshape(2, seg, -1)
    halo = sequence.previous_rows(mixed[:, seg - km1 :], conv_in.astype(mixed.dtype), layout)
    conv_out = jax.vmap(lambda m, t: causal_depthwise_conv(m, p["conv1d"], t)[0])(mixed, halo)
    q, k, v = _by_rows(lambda c: gdn_qkv(cfg, c), conv_out.reshape(2 * seg, -1))
    real = (positions < layout.length).reshape(-1, 1)  # padding: no decay, no write -> the state passes unchanged
    beta, g = jnp.where(real, beta, 0), jnp.where(real, g, 0)

    core = accum_dtype(x.dtype)
    v_aug = jnp.concatenate([v.astype(core), jnp.zeros(v.shape[:-1] + (dk,), core)], axis=-1)
    s_aug = jnp.concatenate([jnp.zeros((hv, dk, dv), core), jnp.broadcast_to(jnp.eye(dk, dtype=core), (hv, dk, dk))],
                            axis=-1)
    per_segment = lambda a: a.reshape((2, seg) + a.shape[1:])
    # a Python loop, not vmap: a vmapped chunked rule (batched triangular solves) deadlocked XLA:CPU collectives
    runs = [gdn_core(cfg, *(a[h] for a in map(per_segment, (q, k, v_aug, g, beta))), s_aug) for h in (0, 1)]
    o_aug, end = (jnp.stack(x) for x in zip(*runs))
    incoming, final = sequence.affine_fold(end[..., dv:], end[..., :dv], state_in.astype(core), layout)
    o = o_aug[..., :dv] + jnp.einsum("sthk,shkv->sthv", o_aug[..., dv:], incoming)
    y = _by_rows(lambda o, z: gdn_output(cfg, p, o, z, x.dtype), o.reshape(2 * seg, hv, dv), z)

    # The new conv tail: the K-1 inputs before position P, read from the segment holding position P-1.
    last = (layout.length - 1) // seg
    owner, half = (int(a[last]) for a in layout.natural_segment_source())
    extended = jnp.concatenate([halo[half], mixed[half]], axis=0)
    start = layout.length - last * seg
    tail = jnp.where(jax.lax.axis_index(sequence.SEQ) == owner, extended[start : start + km1], 0)
    return y, (jax.lax.psum(tail, sequence.SEQ), final)


def _attention_segments(cfg, p, x, positions, offset, layout: SeqLayout, method: str, earlier=None):
    """Sequence-parallel gated attention over this shard's segments of one round (positions [2, L] within the round,
    which starts at natural position `offset`). earlier: None, or (keys, values, slots, (b, j)): this shard's cache
    [nb, nf, S, Hkv, hd] whose first `slots` slots hold earlier rounds (all visible to every query of the round).
    Returns (y [2L, D], (keys, values) [2L, Hkv, hd] for the cache, zero at padding positions)."""
    q, gate, k, v = _by_rows(lambda x, pos: attention_inputs(cfg, p, x, pos), x, offset + positions.reshape(-1))
    per_segment = lambda a: a.reshape((2, layout.segment) + a.shape[1:])
    common = dict(scale=cfg.head_dim**-0.5, block_size=cfg.attention_block_size)
    att = sequence.causal_attention(per_segment(q), per_segment(k), per_segment(v), positions, layout, method=method,
                                    **common)
    if earlier is not None:
        # Every shard's queries see every shard's earlier slots: each shard attends the round's queries of all
        # shards over its own slots (same work as its own queries over all slots), the partials merge across shards.
        keys, values, slots, index = earlier
        queries = jax.lax.all_gather(q, sequence.SEQ)  # [n, 2L, Hq, hd]
        part = _by_rows(lambda q: attn_ops.attend(q, keys, values, k_offset=0, causal=False, kv_length=slots,
                                                  q_positions=jnp.zeros(q.shape[0], jnp.int32), kv_index=index,
                                                  **common), queries.reshape((-1,) + q.shape[1:]))
        mine = jax.tree.map(lambda a: per_segment(a.reshape(queries.shape[:2] + a.shape[1:])[
            jax.lax.axis_index(sequence.SEQ)]), sequence.psum_merge(part))
        att = attn_ops.merge(att, mine)
    att = jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:]), att)
    real = (positions < layout.length).reshape(-1, 1, 1)
    y = _by_rows(lambda out, gate: attention_output(cfg, p, attn_ops.Attended(out, None), gate, x.dtype), att.out, gate)
    return y, (jnp.where(real, k, 0), jnp.where(real, v, 0))


def round_block(cfg, block_specs, method, rounds: RoundLayout, layout: SeqLayout, index, bp, h, state, b):
    """Block `b` of round `index` (laid out by `layout`) on this shard: h [2L, D] -> (h, entries). bp: the block's
    FSDP-sharded parameters ({group: leaves [per_block, ...]}), gathered one layer at a time. state: (conv,
    recurrent) carried into the round and (keys, values) caches, all with a leading block axis indexed by b; the
    caches are only read (earlier rounds' slots). entries: {LINEAR: (conv tail, final state) [nl, ...], FULL:
    (keys, values) [nf, 2L, Hkv, hd]}."""
    conv, recurrent, keys, values = state
    positions = sequence.local_positions(layout)
    entries = {LINEAR: [], FULL: []}
    for kind, j, p in _layers(cfg, bp, block_specs):
        if kind == LINEAR:
            mixer = lambda x: _gdn_segments(cfg, p, x, positions, layout, conv[b, j], recurrent[b, j])
        else:
            earlier = None if rounds.full == 0 else (keys, values, index * rounds.round_slots, (b, j))
            mixer = lambda x: _attention_segments(cfg, p, x, positions, index * rounds.round_positions, layout,
                                                  method, earlier)
        h, entry = _residual(cfg, p, h, mixer)
        entries[kind].append(entry)
    return h, {kind: jax.tree.map(lambda *x: jnp.stack(x), *e) for kind, e in entries.items()}


def _capture_round(cfg, block_specs, method, blocks, h, layout: SeqLayout, index, rounds: RoundLayout, carry):
    """One round (round number `index`, laid out by `layout`) over this shard's h [2L, D], given the carried state
    and cache of the rounds before it; returns the carry with the round's state written in."""
    @jax.checkpoint
    def body(h, xs):
        bp, b = xs
        return round_block(cfg, block_specs, method, rounds, layout, index, bp, h, carry, b)

    _, entries = jax.lax.scan(body, h, (blocks, jnp.arange(cfg.num_blocks)))
    (conv, recurrent), (k, v) = entries[LINEAR], entries[FULL]
    slots = index * rounds.round_slots
    write = lambda cache, new: jax.lax.dynamic_update_slice_in_dim(cache, new.astype(cache.dtype), slots, axis=2)
    return conv, recurrent, write(carry[2], k), write(carry[3], v)


def boundaries_per_shard(rounds: RoundLayout) -> int:
    """Round boundaries each shard keeps: the rounds.full + 1 GDN states carried into the rounds are spread over the
    shards (round r on shard r // per), so no device holds all of them."""
    return -(-(rounds.full + 1) // rounds.shards)


def _keep_boundary(owned, carried, r, per: int):
    """Store the GDN state carried into round r at its owner's slot r % per; other shards write the scratch slot
    `per` (buffers [per + 1, ...])."""
    slot = jnp.where(jax.lax.axis_index(sequence.SEQ) == r // per, r % per, per)
    return jax.tree.map(lambda buf, x: buf.at[slot].set(x.astype(buf.dtype)), owned, carried)


def read_boundary(owned, r, per: int):
    """Inside `shard_map`: round r's boundary (conv, recurrent), on every shard (a psum from its owner; exact)."""
    mine = jax.lax.axis_index(sequence.SEQ) == r // per
    return jax.tree.map(lambda buf: jax.lax.psum(jnp.where(mine, buf[r % per], 0).astype(buf.dtype), sequence.SEQ),
                        owned)


def _capture_local(cfg, rounds: RoundLayout, block_specs, method, blocks, h):
    """This shard's h [rounds.per_shard, D] -> ((conv, recurrent, keys, values), boundaries): a scan over the full
    rounds, then the last round. Only one round's activations are ever live; the cache fills in place.
    boundaries: this shard's (conv, recurrent) carried into its rounds, [per + 1, ...] (`boundaries_per_shard`;
    the last slot is scratch), for the exact backward (`read_boundary`)."""
    nb, hv = cfg.num_blocks, cfg.linear_num_value_heads
    linear, full = cfg.block_pattern.count(LINEAR), cfg.block_pattern.count(FULL)
    conv_dim = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + hv * cfg.linear_value_head_dim
    carry = (jnp.zeros((nb, linear, cfg.linear_conv_kernel_dim - 1, conv_dim), h.dtype),
             jnp.zeros((nb, linear, hv, cfg.linear_key_head_dim, cfg.linear_value_head_dim), accum_dtype(h.dtype)),
             *(jnp.zeros((nb, full, rounds.per_shard, cfg.num_key_value_heads, cfg.head_dim), h.dtype),) * 2)
    one_round = functools.partial(_capture_round, cfg, block_specs, method, blocks)
    per = boundaries_per_shard(rounds)
    owned = tuple(jnp.zeros((per + 1,) + a.shape, a.dtype) for a in carry[:2])
    if rounds.full:
        def step(c, xs):
            carry, owned = c
            owned = _keep_boundary(owned, carry[:2], xs[1], per)
            return (one_round(xs[0], rounds.round, xs[1], rounds, carry), owned), None

        h_full = h[: rounds.full * rounds.round_slots].reshape(rounds.full, rounds.round_slots, -1)
        (carry, owned), _ = jax.lax.scan(step, (carry, owned), (h_full, jnp.arange(rounds.full)))
    owned = _keep_boundary(owned, carry[:2], rounds.full, per)
    return one_round(h[rounds.full * rounds.round_slots :], rounds.last, rounds.full, rounds, carry), owned


def capture(model: Qwen36, params: dict, tokens, mesh, attention: str = "ring", pad_id: int = 0,
            round_len: int | None = None) -> ShardedPromptState:
    """Prompt tokens int32 [P] -> ShardedPromptState, sequence-parallel over `mesh`'s `seq` axis.

    `params` may be placed anywhere (ideally by `rules.param_specs`: then nothing is moved but one layer at a time).
    attention: "ring" or "allgather" (sequence.causal_attention). `pad_id` only fills padding slots; it cannot
    change any result (tests check this). round_len: capture in rounds of about this many positions (activation
    memory of one round; later rounds attend over the cache of earlier ones); None: the whole prompt in one round.
    """
    cfg = model.config
    tokens = check_tokens(tokens, cfg.vocab_size)
    if attention not in sequence.ATTENTION_METHODS:
        raise ValueError(f"attention={attention!r}; allowed: {sequence.ATTENTION_METHODS}")
    layout = RoundLayout.for_prompt(tokens.shape[0], mesh.shape[sequence.SEQ], min_segment(cfg), round_len)
    return _capture(model, params, layout.to_stored(tokens, pad_id), mesh, layout, attention)[0]


@functools.partial(jax.jit, static_argnums=(0, 3, 4, 5))
def _capture(model, params, stored_tokens, mesh, layout, attention):
    """-> (ShardedPromptState, boundaries: the GDN (conv, recurrent) carried into each round, spread over the seq
    shards as `_capture_local` keeps them)."""
    cfg = model.config
    specs = param_specs(params, mesh)
    h = jax.lax.with_sharding_constraint(params["embed"][stored_tokens], NamedSharding(mesh, P(sequence.SEQ)))
    kv_spec = P(None, None, sequence.SEQ)
    (conv, recurrent, keys, values), boundaries = jax.shard_map(
        functools.partial(_capture_local, cfg, layout, specs["blocks"], attention), mesh=mesh,
        in_specs=(specs["blocks"], P(sequence.SEQ)),
        out_specs=((P(), P(), kv_spec, kv_spec), (P(sequence.SEQ), P(sequence.SEQ))),
        check_vma=False,
    )(params["blocks"], h)
    state = PromptState(conv=conv, recurrent=recurrent, keys=keys, values=values, length=layout.length)
    return ShardedPromptState(state, layout), boundaries


# ----- replay ------------------------------------------------------------------------------------------------------


def _cached_attention(cfg, p, x, positions, sstate_local: PromptState, rounds: RoundLayout, b, j):
    """Gated attention of new tokens over the seq-sharded prompt cache (log-sum-exp across shards) and, causally,
    over themselves. sstate_local.keys: this shard's [nb, nf, S, Hkv, hd], `rounds`' slots: every slot of the full
    rounds is a real position; of the last round's two segments, a prefix of each."""
    q, gate, k, v = attention_inputs(cfg, p, x, positions)
    common = dict(q_positions=positions, scale=cfg.head_dim**-0.5, block_size=cfg.attention_block_size)
    earlier, last = rounds.full * rounds.round_slots, rounds.last
    parts = []
    if rounds.full:
        parts.append(attn_ops.attend(q, sstate_local.keys, sstate_local.values, k_offset=0, causal=False,
                                     kv_length=earlier, kv_index=(b, j), **common))
    split = lambda cache: cache[:, :, earlier:].reshape(cache.shape[:2] + (2, last.segment) + cache.shape[3:])
    keys, values = split(sstate_local.keys), split(sstate_local.values)
    visible = jnp.clip(last.length - sequence.local_segments(last) * last.segment, 0, last.segment)
    parts += [attn_ops.attend(q, keys, values, k_offset=0, causal=False, kv_length=visible[h], kv_index=(b, j, h),
                              **common) for h in (0, 1)]
    prompt = sequence.psum_merge(functools.reduce(attn_ops.merge, parts))
    new = attn_ops.attend(q, k, v, k_offset=rounds.length, causal=True, **common)
    return attention_output(cfg, p, attn_ops.merge(prompt, new), gate, x.dtype), None


def extend_block(cfg, block_specs, rounds: RoundLayout, bp, h, state: PromptState, b):
    """Block b of the replay on this shard: new tokens' h [T, D] (the same on every shard) at positions P.. over this
    shard's slice of the prompt cache; state: this shard's PromptState, leading block axis indexed by b."""
    positions = rounds.length + jnp.arange(h.shape[0], dtype=jnp.int32)
    for kind, j, p in _layers(cfg, bp, block_specs):
        if kind == LINEAR:
            mixer = lambda x: (gated_deltanet(cfg, p, x, state.conv[b, j], state.recurrent[b, j])[0], None)
        else:
            mixer = lambda x: _cached_attention(cfg, p, x, positions, state, rounds, b, j)
        h, _ = _residual(cfg, p, h, mixer)
    return h


def _extend_local(cfg, rounds, block_specs, blocks, state, h):
    body = jax.checkpoint(lambda h, xs: (extend_block(cfg, block_specs, rounds, xs[0], h, state, xs[1]), None))
    return jax.lax.scan(body, h, (blocks, jnp.arange(cfg.num_blocks)))[0]


def extend_hidden(model: Qwen36, params: dict, sstate: ShardedPromptState, tokens, mesh) -> jax.Array:
    """As `model.extend_hidden` on the sharded state: tokens int32 [T] -> final-normed hidden [T, D]."""
    return _extend_hidden(model, params, sstate, check_tokens(tokens, model.config.vocab_size), mesh)


@functools.partial(jax.jit, static_argnums=(0, 4))
def _extend_hidden(model, params, sstate, tokens, mesh):
    cfg = model.config
    specs = param_specs(params, mesh)
    h = params["embed"][tokens]
    h = jax.shard_map(
        functools.partial(_extend_local, cfg, sstate.layout, specs["blocks"]), mesh=mesh,
        in_specs=(specs["blocks"], prompt_state_specs(sstate.state), P()), out_specs=P(), check_vma=False,
    )(params["blocks"], sstate.state, h)
    return rms_norm_1p(h, params["final_norm"], cfg.rms_norm_eps)
