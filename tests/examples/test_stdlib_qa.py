"""The stdlib question-answering example (examples/stdlib_qa, configs/stdlib_qa.toml), built small here:

- building is deterministic (two builds give identical files) and bad build options are one error naming the option;
- rows have the fields configs/stdlib_qa.toml's command uses (messages, answer); each answer is in exactly one file
  of its prompt (the only one that defines the function, the real stdlib source, whose parsed default is the answer);
  held-out rows use modules no training row holds;
- prompts have min_tokens..max_tokens tokens with the trained tokenizer, as the trainer renders them;
- the tokenizer directory loads with AutoTokenizer, renders the chat template and stops on <|im_end|>;
- the reward is exact on the literal; an end-to-end trainer run of the example's config, warm-up included (slow).
"""
import json
import os
import re
import tomllib

import pytest

from examples.stdlib_qa import build, reward
from longstraw_jax.tasks import dataset, rewards, tokenizer as tokenizers
from longstraw_jax.trainer import cli as run
from tests.helpers import ROOT

SMALL = build.BuildConfig(rows=6, held_out_rows=3, min_tokens=600, max_tokens=1200, vocab_size=512)
FILES = ("train.jsonl", "held_out.jsonl", "held_out_no_read.jsonl", "manifest.json", "tokenizer/tokenizer.json",
         "tokenizer/tokenizer_config.json")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("stdlib_qa")
    build.write(str(out), SMALL)
    return out


pytestmark = pytest.mark.usefixtures("datasets_cache")  # tests/conftest.py


def read_rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def segments(user: str) -> dict[str, str]:
    """The user turn of a row -> {path: the module's text as the prompt holds it}."""
    parts = re.split(r"^# file: (\S+)\n", user, flags=re.M)
    assert parts[0] == ""
    return {path: text for path, text in zip(parts[1::2], parts[2::2])}


def test_build_is_deterministic(built, tmp_path):
    again = tmp_path / "again"
    build.write(str(again), SMALL)
    for name in FILES:
        assert (built / name).read_bytes() == (again / name).read_bytes(), name


def test_rows_answer_in_exactly_one_file(built):
    config = tomllib.loads(open(os.path.join(ROOT, "configs", "stdlib_qa.toml")).read())
    train, held = read_rows(built / "train.jsonl"), read_rows(built / "held_out.jsonl")
    assert len(train) == SMALL.rows and len(held) == SMALL.held_out_rows
    for row in train + held:
        assert config["messages_field"] in row and "answer" in row
        system, user = row[config["messages_field"]]
        assert system == {"role": "system", "content": build.SYSTEM} and user["role"] == "user"
        question = build.QUESTION.format(parameter=row["parameter"], function=row["function"])
        assert user["content"].endswith("\n\n" + question)
        if row in held:  # held_out_no_read.jsonl: the same row asked without its files
            assert build.without_files(row)["messages"] == [system, {"role": "user", "content": question}]
        files = segments(user["content"][: -len(question)])
        assert list(files) == row["files"] and len(files) >= 1
        defining = [p for p, text in files.items() if re.search(rf"\bdef {re.escape(row['function'])}\(", text)]
        assert defining == [row["file"]]
        text = files[row["file"]]
        with open(os.path.join(build.stdlib_dir(), row["file"])) as f:
            assert text == f.read().rstrip("\n") + "\n\n"  # the real source
        answers = {d.answer for d in build.literal_defaults(text, SMALL.max_answer_chars)
                   if (d.function, d.parameter) == (row["function"], row["parameter"])}
        assert answers == {row["answer"]}
    manifest = json.loads((built / "manifest.json").read_text())
    assert {row["answer"] for row in train + held} <= set(manifest["answers"]) and len(manifest["answers"]) >= 2
    train_files = {p for row in train for p in row["files"]}
    assert not train_files & {p for row in held for p in row["files"]}  # held-out modules are never trained on


def test_prompts_have_the_requested_tokens(built):
    tokenizer = tokenizers.load_tokenizer(str(built / "tokenizer"), vocab_size=SMALL.vocab_size)
    assert len(tokenizer) == SMALL.vocab_size
    for name in ("train.jsonl", "held_out.jsonl"):
        path = str(built / name)
        rows = dataset.read_dataset(path)
        task = dataset.DatasetTask(rows, path, range(len(rows)), tokenizer, dataset.PromptFormat(
            messages_field="messages"), shuffle=False)
        lengths = [len(task.prompt(i).tokens) for i in range(len(rows))]
        assert lengths == [r["prompt_tokens"] for r in read_rows(path)]
        assert all(SMALL.min_tokens <= n <= SMALL.max_tokens for n in lengths), lengths
    manifest = json.loads((built / "manifest.json").read_text())
    assert manifest["prompt_tokens"]["min"] >= SMALL.min_tokens and manifest["vocab"] == SMALL.vocab_size


