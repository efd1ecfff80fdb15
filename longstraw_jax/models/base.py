"""What every model family shares: the contracts (`typing.Protocol`s) the engine relies on, the public entry points
(`CausalLM`) and config.json helpers. (The chunked walk over a prompt is the engine's: `engine/capture.py`.)

Contracts (structural: a family implements them by having the methods, no registration):
- `PromptState`: what `capture` returns (a flax struct dataclass: a pytree with a static `length`).
- `Model`: the state protocol every family implements; `engine/local.py`, `engine/naive.py`, `sampling/branches.py` use
  only this.
- `BlockModel`: the block protocol of `engine/layerwise.py` (block-by-block backward over stacked layers).
- `MeshAdapter`: the family's adapter for the sharded engine (`model.mesh_adapter()`), used by
  `engine/capture.py` and `engine/mesh.py`.
A new family writes its model (and, for meshes, its adapter); nothing in the engines dispatches on model classes.
"""
import functools
import json
import os
import warnings
from typing import Any, Callable, NamedTuple, Protocol, runtime_checkable

import jax
import jax.numpy as jnp

from longstraw_jax.common.validation import check_left_pad, check_tokens
from longstraw_jax.engine import layerwise
from longstraw_jax.engine.capture import capture_chunks, chunk_layout
from longstraw_jax.ops.dtypes import accum_dtype


@runtime_checkable
class PromptState(Protocol):
    """What later tokens need from a prompt of `length` tokens: appended parts (KV caches, latent rows: position
    axis listed in `sharding.rules.SEQ_AXES`) and carried parts (overwritten by each chunk: GDN conv tails and
    recurrent matrices). Families: `qwen36.Qwen36State`, `glm52.Glm52State`."""

    length: int

    def nbytes(self) -> int: ...

    def replace(self, **fields) -> "PromptState": ...


@runtime_checkable
class Model(Protocol):
    """The state protocol. A chunk writes tokens [C] at positions start.. into a state that holds positions < start:
    `chunk_entries` reads the state (never writes it) and returns the chunk's entries; `write_entries` puts them in
    (in place: appended parts at start.., carried parts replaced); `read_entries` is its transpose (used on
    cotangents). `carried` / `with_carried` get and set the carried part: before each chunk it is all that a
    backward pass needs to recompute the chunk, since appended parts are final after the chunk that writes them.
    Every method that reads a prompt takes `left_pad` (int32 [] or None): positions < left_pad are a left-padded
    prompt's pads, on which no real position may depend (docs/architecture.md 4.6)."""

    config: Any
    state_type: type

    def init(self, key: jax.Array, dtype=jnp.float32) -> dict: ...

    def init_state(self, length: int, dtype=jnp.float32, capacity: int | None = None) -> PromptState:
        """Zero state of `length` valid positions; appended parts sized `capacity` (default length; see
        `state_capacity`). Whatever reads a whole state (`extend`, `branch_grads`) reads positions < length only."""

    def capture_chunk(self, params: dict, state: PromptState, tokens: jax.Array, start,
                      left_pad=None) -> PromptState: ...

    def chunk_entries(self, params: dict, state: PromptState, tokens: jax.Array, start, left_pad=None) -> dict: ...

    def write_entries(self, state: PromptState, entries: dict, start) -> PromptState: ...

    def read_entries(self, state: PromptState, start, size: int) -> dict: ...

    def carried(self, state: PromptState) -> Any: ...

    def with_carried(self, state: PromptState, carried) -> PromptState: ...

    def advance(self, params: dict, state: PromptState, tokens: jax.Array, start,
                left_pad=None) -> tuple[jax.Array, PromptState]:
        """capture_chunk that also returns the tokens' final-normed hidden states [C, D] (decoding)."""

    def lm_head(self, params: dict) -> jax.Array: ...

    def logits(self, params: dict, hidden: jax.Array) -> jax.Array: ...

    def differentiable_state(self, state: PromptState) -> PromptState:
        """`state` with the leaves that never receive a gradient set to None: the structure of the state cotangent
        accumulator (`engine/replay.py`), so that none is allocated for them."""

    def branch_grads(self, params, state, tokens, head, grads, acc, left_pad=None): ...

    def chunk_grads(self, params, state, tokens, start, grads, acc, left_pad=None): ...

    def decode(self, params: dict, state: PromptState, tail: PromptState, token, position, left_pad=None):
        """One decoded token after the prompt `state` (sampling: `sampling/branches.py`)."""

    def mesh_adapter(self) -> "MeshAdapter": ...


