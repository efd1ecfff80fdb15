"""The trainer's update options: --updates-per-batch (mu updates from one sampled batch, the later ones capturing
afresh), --drop-uniform-groups (groups of equal rewards left out; no update when none is left; --refill-batches:
the next batches sampled until -B groups carry a signal) and --ratio /
--clip-eps-low / --clip-eps-high reaching the objective."""
import jax
import numpy as np
import pytest

from longstraw_jax import train
from longstraw_jax.grpo import GroupBatch
from longstraw_jax.trainer import updates
from longstraw_jax.trainer.config import parse_args
from longstraw_jax.trainer.loop import Trainer
from tests.trainer.test_run import SMALL, bits

UNIFORM_IF_EVEN = "tests.trainer.test_updates:uniform_if_even_prompt"


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


def assert_same_update(record, params, want_metrics, want):
    """A trainer step (its metrics record, its new params) equals a direct train_step (metrics, params): loss and
    grad norm to 1e-4; parameters to round-off except a handful. AdamW moves a parameter with a near-zero gradient by
    ~lr (3e-3) in a direction that round-off (the sampler's capture reused vs captured again) can tip, so a few such
    elements may differ by a fraction of lr; a wrong set of groups would move most parameters differently."""
    np.testing.assert_allclose([record["loss"], record["grad_norm"]],
                               [float(want_metrics["loss"]), float(want_metrics["grad_norm"])], rtol=1e-4)
    flat = lambda tree: np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree.leaves(tree)])
    got, expected = flat(params), flat(want)
    off = np.abs(got - expected) > 1e-6 + 2e-5 * np.abs(expected)
    assert off.mean() < 1e-3 and np.abs(got - expected).max() < 2 * 3e-3, (off.sum(), off.size)


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
    want, _, want_metrics = train.train_step(trainer.model, trainer.params, trainer.opt_state,
                                  jax.tree.map(lambda x: np.asarray(x)[kept], batch), trainer.optimizer, trainer.grpo,
                                  "exact", 16)
    record = trainer.train_one()
    assert record["uniform_groups"] == uniform.sum() and record["updates"] == 1 and record["groups"] == 4
    np.testing.assert_allclose(record["reward_mean"], np.mean(batch.rewards), rtol=1e-6)  # over all 4 groups
    assert_same_update(record, trainer.params, want_metrics, want)

    reward = ["--reward", "tests.trainer.test_updates:constant"]
    flat = Trainer(*parse_args(flags + reward + ["--out", str(tmp_path / "b")]))
    before = bits(flat.params)
    record = flat.train_one()
    assert record["uniform_groups"] == 4 and record["updates"] == 0 and record["loss"] == 0.0
    assert bits(flat.params) == before


@pytest.mark.slow  # a trainer set-up, two direct steps and a GSPO step (~60 s)
def test_updates_per_batch_reuse_the_batch_capturing_afresh(tmp_path):
    """--updates-per-batch 2: the second update is a train_step on the same batch (the sampler's log-probs as old
    log-probs) from the first update's params, capturing the prompt itself; its ratio is no longer 1."""
    flags = SMALL + ["--reward", "tests.trainer.test_run:token_reward", "--steps", "1", "--updates-per-batch", "2",
                     "--ratio", "sequence", "--clip-eps-low", "0.001", "--clip-eps-high", "0.001",
                     "--learning-rate", "3e-2"]
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


def test_refilled_pools_batches_and_keeps_the_first_groups_with_a_signal():
    """Two sampled batches of B = 2 (prompts of 3 and 5 tokens: the first left-padded by 2): the update takes the
    first 2 non-uniform groups in sampling order; too few: rounded up to the data size with uniform ones; none:
    None. Every group's real prompt tokens and responses are kept."""
    def batch(prompt, rewards, seed):
        prompt = np.asarray(prompt, np.int32)
        rng = np.random.default_rng(seed)
        return GroupBatch(prompt=prompt, responses=rng.integers(0, 9, (len(rewards), 3, 2)).astype(np.int32),
                          mask=np.ones((len(rewards), 3, 2), np.float32), rewards=np.asarray(rewards, np.float32),
                          left_pad=np.zeros(len(rewards), np.int32))

    first = batch([[1, 2, 3], [4, 5, 6]], [[1, 1, 1], [0, 1, 0]], 0)  # group 0 uniform
    second = batch([[7, 7, 7, 7, 7], [8, 8, 8, 8, 8]], [[2, 0, 0], [3, 3, 3]], 1)  # group 1 uniform
    pool = updates.pooled([first, second])
    assert pool.prompt.tolist() == [[0, 0, 1, 2, 3], [0, 0, 4, 5, 6], [7] * 5, [8] * 5]
    assert pool.left_pad.tolist() == [2, 2, 0, 0]
    chosen, uniform = updates.refilled([first, second], 2)
    assert uniform == 2 and chosen.prompt.tolist() == [[0, 0, 4, 5, 6], [7] * 5]
    np.testing.assert_array_equal(chosen.responses, [first.responses[1], second.responses[0]])
    assert chosen.left_pad.tolist() == [2, 0]
    third = batch([[9, 9, 9], [9, 9, 9]], [[1, 1, 1], [4, 4, 4]], 2)  # both uniform
    assert updates.refilled([first, third], 2, data_size=2)[0].prompt.tolist() == [[1, 2, 3], [4, 5, 6]]
    assert updates.refilled([third], 2) == (None, 2)
    with pytest.raises(ValueError, match="--refill-batches=2 refills the groups --drop-uniform-groups leaves out"):
        parse_args(SMALL + ["--refill-batches", "2"])


@pytest.mark.slow  # a trainer set-up and a direct step (~45 s)
def test_refill_batches_fill_the_step_with_groups_that_carry_a_signal(tmp_path):
    """-B 4 --drop-uniform-groups --refill-batches 3: the step samples the next batches (each with its own key)
    until 4 groups carry a signal and updates from those 4 exactly as a train_step on them; the data position
    moves past every batch sampled."""
    flags = SMALL + ["-B", "4", "--drop-uniform-groups", "--refill-batches", "3", "--steps", "2", "--reward",
                     UNIFORM_IF_EVEN, "--out", str(tmp_path / "a")]
    trainer = Trainer(*parse_args(flags))
    sampled = []
    for k in range(4):
        key = trainer.key if k == 0 else jax.random.fold_in(trainer.key, k)
        sampled.append(trainer.data.batch(trainer.model, trainer.params, key, 0, k)[0])
        if (~updates.uniform_groups(updates.pooled(sampled).rewards)).sum() >= 4:
            break
    assert len(sampled) >= 2, "the seed gives no refill: the test checks nothing"
    chosen, uniform = updates.refilled(sampled, 4)
    want, _, want_metrics = train.train_step(trainer.model, trainer.params, trainer.opt_state, chosen,
                                             trainer.optimizer, trainer.grpo, "exact", 16)
    record = trainer.train_one()
    assert record["refill_batches"] == len(sampled) - 1 and record["uniform_groups"] == uniform
    assert record["groups"] == 4 * len(sampled) and trainer.data_position == len(sampled)
    assert_same_update(record, trainer.params, want_metrics, want)
