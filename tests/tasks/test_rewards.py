"""Rewards over text (tasks/rewards.py, TRL's convention) and the token-level interface beside them:

- the built-ins: LongBench's normalisation and token F1, exact match, whole-word containment, math equivalence
  (math-verify; a clear error without it); lists of acceptable answers; None where a function does not apply;
- TextRewards: completions decoded without special tokens, one call per group with the row's columns, weights,
  per-function parts; each bad return (raises, wrong count, a string, NaN, inf) names the function;
- --reward parsing (repeatable and comma lists, weights, unknown names, the answer column);
- the token-level `(prompt_tokens, response_tokens, info)` reward keeps working through the same scorer path;
- through the trainer: a bad text reward is one line naming the function, exit 2, nothing written.
"""
import os
import sys

import numpy as np
import pytest

from longstraw_jax.tasks import Prompt, RewardError, TokenReward, as_scorer, rewards
from longstraw_jax.tasks.retrieval import RetrievalTask
from longstraw_jax.trainer import cli as run, components
from tests.tasks.test_dataset import VOCAB, data_args, rows_of, tiny_tokenizer, write_jsonl

G = 3


def test_normalise_and_token_f1_as_longbench_scores_qa():
    assert rewards.normalise("  The Answer: an Apple, a pie!  ") == "answer apple pie"
    assert rewards.token_f1("the red apple", "Red apple pie") == pytest.approx(2 * (2 / 2) * (2 / 3) / (2 / 2 + 2 / 3))
    assert rewards.token_f1("blue blue", "blue") == pytest.approx(2 * 0.5 * 1 / 1.5)  # multiset overlap
    assert rewards.token_f1("", "blue") == 0.0 and rewards.token_f1("the", "the") == 0.0  # empty after normalising


def test_builtins_on_text_answers_lists_and_none():
    completions = ["The answer is Blue.", "blue", "red", "no idea"]
    answers = ["blue", ["Blue!"], ["crimson", "red"], None]
    prompts = ["q"] * 4
    assert rewards.exact_match(prompts, completions, answer=answers) == [0.0, 1.0, 1.0, None]
    assert rewards.contains(prompts, completions, answer=answers) == [1.0, 1.0, 1.0, None]
    assert rewards.contains(["q"], ["blueberry"], answer=["blue"]) == [0.0]  # whole words
    assert rewards.contains(["q"], ["anything"], answer=["The"]) == [None]  # normalises to nothing: no test
    f1 = rewards.f1(prompts, completions, answer=answers)
    assert f1[0] == pytest.approx(2 * (1 / 3) / (4 / 3)) and f1[1:] == [1.0, 1.0, None]
    assert rewards.exact_match(["q"], ["42"], answer=[42]) == [1.0]  # numbers compare as text


def test_math_equivalence_with_math_verify():
    completions = ["so the result is $\\frac{1}{2}$", "\\boxed{0.5}", "it is 3", "x"]
    assert rewards.math_equal(["q"] * 4, completions, answer=["0.5", "$\\frac{1}{2}$", "4", "not math at all"]) == [
        1.0, 1.0, 0.0, None]


def test_math_without_math_verify_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # an import of it raises ImportError
    with pytest.raises(ImportError, match=r"the 'math' reward needs the package math-verify: pip install "
                                          r"'longstraw-jax\[math\]'"):
        rewards.math_equal(["q"], ["1"], answer=["1"])


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from longstraw_jax.tasks.tokenizer import load_tokenizer

    return load_tokenizer(tiny_tokenizer(tmp_path_factory.mktemp("tok")), VOCAB)


def ids(tokenizer, *texts):
    """Responses int32 [G, R] and mask [G, R] of the texts (right-padded with 0)."""
    rows = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    length = max(map(len, rows))
    responses, mask = np.zeros((len(rows), length), np.int32), np.zeros((len(rows), length), np.float32)
    for i, row in enumerate(rows):
        responses[i, : len(row)], mask[i, : len(row)] = row, 1
    return responses, mask


def test_text_rewards_decode_weight_and_report_each_function(tokenizer):
    calls = []

    def judge(prompts, completions, answer, level, **columns):
        calls.append((prompts, completions, answer, level, columns))
        return [None, 2.0, 0.5]

    functions = [rewards.RewardFunction("exact_match", rewards.exact_match, 1.0, "answer"),
                 rewards.RewardFunction("judge", judge, -0.5)]
    scorer = rewards.TextRewards(functions, tokenizer)
    responses, mask = ids(tokenizer, "blue <|im_end|>", "red", "the blue <|im_end|>")
    prompt = Prompt(np.array([1, 2], np.int32), {"answer": "blue", "level": 3}, text="what colour ?")
    total, parts = scorer.score_group(prompt, responses, mask)
    assert calls == [(["what colour ?"] * G, ["blue", "red", "the blue"], ["blue"] * G, [3] * G, {})]
    np.testing.assert_allclose(total, [1.0, -1.0, 1.0 - 0.25])  # None adds nothing
    assert total.dtype == np.float32 and scorer.names == ["exact_match", "judge"]
    np.testing.assert_array_equal(parts["judge"][0], [0, 2, 0.5])
    np.testing.assert_array_equal(parts["judge"][1], [False, True, True])
    np.testing.assert_array_equal(parts["exact_match"][0], [1, 0, 1])
    judge = {"judge": (parts["judge"][0][None], parts["judge"][1][None])}
    assert components.part_means(judge) == {"reward/judge": 1.25}


