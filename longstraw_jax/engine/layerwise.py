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
methods of those names. Two generalisations serve a family whose layers are not one repeated block:
- `stages`: several kinds of blocks run one after another (`Stage`: its own block count, parameters and state
  slices), scanned in order forward and in reverse backward; `None` is the model's own blocks as one stage.
  GLM-5.x: one stage per segment (a block is one repeat of the segment's layer pattern, `models/glm52/model.py`).
- The block carry `h` may be a pytree with integer leaves (GLM-5.x: `(h, selected)`, the IndexShare selection that
  shared layers reuse from the latest full layer, possibly in an earlier block): they are recomputed in the forward,
  stored with each block's input, and get no cotangent (the backward differentiates the floating leaves only).
And the state cotangent accumulator `acc` may lack leaves of the state (None there: `Model.differentiable_state`):
those leaves are closed over as constants, never vjp inputs, so no cotangent of them is ever allocated (GLM-5.x: the
indexer keys, read only by the non-differentiable top-k selection). Qwen3.6 uses none of this: one stage, an array
carry, a full accumulator, and the same computation as before.
A caller may also pass `embed_grads(grads, tokens, dh)`, which adds the embedding's gradient itself (e.g. a row
scatter-add into the accumulator, in place); by default it comes from a vjp of `embed`, a params-shaped temporary
added into grads (Qwen3.6 on a mesh passes one: `models/qwen36/mesh.py`).

A family may also keep `CausalLM`'s defaults, `branch_grads_autodiff` / `chunk_grads_autodiff`: the same results
from plain autodiff of its whole layer stack, with a full-size state cotangent per branch/chunk.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp

from longstraw_jax.adapters import trainable
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


def _is_none(x) -> bool:
    return x is None


def _floats(tree):
    """tree with its integer leaves (e.g. IndexShare selections in a block carry) replaced by None: the part that
    gets a cotangent. An array (Qwen's h) is returned as is."""
    return jax.tree.map(lambda x: x if jnp.issubdtype(x.dtype, jnp.inexact) else None, tree)


def _like(part, tree):
    """tree restricted to part's structure: tree's leaf where part has one, None where part has None."""
    return jax.tree.map(lambda p, x: None if p is None else x, part, tree, is_leaf=_is_none)


def _fill(part, tree):
    """part with its None leaves taken from tree (the inverse of `_like` / `_floats`)."""
    return jax.tree.map(lambda p, x: x if p is None else p, part, tree, is_leaf=_is_none)


def _positions(start, length: int) -> jax.Array:
    return start + jnp.arange(length, dtype=jnp.int32)


@runtime_checkable
class Stage(Protocol):
    """One kind of block, repeated `num_blocks` times. `block_params` leaves are stacked [num_blocks, ...]; `block`
    runs one block (as `BlockModel.block`); `at(tree, b)` is block b's slice of a state, of a state cotangent (None
    leaves stay None) or of a chunk's entries, `set_at(tree, b, sub)` writes a slice back (in place in a scan carry);
    `stacked(entries)` turns a chunk's entries (`read_entries` of a whole state) into leaves [num_blocks, ...]."""

    num_blocks: int

    def block_params(self, params: dict) -> dict: ...

    def with_block_params(self, params: dict, blocks: dict) -> dict: ...

    def block(self, bp: dict, h, state_block, positions: jax.Array, cache_length, left_pad=None) -> tuple: ...

    def at(self, tree, b): ...

    def set_at(self, tree, b, sub): ...

    def stacked(self, entries): ...


@dataclasses.dataclass(frozen=True)
class Forwarding:
    """`inner`'s block protocol (a `models.base.BlockModel` or a `Stage`) except what a subclass defines: every other
    attribute is `inner`'s. The mesh adapters use it to run one block in its own `shard_map` (`block`) and a capture
    round's own embedding and cotangent reads (`embed`, `read_entries`) while the rest stays the model's or stage's.
    A subclass is a frozen dataclass; its first field is `inner`."""

    inner: Any

    def __getattr__(self, name):
        if name.startswith("__") or name == "inner":  # dunders, and `inner` itself before it is set: no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)


