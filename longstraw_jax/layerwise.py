"""Block-by-block backward over a model's stacked layers, adding the prompt-state cotangent in place.

Autodiff of a layer scan that reads a shared cache gives each read a cotangent the size of the whole cache, summed
afterwards: per branch (and per prompt chunk) a full-size temporary next to the accumulator. Here the backward pass
is written out instead: a forward scan over blocks keeps only each block's input h [T, D]; a reverse scan recomputes
one block at a time under `jax.vjp` with that block's slice of the state as an explicit input, so the slice's
cotangent (1/num_blocks of the state) is added into the running float32 accumulator `acc[b]` inside the scan carry,
which XLA updates in place. Activation memory is one block's; the state cotangent exists once.

Models provide the block protocol: `num_blocks`, `embed(params, tokens)`, `block_params(params)` (leaves stacked
[num_blocks, ...]), `block(bp, h, state_block, positions, cache_length) -> (h, entries)`, `final_norm(params, h)`,
and `read_entries` / `carried` / `with_carried`, which must also work on one block's slice of a state. A model
without it (GLM-5.2 so far: its layers carry IndexShare selections and come in several segments) gets the same
results from plain autodiff of its whole layer stack: correct, with a full-size state cotangent per branch/chunk.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from longstraw_jax.ops.dtypes import at_least_f32


def _at(tree, b):
    return jax.tree.map(lambda a: a[b], tree)


def _set(tree, b, sub):
    return jax.tree.map(lambda a, s: a.at[b].set(s.astype(a.dtype)), tree, sub)


def _add(acc, tree):
    return jax.tree.map(lambda a, x: a + x.astype(a.dtype), acc, tree)


def _positions(start, length: int) -> jax.Array:
    return start + jnp.arange(length, dtype=jnp.int32)


def _forward(model, params, state, tokens, start, cache_length):
    """Blocks 0..N-1 over tokens [T]: (h [T, D] after the last block, each block's input h stacked [N, T, D])."""
    positions = _positions(start, tokens.shape[0])

    def body(h, xs):
        bp, b = xs
        return model.block(bp, h, _at(state, b), positions, cache_length)[0], h

    return jax.lax.scan(body, model.embed(params, tokens), (model.block_params(params), jnp.arange(model.num_blocks)))


def _backward(model, params, state, tokens, start, cache_length, inputs, dh, acc, chunk_entries: bool):
    """Reverse scan over blocks. dh: cotangent of the last block's output h. acc: float32 state cotangent (or None:
    no gradient into the state). With `chunk_entries`, each block's new entries also receive their cotangent, read
    from acc at positions start.. (keys/values) and from acc's carried part, which is then replaced by the cotangent
    of the carried state the block read (the chunk before owns it); cache reads are added into acc.

    Returns (cotangent of params as a pytree like params, acc).
    """
    positions = _positions(start, tokens.shape[0])
    # The entries' cotangents, read for all blocks before the scan (chunk-sized): inside it, acc is only read and
    # written at block b, which XLA then updates in place.
    entries_cot = model.read_entries(acc, start, tokens.shape[0]) if chunk_entries else None

    def body(carry, xs):
        dh, acc = carry
        bp, b, h_in, entries_cot = xs
        state_block = _at(state, b)
        if acc is None:
            _, vjp = jax.vjp(lambda bp, h: model.block(bp, h, state_block, positions, cache_length)[0], bp, h_in)
            d_bp, dh = vjp(dh)
            return (dh, None), d_bp
        acc_block = _at(acc, b)
        if chunk_entries:
            entries, vjp = jax.vjp(lambda bp, h, s: model.block(bp, h, s, positions, cache_length), bp, h_in,
                                   state_block)
            entries_cot = jax.tree.map(lambda c, e: c.astype(e.dtype), entries_cot, entries[1])
            d_bp, dh, d_state = vjp((dh, entries_cot))
            acc_block = model.with_carried(_add(acc_block, d_state),
                                           model.carried(jax.tree.map(at_least_f32, d_state)))
        else:
            _, vjp = jax.vjp(lambda bp, h, s: model.block(bp, h, s, positions, cache_length)[0], bp, h_in, state_block)
            d_bp, dh, d_state = vjp(dh)
            acc_block = _add(acc_block, d_state)
        return (dh, _set(acc, b, acc_block)), d_bp

    xs = (model.block_params(params), jnp.arange(model.num_blocks), inputs, entries_cot)
    (dh, acc), d_blocks = jax.lax.scan(body, (dh, acc), xs, reverse=True)
    _, vjp = jax.vjp(lambda p: (model.embed(p, tokens), model.block_params(p)), params)
    return vjp((dh, d_blocks))[0], acc


def branch_grads(model, params, state, tokens, head, acc):
    """One branch replayed after `state`: tokens [R] at positions state.length.. attend over the whole state.

    head(params, hidden [R, D] final-normed) -> (loss, aux). Returns (loss, aux, param grads, acc + the state
    cotangent of this branch; acc None: detached, no state gradient).
    """
    if not hasattr(model, "block"):
        return _branch_grads_autodiff(model, params, state, tokens, head, acc)
    h, inputs = _forward(model, params, state, tokens, state.length, None)
    loss, vjp, aux = jax.vjp(lambda p, h: head(p, model.final_norm(p, h)), params, h, has_aux=True)
    d_head, dh = vjp(jnp.ones_like(loss))
    d_layers, acc = _backward(model, params, state, tokens, state.length, None, inputs, dh, acc, chunk_entries=False)
    return loss, aux, _add(jax.tree.map(at_least_f32, d_head), d_layers), acc


def chunk_grads(model, params, state, tokens, start, acc):
    """The prompt chunk tokens [C] at positions start.., recomputed from `state` (the final cache, with the carried
    part as it was before this chunk). acc holds the cotangent of everything the chunk wrote (its keys/values at
    start.., the carried state after it). Returns (param grads, acc with the chunk's cache reads added and its
    carried part now the cotangent of the carried state before the chunk)."""
    if not hasattr(model, "block"):
        return _chunk_grads_autodiff(model, params, state, tokens, start, acc)
    h, inputs = _forward(model, params, state, tokens, start, start)
    grads, acc = _backward(model, params, state, tokens, start, start, inputs, jnp.zeros_like(h), acc,
                           chunk_entries=True)
    return jax.tree.map(at_least_f32, grads), acc


# ----- models without the block protocol: autodiff of the whole layer stack -----


def _branch_grads_autodiff(model, params, state, tokens, head, acc):
    return branch_grads_autodiff(model._extend_hidden, params, state, tokens, head, acc)


def branch_grads_autodiff(extend_hidden, params, state, tokens, head, acc):
    """As `branch_grads`, by autodiff of `extend_hidden(params, state, tokens) -> final-normed hidden [R, D]`."""
    def objective(params, state):
        return head(params, extend_hidden(params, state, tokens))

    if acc is None:
        (loss, aux), grads = jax.value_and_grad(objective, has_aux=True)(params, state)
    else:
        (loss, aux), (grads, d_state) = jax.value_and_grad(objective, argnums=(0, 1), has_aux=True)(params, state)
        acc = _add(acc, d_state)
    return loss, aux, jax.tree.map(at_least_f32, grads), acc


def _chunk_grads_autodiff(model, params, state, tokens, start, acc):
    entries, vjp = jax.vjp(lambda p, s: model.chunk_entries(p, s, tokens, start), params, state)
    entries_cot = jax.tree.map(lambda c, e: c.astype(e.dtype), model.read_entries(acc, start, tokens.shape[0]),
                               entries)
    grads, d_state = vjp(entries_cot)
    acc = model.with_carried(_add(acc, d_state), model.carried(jax.tree.map(at_least_f32, d_state)))
    return jax.tree.map(at_least_f32, grads), acc
