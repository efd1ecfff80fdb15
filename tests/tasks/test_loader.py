"""Tasks and rewards: the synthetic retrieval task, `module:function` loading, reward checks, rollout JSONL files."""
import json
import subprocess
import sys

import numpy as np
import pytest

from longstraw_jax.tasks import BUILTIN_TASKS, Prompt, RewardError, load_callable, make_task, score
from longstraw_jax.tasks.lookup import LookupTask
from longstraw_jax.tasks.retrieval import FACT, QUERY, STOP, TOOL, RetrievalTask
from longstraw_jax.tasks.rollout_file import load_rollouts
from tests.helpers import ROOT


def nan_reward(prompt_tokens, response_tokens, info):
    return float("nan")


@pytest.mark.parametrize("prompt_len, depth, facts", [(64, 0.0, 1), (200, 0.5, 3), (1000, 1.0, 2), (300, None, 4)])
def test_retrieval_prompt_layout(prompt_len, depth, facts):
    task = RetrievalTask(prompt_len=prompt_len, vocab_size=64, seed=3, num_facts=facts, depth=depth)
    for index in range(5):
        prompt = task.prompt(index)
        tokens, info = prompt.tokens, prompt.info
        assert tokens.dtype == np.int32 and tokens.shape == (prompt_len,)
        assert tokens.min() >= 0 and tokens.max() < 64
        assert tokens[-2] == QUERY and tokens[-1] == info["key"]
        fact_positions = np.flatnonzero(tokens == FACT)
        assert len(fact_positions) == facts
        keys = tokens[fact_positions + 1]
        assert len(set(keys.tolist())) == facts and info["key"] in keys
        queried = fact_positions[keys == info["key"]][0]
        assert tokens[queried + 2] == info["answer"] and 5 <= info["answer"] < 5 + task.num_answers
        assert info["depth"] == pytest.approx(queried / (prompt_len - 2))
        if depth is not None:  # the queried fact sits at the requested depth of the log (up to rounding)
            assert abs(queried - depth * (prompt_len - 2 - 3 * facts)) <= 3 * facts
        # every other token is tool-log filler or a TOOL marker; the answer ids appear only inside facts
        rest = np.delete(tokens[:-2], np.concatenate([fact_positions + i for i in range(3)]))
        assert np.all((rest == TOOL) | (rest >= task.first_filler))
        np.testing.assert_array_equal(task.prompt(index).tokens, tokens)  # deterministic in the index
    assert not np.array_equal(task.prompt(0).tokens, task.prompt(1).tokens)


def test_retrieval_reward():
    task = RetrievalTask(prompt_len=64, vocab_size=64, format_reward=0.1)
    prompt = task.prompt(0)
    answer = prompt.info["answer"]
    wrong = 5 + (answer - 5 + 1) % task.num_answers
    assert task.reward(prompt.tokens, np.array([answer, STOP]), prompt.info) == 1.0
    assert task.reward(prompt.tokens, np.array([wrong]), prompt.info) == 0.1
    assert task.reward(prompt.tokens, np.array([40, answer]), prompt.info) == 0.0
    assert task.reward(prompt.tokens, np.array([], np.int32), prompt.info) == 0.0
    assert task.chance_reward == pytest.approx(0.25 + 0.75 * 0.1)


def test_retrieval_rejects_bad_settings():
    with pytest.raises(ValueError, match="vocab_size=16 is too small"):
        RetrievalTask(prompt_len=64, vocab_size=16)
    with pytest.raises(ValueError, match="prompt_len=4 is too short"):
        RetrievalTask(prompt_len=4, vocab_size=64)
    with pytest.raises(ValueError, match="depth=1.5"):
        RetrievalTask(prompt_len=64, vocab_size=64, depth=1.5)
    with pytest.raises(ValueError, match=r"max_depth=0.0 must be in \(0, 1\]"):
        RetrievalTask(prompt_len=64, vocab_size=64, max_depth=0.0)
    with pytest.raises(ValueError, match="depth=0.5 must be <= max_depth=0.1"):
        RetrievalTask(prompt_len=64, vocab_size=64, depth=0.5, max_depth=0.1)


