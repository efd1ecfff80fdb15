"""The supervised warm-up on a dataset (`--data --sft-steps N`, trainer/warmup.py DatasetTargets), with the tiny
word-level tokenizer and datasets of tests/tasks/test_dataset.py:

- each target is the row's --answer-field tokenized + the run's stop token, right-padded to --response-len; the
  prompt is the one the GRPO phase renders (chat template), left-padded to the GRPO phase's bucket;
- rows come from the training split only (never --eval-fraction's held-out rows), in an order that is a pure function
  of --seed and differs from GRPO's;
- a left-padded prompt gives the unpadded prompt's loss and gradient; the row-at-a-time gradient equals the vmapped
  one; a few steps lower the loss;
- a row without the answer (or one that does not fit -R): one line naming file, row and field, exit 2;
- a trainer run logs the warm-up records before GRPO (slow).
"""
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longstraw_jax import models
from longstraw_jax.tasks import dataset
from longstraw_jax.trainer import cli as run, components, warmup
from tests.tasks.test_dataset import VOCAB, data_args, rows_of, write_jsonl

STOP = 3  # <|im_end|> in tests/tasks/test_dataset.py's tokenizer ("[UNK]" is id 0)


pytestmark = pytest.mark.usefixtures("datasets_cache")  # tok_dir, tokenizer: tests/conftest.py


def training_task(tmp_path, tokenizer, rows, fraction=0.25, seed=0):
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    table = dataset.read_dataset(path)
    train, held = dataset.split_rows(len(table), fraction, path)
    fmt = dataset.choose_format(table.column_names, None, "messages")
    return dataset.DatasetTask(table, path, train, tokenizer, fmt, seed=seed), train, held


@pytest.fixture(scope="module")
def tiny_model():
    model = models.build(models.Qwen36Config.tiny(vocab_size=VOCAB))
    return model, model.init(jax.random.key(0), jnp.float32)


def test_targets_are_the_answer_tokens_and_the_stop_token(tmp_path, tokenizer):
    task, train, _ = training_task(tmp_path, tokenizer, rows_of(12, messages=True))
    buckets = components.PromptBuckets(multiple=8, max_length=32, pad_id=1)
    targets = warmup.DatasetTargets(task, "answer", STOP, response_len=4, buckets=buckets, seed=7, pad_token=1)
    prompts, left_pad, out, mask = targets.batch(0, 3)
    assert prompts.shape == (3, 16) and out.shape == (3, 4) and mask.shape == (3, 4)  # 11 tokens -> bucket 16
    for b in range(3):
        row = targets.task.row_of(b)
        answer = task.dataset[row]["answer"]
        expected = tokenizer(answer, add_special_tokens=False)["input_ids"] + [STOP]
        assert len(expected) == 2 and out[b].tolist() == expected + [1, 1] and mask[b].tolist() == [1, 1, 0, 0]
        rendered = task.render(row).tokens  # as the GRPO phase renders the row: chat template, generation prompt
        assert tokenizer.decode(rendered.tolist()).endswith("<|im_end|> <|im_start|> assistant")
        assert left_pad[b] == 16 - len(rendered) and prompts[b, left_pad[b]:].tolist() == rendered.tolist()
        assert (prompts[b, : left_pad[b]] == 1).all()
    # no stop token: the answer alone
    bare = warmup.DatasetTargets(task, "answer", None, response_len=4, buckets=buckets, seed=7)
    assert bare.example(0)[1].tolist() == out[0, :1].tolist()


def test_rows_are_training_rows_only_and_the_order_is_a_function_of_the_seed(tmp_path, tokenizer):
    task, train, held = training_task(tmp_path, tokenizer, rows_of(12, messages=True))
    targets = warmup.DatasetTargets(task, "answer", STOP, 4, seed=warmup.warm_up_seed(3))
    drawn = [targets.task.row_of(i) for i in range(3 * len(train))]
    assert set(drawn) == set(train.tolist()) and not set(drawn) & set(held.tolist())
    again = warmup.DatasetTargets(task, "answer", STOP, 4, seed=warmup.warm_up_seed(3))
    assert [again.task.row_of(i) for i in range(len(drawn))] == drawn
    other = warmup.DatasetTargets(task, "answer", STOP, 4, seed=warmup.warm_up_seed(4))
    assert [other.task.row_of(i) for i in range(len(drawn))] != drawn
    grpo = [task.row_of(i) for i in range(len(train))]  # GRPO's order (seed 0 here): another permutation
    assert grpo != drawn[: len(train)]


