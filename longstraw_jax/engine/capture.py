"""Capture: the prompt's state, computed once without autograd, the same for every model family.

One device: `capture_chunks` walks the prompt in chunks of `chunk_size` (a `lax.scan`), each chunk written into the
state by `model.capture_chunk` (`model.capture` is this, jitted). A mesh: `capture_on_mesh` captures sequence-parallel
over the mesh's `seq` axis in rounds of about `chunk_size` positions, through the family's mesh adapter
(`model.mesh_adapter()`, the `MeshAdapter` protocol of models/base.py); `extend_on_mesh` / `extend_hidden_on_mesh`
continue after the sharded state.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from longstraw_jax.common import progress
from longstraw_jax.common.validation import check_left_pad, check_size, check_tokens
from longstraw_jax.sharding import sequence
from longstraw_jax.sharding.layout import RoundLayout, ShardedPromptState

# ----- one device: chunks ----------------------------------------------------------------------------------


def chunk_layout(length: int, chunk_size: int) -> tuple[int, int]:
    """(number of full chunks, length of the remainder chunk) for a prompt of `length` tokens."""
    return divmod(int(length), check_size(chunk_size, "chunk_size"))


def capture_chunks(model, params, tokens: jax.Array, chunk_size: int, dtype, keep_boundaries: bool = False,
                   capacity: int | None = None, left_pad=None):
    """Capture tokens [P] in chunks of `chunk_size` (a `lax.scan` over full chunks, then one remainder chunk) into a
    state of length P with room for `capacity` positions (default P; more leaves room to decode after the prompt:
    `advance` at positions P.. writes there, and nothing that reads the state as a whole looks past its length).

    Returns the state, and with keep_boundaries also `(full, last)`: `model.carried(state)` before each full chunk
    (leaves stacked [N, ...]) and before the remainder chunk (None when chunk_size divides P). The computation (and
    so the state on positions < P and the boundaries) does not depend on `capacity`.

    left_pad (int32 [], traced, or None): tokens[:left_pad] are pads of a left-padded prompt (docs/architecture.md
    4.6): never attended, and Qwen3.6's GDN state passes them unchanged. The state of the real tokens then
    equals the unpadded prompt's, shifted by left_pad positions. None: no padding (the same program as before).
    """
    state = model.init_state(tokens.shape[0], dtype, capacity=capacity)
    num_full, remainder = chunk_layout(tokens.shape[0], chunk_size)
    full_boundaries = last_boundary = None
    chunks_total = num_full + (remainder > 0)
    if num_full:
        chunks = tokens[: num_full * chunk_size].reshape(num_full, chunk_size)

        def step(state, xs):
            index, chunk = xs
            boundary = model.carried(state) if keep_boundaries else None
            state = model.capture_chunk(params, state, chunk, index * chunk_size, left_pad=left_pad)
            progress.tick("capture", index + 1, chunks_total, chunk_size, after=state)
            return state, boundary

        state, full_boundaries = jax.lax.scan(step, state, (jnp.arange(num_full, dtype=jnp.int32), chunks))
    if remainder:
        last_boundary = model.carried(state) if keep_boundaries else None
        state = model.capture_chunk(params, state, tokens[num_full * chunk_size :], num_full * chunk_size,
                                    left_pad=left_pad)
        progress.tick("capture", jnp.int32(chunks_total), chunks_total, remainder, after=state)
    return (state, (full_boundaries, last_boundary)) if keep_boundaries else state


# ----- a mesh: rounds -----------------------------------------------------------------------------------------


def round_layout(model, prompt_positions: int, shards: int, chunk_size: int | None) -> RoundLayout:
    """The layout `capture_on_mesh` and `grpo_grads(mesh=...)` use for `prompt_positions` on `shards` seq shards, in
    rounds of about `chunk_size` positions (None: one round)."""
    return RoundLayout.for_prompt(prompt_positions, shards, model.mesh_adapter().min_segment, chunk_size)


def capture_on_mesh(model, params: dict, tokens, mesh, attention: str = "ring", pad_id: int = 0,
                    chunk_size: int | None = None, left_pad=None) -> ShardedPromptState:
    """Prompt tokens int32 [P] -> ShardedPromptState, sequence-parallel over `mesh`'s `seq` axis, in rounds of about
    `chunk_size` positions (None: one round; later rounds attend over the cache of earlier ones).

    `params` may be placed anywhere (ideally by `rules.param_specs`: then nothing moves but one layer at a time).
    attention ("ring" / "allgather") chooses how a round reads the other shards' keys: Qwen3.6's softmax attention
    (`sequence.causal_attention`), GLM-5.x's earlier rounds' latent rows (`models/glm52/mesh.py`). `pad_id` only
    fills padding slots; it cannot change any result (tests check this). left_pad: tokens[:left_pad] are a
    left-padded prompt's pads (int in [0, P-1], or None), as in `model.capture`."""
    tokens = check_tokens(tokens, model.config.vocab_size)
    if attention not in sequence.ATTENTION_METHODS:
        raise ValueError(f"attention={attention!r}; allowed: {sequence.ATTENTION_METHODS}")
    left_pad = check_left_pad(left_pad, tokens.shape[0] - 1)
    layout = round_layout(model, tokens.shape[0], mesh.shape[sequence.SEQ], chunk_size)
    return jitted_capture_on_mesh(model, params, layout.to_stored(tokens, pad_id), mesh, layout, attention, left_pad)[0]


@functools.partial(jax.jit, static_argnums=(0, 3, 4, 5))
def jitted_capture_on_mesh(model, params, stored_tokens, mesh, layout: RoundLayout, attention: str, left_pad=None):
    """`capture_on_mesh`'s jitted program (model, mesh, layout and attention static), without its host checks:
    stored_tokens are the prompt in `layout`'s stored order (`layout.to_stored`, valid ids) -> (ShardedPromptState, what
    the family's exact backward needs from the capture: e.g. Qwen3.6's GDN states carried into each round). What
    ahead-of-time tools lower (the capacity planner, tools/bench_seq_attention.py)."""
    return model.mesh_adapter().capture(params, stored_tokens, mesh, layout, attention, left_pad)


def extend_hidden_on_mesh(model, params: dict, sstate: ShardedPromptState, tokens, mesh, left_pad=None) -> jax.Array:
    """As `model.extend_hidden` on the sharded state: tokens int32 [T] -> final-normed hidden [T, D]; left_pad: the
    state's prompt was captured with that many left pads."""
    tokens = check_tokens(tokens, model.config.vocab_size)
    return _jitted_extend_hidden(model, params, sstate, tokens, mesh, check_left_pad(left_pad, sstate.length - 1))


@functools.partial(jax.jit, static_argnums=(0, 4))
def _jitted_extend_hidden(model, params, sstate, tokens, mesh, left_pad=None):
    return model.mesh_adapter().extend_hidden(params, sstate, tokens, mesh, left_pad)


def extend_on_mesh(model, params: dict, sstate: ShardedPromptState, tokens, mesh, left_pad=None) -> jax.Array:
    """As `model.extend` on the sharded state: tokens int32 [T] -> float32 logits [T, vocab]."""
    return _logits(model, params, extend_hidden_on_mesh(model, params, sstate, tokens, mesh, left_pad))


@functools.partial(jax.jit, static_argnums=0)
def _logits(model, params, hidden):
    return model.logits(params, hidden)