def test_retrieval_max_depth_keeps_every_fact_near_the_start():
    """max_depth=0.1: every fact (the queried one and the distractors) in the first ~10 % of the log, so the question
    is ~90 % of the prompt away; the default (1.0) draws the same prompts as before the option existed."""
    near = RetrievalTask(prompt_len=1024, vocab_size=32, num_facts=3, max_depth=0.1)
    last = [int(np.flatnonzero(near.prompt(i).tokens == FACT).max()) for i in range(40)]
    assert max(last) <= 0.1 * 1022 + 6 and min(last) >= 2
    anywhere = RetrievalTask(prompt_len=1024, vocab_size=32, num_facts=3)
    assert max(int(np.flatnonzero(anywhere.prompt(i).tokens == FACT).max()) for i in range(40)) > 500
    np.testing.assert_array_equal(RetrievalTask(prompt_len=64, vocab_size=32, max_depth=1.0).prompt(3).tokens,
                                  RetrievalTask(prompt_len=64, vocab_size=32).prompt(3).tokens)


def test_score_and_load_callable():
    prompt = Prompt(np.arange(5, dtype=np.int32), {"answer": 7})
    responses = np.array([[7, 1, 0], [3, 7, 9]], np.int32)
    mask = np.array([[1, 1, 0], [1, 1, 1]], np.float32)
    seen = []

    def reward(prompt_tokens, response_tokens, info):
        seen.append(response_tokens.tolist())
        return float(response_tokens[0] == info["answer"])

    np.testing.assert_array_equal(score(reward, prompt, responses, mask), [1.0, 0.0])
    assert seen == [[7, 1], [3, 7, 9]]  # only real tokens reach the reward function
    with pytest.raises(ValueError, match="reward function tests.tasks.test_loader:nan_reward returned nan for "
                                         "branch 0; rewards must be finite"):
        score(load_callable("tests.tasks.test_loader:nan_reward"), prompt, responses, mask)
    assert load_callable("numpy:mean") is np.mean
    for spec, message in (("numpy.mean", "not of the form"), ("no_such_module_xyz:f", "cannot import"),
                          ("numpy:no_such_function", "has no attribute"), ("numpy:pi", "not callable")):
        with pytest.raises(ValueError, match=message):
            load_callable(spec)
    assert isinstance(make_task("retrieval", prompt_len=64, vocab_size=64, seed=0), RetrievalTask)
    assert make_task("retrieval", prompt_len=64, vocab_size=64, seed=0, depth=1.0).depth == 1.0  # run --depth
    with pytest.raises(ValueError, match="--task 'bogus': unknown task; built-ins: retrieval, lookup, or "
                                         "'module:function'"):
        make_task("bogus", prompt_len=64, vocab_size=64, seed=0)
    task = make_task("tests.tasks.test_loader:small_retrieval", prompt_len=64, vocab_size=64, seed=2, depth=0.5)
    assert task == RetrievalTask(prompt_len=64, vocab_size=64, seed=2, depth=0.5, num_answers=2)


def small_retrieval(**kwargs):
    """A task factory for `--task module:function`."""
    return RetrievalTask(num_answers=2, **kwargs)


