"""Prompts of different lengths in one run: left padding to a few bucket lengths, so that a run compiles one program
(capture, sampler, update step) per bucket instead of one per prompt length.

    L = bucket_length(n, multiple=chunk_size, max_buckets=4, max_length=P_max)
    padded, left_pad = pad_left(tokens, L, pad_id)      # tokens [n] -> padded [L], left_pad = L - n
    GroupBatch(prompt=padded, ..., left_pad=left_pad)   # or prompts [B, L] with left_pad [B]

A prompt of n real tokens becomes `left_pad = L - n` pad tokens followed by the n real tokens: its last token stays
at L - 1, so everything after the prompt (replay, decode tails, response positions) keeps its layout. The engines,
samplers and models hide the pads (`left_pad` arguments; docs/architecture.md 4.6): results equal the unpadded
prompt's up to float round-off, whatever the pad id.

Buckets (`bucket_lengths`): m, 2m, 4m, ... (m = `multiple`, e.g. the capture chunk / round length) below the
longest prompt P_max, then P_max rounded up to a multiple of m. Geometric, so padding adds less than the prompt's own
length (at most 2x the positions, and only for prompts longer than m) and a run over lengths up to P_max compiles at
most 1 + ceil(log2(P_max / m)) programs per phase; `max_buckets` bounds that count: the smallest buckets are dropped
(short prompts pad up to the smallest kept bucket), so a run never compiles more than `max_buckets` programs per phase
(plus one per distinct B, G, R as before). Why powers of two rather than every multiple of m: a dataset from a few
thousand to millions of tokens would compile thousands of programs at a fixed step m, ~10 with doubling.
"""
from __future__ import annotations

import numpy as np

from longstraw_jax.common.validation import check_size


def bucket_lengths(max_length: int, multiple: int, max_buckets: int | None = None) -> tuple[int, ...]:
    """The bucket lengths, ascending: multiple * 2^i for i = 0, 1, ... while below max_length, then max_length
    rounded up to a multiple of `multiple` (the largest bucket holds the longest prompt). With max_buckets, only the
    largest max_buckets of them (so the smallest kept bucket grows: fewer programs, more padding for short
    prompts). ValueError for sizes that are not positive ints."""
    max_length, multiple = check_size(max_length, "max_length"), check_size(multiple, "multiple")
    top = -(-max_length // multiple) * multiple
    lengths, length = [], multiple
    while length < top:
        lengths.append(length)
        length *= 2
    lengths.append(top)
    if max_buckets is not None:
        lengths = lengths[-check_size(max_buckets, "max_buckets"):]
    return tuple(lengths)


def bucket_length(n: int, multiple: int, max_length: int, max_buckets: int | None = None) -> int:
    """The smallest of `bucket_lengths(max_length, multiple, max_buckets)` that holds n tokens (n <= max_length):
    the length a prompt of n tokens is left-padded to. ValueError when n > max_length or n < 2."""
    n, max_length = check_size(n, "n", minimum=2), check_size(max_length, "max_length")
    if n > max_length:
        raise ValueError(f"a prompt of n={n} tokens is longer than max_length={max_length}")
    return next(length for length in bucket_lengths(max_length, multiple, max_buckets) if length >= n)


def pad_left(tokens, length: int, pad_id: int = 0) -> tuple[np.ndarray, np.int32]:
    """tokens int [n] (n >= 2) -> (int32 [length]: length - n copies of pad_id, then tokens; left_pad = length - n as
    int32): what `GroupBatch.left_pad` and the samplers' `left_pad` take. ValueError when the tokens do not fit or
    are not a rank-1 integer array."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"tokens must be a rank-1 integer array [n], got shape {tokens.shape} dtype {tokens.dtype}")
    length, n = check_size(length, "length"), tokens.shape[0]
    if n < 2 or n > length:
        raise ValueError(f"cannot left-pad {n} tokens to length {length}: need 2 <= n <= length")
    if not isinstance(pad_id, (int, np.integer)) or pad_id < 0:
        raise ValueError(f"pad_id must be a non-negative int token id, got {pad_id!r}")
    padded = np.concatenate([np.full(length - n, pad_id, np.int32), tokens.astype(np.int32)])
    return padded, np.int32(length - n)


def pad_batch(prompts, multiple: int, max_length: int, pad_id: int = 0,
              max_buckets: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """B prompts of any lengths (each int [n_b], 2 <= n_b <= max_length) -> (int32 [B, L], left_pad int32 [B]): all
    left-padded to one bucket L, the smallest that holds the longest of them (`bucket_length`): the stacked prompts
    of one step (`GroupBatch(prompt=..., left_pad=...)`, `sampling.groups.sample_groups(..., left_pad=...)`)."""
    prompts = [np.asarray(p) for p in prompts]
    if not prompts:
        raise ValueError("pad_batch needs at least one prompt")
    length = bucket_length(max(p.shape[0] for p in prompts), multiple, max_length, max_buckets)
    padded, left_pad = zip(*(pad_left(p, length, pad_id) for p in prompts))
    return np.stack(padded), np.array(left_pad, np.int32)
