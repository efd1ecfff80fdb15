"""The trainer's update options: --updates-per-batch (mu updates from one sampled batch, the later ones capturing
afresh), --drop-uniform-groups (groups of equal rewards left out; no update when none is left) and --ratio /
--clip-low / --clip-high reaching the objective."""
import jax
import numpy as np
import pytest

from longstraw_jax import train
from longstraw_jax.grpo import GroupBatch
from longstraw_jax.trainer import updates
from longstraw_jax.trainer.config import parse_args
from longstraw_jax.trainer.loop import Trainer
from tests.test_run import SMALL, bits

UNIFORM_IF_EVEN = "tests.test_updates:uniform_if_even_prompt"


def uniform_if_even_prompt(prompt_tokens, response_tokens, info):
    """Every branch 0.5 when the prompt's token sum is even (a uniform group), else the first response token."""
    return 0.5 if int(np.sum(prompt_tokens)) % 2 == 0 else float(response_tokens[0])


def constant(prompt_tokens, response_tokens, info):
    return 1.0


def test_kept_groups_and_rounding_to_the_data_size():
    rewards = np.array([[1, 1, 1], [0, 1, 0], [2, 2, 2], [3, 1, 2]], np.float32)
    uniform = updates.uniform_groups(rewards)
    assert uniform.tolist() == [True, False, True, False]
    assert updates.kept_groups(uniform).tolist() == [1, 3]
    assert updates.kept_groups(np.array([True, False, True, True]), 2).tolist() == [0, 1]  # 1 kept -> 2
    assert updates.kept_groups(np.array([True, True])).size == 0
    batch = GroupBatch(prompt=np.arange(8, dtype=np.int32).reshape(4, 2), responses=np.zeros((4, 3, 2), np.int32),
                       mask=np.ones((4, 3, 2), np.float32), rewards=rewards)
    kept, captured, left_out = updates.without_uniform_groups(batch, {"state": np.arange(4.0)})
    assert left_out == 2 and kept.prompt.tolist() == [[2, 3], [6, 7]]
    assert np.asarray(captured["state"]).tolist() == [1, 3]
    flat = batch.replace(rewards=np.ones((4, 3), np.float32))
    assert updates.without_uniform_groups(flat, None) == (None, None, 4)
    metrics = updates.mean_metrics([{"loss": 1.0, "skipped": 0.0}, {"loss": 3.0, "skipped": 1.0}])
    assert metrics == {"loss": 2.0, "skipped": 1.0, "updates": 2}


@pytest.mark.slow  # two trainer set-ups with B = 4 and a direct step (~55 s)
def test_drop_uniform_groups_updates_from_the_others_only(tmp_path):
    """-B 4 with some groups uniform: the step's update equals a train_step on the kept groups alone (with their
    captures); every group uniform: no update, params unchanged."""
    flags = SMALL + ["-B", "4", "--drop-uniform-groups", "--steps", "2"]
    trainer = Trainer(*parse_args(flags + ["--reward", UNIFORM_IF_EVEN, "--out", str(tmp_path / "a")]))
    batch, _, captured = trainer.data.batch(trainer.model, trainer.params, trainer.key, 0, 0)
    uniform = updates.uniform_groups(batch.rewards)
    assert 0 < uniform.sum() < 4, batch.rewards  # the seed gives a mix (else the test checks nothing)
    kept = np.flatnonzero(~uniform)
    want, _, _ = train.train_step(trainer.model, trainer.params, trainer.opt_state,
                                  jax.tree.map(lambda x: np.asarray(x)[kept], batch), trainer.optimizer, trainer.grpo,
                                  "exact", 16)
    record = trainer.train_one()
    assert record["uniform_groups"] == uniform.sum() and record["updates"] == 1 and record["groups"] == 4
    np.testing.assert_allclose(record["reward_mean"], np.mean(batch.rewards), rtol=1e-6)  # over all 4 groups
    for got, expected in zip(jax.tree.leaves(trainer.params), jax.tree.leaves(want)):
        np.testing.assert_allclose(got, expected, rtol=2e-5, atol=1e-6)

    flat = Trainer(*parse_args(flags + ["--reward", "tests.test_updates:constant", "--out", str(tmp_path / "b")]))
    before = bits(flat.params)
    record = flat.train_one()
    assert record["uniform_groups"] == 4 and record["updates"] == 0 and record["loss"] == 0.0
    assert bits(flat.params) == before


@pytest.mark.slow  # a trainer set-up, two direct steps and a GSPO step (~60 s)
def test_updates_per_batch_reuse_the_batch_capturing_afresh(tmp_path):
    """--updates-per-batch 2: the second update is a train_step on the same batch (the sampler's log-probs as old
    log-probs) from the first update's params, capturing the prompt itself; its ratio is no longer 1."""
    flags = SMALL + ["--reward", "tests.test_run:token_reward", "--steps", "1", "--updates-per-batch", "2",
                     "--ratio", "sequence", "--clip-low", "0.001", "--clip-high", "0.001", "--lr", "3e-2"]
    trainer = Trainer(*parse_args(flags + ["--out", str(tmp_path / "a")]))
    assert (trainer.grpo.ratio, trainer.grpo.clip_eps_low, trainer.grpo.clip_eps_high) == ("sequence", 1e-3, 1e-3)
    batch, _, captured = trainer.data.batch(trainer.model, trainer.params, trainer.key, 0, 0)
    args = (trainer.optimizer, trainer.grpo, "exact", 16)
    params, opt_state, first = train.train_step(trainer.model, trainer.params, trainer.opt_state, batch, *args,
                                                captured=captured)
    params, opt_state, second = train.train_step(trainer.model, params, opt_state, batch, *args)
    record = trainer.train_one()
    assert record["updates"] == 2
    assert float(first["clip_frac"]) == 0 < float(second["clip_frac"])  # the second update sees ratio != 1
    np.testing.assert_allclose(record["clip_frac"], (float(first["clip_frac"]) + float(second["clip_frac"])) / 2)
    for got, expected in zip(jax.tree.leaves(trainer.params), jax.tree.leaves(params)):
        np.testing.assert_allclose(got, expected, rtol=2e-5, atol=1e-6)