@runtime_checkable
class BlockModel(Protocol):
    """The block protocol of `engine/layerwise.py`: layers stacked in `num_blocks` identical blocks. `block_params`
    leaves are stacked [num_blocks, ...]; `block` runs one block on h [T, D] at `positions`, reading `state_block`
    (every state leaf indexed at the block) up to `cache_length` (None: all), and returns (h, the block's entries as
    `chunk_entries` gives them, minus the block axis). `read_entries` / `carried` / `with_carried` must also work on
    one block's slice of a state. A family whose layers are not one repeated block passes `layerwise.Stage`s instead
    (GLM-5.x: one per segment, `Glm52.block_stages`)."""

    num_blocks: int

    def embed(self, params: dict, tokens: jax.Array) -> jax.Array: ...

    def block_params(self, params: dict) -> dict: ...

    def with_block_params(self, params: dict, blocks: dict) -> dict: ...

    def block(self, bp: dict, h: jax.Array, state_block, positions: jax.Array, cache_length,
              left_pad=None) -> tuple: ...

    def final_norm(self, params: dict, h: jax.Array) -> jax.Array: ...


@runtime_checkable
class MeshAdapter(Protocol):
    """A family's pieces for the sharded engine on a ("data", "seq") mesh. Tokens arrive in a `RoundLayout`'s
    stored order (`sharding/layout.py`); every method is traceable (the callers jit)."""

    min_segment: int  # the shortest segment a layout may use (e.g. a conv halo must fit in the previous segment)
    linear_leaves: frozenset  # the layers' matrices applied only through `ops.mlp.linear`: decoded as shards

    def capture(self, params, stored_tokens, mesh, rounds, attention: str, left_pad=None) -> tuple[Any, Any]:
        """-> (ShardedPromptState, capture_aux: what the exact backward needs from the capture, or None).
        left_pad (int32 [] or None): the prompt's first left_pad natural positions are pads (they sit in the first
        shard(s); positions are global)."""

    def extend_hidden(self, params, sstate, tokens, mesh, left_pad=None) -> jax.Array:
        """tokens [T] after the sharded state -> final-normed hidden [T, D]."""

    def branch_grads(self, mesh, rounds, specs) -> Callable:
        """The replay's `branch_grads(params, sstate, tokens, head, grads, acc, left_pad=None)` on the mesh
        (`engine/replay.py`)."""

    def prompt_backward(self, params, stored_tokens, mesh, rounds, attention: str, sstate, capture_aux, state_cot,
                        grads, left_pad=None) -> dict:
        """grads + the gradient of the sharded capture given the float32 state cotangent (exact mode)."""

    def init_tail(self, params, sstate, capacity: int) -> PromptState:
        """The decoding state after the sharded prompt (sampling on the mesh, `sampling/mesh.py`): replicated, room
        for `capacity` decoded positions P.. and the prompt's carried part. Nothing of size P."""

    def decode(self, params, sstate, tail, token, position, mesh, left_pad=None) -> tuple[jax.Array, PromptState]:
        """One token (int32 []) at `position` (traced, P <= position < P + capacity) after the sharded prompt
        (read-only, seq-sharded) and the tail's positions P..position-1 -> (final-normed hidden [1, D], the tail
        with the token written at slot position - P). Equals `advance` on one device on the whole state."""


class Slot(NamedTuple):
    """Where one HF tensor lives in our params: `flat[path][index]` (flat = flatten_dict(params, sep="/")),
    reshaped to `hf_shape` on disk. index is () for unstacked leaves, (block, j) or (layer, expert) for stacked.
    Each model's `hf_layout()` maps HF tensor names to Slots (read and written by models/hf.py)."""

    path: str
    index: tuple[int, ...]
    hf_shape: tuple[int, ...]


def state_capacity(length: int, capacity: int | None) -> int:
    """The position-axis size of a state of `length` valid positions asked to have room for `capacity` (None:
    exactly `length`). ValueError when capacity < length."""
    if capacity is None:
        return length
    if capacity < length:
        raise ValueError(f"capacity={capacity} is below the prompt length {length}")
    return capacity