def test_tokenizer_directory(built):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(built / "tokenizer"), local_files_only=True)
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "def f(x=None):\n    pass"}]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\ns<|im_end|>\n<|im_start|>user\ndef f(x=None):\n    pass<|im_end|>\n"
                    "<|im_start|>assistant\n")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text  # byte-level: lossless
    stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert ids.count(stop) == 2 and tokenizers.stop_ids(tokenizer, str(built / "tokenizer")) == (stop,)
    answer = tokenizer("'strict'", add_special_tokens=False)["input_ids"] + [stop]
    assert tokenizer.decode(answer, skip_special_tokens=True) == "'strict'"


def test_reward_is_exact_on_the_literal(built):
    completions = ["None", " None\n", "none", "'strict'", "strict", "-1", "1", ""]
    answers = ["None", "None", "None", "'strict'", "'strict'", "-1", "-1", "''"]
    assert reward.exact_literal([""] * 8, completions, answers) == [1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0]
    # as the trainer calls it: tokens decoded with special tokens skipped, the row's columns as keyword arguments
    tokenizer = tokenizers.load_tokenizer(str(built / "tokenizer"))
    functions = rewards.load_rewards("examples.stdlib_qa.reward:exact_literal", None, ["answer", "file"])
    stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
    right = tokenizer("0o666", add_special_tokens=False)["input_ids"] + [stop]
    wrong = tokenizer("0o777", add_special_tokens=False)["input_ids"] + [stop]
    width = max(len(right), len(wrong))
    responses = [r + [stop] * (width - len(r)) for r in (right, wrong)]
    mask = [[1.0] * len(r) + [0.0] * (width - len(r)) for r in (right, wrong)]
    prompt = dataset.Prompt([1, 2], {"answer": "0o666", "file": "os.py"}, "")
    total, _ = rewards.TextRewards(functions, tokenizer).score_group(prompt, responses, mask)
    assert total.tolist() == [1.0, 0.0]


