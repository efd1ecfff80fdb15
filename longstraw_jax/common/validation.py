"""Host-side input checks. JAX clamps out-of-range gather indices silently, so bad ids must be caught here.

Also the one parser of the command lines' sizes (`parse_size`: prompt, round and response lengths such as 64K or
2.1M), with its argparse types `size_arg` / `sizes_arg` and the rule in words, `SIZE_RULE`, for `--help` texts."""
import argparse
import math
import re
from fractions import Fraction

import jax
import numpy as np

SIZE_UNITS = {"": 1, "k": 2**10, "m": 2**20}
SIZE_RULE = "K = 1024, M = 2^20; a fraction rounds to the nearest integer, halves up: 2.1M = 2,202,010"


def is_int(value) -> bool:
    """A Python or numpy integer (np.int64(4) included), never a bool (True is an int in Python)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_real(value) -> bool:
    """A Python or numpy integer or float, never a bool (nor a str, array or anything else)."""
    return is_int(value) or isinstance(value, (float, np.floating))


def check_size(value, name: str, minimum: int = 1) -> int:
    """`value` as a Python int if it is an integer (numpy integer types included; bool and float are not) and
    >= minimum; ValueError naming `name` otherwise."""
    if not is_int(value) or value < minimum:
        bound = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ValueError(f"{name} must be {bound}, got {value!r}")
    return int(value)


def parse_size(text: str) -> int:
    """A count of positions or tokens: digits with an optional fraction and an optional binary suffix, K (or k) =
    1024, M (or m) = 2^20 (prompt and round lengths are powers of two: 64K = 65,536, 1M = 1,048,576). A fraction
    rounds to the nearest integer, halves up, computed exactly: 2.1M = 2,202,009.6 -> 2,202,010; 0.5K = 512.
    '8192' -> 8192. Anything else (signs, exponents, other suffixes, commas) raises ValueError."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*", text)
    if not match:
        raise ValueError(f"{text!r} is not a size: expected digits with an optional K or M, like 8192, 64K or 2.1M "
                         f"({SIZE_RULE})")
    return math.floor(Fraction(match[1]) * SIZE_UNITS[match[2].lower()] + Fraction(1, 2))


def size_arg(text: str) -> int:
    """`parse_size` as an argparse type: a bad string is an argparse error that quotes it and states the rule."""
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def sizes_arg(text: str) -> list[int]:
    """A comma list of sizes (`size_arg` each): '2.1M,4M' -> [2202010, 4194304]."""
    return [size_arg(part) for part in text.split(",")]


def is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def check_tokens(tokens, vocab_size: int, name: str = "tokens") -> jax.Array:
    """Validate a token array: integer dtype, rank 1, non-empty, ids in [0, vocab_size). Returns it as int32.

    Under tracing only dtype and rank can be checked (values are unknown); validate before `jit` in that case.
    """
    dtype = np.dtype(tokens.dtype if hasattr(tokens, "dtype") else np.asarray(tokens).dtype)
    if not np.issubdtype(dtype, np.integer):
        raise TypeError(f"{name} must be an integer array (int32), got dtype {dtype}")
    shape = np.shape(tokens)
    if len(shape) != 1:
        raise ValueError(f"{name} must have rank 1 [T] (one unbatched sequence; vmap for batches), got shape {shape}")
    if shape[0] == 0:
        raise ValueError(f"{name} is empty: need at least one token")
    if is_concrete(tokens):
        host = np.asarray(tokens)
        low, high = int(host.min()), int(host.max())
        if low < 0 or high >= vocab_size:
            bad = int(np.argmax((host < 0) | (host >= vocab_size)))
            raise ValueError(f"{name}[{bad}] = {int(host[bad])} is out of range: ids must be in "
                             f"[0, vocab_size={vocab_size})")
    return jax.numpy.asarray(tokens, dtype=np.int32)


def check_left_pad(left_pad, maximum: int, name: str = "left_pad", groups: int | None = None):
    """A left-padded prompt's pad count: None (no padding), or an integer (int32 [] for one prompt; [B] with
    `groups` = B) in [0, maximum], `maximum` being the last position that may still be a pad (at least one real
    position must remain). Returns None or an int32 array; ValueError / TypeError naming `name` and the bound.
    Under tracing only dtype and shape are checked."""
    if left_pad is None:
        return None
    if isinstance(left_pad, (bool, np.bool_)):
        raise TypeError(f"{name} must be an integer, got {left_pad!r}")
    dtype = np.dtype(left_pad.dtype if hasattr(left_pad, "dtype") else np.asarray(left_pad).dtype)
    if not np.issubdtype(dtype, np.integer):
        raise TypeError(f"{name} must be an integer (int32), got dtype {dtype}")
    shape, expected = np.shape(left_pad), (() if groups is None else (groups,))
    if shape != expected:
        raise ValueError(f"{name} must have shape {list(expected)} ({'one per group' if groups else 'a scalar'}), "
                         f"got shape {list(shape)}")
    if is_concrete(left_pad):
        host = np.asarray(left_pad)
        if host.size and (host.min() < 0 or host.max() > maximum):
            bad = host.reshape(-1)[np.argmax(((host < 0) | (host > maximum)).reshape(-1))]
            raise ValueError(f"{name} = {int(bad)} is out of range: need 0 <= {name} <= {maximum} (pads come first "
                             "and at least one real prompt position must remain)")
    return jax.numpy.asarray(left_pad, dtype=np.int32)