def read_json(path: str, what: str = "file", kind: type = dict):
    """The JSON value of `path`, which must be a `kind` (default: an object); ValueError naming the file (and the
    line and column of a syntax error) otherwise."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{path}: {what} is not valid JSON: {e}") from None
    if not isinstance(value, kind):
        raise ValueError(f"{path}: {what} must be a JSON {'object' if kind is dict else kind.__name__}, "
                         f"got {type(value).__name__}")
    return value


def read_json_config(source) -> dict:
    """A transformers config as a dict: given a dict, a config.json path, or a checkpoint directory (errors name the
    file)."""
    if isinstance(source, dict):
        return source
    path = os.fspath(source)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"no config.json at {path}")
    return read_json(path, "config file")


def check_config_fields(raw: dict, known: set, strict: bool, what: str = "fields") -> None:
    """Unknown config.json keys: a warning naming them (strict: a ValueError) — a real config may carry keys that
    do not change the math, and refusing to load it would be worse."""
    unknown = sorted(set(raw) - known)
    if unknown:
        message = f"config.json: unknown {what} {unknown}; they are not read by this port"
        if strict:
            raise ValueError(message)
        warnings.warn(message, stacklevel=3)


class CausalLM:
    """Entry points every model shares. A subclass (a frozen dataclass with `config`) provides `init_state(length,
    dtype)`, `_extend_hidden(params, state, tokens, remat=False)` (final-normed hidden states, jitted),
    `chunk_entries` and `write_entries`; the public methods validate tokens on the host, then call jitted code."""

    def forward(self, params: dict, tokens, left_pad=None) -> jax.Array:
        """Reference path: tokens int32 [T] -> float32 logits [T, vocab]. left_pad: tokens[:left_pad] are pads
        (int in [0, T-1]; their logits are meaningless, the others equal those of tokens[left_pad:] alone)."""
        tokens = check_tokens(tokens, self.config.vocab_size)
        return self._forward(params, tokens, left_pad=check_left_pad(left_pad, tokens.shape[0] - 1))

    def capture(self, params: dict, tokens, chunk_size: int = 2048, left_pad=None):
        """Prompt tokens int32 [P] -> the model's state, in chunks of `chunk_size` (need not divide P); no logits.
        left_pad: tokens[:left_pad] are pads (int in [0, P-1]; `capture_chunks`)."""
        tokens = check_tokens(tokens, self.config.vocab_size)
        chunk_layout(tokens.shape[0], chunk_size)  # validates chunk_size
        return self._capture(params, tokens, chunk_size, check_left_pad(left_pad, tokens.shape[0] - 1))

    def extend(self, params: dict, state, tokens, left_pad=None) -> jax.Array:
        """Continue after `state` without modifying it: tokens int32 [T] -> float32 logits [T, vocab]. left_pad:
        the state's prompt was captured with that many left pads (int in [0, state.length - 1])."""
        tokens = check_tokens(tokens, self.config.vocab_size)
        return self._extend(params, state, tokens, left_pad=check_left_pad(left_pad, state.length - 1))

    def extend_hidden(self, params: dict, state, tokens, left_pad=None) -> jax.Array:
        """As `extend`, but returns the final-normed hidden states [T, D] (model dtype): no vocabulary projection,
        so callers can compute log-probs in token chunks."""
        tokens = check_tokens(tokens, self.config.vocab_size)
        return self._extend_hidden(params, state, tokens, left_pad=check_left_pad(left_pad, state.length - 1))

    def lm_head(self, params: dict) -> jax.Array:
        """The output projection [vocab, D] (the embedding matrix when tied)."""
        return params["embed"] if self.config.tie_word_embeddings else params["lm_head"]

    def logits(self, params: dict, hidden: jax.Array) -> jax.Array:
        """hidden [T, D] (after the final norm) -> float32 logits [T, vocab]."""
        return jnp.einsum("td,yd->ty", hidden, self.lm_head(params), preferred_element_type=accum_dtype(hidden.dtype))

    def capture_chunk(self, params: dict, state, tokens: jax.Array, start, left_pad=None):
        """Process tokens [C] at positions start.. (start may be traced) and write them into `state`, which must
        hold positions < start and have room for start + C. Layers only read the state; entries are written once,
        after the last layer, so the cache is updated in place. left_pad: positions < left_pad are pads."""
        return self.write_entries(state, self.chunk_entries(params, state, tokens, start, left_pad), start)

    def differentiable_state(self, state):
        """Every leaf of the state can receive a gradient (a family overrides this when some cannot)."""
        return state

    def branch_grads(self, params: dict, state, tokens: jax.Array, head, grads, acc, left_pad=None):
        """One replayed branch (`replay.replay_branches`): tokens [R] after `state`; head(params, hidden) -> (loss,
        aux). Returns (loss, aux, grads + its parameter gradient, acc + its state cotangent (acc None: detached)).
        Here by autodiff of the whole layer stack; a family with the block protocol backpropagates block by block."""
        extend_hidden = functools.partial(self._extend_hidden, left_pad=left_pad)
        return layerwise.branch_grads_autodiff(extend_hidden, params, state, tokens, head, grads, acc)

    def chunk_grads(self, params: dict, state, tokens: jax.Array, start, grads, acc, left_pad=None):
        """One prompt chunk of exact mode's backward (`engine.prompt_backward`); see `layerwise.chunk_grads`."""
        return layerwise.chunk_grads_autodiff(self, params, state, tokens, start, grads, acc, left_pad=left_pad)

    def mesh_adapter(self) -> MeshAdapter:
        raise NotImplementedError(f"{type(self).__name__} has no sequence-parallel path (mesh=...): pass mesh=None")

    # remat=True: rematerialise each block/repeat in the backward pass (same values, less memory).
    @functools.partial(jax.jit, static_argnums=0, static_argnames="remat")
    def _forward(self, params, tokens, remat: bool = False, left_pad=None):
        return self._extend(params, self.init_state(0, params["embed"].dtype), tokens, remat=remat, left_pad=left_pad)

    @functools.partial(jax.jit, static_argnums=0, static_argnames="remat")
    def _extend(self, params, state, tokens, remat: bool = False, left_pad=None):
        return self.logits(params, self._extend_hidden(params, state, tokens, remat=remat, left_pad=left_pad))

    @functools.partial(jax.jit, static_argnums=(0, 3))
    def _capture(self, params, tokens, chunk_size, left_pad=None):
        return capture_chunks(self, params, tokens, chunk_size, params["embed"].dtype, left_pad=left_pad)