def test_task_modules_import_alone():
    """tasks/base.py holds what tasks/__init__.py and tasks/retrieval.py share (no cycle): retrieval imports first in
    a fresh interpreter, and the prompt type is one object everywhere."""
    result = subprocess.run([sys.executable, "-c", "import longstraw_jax.tasks.retrieval"], capture_output=True,
                            text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    from longstraw_jax.tasks import base, retrieval

    assert Prompt is base.Prompt and retrieval.Prompt is base.Prompt
    assert BUILTIN_TASKS == {"retrieval": RetrievalTask, "lookup": LookupTask}


def write_lines(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def test_rollout_file_ids_and_text(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "the": 1, "answer": 2, "is": 3, "blue": 4, "red": 5, "question": 6}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    path = write_lines(tmp_path / "r.jsonl", [
        {"prompt": [1, 2, 3], "responses": [[4], [5, 4, 4]], "rewards": [1.0, 0.0],
         "old_logprobs": [[-0.5], [-1.0, -2.0, -3.0]]},
        "",
        {"prompt_text": "question the answer is", "responses_text": ["blue", "red red"], "rewards": [0, 1]},
    ])
    groups = load_rollouts(path, vocab_size=8, tokenizer_path=str(tmp_path / "tokenizer.json"), pad_token=7)
    assert len(groups) == 2
    first, second = groups
    np.testing.assert_array_equal(first.responses, [[4, 7, 7], [5, 4, 4]])  # padded to the file's longest
    np.testing.assert_array_equal(first.mask, [[1, 0, 0], [1, 1, 1]])
    np.testing.assert_array_equal(first.old_logprobs, [[-0.5, 0, 0], [-1, -2, -3]])
    assert first.ref_logprobs is None and first.rewards.dtype == np.float32
    np.testing.assert_array_equal(second.prompt, [6, 1, 2, 3])
    np.testing.assert_array_equal(second.responses, [[4, 7, 7], [5, 5, 7]])


def test_rollout_file_multi_turn_trajectories(tmp_path):
    """An agent harness's trajectories: "turns" (assistant tokens trained, tool tokens read) or "responses" with a
    "loss_mask"; both give the same batch, and old log-probs at mask 0 may be anything."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "call": 1, "result": 2, "blue": 3}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    turns = [[{"role": "assistant", "tokens": [1, 4]}, {"role": "tool", "text": "result blue"},
              {"role": "assistant", "tokens": [3]}],
             [{"role": "assistant", "text": "blue"}]]
    path = write_lines(tmp_path / "r.jsonl", [
        {"prompt": [5, 6, 7], "turns": turns, "rewards": [1.0, 0.0]},
        {"prompt": [5, 6, 7], "responses": [[1, 4, 2, 3, 3], [3]], "loss_mask": [[1, 1, 0, 0, 1], [1]],
         "rewards": [1.0, 0.0], "old_logprobs": [[-1.0, -1.0, 0.5, float("nan"), -2.0], [-3.0]]},
    ])
    as_turns, as_mask = load_rollouts(path, vocab_size=8, tokenizer_path=str(tmp_path / "tokenizer.json"))
    for batch in (as_turns, as_mask):
        np.testing.assert_array_equal(batch.responses, [[1, 4, 2, 3, 3], [3, 0, 0, 0, 0]])
        np.testing.assert_array_equal(batch.mask, [[1, 1, 0, 0, 1], [1, 0, 0, 0, 0]])
    np.testing.assert_array_equal(as_mask.old_logprobs[0], [-1, -1, 0, 0, -2])
    bad = [({"prompt": [1, 2], "turns": [[{"role": "tool", "tokens": [1]}]], "rewards": [0]},
            "no token with loss mask"),
           ({"prompt": [1, 2], "turns": [[{"role": "user", "tokens": [1]}]], "rewards": [0]}, "role 'assistant' or"),
           ({"prompt": [1, 2], "responses": [[1, 2]], "loss_mask": [[1]], "rewards": [0]}, "must be 2 values 0 or 1"),
           ({"prompt": [1, 2], "turns": [[{"role": "assistant", "tokens": [1]}]], "loss_mask": [[1]],
             "rewards": [0]}, "drop 'loss_mask'")]
    for line, message in bad:
        with pytest.raises(ValueError, match=message):
            load_rollouts(write_lines(tmp_path / "bad.jsonl", [line]), vocab_size=8)


@pytest.mark.parametrize("line, message", [
    ("{not json", "Expecting property name"),
    ({"prompt": [1, 2], "responses": [[1]], "rewards": [float("nan")]}, r"'rewards'\[0\] = nan"),
    ({"prompt": [1, 2], "responses": [[1], []], "rewards": [0, 1]}, r"'responses\[1\]' is empty"),
    ({"prompt": [1, 99], "responses": [[1]], "rewards": [0]}, r"'prompt'\[1\] = 99 is out of range"),
    ({"prompt": [1, 2], "responses": [[1, 8]], "rewards": [0]}, r"'responses\[0\]'\[1\] = 8 is out of range"),
    ({"prompt": [1, 2], "responses": [], "rewards": []}, r"G >= 1"),
    ({"prompt": [1, 2], "responses": [[1]], "rewards": [0, 1]}, "list of 1 numbers"),
    ({"prompt": [1, 2], "responses": [[1, 2]], "rewards": [0], "old_logprobs": [[0.0]]}, "must have 2 numbers"),
    ({"prompt": [1, 2], "responses": [[1]], "rewards": [0], "advantages": [1]}, r"unknown field\(s\) \['advantages'\]"),
    ({"prompt_text": "a b", "responses": [[1]], "rewards": [0]}, "pass a tokenizer.json"),
    ({"prompt": [1, 2], "responses": [[1]], "rewards": [True]},
     r"'rewards'\[0\] = True \(bool\); a reward must be a real number \(int or float, not bool or str\)$"),
    ({"prompt": [1, 2], "responses": [[1]], "rewards": ["1.0"]}, r"'rewards'\[0\] = '1.0' \(str\); a reward must be"),
    ('{"prompt": [1, 2], "responses": [[1]], "rewards": [1e308]}',
     r"'rewards'\[0\] = 1e\+308; rewards must be within float32 range \(\|r\| <= 3.40282e\+38\)$"),
    ('{"prompt": [1, 2], "responses": [[1]], "rewards": [1' + "0" * 400 + "]}", r"'rewards'\[0\] = 1000.*\.\.\.; "
     r"rewards must be within float32 range"),
    ({"prompt": [1, 2], "responses": [[1, 2]], "rewards": [0], "old_logprobs": [[-1.0, 0.25]]},
     r"'old_logprobs'\[0\]\[1\] = 0.25; log-probs must be <= 0$"),
    ({"prompt": [1, 2], "responses": [[1, 2]], "rewards": [0], "ref_logprobs": [[-1.0, "x"]]},
     r"'ref_logprobs'\[0\] must be a list of numbers$"),
])
def test_rollout_file_errors_name_the_line(tmp_path, line, message):
    good = {"prompt": [1, 2, 3], "responses": [[1, 2]], "rewards": [0.5]}
    path = write_lines(tmp_path / "bad.jsonl", [good, good, line])
    with pytest.raises(ValueError, match=rf"bad.jsonl:3: .*{message}"):
        load_rollouts(path, vocab_size=8)


def test_rollout_file_required_field_names_the_line(tmp_path):
    with_ref = {"prompt": [1, 2, 3], "responses": [[1, 2]], "rewards": [0.5], "ref_logprobs": [[-1.0, -2.0]]}
    path = write_lines(tmp_path / "r.jsonl", [with_ref, {k: v for k, v in with_ref.items() if k != "ref_logprobs"}])
    assert len(load_rollouts(path, vocab_size=8)) == 2  # optional unless required
    with pytest.raises(ValueError) as info:
        load_rollouts(path, vocab_size=8, required={"ref_logprobs": "--kl-coef=0.1 needs it"})
    assert str(info.value) == f"{path}:2: 'ref_logprobs' is missing; --kl-coef=0.1 needs it"


def raising_reward(prompt_tokens, response_tokens, info):
    if len(response_tokens) > 2:
        raise KeyError("answer")
    return 1.0


class Rewards:
    def text(self, prompt_tokens, response_tokens, info):
        return "1.0"


def test_reward_function_errors_name_the_function():
    """Whatever the reward function raises or returns wrongly: one RewardError (a ValueError) naming it."""
    prompt = Prompt(np.arange(5, dtype=np.int32), {})
    responses, mask = np.array([[1, 2, 3], [3, 4, 5]], np.int32), np.array([[1, 1, 0], [1, 1, 1]], np.float32)
    float32 = "rewards must be within float32 range (|r| <= 3.40282e+38)"
    cases = [
        (raising_reward, "reward function tests.tasks.test_loader:raising_reward raised KeyError on branch 1: "
                         "'answer'"),
        (lambda p, r, i: 1 / 0, "reward function tests.tasks.test_loader:test_reward_function_errors_name_the_function."
                                "<locals>.<lambda> raised ZeroDivisionError on branch 0: division by zero"),
        (lambda p, r, i: (_ for _ in ()).throw(ValueError("bad\nsecond line")), "raised ValueError on branch 0: bad"),
        (Rewards().text, "reward function tests.tasks.test_loader:Rewards.text returned '1.0' (str) for branch 0; a "
                         "reward must be a real number (int or float, not bool or str)"),
        (lambda p, r, i: True, "returned True (bool) for branch 0; a reward must be a real number"),
        (lambda p, r, i: np.bool_(False), "(bool"),
        (lambda p, r, i: None, "returned None (NoneType) for branch 0"),
        (lambda p, r, i: [1.0], "returned [1.0] (list) for branch 0"),
        (lambda p, r, i: 1e20 if len(r) > 2 else 1e39, f"returned 1e+39 for branch 0; {float32}"),
        (lambda p, r, i: 10**400, f"returned {'1' + '0' * 56}... for branch 0; {float32}"),
        (lambda p, r, i: float("inf"), "returned inf for branch 0; rewards must be finite"),
    ]
    for fn, message in cases:
        with pytest.raises(RewardError) as info:
            score(fn, prompt, responses, mask)
        text = str(info.value)
        assert "\n" not in text and message in text, (message, text)
        assert isinstance(info.value, ValueError)
    assert isinstance(score(raising_reward, prompt, responses[:1], mask[:1])[0], np.float32)
    # real numbers of any kind, 0-d arrays included
    for value in (1, 0.5, np.float16(0.5), np.int64(2), np.array(0.25), 3.0e38, -7):
        np.testing.assert_array_equal(score(lambda p, r, i: value, prompt, responses, mask), [np.float32(value)] * 2)
    import jax.numpy as jnp

    np.testing.assert_array_equal(score(lambda p, r, i: jnp.float32(0.5), prompt, responses, mask), [0.5, 0.5])


def test_rollout_file_missing_or_empty(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_rollouts(tmp_path / "nope.jsonl", vocab_size=8)
    with pytest.raises(ValueError, match="no rollout groups"):
        load_rollouts(write_lines(tmp_path / "empty.jsonl", [""]), vocab_size=8)