@pytest.mark.slow  # two warm-up gradient compiles (the fast tier keeps the warm-up's loss and its fall)
def test_padded_prompt_and_row_by_row_give_the_same_loss_and_gradient(tiny_model):
    model, params = tiny_model
    rng = np.random.default_rng(0)
    prompts = rng.integers(4, VOCAB, (2, 9)).astype(np.int32)
    targets = np.array([[10, 11, STOP], [12, STOP, 0]], np.int32)
    mask = np.array([[1, 1, 1], [1, 1, 0]], np.float32)
    loss = lambda *a: warmup.sft_loss(model, params, *a)[0]  # noqa: E731
    plain, grads = jax.value_and_grad(lambda q: warmup.sft_loss(model, q, prompts, targets, mask)[0])(params)
    padded = np.concatenate([np.full((2, 7), 5, np.int32), prompts], axis=1)  # 7 pads of a real token id
    left_pad = np.array([7, 7], np.int32)
    np.testing.assert_allclose(loss(padded, targets, mask, left_pad), plain, rtol=1e-5)
    assert abs(float(loss(padded, targets, mask)) - float(plain)) > 1e-4  # unmasked pads would change it
    by_row, metrics = warmup.sft_grads_by_row(model, params, padded, targets, mask, left_pad)
    np.testing.assert_allclose(metrics["sft_loss"], plain, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(by_row), jax.tree.leaves(grads)):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5 * float(np.abs(b).max()))  # float32 round-off


@pytest.mark.slow  # ~20 s of compiles
def test_warm_up_on_a_dataset_lowers_the_loss(tmp_path, tokenizer, tiny_model):
    model, params = tiny_model
    task, _, _ = training_task(tmp_path, tokenizer, rows_of(12, messages=True))
    targets = warmup.DatasetTargets(task, "answer", STOP, 3, components.PromptBuckets(8, 16), seed=1)
    prompts, left_pad, out, mask = targets.batch(0, 9)  # every training row
    before = float(warmup.sft_loss(model, params, prompts, out, mask, left_pad)[0])
    first, first_pad, first_out, first_mask = targets.batch(0, 3)  # step 1's batch
    first_loss = float(warmup.sft_loss(model, params, first, first_out, first_mask, first_pad)[0])
    trained, records = warmup.warm_up(model, params, targets, steps=6, batch=3, learning_rate=1e-2)
    assert [r["sft_step"] for r in records] == list(range(1, 7)) and all(r["kind"] == "sft" for r in records)
    np.testing.assert_allclose(records[0]["sft_loss"], first_loss, rtol=1e-5)  # the row-at-a-time step's loss
    after = float(warmup.sft_loss(model, trained, prompts, out, mask, left_pad)[0])
    assert after < 0.7 * before, (before, after)


