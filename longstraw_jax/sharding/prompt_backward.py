"""Exact mode's prompt backward on the mesh: round by round in reverse, block by block (the sequence-parallel
counterpart of `engine.prompt_backward` + `layerwise.chunk_grads`).

Given the float32 cotangent of the captured state (the branches' sum: KV cache seq-sharded, GDN carried state
replicated), each round is recomputed from the GDN state carried into it (`boundaries`) and the final cache (its
earlier slots are exactly what the round read during capture; later slots are never read): a forward over blocks
keeps each block's input h (one round's positions), then a reverse scan over blocks takes the vjp of one block
(`sharding.qwen36.round_block` inside its own `shard_map`) with
- the cotangent of the block's new keys/values, read from the running cotangent at the round's slots,
- the cotangent of the block's outgoing GDN state (the carried cotangent),
and adds the block's parameter gradient (FSDP-sharded: the layer all-gathers transpose to reduce-scatters), adds
the cotangent of the cache reads into the running KV cotangent at block b (1/num_blocks of it at a time, in place),
and replaces the carried cotangent by that of the state the round started from. Collectives inside a block (ring
`ppermute`, the GDN fold's all-gathers, the log-sum-exp merge over earlier rounds) are transposed by JAX.

Memory: the state, its cotangent, the round boundaries (GDN state per round, spread over the seq shards) and one
round's block inputs and one block's recomputation; nothing scales with P except the first two and the boundaries.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from longstraw_jax.models.qwen36 import FULL, LINEAR
from longstraw_jax.ops.dtypes import at_least_f32
from longstraw_jax.sharding.layout import RoundLayout
from longstraw_jax.sharding.qwen36 import boundaries_per_shard, read_boundary, round_block
from longstraw_jax.sharding.rules import block_slice_specs, param_specs
from longstraw_jax.sharding.sequence import SEQ, each_round, round_slots

_KV = P(None, None, SEQ)  # a KV cache or its cotangent: [blocks (or 1), nf, S, Hkv, hd], S split along seq


def prompt_backward(model, params, stored_tokens, mesh, rounds: RoundLayout, attention: str, state, boundaries,
                    state_cot, grads) -> dict:
    """grads + the float32 gradient of the sequence-parallel capture of `stored_tokens` ([rounds.padded] in stored
    order) given `state_cot`, the float32 cotangent of the captured PromptState. grads: a float32 params-shaped
    tree, FSDP-sharded (the replay's gradient: added to in place, no second params-sized buffer)."""
    cfg = model.config
    specs = param_specs(params, mesh)
    block_specs = specs["blocks"]
    slice_specs = block_slice_specs(block_specs)
    blocks = params["blocks"]
    per = boundaries_per_shard(rounds)

    place = lambda tree, spec_tree: jax.tree.map(
        lambda a, s: jax.lax.with_sharding_constraint(a, NamedSharding(mesh, s)), tree, spec_tree)

    def shard_map(fn, in_specs, out_specs):
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)

    def block(layout, index, bp, h, conv, recurrent, keys, values):
        """Block of round `index` on the mesh: h [n * 2L, D] (stored order) -> (h, tail, final, keys, values)."""
        def local(bp, h, conv, recurrent, keys, values, index):
            h, entries = round_block(cfg, block_specs, attention, rounds, layout, index, bp, h,
                                     (conv, recurrent, keys, values), 0)
            return h, *entries[LINEAR], *entries[FULL]

        return shard_map(local, (slice_specs, P(SEQ), P(), P(), _KV, _KV, P()),
                         (P(SEQ), P(), P(), P(None, SEQ), P(None, SEQ)))(bp, h, conv, recurrent, keys, values, index)

    read_round = functools.partial(round_slots, mesh, rounds)

    def round_backward(carry, layout, index):
        grads, keys_cot, values_cot, conv_cot, rec_cot = carry
        size = layout.per_shard
        tokens = read_round(stored_tokens, index, size, 0)
        conv_in, rec_in = shard_map(lambda b, r: read_boundary(b, r, per), (P(SEQ), P()), P())(boundaries, index)
        at = lambda tree, b: jax.tree.map(lambda a: a[b], tree)
        state_of = lambda b: (conv_in[b][None], rec_in[b][None], state.keys[b][None], state.values[b][None])
        h0 = jax.lax.with_sharding_constraint(params["embed"][tokens], NamedSharding(mesh, P(SEQ)))

        def forward(h, b):
            return block(layout, index, at(blocks, b), h, *state_of(b))[0], h

        _, inputs = jax.lax.scan(forward, h0, jnp.arange(cfg.num_blocks))

        def backward(carry, b):
            dh, grads_blocks, keys_cot, values_cot, conv_cot, rec_cot = carry
            primals = (at(blocks, b), inputs[b], *state_of(b))
            outputs, vjp = jax.vjp(functools.partial(block, layout, index), *primals)
            entries_cot = (conv_cot[b], rec_cot[b],
                           read_round(keys_cot[b], index, size, 1),
                           read_round(values_cot[b], index, size, 1))
            cot = (dh,) + tuple(c.astype(o.dtype) for c, o in zip(entries_cot, outputs[1:]))
            d_bp, dh, d_conv, d_rec, d_keys, d_values = vjp(cot)
            # the constraints keep the carried accumulators sharded (FSDP / seq) through the scan
            grads_blocks = place(jax.tree.map(lambda g, d: g.at[b].add(d.astype(g.dtype)), grads_blocks, d_bp),
                                 block_specs)
            keys_cot = place(keys_cot.at[b].add(d_keys[0].astype(keys_cot.dtype)), _KV)
            values_cot = place(values_cot.at[b].add(d_values[0].astype(values_cot.dtype)), _KV)
            conv_cot = conv_cot.at[b].set(d_conv[0].astype(conv_cot.dtype))
            rec_cot = rec_cot.at[b].set(d_rec[0].astype(rec_cot.dtype))
            return (dh, grads_blocks, keys_cot, values_cot, conv_cot, rec_cot), None

        carry = (jnp.zeros_like(h0), grads["blocks"], keys_cot, values_cot, conv_cot, rec_cot)
        (dh, grads_blocks, *cots), _ = jax.lax.scan(backward, carry, jnp.arange(cfg.num_blocks), reverse=True)
        embed = place(grads["embed"].at[tokens].add(dh.astype(grads["embed"].dtype)), specs["embed"])
        return (dict(grads, blocks=grads_blocks, embed=embed), *cots)

    f32 = at_least_f32  # (float64 for a float64 model)
    carry = (grads, f32(state_cot.keys), f32(state_cot.values), f32(state_cot.conv), f32(state_cot.recurrent))
    return each_round(rounds, carry, round_backward, reverse=True)[0]