@dataclasses.dataclass(frozen=True)
class _Branches(Forwarding):
    """k branches replayed together: `inner`'s embedding, blocks and final norm run per branch (vmapped over the
    leading branch axis of tokens [k, R] and of every block carry leaf), sharing the parameters and the state, so a
    vjp sums their cotangents over the branches."""

    def embed(self, params, tokens):
        return jax.vmap(lambda t: self.inner.embed(params, t))(tokens)

    def block(self, bp, h, state_block, positions, cache_length, left_pad=None):
        return jax.vmap(lambda h: self.inner.block(bp, h, state_block, positions, cache_length, left_pad=left_pad))(h)

    def final_norm(self, params, h):
        return jax.vmap(lambda h: self.inner.final_norm(params, h))(h)


def _each_branch(embed_grads):
    """An `embed_grads` of one branch's tokens [R] -> one of k branches' tokens [k, R] (added branch by branch)."""
    def add(grads, tokens, dh):
        for i in range(tokens.shape[0]):
            grads = embed_grads(grads, tokens[i], jax.tree.map(lambda x: x[i], dh))
        return grads

    return add


@dataclasses.dataclass(frozen=True)
class _Uniform(Forwarding):
    """A `BlockModel`'s own blocks as one stage: every leaf of a state (and of its entries) has the block axis
    first."""

    def at(self, tree, b):
        return _at(tree, b)

    def set_at(self, tree, b, sub):
        return _set(tree, b, sub)

    def stacked(self, entries):
        return entries


def _forward(model, stages, params, state, tokens, start, cache_length, left_pad=None, last_block: bool = True):
    """The stages' blocks in order over tokens [T] ([k, T]: k branches, `_Branches`): (the carry after the last
    block, per stage each block's input carry stacked [nb, ...]).

    last_block=False: the inputs are all that is wanted (a prompt chunk: its output carry gets no cotangent), so the
    last block is not run; the carry returned is then the last block's input (same structure and shapes)."""
    positions = _positions(start, tokens.shape[-1])
    h, inputs = model.embed(params, tokens), []
    for i, stage in enumerate(stages):
        def body(h, xs, stage=stage):
            bp, b = xs
            return stage.block(bp, h, stage.at(state, b), positions, cache_length, left_pad=left_pad)[0], h

        if last_block or i < len(stages) - 1:
            h, stage_inputs = jax.lax.scan(body, h, (stage.block_params(params), jnp.arange(stage.num_blocks)))
        elif stage.num_blocks > 1:  # blocks 0..nb-2 (parameters read by index: no sliced copy), the last one's input
            blocks = stage.block_params(params)
            h, head = jax.lax.scan(lambda h, b: body(h, (_at(blocks, b), b)), h, jnp.arange(stage.num_blocks - 1))
            stage_inputs = jax.tree.map(lambda xs, x: jnp.concatenate([xs, x[None]]), head, h)
        else:
            stage_inputs = jax.tree.map(lambda x: x[None], h)
        inputs.append(stage_inputs)
    return h, inputs