def bad_returns(kind):
    def fn(prompts, completions, **columns):
        if kind == "raises":
            raise KeyError("missing thing")
        return {"count": [1.0], "string": "1.0", "nan": [1.0, float("nan"), 0.0], "inf": [1.0, 1.0, float("inf")],
                "text": [1.0, "1", 0.0]}[kind]

    fn.__name__ = f"bad_{kind}"
    return fn


BAD = {"raises": r"reward function bad_raises raised KeyError: 'missing thing'",
       "count": r"reward function bad_count returned 1 value\(s\) for 3 completions",
       "string": r"reward function bad_string returned a str; it must return a list of 3 numbers",
       "nan": r"reward function bad_nan returned nan for completion 1; rewards must be finite",
       "inf": r"reward function bad_inf returned inf for completion 2; rewards must be finite",
       "text": r"reward function bad_text returned '1' \(str\) for completion 1; a reward must be a real number"}


@pytest.mark.parametrize("kind", sorted(BAD))
def test_each_bad_return_names_the_function(tokenizer, kind):
    scorer = rewards.TextRewards([rewards.RewardFunction(f"bad_{kind}", bad_returns(kind))], tokenizer)
    responses, mask = ids(tokenizer, "blue", "red", "sky")
    with pytest.raises(RewardError, match=BAD[kind]):
        scorer.score_group(Prompt(np.array([1, 2], np.int32), {}, text="q"), responses, mask)


def test_load_rewards_names_weights_and_the_answer_column():
    functions = rewards.load_rewards("exact_match, tests.tasks.test_dataset:row_id,f1", "1,0,0.5", ["answer", "id"])
    assert [(f.name, f.weight, f.answer_field) for f in functions] == [
        ("exact_match", 1.0, "answer"), ("row_id", 0.0, None), ("f1", 0.5, "answer")]
    same = rewards.load_rewards("tests.tasks.test_dataset:row_id,tests.tasks.test_rewards:row_id", None, ["id"])
    # names kept apart
    assert [f.name for f in same] == ["tests.tasks.test_dataset:row_id", "tests.tasks.test_rewards:row_id"]
    assert rewards.load_rewards("f1", None, ["gold"], answer_field="gold")[0].answer_field == "gold"
    for specs, weights, message in (("f1", "1,2", r"has 2 weight\(s\); need one per --reward function \(1\)"),
                                    ("f1,contains", "1,nan", r"weights must be finite numbers"),
                                    ("f1", "x", r"must be comma-separated numbers"),
                                    ("bleu", None, r"--reward 'bleu': unknown; built-ins: exact_match, contains, f1"),
                                    ("f1", None, r"--reward f1 reads the reference answer from the column 'answer'")):
        with pytest.raises(ValueError, match=message):
            rewards.load_rewards(specs, weights, ["question"])
    config, _ = run.parse_args(["--reward", "f1", "--reward", "pkg.mod:fn,contains"])  # repeatable and comma lists
    assert config.reward == "f1,pkg.mod:fn,contains"


row_id = rewards.exact_match  # a second function named row_id (the name clash above)


def test_token_level_rewards_go_through_the_same_scorer_path():
    """A plain fn(prompt_tokens, response_tokens, info) (--task's --reward, a task's own reward) is wrapped as a
    group scorer with no per-function parts: the trainer scores it as before."""
    task = RetrievalTask(prompt_len=24, vocab_size=32)
    prompts = [task.prompt(0), task.prompt(1)]
    responses = np.array([[[p.info["answer"], 1], [5 + (p.info["answer"] == 5), 0], [2, 2]] for p in prompts])
    mask = np.array([[[1, 1], [1, 0], [1, 1]]] * 2, np.float32)
    assert isinstance(as_scorer(task.reward), TokenReward)
    rewards_, correct, parts = components.score_groups(task, task.reward, prompts, responses, mask)
    np.testing.assert_allclose(rewards_, [[1.0, 0.1, 0.0]] * 2)
    np.testing.assert_array_equal(correct, [[1, 0, 0]] * 2)
    assert parts == {}
    seen = []
    as_scorer(lambda p, r, info: seen.append((p.tolist(), r.tolist(), info)) or 0.0).score_group(
        prompts[0], responses[0], mask[0])
    assert seen[1] == (prompts[0].tokens.tolist(), [responses[0, 1, 0]], prompts[0].info)  # real tokens only


def raising_reward(prompts, completions, **columns):
    raise RuntimeError("judge offline")


def short_reward(prompts, completions, **columns):
    return [1.0]


def nan_reward(prompts, completions, **columns):
    return [float("nan")] * len(completions)


@pytest.mark.slow
def test_a_bad_text_reward_stops_the_trainer_naming_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    tok = tiny_tokenizer(tmp_path / "tok")
    data = write_jsonl(tmp_path / "d.jsonl", rows_of(4))
    for name, message in (("raising_reward", "raised RuntimeError: judge offline"),
                          ("short_reward", "returned 1 value(s) for 3 completions"),
                          ("nan_reward", "returned nan for completion 0; rewards must be finite (or None: does not "
                                         "apply)")):
        out = str(tmp_path / name)
        argv = data_args(data, tok, "--steps", "2", "--out", out, "--eval-every", "0", "--reward",
                         f"tests.tasks.test_rewards:{name}", "--reward-weights", "1,0,0.5,1")
        assert run.main(argv) == 2
        err = capsys.readouterr().err
        assert err == f"error: reward function {name} {message}" + (
            "" if name != "short_reward" else "; it must return one per completion") + "\n", err
        assert not os.path.exists(out)
