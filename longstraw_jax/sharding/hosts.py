"""Host values across the processes of a multi-process run: a global array's full value on every process
(`to_host`), and small Python values every process contributes, exchanged (`gather_objects`). Both are collectives:
every process must call them at the same point of its program. With one process they copy nothing across."""
from __future__ import annotations

import json

import jax
import numpy as np
from jax.experimental import multihost_utils


def to_host(tree):
    """Numpy copies of a pytree of arrays, the same full value on every process: a process-local or fully replicated
    array is read directly; one sharded over other processes' devices is gathered (a collective: every process
    must call this in the same order). Non-arrays pass through."""

    def one(x):
        if not isinstance(x, jax.Array):
            return x
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return jax.random.wrap_key_data(one(jax.random.key_data(x)), impl=jax.random.key_impl(x))
        if x.is_fully_addressable or x.is_fully_replicated:
            return np.asarray(x)
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree.map(one, tree)


def gather_objects(value) -> list:
    """Every process's `value` (anything `json` writes: lists, dicts, strings, numbers, None), in process order, on
    every process: its UTF-8 JSON text exchanged as bytes (two all-gathers: the lengths, then the padded texts).
    One process: [value]."""
    if jax.process_count() == 1:
        return [value]
    text = np.frombuffer(json.dumps(value).encode(), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.int64(text.size))).reshape(-1)
    padded = np.zeros(max(int(sizes.max()), 1), np.uint8)
    padded[:text.size] = text
    texts = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(sizes), -1)
    return [json.loads(bytes(row[:size])) for row, size in zip(texts, sizes)]