def _backward_stage(model, stage, params, state, positions, cache_length, inputs, entries_cot, dh, grads, acc,
                    chunk_entries: bool, left_pad=None, no_output_cotangent: bool = False):
    """Reverse scan over one stage's blocks (see `_backward`). Returns (dh, grads, acc).

    no_output_cotangent (a prompt chunk's last stage, chunk_entries): the stage's last block gets no cotangent on its
    output carry (dh is zero there), so it is differentiated on its own through its entries alone: what only feeds
    its output (e.g. the last layer's mixer output and MLP) is neither run nor transposed."""
    def body(carry, xs, with_output: bool = True):
        dh, acc, grads_blocks = carry
        bp, b, h_in, entries_cot = xs
        state_block = stage.at(state, b)
        run = lambda bp, h, s: stage.block(bp, _fill(h, h_in), s, positions, cache_length, left_pad=left_pad)
        # with respect to the trainable leaves of the block only (grads_blocks has their structure:
        # adapters/trainable.py)
        vjp_of = lambda fn, *primals: trainable.vjp(fn, bp, grads_blocks, *primals)
        if acc is None:
            _, vjp = vjp_of(lambda bp, h: _floats(run(bp, h, state_block)[0]), _floats(h_in))
            d_bp, dh = vjp(dh)
            return (dh, None, _add_at(grads_blocks, b, d_bp)), None
        acc_block = stage.at(acc, b)
        # the state leaves acc has are vjp inputs; the others (None in acc) are constants: no cotangent for them
        state_in = _like(acc_block, state_block)
        if chunk_entries:
            def entries_fn(bp, h, s):  # the entries that get a cotangent: those acc has (entries_cot's structure)
                h, entries = run(bp, h, _fill(s, state_block))
                return (_floats(h), _like(entries_cot, entries)) if with_output else _like(entries_cot, entries)

            entries, vjp = vjp_of(entries_fn, _floats(h_in), state_in)
            cast = lambda entries: jax.tree.map(lambda c, e: c.astype(e.dtype), entries_cot, entries)
            d_bp, dh, d_state = vjp((dh, cast(entries[1])) if with_output else cast(entries))
            acc_block = model.with_carried(_add(acc_block, d_state),
                                           model.carried(jax.tree.map(at_least_f32, d_state)))
        else:
            _, vjp = vjp_of(lambda bp, h, s: _floats(run(bp, h, _fill(s, state_block))[0]), _floats(h_in), state_in)
            d_bp, dh, d_state = vjp(dh)
            acc_block = _add(acc_block, d_state)
        return (dh, stage.set_at(acc, b, acc_block), _add_at(grads_blocks, b, d_bp)), None

    xs = (stage.block_params(params), jnp.arange(stage.num_blocks), inputs,
          None if entries_cot is None else stage.stacked(entries_cot))
    carry = (dh, acc, stage.block_params(grads))
    if no_output_cotangent and chunk_entries and acc is not None:
        # the last block through its entries alone, chosen inside the one scan (a block peeled off before the loop
        # would hold its own activation buffers next to the loop's: twice the temporaries)
        last = stage.num_blocks - 1
        step = lambda carry, xs: jax.lax.cond(xs[1] == last, lambda c, x: body(c, x, with_output=False), body,
                                              carry, xs)
        carry, _ = jax.lax.scan(step, carry, xs, reverse=True)
    else:
        carry, _ = jax.lax.scan(body, carry, xs, reverse=True)
    dh, acc, grads_blocks = carry
    return dh, stage.with_block_params(grads, grads_blocks), acc


def _backward(model, stages, params, state, tokens, start, cache_length, inputs, dh, grads, acc,
              chunk_entries: bool, embed_grads=None, left_pad=None, no_output_cotangent: bool = False):
    """Reverse scans over the stages' blocks, last stage first. dh: cotangent of the last block's output carry
    (floating leaves). grads: float32 params-shaped gradient accumulator. acc: float32 state cotangent (or None: no
    gradient into the state). With `chunk_entries`, each block's new entries also receive their cotangent, read
    from acc at positions start.. (keys/values) and from acc's carried part, which is then replaced by the cotangent
    of the carried state the block read (the chunk before owns it); cache reads are added into acc. embed_grads:
    see `branch_grads`. no_output_cotangent: dh is zero (a prompt chunk), so the last block is differentiated
    through its entries alone (`_backward_stage`).

    Returns (grads + the gradient of params through the blocks and the embedding, acc).
    """
    positions = _positions(start, tokens.shape[-1])
    # The entries' cotangents, read for all blocks before the scans (chunk-sized): inside them, acc is only read and
    # written at block b, which XLA then updates in place.
    entries_cot = model.read_entries(acc, start, tokens.shape[0]) if chunk_entries else None
    for i, (stage, stage_inputs) in enumerate(zip(reversed(stages), reversed(inputs))):
        dh, grads, acc = _backward_stage(model, stage, params, state, positions, cache_length, stage_inputs,
                                         entries_cot, dh, grads, acc, chunk_entries, left_pad,
                                         no_output_cotangent=no_output_cotangent and i == 0)
    if embed_grads is not None:
        return embed_grads(grads, tokens, dh), acc
    _, vjp = trainable.vjp(lambda p: _floats(model.embed(p, tokens)), params, grads)
    return _add(grads, vjp(dh)[0]), acc


