"""The sharded prompt API, the same for every model family: `capture` a prompt sequence-parallel over a mesh, then
`extend` (logits) or `extend_hidden` after it. Each family supplies its adapter (`model.sequence_parallel()`, the
`SequenceParallel` protocol of models/base.py): Qwen3.6 `models/qwen36_mesh.py`, GLM-5.x `models/glm52_mesh.py`."""
from __future__ import annotations

import functools

import jax

from longstraw_jax.parallel import sequence
from longstraw_jax.parallel.layout import RoundLayout, ShardedPromptState
from longstraw_jax.validation import check_left_pad, check_tokens


def round_layout(model, prompt_positions: int, shards: int, chunk_size: int | None) -> RoundLayout:
    """The layout `capture` and `grpo_grads(mesh=...)` use for `prompt_positions` on `shards` seq shards, in rounds
    of about `chunk_size` positions (None: one round)."""
    return RoundLayout.for_prompt(prompt_positions, shards, model.sequence_parallel().min_segment, chunk_size)


def capture(model, params: dict, tokens, mesh, attention: str = "ring", pad_id: int = 0,
            chunk_size: int | None = None, left_pad=None) -> ShardedPromptState:
    """Prompt tokens int32 [P] -> ShardedPromptState, sequence-parallel over `mesh`'s `seq` axis, in rounds of about
    `chunk_size` positions (None: one round; later rounds attend over the cache of earlier ones).

    `params` may be placed anywhere (ideally by `rules.param_specs`: then nothing moves but one layer at a time).
    attention ("ring" / "allgather") chooses how a round reads the other shards' keys: Qwen3.6's softmax attention
    (`sequence.causal_attention`), GLM-5.x's earlier rounds' latent rows (`models/glm52_mesh.py`). `pad_id` only
    fills padding slots; it cannot change any result (tests check this). left_pad: tokens[:left_pad] are a
    left-padded prompt's pads (int in [0, P-1], or None), as in `model.capture`."""
    tokens = check_tokens(tokens, model.config.vocab_size)
    if attention not in sequence.ATTENTION_METHODS:
        raise ValueError(f"attention={attention!r}; allowed: {sequence.ATTENTION_METHODS}")
    left_pad = check_left_pad(left_pad, tokens.shape[0] - 1)
    layout = round_layout(model, tokens.shape[0], mesh.shape[sequence.SEQ], chunk_size)
    return jitted_capture(model, params, layout.to_stored(tokens, pad_id), mesh, layout, attention, left_pad)[0]


@functools.partial(jax.jit, static_argnums=(0, 3, 4, 5))
def jitted_capture(model, params, stored_tokens, mesh, layout: RoundLayout, attention: str, left_pad=None):
    """`capture`'s jitted program (model, mesh, layout and attention static), without its host checks: stored_tokens
    are the prompt in `layout`'s stored order (`layout.to_stored`, valid ids) -> (ShardedPromptState, what the family's
    exact backward needs from the capture: e.g. Qwen3.6's GDN states carried into each round). What ahead-of-time
    tools lower (the capacity planner, tools/bench_seq_attention.py)."""
    return model.sequence_parallel().capture(params, stored_tokens, mesh, layout, attention, left_pad)


def extend_hidden(model, params: dict, sstate: ShardedPromptState, tokens, mesh, left_pad=None) -> jax.Array:
    """As `model.extend_hidden` on the sharded state: tokens int32 [T] -> final-normed hidden [T, D]; left_pad: the
    state's prompt was captured with that many left pads."""
    tokens = check_tokens(tokens, model.config.vocab_size)
    return _extend_hidden(model, params, sstate, tokens, mesh, check_left_pad(left_pad, sstate.length - 1))


@functools.partial(jax.jit, static_argnums=(0, 4))
def _extend_hidden(model, params, sstate, tokens, mesh, left_pad=None):
    return model.sequence_parallel().extend_hidden(params, sstate, tokens, mesh, left_pad)


def extend(model, params: dict, sstate: ShardedPromptState, tokens, mesh, left_pad=None) -> jax.Array:
    """As `model.extend` on the sharded state: tokens int32 [T] -> float32 logits [T, vocab]."""
    return _logits(model, params, extend_hidden(model, params, sstate, tokens, mesh, left_pad))


@functools.partial(jax.jit, static_argnums=0)
def _logits(model, params, hidden):
    return model.logits(params, hidden)