def test_bad_answer_rows_one_line_error(tmp_path, tok_dir, capsys):
    good = rows_of(8, messages=True)
    missing = [dict(r) for r in good]
    del missing[5]["answer"]
    cases = [
        (missing, r"d.jsonl: row 5: 'answer' is missing: the supervised warm-up"),
        ([{k: v for k, v in r.items() if k != "answer"} for r in good], r"d.jsonl: row \d: 'answer' is missing"),
        ([dict(r, answer=7) for r in good], r"d.jsonl: row \d: 'answer' must be a string .*7 \(int\)"),
        ([dict(r, answer="blue red green") for r in good],
         r"d.jsonl: row \d: 'answer' has 4 tokens with the stop token; .*--response-len=3"),
    ]
    for rows, message in cases:
        data = write_jsonl(tmp_path / "d.jsonl", rows)
        out = str(tmp_path / "out")
        argv = ["--vocab-size", str(VOCAB), "--data", data, "--tokenizer", tok_dir, "-G", "2", "-R", "3",
                "--chunk-size", "8", "--reward", "tests.tasks.test_dataset:length_reward", "--steps", "1", "--out", out,
                "--sft-steps", "2"]
        assert run.main(argv) == 2, message
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: ") and re.search(message, err), (message, err)
        assert not os.path.exists(out)
    data = write_jsonl(tmp_path / "d.jsonl", good)
    argv = data_args(data, tok_dir, "--steps", "1", "--out", str(tmp_path / "o"), "--sft-steps", "2",
                     "--sft-prompt-len", "8")
    assert run.main(argv) == 2
    assert "--sft-prompt-len=8 sets a --task's warm-up prompt length" in capsys.readouterr().err
    for flag, value in (("--sft-num-facts", "1"), ("--sft-max-depth", "0.5")):
        argv = data_args(data, tok_dir, "--steps", "1", "--out", str(tmp_path / "o"), "--sft-steps", "2", flag, value)
        assert run.main(argv) == 2
        assert f"{flag}={value} sets the retrieval task's warm-up facts" in capsys.readouterr().err


@pytest.mark.slow
def test_trainer_warm_up_on_data_then_grpo(tmp_path, tok_dir, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", rows_of(12, messages=True))
    out = str(tmp_path / "run")
    argv = data_args(data, tok_dir, "--steps", "1", "--out", out, "--sft-steps", "3", "--sft-batch", "2",
                     "--sft-learning-rate", "1e-2", "--eval-fraction", "0.25", "--eval-every", "1",
                     "--eval-prompts", "2")
    assert run.main(argv) == 0
    printed = capsys.readouterr().out
    assert "warm-up: 3 supervised steps x 2 training rows of" in printed and "warm-up    3/3" in printed
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    assert [r.get("kind") for r in records] == ["eval", "sft", "sft", "sft", "eval", None, "eval"]
    assert records[0]["before_warm_up"] and all(np.isfinite(r["sft_loss"]) for r in records[1:4])


def test_an_episode_target_is_imitated_without_its_tool_reply(tiny_model):
    """A task's target with a mask (an agent episode, tasks/lookup.py): the batch keeps the mask; the tool reply's
    tokens (mask 0) add nothing to the loss; the accuracy of an episode is its exactness, not its first token."""
    from longstraw_jax.tasks.lookup import LookupTask

    model, params = tiny_model
    task = LookupTask(prompt_len=32, vocab_size=VOCAB + 16, seed=0)
    prompts, targets, mask = warmup.target_batch(task, 0, 3)
    np.testing.assert_array_equal(mask, np.tile([1, 1, 1, 0, 0, 1, 1], (3, 1)))
    model = models.build(models.Qwen36Config.tiny(vocab_size=VOCAB + 16))
    params = model.init(jax.random.key(0), jnp.float32)
    loss, metrics = warmup.sft_loss(model, params, prompts, targets, mask)
    other = targets.copy()
    other[:, 3:5] = 2  # another tool reply: different inputs after it, the same imitated tokens before it
    assert float(warmup.sft_loss(model, params, prompts, other, mask)[0]) != float(loss)
    hit = np.array([1, 0, 1, 0, 0, 1, 1], bool)  # the call's opening right, its id wrong
    assert [float(x) for x in warmup.target_accuracy(hit, mask[0])] == [0.0, 0.0]
    assert [float(x) for x in warmup.target_accuracy(hit | (mask[0] == 0) | True, mask[0])] == [1.0, 1.0]
    plain = np.array([1, 1, 1, 0, 0, 0, 0], np.float32)  # no hole: a plain answer, its first token decides
    assert [float(x) for x in warmup.target_accuracy(np.array([1, 0, 1, 1, 1, 1, 1], bool), plain)] == [1.0, 0.0]