def branch_grads(model, params, state, tokens, head, grads, acc, stages=None, embed_grads=None, left_pad=None):
    """One branch replayed after `state`: tokens [R] at positions state.length.. attend over the state's positions
    < state.length (a state with spare capacity keeps whatever it holds beyond its length out of sight). tokens
    [k, R]: k branches at once (each its own forward, `_Branches`; head then gets hidden [k, R, D]), their
    gradients and state cotangents added.

    head(params, hidden [R, D] final-normed) -> (loss, aux). grads: the float32 gradient accumulator (params-shaped).
    acc: the float32 state cotangent accumulator (None: detached, no state gradient); a None leaf in it (a state
    leaf that receives no gradient) is never differentiated. stages: the kinds of blocks (`Stage`s) in order; None:
    the model's own blocks (`BlockModel`). embed_grads(grads, tokens, dh) -> grads + the embedding's gradient given
    dh, the cotangent of `embed`'s output (floating leaves); None: by vjp of `model.embed`. left_pad (int32 [] or
    None): the state's prompt positions < left_pad are pads (every block hides them). Returns (loss, aux,
    grads + this branch's parameter gradient, acc + the state cotangent of this branch).
    """
    stages = (_Uniform(model),) if stages is None else stages
    if tokens.ndim == 2:
        model, stages = _Branches(model), tuple(_Branches(stage) for stage in stages)
        embed_grads = None if embed_grads is None else _each_branch(embed_grads)
    h, inputs = _forward(model, stages, params, state, tokens, state.length, state.length, left_pad)
    loss, vjp, aux = trainable.vjp(lambda p, hf: head(p, model.final_norm(p, _fill(hf, h))), params, grads,
                                   _floats(h), has_aux=True)
    d_head, dh = vjp(jnp.ones_like(loss))
    grads, acc = _backward(model, stages, params, state, tokens, state.length, state.length, inputs, dh,
                           _add(grads, d_head), acc, chunk_entries=False, embed_grads=embed_grads, left_pad=left_pad)
    return loss, aux, grads, acc


def chunk_grads(model, params, state, tokens, start, grads, acc, stages=None, embed_grads=None, left_pad=None):
    """The prompt chunk tokens [C] at positions start.., recomputed from `state` (the final cache, with the carried
    part as it was before this chunk). acc holds the cotangent of everything the chunk wrote (its keys/values at
    start.., the carried state after it). Returns (grads + the chunk's parameter gradient, acc with the chunk's cache
    reads added and its carried part now the cotangent of the carried state before the chunk). stages,
    embed_grads, left_pad: as in `branch_grads` (the chunk's own rows at positions < left_pad are pads too)."""
    stages = (_Uniform(model),) if stages is None else stages
    # the last block's output carry gets no cotangent (only the entries do): its forward is not needed
    h, inputs = _forward(model, stages, params, state, tokens, start, start, left_pad, last_block=False)
    return _backward(model, stages, params, state, tokens, start, start, inputs,
                     jax.tree.map(jnp.zeros_like, _floats(h)), grads, acc, chunk_entries=True, embed_grads=embed_grads,
                     left_pad=left_pad, no_output_cotangent=True)


# ----- models without the block protocol: autodiff of the whole layer stack -----


def branch_grads_autodiff(extend_hidden, params, state, tokens, head, grads, acc):
    """As `branch_grads`, by autodiff of `extend_hidden(params, state, tokens) -> final-normed hidden [R, D]`
    (tokens [k, R]: vmapped over the k branches)."""
    # with respect to the trainable leaves only (grads has their structure: adapters/trainable.py)
    part, rest = trainable.split_like(params, grads)

    def objective(part, state):
        params = trainable.merge(part, rest)
        if tokens.ndim == 2:
            return head(params, jax.vmap(lambda t: extend_hidden(params, state, t))(tokens))
        return head(params, extend_hidden(params, state, tokens))

    if acc is None:
        (loss, aux), d_params = jax.value_and_grad(objective, has_aux=True)(part, state)
    else:
        (loss, aux), (d_params, d_state) = jax.value_and_grad(objective, argnums=(0, 1), has_aux=True)(part, state)
        acc = _add(acc, d_state)
    return loss, aux, _add(grads, d_params), acc


def chunk_grads_autodiff(model, params, state, tokens, start, grads, acc, left_pad=None):
    """As `chunk_grads`, by autodiff of `model.chunk_entries` (a full-size state cotangent for the chunk)."""
    entries, vjp = trainable.vjp(lambda p, s: model.chunk_entries(p, s, tokens, start, left_pad=left_pad), params,
                                 grads, state)
    entries_cot = jax.tree.map(lambda c, e: c.astype(e.dtype), model.read_entries(acc, start, tokens.shape[0]),
                               entries)
    d_params, d_state = vjp(entries_cot)
    acc = model.with_carried(_add(acc, d_state), model.carried(jax.tree.map(at_least_f32, d_state)))
    return _add(grads, d_params), acc
