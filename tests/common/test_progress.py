"""Progress from inside the compiled loops (longstraw_jax/common/progress.py): with the ticks on, the capture's chunks /
rounds, the decode steps and the prompt backward's chunks / rounds each reach the sink once, in order, and the
results are bitwise those of the same programs without ticks (one device and a 1x8 mesh). The trainer's lines
(trainer/console.py PhaseTicker) say how far the running loop is, how fast and when it ends.
"""
import contextlib

import jax
import numpy as np
import pytest

from longstraw_jax import GroupBatch, GRPOConfig, grpo_grads, sharding
from longstraw_jax.common import progress
from longstraw_jax.engine.capture import capture_on_mesh, extend_on_mesh
from longstraw_jax.sampling import branches
from longstraw_jax.sampling.branches import SamplingConfig
from longstraw_jax.sharding import rules
from longstraw_jax.trainer import console
from tests.helpers import tiny_model

P, G, R, CHUNK = 30, 3, 4, 8  # prompt[:-1] = 29 positions: 3 chunks of 8 and one of 5


def batch(vocab: int, prompt_len: int = P) -> GroupBatch:
    rng = np.random.default_rng(0)
    return GroupBatch(prompt=rng.integers(0, vocab, prompt_len).astype(np.int32),
                      responses=rng.integers(0, vocab, (G, R)).astype(np.int32), mask=np.ones((G, R), np.float32),
                      rewards=np.array([1.0, 0.0, 0.5], np.float32))


def with_and_without(compute):
    """(compute() without ticks, compute() with ticks, the ticks it reported), each traced afresh."""
    progress.enable(False)
    jax.clear_caches()
    plain = jax.tree.map(np.asarray, compute())
    ticks = []
    progress.enable(True)
    jax.clear_caches()
    try:
        with progress.reporting(lambda *tick: ticks.append(tick)):
            ticked = jax.tree.map(np.asarray, compute())
    finally:
        progress.enable(False)
        jax.clear_caches()
    return plain, ticked, ticks


def phase(ticks, name):
    return [(done, total, per) for p, done, total, per in ticks if p == name]


def assert_bitwise(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


def assert_round_off(a, b):
    """Equal up to a few float32 ulps: a callback in a loop body may change how XLA:CPU fuses the body around it
    (the short unpadded GDN chunks of the capture do: 1.4e-6 on log-probs near -5); the sampled tokens are equal."""
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        if np.issubdtype(np.asarray(x).dtype, np.floating):
            np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6)
        else:
            np.testing.assert_array_equal(x, y)


@pytest.mark.slow  # two compiles (with and without ticks) of the sampler and the exact gradient
def test_one_device_ticks_change_nothing():
    """Sampling (capture + decode) and the exact gradient (capture, replay, prompt backward), Qwen3.6."""
    model, params, _ = tiny_model("qwen36")
    group = batch(model.config.vocab_size)
    sampling = SamplingConfig(response_len=R, temperature=1.0)

    def compute():
        rollout = branches.sample_group(model, params, group.prompt, G, sampling, jax.random.key(3), chunk_size=CHUNK)
        return rollout, grpo_grads(model, params, group, GRPOConfig(), "exact", chunk_size=CHUNK)

    plain, ticked, ticks = with_and_without(compute)
    assert_round_off(plain, ticked)
    chunks = [(1, 4, 8), (2, 4, 8), (3, 4, 8), (4, 4, 5)]
    assert phase(ticks, "capture") == chunks * 2  # sampling's capture, then the gradient's
    assert phase(ticks, "sampling") == [(t, R, G) for t in range(1, R + 1)]
    # backward: the last chunk (5 positions) first
    assert phase(ticks, "prompt backward") == [(1, 4, 5), (2, 4, 8), (3, 4, 8), (4, 4, 8)]
    assert {p for p, *_ in ticks} == {"capture", "sampling", "prompt backward"}


@pytest.mark.slow  # two compiles (with and without ticks) of the mesh exact gradient (Qwen3.6) or capture (GLM-5.2)
@pytest.mark.parametrize("family", ["qwen36", "glm52"])
def test_mesh_ticks_once_per_round_and_change_nothing(family):
    """1x8, a prompt of 120 tokens in rounds (the smallest of 8 shards): each round reaches the sink once (not once
    per device), in order; Qwen3.6 takes the exact gradient (it captures in rounds, then goes back through them),
    GLM-5.2 captures and extends (the round loop its backward shares, forward)."""
    model, params, _ = tiny_model(family)
    mesh = sharding.make_mesh("1x8")
    placed = jax.device_put(params, rules.named(rules.param_specs(params, mesh), mesh))
    group = batch(model.config.vocab_size, 120)

    def compute():
        if family == "qwen36":
            return grpo_grads(model, placed, group, GRPOConfig(), "exact", chunk_size=CHUNK, mesh=mesh)
        state = capture_on_mesh(model, placed, group.prompt[:-1], mesh, chunk_size=CHUNK)
        return extend_on_mesh(model, placed, state, group.responses[0], mesh)

    plain, ticked, ticks = with_and_without(compute)
    assert_bitwise(plain, ticked)
    done = lambda name: [(d, total) for d, total, _ in phase(ticks, name)]
    n = phase(ticks, "capture")[0][1]  # Qwen3.6: 3 rounds of 48 positions; GLM-5.2 (segments of 8): 8 of 16
    rounds = [(d, n) for d in range(1, n + 1)]
    assert n >= 3 and done("capture") == rounds
    if family == "qwen36":
        assert done("prompt backward") == rounds  # the last round first: done counts up


def test_phase_ticker_lines_say_the_loops_progress():
    """The sink of the trainer's PhaseTicker: its lines carry the running loop's iterations done, positions/s and
    the ETA, from the ticks' times."""
    now = [0.0]
    lines = []
    ticker = console.PhaseTicker(lambda text, flush=False: lines.append(text), 60.0, clock=lambda: now[0])
    with contextlib.ExitStack() as stack:
        stack.enter_context(ticker.phase(2, 5, "sampling"))
        for done, at in ((1, 10.0), (2, 20.0), (3, 30.0)):
            now[0] = at
            ticker.note("capture", done, 8, 1000)
        assert ticker.status() == "capture 3/8, 100 positions/s, ETA 50 s"
        now[0] = 31.0
        ticker.note("sampling", 1, 64, 8)  # the next loop: no rate yet
        assert ticker.status() == "sampling 1/64"
        now[0] = 33.0
        ticker.note("sampling", 3, 64, 8)
        assert ticker.status() == "sampling 3/64, 8 tokens/s, ETA 61 s"
