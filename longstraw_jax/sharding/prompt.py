"""The sharded prompt API for every model family: `capture` a prompt sequence-parallel over a mesh, then `extend`
(logits) or `extend_hidden` after it. Qwen3.6: `sharding/qwen36.py`; GLM-5.x: `sharding/glm52.py`."""
from __future__ import annotations

import functools

import jax

from longstraw_jax.models.glm52 import Glm52
from longstraw_jax.models.qwen36 import Qwen36
from longstraw_jax.sharding import glm52 as sharded_glm52
from longstraw_jax.sharding import qwen36 as sharded_qwen36
from longstraw_jax.sharding.layout import RoundLayout, ShardedPromptState


def _family(model):
    if isinstance(model, Qwen36):
        return sharded_qwen36
    if isinstance(model, Glm52):
        return sharded_glm52
    raise NotImplementedError(f"no sequence-parallel path for {type(model).__name__}")


def round_layout(model, prompt_positions: int, shards: int, round_len: int | None) -> RoundLayout:
    """The layout `capture` and `grpo_grads(mesh=...)` use for `prompt_positions` on `shards` seq shards."""
    return RoundLayout.for_prompt(prompt_positions, shards, _family(model).min_segment(model.config), round_len)


def capture(model, params: dict, tokens, mesh, attention: str = "ring", pad_id: int = 0,
            round_len: int | None = None) -> ShardedPromptState:
    """Prompt tokens int32 [P] -> ShardedPromptState, sequence-parallel over `mesh`'s `seq` axis, in rounds of about
    `round_len` positions (None: one). attention ("ring" / "allgather") chooses Qwen3.6's softmax attention; GLM-5.x
    always all-gathers its latent rows (`sharding/glm52.py` says why)."""
    if isinstance(model, Glm52):
        return sharded_glm52.capture(model, params, tokens, mesh, pad_id=pad_id, round_len=round_len)
    return _family(model).capture(model, params, tokens, mesh, attention=attention, pad_id=pad_id,
                                  round_len=round_len)


def extend_hidden(model, params: dict, sstate: ShardedPromptState, tokens, mesh) -> jax.Array:
    """As `model.extend_hidden` on the sharded state: tokens int32 [T] -> final-normed hidden [T, D]."""
    return _family(model).extend_hidden(model, params, sstate, tokens, mesh)


def extend(model, params: dict, sstate: ShardedPromptState, tokens, mesh) -> jax.Array:
    """As `model.extend` on the sharded state: tokens int32 [T] -> float32 logits [T, vocab]."""
    return _logits(model, params, extend_hidden(model, params, sstate, tokens, mesh))


@functools.partial(jax.jit, static_argnums=0)
def _logits(model, params, hidden):
    return model.logits(params, hidden)
