"""Host-side input checks. JAX clamps out-of-range gather indices silently, so bad ids must be caught here."""
import jax
import numpy as np


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
