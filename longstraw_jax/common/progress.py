"""Progress from inside the long compiled loops: the capture's rounds (chunks on one device), the decode steps of
sampling and the prompt backward's rounds, reported to the host while a step of hours runs.

Off unless `enable()`d before the programs are traced (the trainer's `--progress-rounds`). When on, `tick` puts one
unordered host callback (`jax.debug.callback`) of the loop's int32 counter into each iteration: no operation of the
math changes (tests/common/test_progress.py compares results with and without, bitwise). The cost is the callback (a
device -> host copy of the counter and of one element of the iteration's result, which makes the callback wait for
the iteration's work) and one more: JAX keeps no program with a host callback in its
persistent compilation cache, so with ticks on, a restarted run compiles afresh.

On the host, the installed sink (`reporting`) gets (phase, done, total, positions per iteration) once per iteration:
the calls of a mesh's devices (one each inside `shard_map`) and of vmapped groups (the smallest counter) are folded
into one.
"""
from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable

import jax
import numpy as np

Sink = Callable[[str, int, int, int], None]

_enabled = False
_sink: Sink | None = None
_lock = threading.Lock()
_last: dict[str, int] = {}


def enable(on: bool = True) -> None:
    """Turn the ticks on (or off) for programs traced from now on (a program already traced keeps what it has)."""
    global _enabled
    _enabled = on


def enabled() -> bool:
    return _enabled


def tick(phase: str, done, total: int, per: int = 1, after=None) -> None:
    """Inside a traced loop body: iteration `done` (int32 [], traced; counted from 1) of `total` of `phase` has run;
    `per`: positions (or tokens) each iteration processes; `after`: an array the iteration computes (its first
    element is passed along and ignored, so that the callback waits for it). Nothing when the ticks are off."""
    if _enabled:
        first = None if after is None else jax.numpy.ravel(jax.tree.leaves(after)[0])[:1]
        jax.debug.callback(functools.partial(_report, phase, int(total), int(per)), done, first)


def _report(phase: str, total: int, per: int, done, _after) -> None:
    sink = _sink
    if sink is None:
        return
    done = int(np.min(done))  # vmapped groups: the slowest
    with _lock:
        if _last.get(phase) == done:  # the same iteration from another device
            return
        _last[phase] = done
    sink(phase, done, total, per)


@contextlib.contextmanager
def reporting(sink: Sink):
    """Within: every tick reaches sink(phase, done, total, per), once per iteration."""
    global _sink
    with _lock:
        _last.clear()
    _sink = sink
    try:
        yield
    finally:
        _sink = None