@pytest.mark.parametrize("options, message", [
    (dict(min_tokens=8), "--min-tokens=8 must be >= 16"),
    (dict(min_tokens=900, max_tokens=800), "--max-tokens=800 must be >= --min-tokens=900"),
    (dict(held_out_fraction=1.0), "--held-out-fraction=1.0 must be in (0, 1)"),
    (dict(vocab_size=100), "--vocab-size=100 must be >= 300"),
])
def test_bad_build_options(options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        build.BuildConfig(**options)


def test_build_command_refuses_prompts_that_cannot_fit(tmp_path, capsys):
    # no module set fills 20,000..20,010 tokens exactly: one line naming the options, exit 2, nothing written
    out = tmp_path / "out"
    assert build.main(["--out", str(out), "--min-tokens", "20000", "--max-tokens", "20010", "--vocab-size",
                       "512"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "--min-tokens" in err and err.count("\n") == 1
    assert not out.exists()


@pytest.mark.slow
def test_trainer_runs_the_example(built, tmp_path, capsys):
    """The example's config with the small build, tiny sizes: held-out evaluations before and after, 2 steps."""
    out = str(tmp_path / "run")
    args = ["--config", os.path.join(ROOT, "configs", "stdlib_qa.toml"), "--data", str(built / "train.jsonl"),
            "--eval-data", str(built / "held_out.jsonl"), "--tokenizer", str(built / "tokenizer"), "--vocab-size",
            str(SMALL.vocab_size), "--max-prompt-len", "1280", "--chunk-size", "640", "--steps", "2",
            "--eval-every", "2", "--eval-prompts", "2", "-R", "8", "-G", "2", "--sft-steps", "2", "--sft-batch", "1",
            "--out", out]
    assert run.main(args) == 0
    text = capsys.readouterr().out
    assert "held-out reward" in text
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    evals = [r for r in records if r.get("kind") == "eval"]
    steps = [r for r in records if "kind" not in r]
    warm = [r for r in records if r.get("kind") == "sft"]  # the config's warm-up on the rows' answers
    assert [r["sft_step"] for r in warm] == [1, 2] and all(r["sft_loss"] > 0 for r in warm)
    assert [r["step"] for r in evals] == [0, 0, 2] and all(r["eval_prompts"] == 2 for r in evals)
    assert evals[0]["before_warm_up"]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(0.0 <= r["eval_reward"] <= 1.0 and "eval_reward/exact_literal" in r for r in evals)
    assert all("reward/exact_literal" in r for r in steps)


NEXT = build.BuildConfig(rows=6, held_out_rows=3, min_tokens=600, max_tokens=1000, max_chars=4000, vocab_size=512,
                         question="next_name")


def test_next_name_rows_ask_for_the_name_after_a_line_prefix_found_once(tmp_path):
    """--question next_name: the prefix occurs exactly once in the prompt's files, in the asked file, followed there
    by the answer as a whole identifier (a code line, not a docstring); the answer is not a name a policy could give
    without reading (a keyword, a builtin, or one of the names in over 10 % of the modules); held_out_no_read.jsonl
    asks the held-out questions alone; corpus/ holds sources for pre-training and none of the held-out prompts'
    files."""
    out = tmp_path / "next"
    manifest = build.write(str(out), NEXT)
    train, held = read_rows(out / "train.jsonl"), read_rows(out / "held_out.jsonl")
    assert len(train) == NEXT.rows and len(held) == NEXT.held_out_rows and manifest["config"]["question"] == "next_name"
    modules = build.read_modules(NEXT)
    common = build.common_names(modules)
    assert "self" in common
    for row in train + held:
        system, user = row["messages"]
        assert system == {"role": "system", "content": build.NEXT_SYSTEM}
        question = build.NEXT_QUESTION.format(prefix=row["prefix"])
        assert user["content"].endswith(question)
        files_text = user["content"][: -len(question)]
        assert files_text.count(row["prefix"]) == 1
        files = segments(files_text)
        assert list(files) == row["files"] and row["prefix"] in files[row["file"]]
        assert re.search(re.escape(row["prefix"]) + re.escape(row["answer"]) + r"(?![A-Za-z0-9_])", files[row["file"]])
        assert len(row["answer"]) >= 4 and row["answer"].isidentifier() and row["answer"] not in common
        assert NEXT.min_tokens <= row["prompt_tokens"] <= NEXT.max_tokens
    no_read = read_rows(out / "held_out_no_read.jsonl")  # the same questions without the files
    assert [r["answer"] for r in no_read] == [r["answer"] for r in held]
    assert [r["messages"][1]["content"] for r in no_read] == [build.NEXT_QUESTION.format(prefix=r["prefix"])
                                                               for r in held]
    corpus = set(os.listdir(out / "corpus"))
    assert corpus and not corpus & {p.replace("/", "__") for row in held for p in row["files"]}
    assert {p.replace("/", "__") for row in train for p in row["files"]} <= corpus


def test_next_name_cuts_skip_docstrings_comments_and_attributes():
    text = ('def f(alpha_value, beta):\n    """Docstring line mentioning something_long\n    and more prose here"""\n'
            '    result = compute_things(alpha_value)  # a comment\n    other = helper.attribute_name(beta)\n'
            '    return combine_all(result, other)\n')
    cuts = build.next_name_cuts(text, frozenset({"result"}))
    assert ("return combine_all(result, ", "other") in cuts
    assert ("other = helper.", "attribute_name") not in cuts  # an attribute: no '.' before the name
    assert ("def f(alpha_value, ", "beta") in cuts and ("result = ", "compute_things") not in cuts  # a comment line
    assert not [c for c in cuts if "Docstring" in c[0] or "prose" in c[0] or "something_long" in c[1]]


def test_complete_rows_end_with_the_asked_line_and_score_its_next_name(tmp_path):
    """--question complete: the prompt is the files, then the asked line again as indented in its file, up to the
    name (trailing whitespace dropped); that prefix occurs once in the files, where the answer follows it; the
    tokenizer is next_name's (one base serves both); `first_name` scores the file's own continuation 1 and a wrong or
    cut name 0; held_out_no_read.jsonl holds the asked line alone."""
    out = tmp_path / "complete"
    config = build.BuildConfig(**{**NEXT.__dict__, "question": "complete"})
    build.write(str(out), config)
    train, held = read_rows(out / "train.jsonl"), read_rows(out / "held_out.jsonl")
    assert len(train) == config.rows and len(held) == config.held_out_rows
    for row in train + held:
        assert "messages" not in row and row["prefix"] == row["prefix"].rstrip()
        files, line = row["prompt"].rsplit("\n", 1)
        assert files.count(row["prefix"]) == 1 and line.strip() == row["prefix"] and line.endswith(row["prefix"])
        found = re.search(r"\n([ \t]*)" + re.escape(row["prefix"]) + r"(\s*)" + re.escape(row["answer"]) +
                          r"(?![A-Za-z0-9_])", segments(files + "\n")[row["file"]])
        assert found and found.group(1) == line[: -len(row["prefix"])]  # indented as in its file
        assert reward.first_name([], [found.group(2) + row["answer"] + ")", "x" + row["answer"], row["answer"][:-1]],
                                 [row["answer"]] * 3) == [1.0, 0.0, 0.0]
    assert [r["prompt"] for r in read_rows(out / "held_out_no_read.jsonl")] == [r["prompt"].rsplit("\n", 1)[1]
                                                                                for r in held]
    next_dir = tmp_path / "next"
    build.write(str(next_dir), NEXT)
    tokenizer_file = os.path.join("tokenizer", "tokenizer.json")
    assert (out / tokenizer_file).read_bytes() == (next_dir / tokenizer_file).read_bytes()


def test_the_example_base_config_loads_at_the_build_vocabulary():
    """examples/stdlib_qa/base.json (the base `python -m longstraw_jax.pretrain --model` starts from in
    docs/benchmarks.md 6d): a valid Qwen3.6 config whose vocabulary is the build's default tokenizer size."""
    from longstraw_jax import models

    config = models.config_from_hf(os.path.join(ROOT, "examples", "stdlib_qa", "base.json"))
    assert config.vocab_size == build.BuildConfig().vocab_size and config.num_hidden_layers == 2
