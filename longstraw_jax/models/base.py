"""What every model shares: the chunked walk over a prompt.

A model provides `init_state(length, dtype)`, `capture_chunk(params, state, tokens, start)` (write tokens at
positions start.. into the state, reading only positions < start + len(tokens)), `advance(params, state, tokens,
start)` (the same, also returning the tokens' final-normed hidden states: decoding), and `carried(state)` /
`with_carried(state, carried)`: the part of the state that each chunk overwrites rather than appends to (GDN conv
tails and recurrent matrices; empty for pure-attention models). Appended parts (KV caches) are final after the
chunk that writes them, so the carried part before each chunk is all a backward pass needs to recompute it.
"""
import json
import os

import jax
import jax.numpy as jnp


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

        state, full_boundaries = jax.lax.scan(step, state, (jnp.arange(num_full), chunks))
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
