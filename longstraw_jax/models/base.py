"""What every model shares: the chunked walk over a prompt.

A model provides `init_state(length, dtype)`, `capture_chunk(params, state, tokens, start)` (write tokens at
positions start.. into the state, reading only positions < start + len(tokens)), `advance(params, state, tokens,
start)` (the same, also returning the tokens' final-normed hidden states: decoding), and `carried(state)` /
`with_carried(state, carried)`: the part of the state that each chunk overwrites rather than appends to (GDN conv
tails and recurrent matrices; empty for pure-attention models). Appended parts (KV caches) are final after the
chunk that writes them, so the carried part before each chunk is all a backward pass needs to recompute it.
"""
import functools
import json
import os
import warnings

import jax
import jax.numpy as jnp

from longstraw_jax.ops.dtypes import accum_dtype
from longstraw_jax.validation import check_tokens


def chunk_layout(length: int, chunk_size: int) -> tuple[int, int]:
    """(number of full chunks, length of the remainder chunk) for a prompt of `length` tokens."""
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    return divmod(length, chunk_size)


def capture_chunks(model, params, tokens: jax.Array, chunk_size: int, dtype, keep_boundaries: bool = False,
                   capacity: int | None = None):
    """Capture tokens [P] in chunks of `chunk_size` (a `lax.scan` over full chunks, then one remainder chunk) into a
    state with room for `capacity` positions (default P; more leaves room to decode after the prompt).

    Returns the state, and with keep_boundaries also `(full, last)`: `model.carried(state)` before each full chunk
    (leaves stacked [N, ...]) and before the remainder chunk (None when chunk_size divides P).
    """
    if capacity is not None and capacity < tokens.shape[0]:
        raise ValueError(f"capacity={capacity} is below the prompt length {tokens.shape[0]}")
    state = model.init_state(tokens.shape[0] if capacity is None else capacity, dtype)
    num_full, remainder = chunk_layout(tokens.shape[0], chunk_size)
    full_boundaries = last_boundary = None
    if num_full:
        chunks = tokens[: num_full * chunk_size].reshape(num_full, chunk_size)

        def step(state, xs):
            index, chunk = xs
            boundary = model.carried(state) if keep_boundaries else None
            return model.capture_chunk(params, state, chunk, index * chunk_size), boundary

        state, full_boundaries = jax.lax.scan(step, state, (jnp.arange(num_full, dtype=jnp.int32), chunks))
    if remainder:
        last_boundary = model.carried(state) if keep_boundaries else None
        state = model.capture_chunk(params, state, tokens[num_full * chunk_size :], num_full * chunk_size)
    return (state, (full_boundaries, last_boundary)) if keep_boundaries else state


def read_json_config(source) -> dict:
    """A transformers config as a dict: given a dict, a config.json path, or a checkpoint directory."""
    if isinstance(source, dict):
        return source
    path = os.fspath(source)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"no config.json at {path}")
    with open(path) as f:
        return json.load(f)


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

    def forward(self, params: dict, tokens) -> jax.Array:
        """Reference path: tokens int32 [T] -> float32 logits [T, vocab]."""
        return self._forward(params, check_tokens(tokens, self.config.vocab_size))

    def capture(self, params: dict, tokens, chunk_size: int = 2048):
        """Prompt tokens int32 [P] -> the model's state, in chunks of `chunk_size` (need not divide P); no logits."""
        tokens = check_tokens(tokens, self.config.vocab_size)
        chunk_layout(tokens.shape[0], chunk_size)  # validates chunk_size
        return self._capture(params, tokens, chunk_size)

    def extend(self, params: dict, state, tokens) -> jax.Array:
        """Continue after `state` without modifying it: tokens int32 [T] -> float32 logits [T, vocab]."""
        return self._extend(params, state, check_tokens(tokens, self.config.vocab_size))

    def extend_hidden(self, params: dict, state, tokens) -> jax.Array:
        """As `extend`, but returns the final-normed hidden states [T, D] (model dtype): no vocabulary projection,
        so callers can compute log-probs in token chunks."""
        return self._extend_hidden(params, state, check_tokens(tokens, self.config.vocab_size))

    def lm_head(self, params: dict) -> jax.Array:
        """The output projection [vocab, D] (the embedding matrix when tied)."""
        return params["embed"] if self.config.tie_word_embeddings else params["lm_head"]

    def logits(self, params: dict, hidden: jax.Array) -> jax.Array:
        """hidden [T, D] (after the final norm) -> float32 logits [T, vocab]."""
        return jnp.einsum("td,vd->tv", hidden, self.lm_head(params), preferred_element_type=accum_dtype(hidden.dtype))

    def capture_chunk(self, params: dict, state, tokens: jax.Array, start):
        """Process tokens [C] at positions start.. (start may be traced) and write them into `state`, which must
        hold positions < start and have room for start + C. Layers only read the state; entries are written once,
        after the last layer, so the cache is updated in place."""
        return self.write_entries(state, self.chunk_entries(params, state, tokens, start), start)

    # remat=True: rematerialise each block/repeat in the backward pass (same values, less memory).
    @functools.partial(jax.jit, static_argnums=0, static_argnames="remat")
    def _forward(self, params, tokens, remat: bool = False):
        return self._extend(params, self.init_state(0, params["embed"].dtype), tokens, remat=remat)

    @functools.partial(jax.jit, static_argnums=0, static_argnames="remat")
    def _extend(self, params, state, tokens, remat: bool = False):
        return self.logits(params, self._extend_hidden(params, state, tokens, remat=remat))

    @functools.partial(jax.jit, static_argnums=(0, 3))
    def _capture(self, params, tokens, chunk_size):
        return capture_chunks(self, params, tokens, chunk_size, params["embed"].dtype)
