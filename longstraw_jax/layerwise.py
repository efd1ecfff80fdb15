"""Block-by-block backward over a model's stacked layers, adding the prompt-state cotangent in place.

Autodiff of a layer scan that reads a shared cache gives each read a cotangent the size of the whole cache, summed
afterwards: per branch (and per prompt chunk) a full-size temporary next to the accumulator. Here the backward pass
is written out instead: a forward scan over blocks keeps only each block's input h [T, D]; a reverse scan recomputes
one block at a time under `jax.vjp` with that block's slice of the state as an explicit input, so the slice's
cotangent (1/num_blocks of the state) is added into the running float32 accumulator `acc[b]` inside the scan carry,
which XLA updates in place; the block's parameter gradient is added the same way into the caller's float32 gradient
accumulator at block b (no stacked per-block gradients, no second params-sized buffer). Activation memory is one
block's; the state cotangent and the gradient exist once.

Models provide the block protocol (`models.base.BlockModel`) and call `branch_grads` / `chunk_grads` from their own
methods of those names (Qwen3.6). A family without it (GLM-5.x: its layers carry IndexShare selections and come in
several segments) keeps `CausalLM`'s defaults, `branch_grads_autodiff` / `chunk_grads_autodiff`: the same results
from plain autodiff of its whole layer stack, with a full-size state cotangent per branch/chunk.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from longstraw_jax import trainable
from longstraw_jax.ops.dtypes import at_least_f32


def _at(tree, b):
    return jax.tree.map(lambda a: a[b], tree)


def _set(tree, b, sub):
    return jax.tree.map(lambda a, s: a.at[b].set(s.astype(a.dtype)), tree, sub)


def _add(acc, tree):
    return jax.tree.map(lambda a, x: a + x.astype(a.dtype), acc, tree)


def _add_at(acc, b, tree):
    """acc[b] += tree, leaf by leaf (in place inside a scan carry)."""
    return jax.tree.map(lambda a, x: a.at[b].add(x.astype(a.dtype)), acc, tree)


def _positions(start, length: int) -> jax.Array:
    return start + jnp.arange(length, dtype=jnp.int32)


def _forward(model, params, state, tokens, start, cache_length):
    """Blocks 0..nb-1 over tokens [T]: (h [T, D] after the last block, each block's input h stacked [nb, T, D])."""
    positions = _positions(start, tokens.shape[0])

    def body(h, xs):
        bp, b = xs
        return model.block(bp, h, _at(state, b), positions, cache_length)[0], h

    return jax.lax.scan(body, model.embed(params, tokens), (model.block_params(params), jnp.arange(model.num_blocks)))


def _backward(model, params, state, tokens, start, cache_length, inputs, dh, grads, acc, chunk_entries: bool):
    """Reverse scan over blocks. dh: cotangent of the last block's output h. grads: float32 params-shaped gradient
    accumulator. acc: float32 state cotangent (or None: no gradient into the state). With `chunk_entries`, each
    block's new entries also receive their cotangent, read from acc at positions start.. (keys/values) and from acc's
    carried part, which is then replaced by the cotangent of the carried state the block read (the chunk before owns
    it); cache reads are added into acc.

    Returns (grads + the gradient of params through the blocks and the embedding, acc).
    """
    positions = _positions(start, tokens.shape[0])
    # The entries' cotangents, read for all blocks before the scan (chunk-sized): inside it, acc is only read and
    # written at block b, which XLA then updates in place.
    entries_cot = model.read_entries(acc, start, tokens.shape[0]) if chunk_entries else None

    def body(carry, xs):
        dh, acc, grads_blocks = carry
        bp, b, h_in, entries_cot = xs
        state_block = _at(state, b)
        # with respect to the trainable leaves of the block only (grads_blocks has their structure: trainable.py)
        vjp_of = lambda fn, *primals: trainable.vjp(fn, bp, grads_blocks, *primals)
        if acc is None:
            _, vjp = vjp_of(lambda bp, h: model.block(bp, h, state_block, positions, cache_length)[0], h_in)
            d_bp, dh = vjp(dh)
            return (dh, None, _add_at(grads_blocks, b, d_bp)), None
        acc_block = _at(acc, b)
        if chunk_entries:
            entries, vjp = vjp_of(lambda bp, h, s: model.block(bp, h, s, positions, cache_length), h_in, state_block)
            entries_cot = jax.tree.map(lambda c, e: c.astype(e.dtype), entries_cot, entries[1])
            d_bp, dh, d_state = vjp((dh, entries_cot))
            acc_block = model.with_carried(_add(acc_block, d_state),
                                           model.carried(jax.tree.map(at_least_f32, d_state)))
        else:
            _, vjp = vjp_of(lambda bp, h, s: model.block(bp, h, s, positions, cache_length)[0], h_in, state_block)
            d_bp, dh, d_state = vjp(dh)
            acc_block = _add(acc_block, d_state)
        return (dh, _set(acc, b, acc_block), _add_at(grads_blocks, b, d_bp)), None

    xs = (model.block_params(params), jnp.arange(model.num_blocks), inputs, entries_cot)
    (dh, acc, grads_blocks), _ = jax.lax.scan(body, (dh, acc, model.block_params(grads)), xs, reverse=True)
    _, vjp = trainable.vjp(lambda p: model.embed(p, tokens), params, grads)
    return _add(model.with_block_params(grads, grads_blocks), vjp(dh)[0]), acc


def branch_grads(model, params, state, tokens, head, grads, acc):
    """One branch replayed after `state`: tokens [R] at positions state.length.. attend over the state's positions
    < state.length (a state with spare capacity keeps whatever it holds beyond its length out of sight).

    head(params, hidden [R, D] final-normed) -> (loss, aux). grads: the float32 gradient accumulator (params-shaped).
    Returns (loss, aux, grads + this branch's parameter gradient, acc + the state cotangent of this branch; acc None:
    detached, no state gradient).
    """
    h, inputs = _forward(model, params, state, tokens, state.length, state.length)
    loss, vjp, aux = trainable.vjp(lambda p, h: head(p, model.final_norm(p, h)), params, grads, h, has_aux=True)
    d_head, dh = vjp(jnp.ones_like(loss))
    grads, acc = _backward(model, params, state, tokens, state.length, state.length, inputs, dh, _add(grads, d_head),
                           acc, chunk_entries=False)
    return loss, aux, grads, acc


def chunk_grads(model, params, state, tokens, start, grads, acc):
    """The prompt chunk tokens [C] at positions start.., recomputed from `state` (the final cache, with the carried
    part as it was before this chunk). acc holds the cotangent of everything the chunk wrote (its keys/values at
    start.., the carried state after it). Returns (grads + the chunk's parameter gradient, acc with the chunk's cache
    reads added and its carried part now the cotangent of the carried state before the chunk)."""
    h, inputs = _forward(model, params, state, tokens, start, start)
    return _backward(model, params, state, tokens, start, start, inputs, jnp.zeros_like(h), grads, acc,
                     chunk_entries=True)


# ----- models without the block protocol: autodiff of the whole layer stack -----


def branch_grads_autodiff(extend_hidden, params, state, tokens, head, grads, acc):
    """As `branch_grads`, by autodiff of `extend_hidden(params, state, tokens) -> final-normed hidden [R, D]`."""
    # with respect to the trainable leaves only (grads has their structure: trainable.py)
    part, rest = trainable.split_like(params, grads)

    def objective(part, state):
        params = trainable.merge(part, rest)
        return head(params, extend_hidden(params, state, tokens))

    if acc is None:
        (loss, aux), d_params = jax.value_and_grad(objective, has_aux=True)(part, state)
    else:
        (loss, aux), (d_params, d_state) = jax.value_and_grad(objective, argnums=(0, 1), has_aux=True)(part, state)
        acc = _add(acc, d_state)
    return loss, aux, _add(grads, d_params), acc


def chunk_grads_autodiff(model, params, state, tokens, start, grads, acc):
    """As `chunk_grads`, by autodiff of `model.chunk_entries` (a full-size state cotangent for the chunk)."""
    entries, vjp = trainable.vjp(lambda p, s: model.chunk_entries(p, s, tokens, start), params, grads, state)
    entries_cot = jax.tree.map(lambda c, e: c.astype(e.dtype), model.read_entries(acc, start, tokens.shape[0]),
                               entries)
    d_params, d_state = vjp(entries_cot)
    acc = model.with_carried(_add(acc, d_state), model.carried(jax.tree.map(at_least_f32, d_state)))
    return _add(grads, d_params), acc
