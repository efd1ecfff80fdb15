"""Training on your own data (`--data`, tasks/dataset.py, tasks/tokenizer.py), with a tiny word-level tokenizer and
tiny datasets built here (no network):

- the three formats (JSONL, Parquet, a save_to_disk directory) read the same rows; the order is a permutation per
  epoch, a pure function of (seed, position); --eval-fraction holds out rows training never draws;
- prompts: text encoded as it is, chat messages rendered with the tokenizer's own template (and its kwargs),
  --truncate left / right / error; the tokenizer from a directory, its stop ids (generation_config.json + EOS);
- the trainer: a run of 3 steps equals 2 steps + --resume to 3 (same rows, same metrics, per-function rewards
  logged, held-out evaluation per function); prompts of different lengths padded to one bucket (one program),
  B = 1 and 2;
- bad input: one line naming the file, row and field (or the option), exit 2, nothing written.
"""
import json
import os

import numpy as np
import pytest

from longstraw_jax.tasks import dataset, tokenizer as tokenizers
from longstraw_jax.trainer import cli as run, components
from tests.helpers import ROOT

WORDS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "user", "assistant", "system", "nothink", "the", "answer",
         "is", "blue", "red", "green", "what", "colour", "sky", "grass", "sea", "log", "tool", "ok", "?"]
TEMPLATE = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
            "{% if add_generation_prompt %}<|im_start|> assistant {% if enable_thinking is defined and not "
            "enable_thinking %}nothink {% endif %}{% endif %}")
VOCAB = 32  # the tiny model's (--vocab-size): the tokenizer has len(WORDS) + 1 = 23 tokens


def tiny_tokenizer(directory, words=WORDS, eos_ids=None, template=TEMPLATE):
    """A word-level tokenizer ("[UNK]" + words, split on whitespace) with a chat template, saved with
    save_pretrained into `directory` (tokenizer.json, tokenizer_config.json, chat_template.jinja) and, with
    eos_ids, a generation_config.json. Returns the directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["[UNK]", *words])}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.chat_template = template
    fast.save_pretrained(str(directory))
    if eos_ids is not None:
        (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids}))
    return str(directory)


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


QUESTIONS = [("what colour is the sky ?", "blue"), ("what colour is the grass ?", "green"),
             ("what colour is the sea ?", "blue"), ("what colour is the answer ?", "red")]


def rows_of(n, messages=False):
    """n rows of one token length (prompt text or chat messages), columns answer and id."""
    out = []
    for i in range(n):
        question, answer = QUESTIONS[i % len(QUESTIONS)]
        prompt = {"messages": [{"role": "user", "content": question}]} if messages else {"prompt": question}
        out.append({**prompt, "answer": answer, "id": i})
    return out


pytestmark = pytest.mark.usefixtures("datasets_cache")  # tok_dir, tokenizer: tests/conftest.py


def task_of(rows, tokenizer, path="d.jsonl", **options):
    fmt = dataset.choose_format(rows.column_names, options.pop("prompt_field", None),
                                options.pop("messages_field", None), **options)
    return dataset.DatasetTask(rows, path, np.arange(len(rows)), tokenizer, fmt)


# ----- datasets ------------------------------------------------------------------------------------------------------


def test_the_three_formats_read_the_same_rows(tmp_path):
    import datasets

    rows = rows_of(5)
    jsonl = write_jsonl(tmp_path / "d.jsonl", rows)
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "d.parquet"))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "disk"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "dict"))
    for path in (jsonl, str(tmp_path / "d.parquet"), str(tmp_path / "disk"), str(tmp_path / "dict")):
        read = dataset.read_dataset(path)
        assert [read[i] for i in range(len(read))] == rows, path
        assert type(read.data).__name__ == "MemoryMappedTable", path  # Arrow on disk, not rows in memory


def test_order_is_a_permutation_per_epoch_and_a_pure_function_of_the_position(tokenizer):
    import datasets

    rows = datasets.Dataset.from_list(rows_of(7))
    task = task_of(rows, tokenizer)
    drawn = [task.row_of(i) for i in range(21)]
    epochs = [drawn[i:i + 7] for i in (0, 7, 14)]
    assert all(sorted(e) == list(range(7)) for e in epochs)  # every row once per epoch
    assert len({tuple(e) for e in epochs}) == 3 and epochs[0] != list(range(7))  # shuffled, anew each epoch
    again = task_of(rows, tokenizer)
    assert [again.row_of(i) for i in (20, 3, 15, 0)] == [drawn[20], drawn[3], drawn[15], drawn[0]]  # any order
    other = dataset.DatasetTask(rows, "d", np.arange(7), tokenizer, task.format, seed=1)
    assert [other.row_of(i) for i in range(7)] != epochs[0]
    assert task.prompt(4).info == {"answer": rows[drawn[4]]["answer"], "id": drawn[4]}


def test_eval_fraction_holds_out_rows_training_never_draws():
    train, held = dataset.split_rows(40, 0.25)
    assert len(held) == 10 and len(train) == 30 and not set(train) & set(held)
    assert sorted([*train, *held]) == list(range(40))
    np.testing.assert_array_equal(dataset.split_rows(40, 0.25)[1], held)  # fixed: the same whatever --seed
    with pytest.raises(ValueError, match=r"--eval-fraction=0.01 of the 40 rows of d.jsonl holds out 0"):
        dataset.split_rows(40, 0.01, "d.jsonl")


# ----- prompts -------------------------------------------------------------------------------------------------------


def test_text_prompts_and_chat_messages_with_the_tokenizers_template(tokenizer):
    import datasets

    text = task_of(datasets.Dataset.from_list(rows_of(2)), tokenizer).render(0)
    assert text.tokens.tolist() == tokenizer("what colour is the sky ?", add_special_tokens=False)["input_ids"]
    assert text.text == "what colour is the sky ?" and text.info == {"answer": "blue", "id": 0}
    assert text.tokens.dtype == np.int32

    rows = datasets.Dataset.from_list(rows_of(2, messages=True))
    chat = task_of(rows, tokenizer).render(1)
    expected = "<|im_start|> user what colour is the grass ? <|im_end|> <|im_start|> assistant "
    assert chat.text == expected
    assert chat.tokens.tolist() == [WORDS.index(w) + 1 for w in expected.split()]
    quiet = task_of(rows, tokenizer, chat_template_kwargs=dataset.template_kwargs('{"enable_thinking": false}'))
    assert quiet.render(1).text == expected + "nothink "
    # messages with tool calls: null content allowed there, null extra keys (Arrow structs) dropped
    assert dataset.check_messages([{"role": "user", "content": "hi", "name": None},
                                   {"role": "assistant", "content": None, "tool_calls": [{"f": 1}]}]) == [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [{"f": 1}]}]


def test_truncate_left_keeps_the_question_right_the_start_error_refuses(tokenizer):
    import datasets

    rows = datasets.Dataset.from_list([{"prompt": "tool log log log ok what is the answer ?", "answer": "red"}])
    full = task_of(rows, tokenizer).render(0).tokens
    left = task_of(rows, tokenizer, max_prompt_len=5, truncate="left").render(0)
    right = task_of(rows, tokenizer, max_prompt_len=5, truncate="right").render(0)
    np.testing.assert_array_equal(left.tokens, full[-5:])
    np.testing.assert_array_equal(right.tokens, full[:5])
    assert left.text == "what is the answer ?" and right.text == "tool log log log ok"
    np.testing.assert_array_equal(task_of(rows, tokenizer, max_prompt_len=10).render(0).tokens, full)  # fits
    with pytest.raises(ValueError, match=r"d.jsonl: row 0: 'prompt' has 10 tokens, more than --max-prompt-len=9"):
        task_of(rows, tokenizer, max_prompt_len=9).render(0)


def test_tokenizer_directory_stop_ids_and_vocabulary(tmp_path, tok_dir, tokenizer):
    assert len(tokenizer) == len(WORDS) + 1
    # generation_config.json's ids first (3 = <|im_end|>, 1 = <|endoftext|>), then the tokenizer's EOS (3 again)
    assert tokenizers.stop_ids(tokenizer, tok_dir) == (3, 1)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "generation_config.json").write_text('{"eos_token_id": 7}')
    assert tokenizers.stop_ids(tokenizer, tok_dir, str(tmp_path / "ckpt")) == (3, 1, 7)
    plain = tiny_tokenizer(tmp_path / "plain")
    assert tokenizers.stop_ids(tokenizers.load_tokenizer(plain), plain) == (3,)  # no generation_config: the EOS
    with pytest.raises(ValueError, match=r"has 23 tokens, more than the model's vocab_size=16"):
        tokenizers.load_tokenizer(tok_dir, 16)
    with pytest.raises(ValueError, match=r"--tokenizer .*empty: no tokenizer files there"):
        tokenizers.load_tokenizer(str((tmp_path / "empty").mkdir() or tmp_path / "empty"))


# ----- the trainer ---------------------------------------------------------------------------------------------------

ROW_ID = "tests.tasks.test_dataset:row_id"
LENGTH = "tests.tasks.test_dataset:length_reward"


def row_id(prompts, completions, id, **columns):
    """The row's id, for every completion: logged as reward/row_id, it names the row each step drew."""
    return [float(i) for i in id]


def length_reward(prompts, completions, **columns):
    """Differs between branches (non-zero advantages): the completion's length in characters / 10."""
    return [len(c) / 10 for c in completions]


def data_args(data, tok_dir, *extra):
    return ["--vocab-size", str(VOCAB), "--data", data, "--tokenizer", tok_dir, "-G", "3", "-R", "3",
            "--chunk-size", "8", "--learning-rate", "3e-3", "--save-every", "2", "--seed", "3", "--sft-steps", "0",
            "--reward", LENGTH, "--reward", ROW_ID, "--reward", "contains", "--reward-weights", "1,0,0.5", *extra]


def records(out, kind=None):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [r for r in rows if r.get("kind") == kind]


TIMING = {"tokens_per_s", "rollout_s", "update_s", "step_s", "peak_mem_bytes", "peak_mem_source", "eval_s"}


@pytest.mark.slow
def test_data_run_equals_two_steps_and_resume(tmp_path, tok_dir, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", rows_of(12, messages=True))
    args = data_args(data, tok_dir, "--eval-fraction", "0.25", "--eval-every", "2", "--eval-prompts", "2",
                     "--chat-template-kwargs", '{"enable_thinking": false}')
    whole, part = str(tmp_path / "whole"), str(tmp_path / "part")
    assert run.main(args + ["--steps", "3", "--out", whole]) == 0
    out = capsys.readouterr().out
    assert "data: task data " in out and "prompt from data tokens" in out and "reward per function: " in out
    assert run.main(args + ["--steps", "2", "--out", part]) == 0
    assert run.main(["--out", part, "--resume", "--steps", "3"]) == 0
    steps = records(whole)
    assert [r["step"] for r in steps] == [1, 2, 3]
    drawn = [int(r["reward/row_id"]) for r in steps]
    _, held = dataset.split_rows(12, 0.25)
    assert not set(drawn) & set(held.tolist())  # never a held-out row
    for r in steps:
        assert {"reward/length_reward", "reward/row_id", "reward/contains"} <= set(r)
        assert r["reward_mean"] == pytest.approx(r["reward/length_reward"] + 0.5 * r["reward/contains"], abs=1e-5)
    clean = lambda rs: [{k: v for k, v in r.items() if k not in TIMING} for r in rs]
    assert clean(records(part)) == clean(steps)  # the same rows, the same metrics
    evals = records(whole, "eval")
    assert [r["step"] for r in evals] == [0, 2, 3] and clean(records(part, "eval")) == clean(evals)
    assert all({"eval_reward/contains", "eval_reward/row_id"} <= set(r) and r["eval_prompts"] == 2 for r in evals)
    assert {int(r["eval_reward/row_id"] * 2) for r in evals} == {int(held[0] + held[1])}  # the first 2 held-out
    # python -m longstraw_jax.evaluate scores the checkpoint with the run's data options: the last evaluation again
    from longstraw_jax.trainer import evaluate

    report = str(tmp_path / "eval.json")
    assert evaluate.main(["--resume", whole, "--json", report]) == 0
    with open(report) as f:
        scored = json.load(f)
    assert {k: v for k, v in scored["metrics"].items() if k not in TIMING | {"eval_kl_to_start"}} == {
        k: v for k, v in evals[-1].items() if k not in TIMING | {"step", "kind", "eval_kl_to_start"}}
    assert [a["info"]["id"] for a in scored["answers"]] == held[:2].tolist()


@pytest.mark.slow
def test_prompts_of_different_lengths(tmp_path, tok_dir):
    """Prompts of 5 and 8 tokens are left-padded to one bucket (8 = --chunk-size; the models mask the pads), so the
    update compiles once for both lengths, and groups of different lengths share a step (B = 2)."""
    from longstraw_jax import train

    rows = [{"prompt": "what is the answer ?", "answer": "red", "id": 0},
            {"prompt": "tool log ok what is the answer ?", "answer": "red", "id": 1}]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    common = data_args(data, tok_dir, "--eval-every", "0", "--steps", "2", "--save-every", "5")
    train.jitted_train_step_donated.clear_cache()
    assert run.main(common + ["--out", str(tmp_path / "b1")]) == 0
    assert sorted(r["prompt_tokens"] for r in records(str(tmp_path / "b1"))) == [5, 8]  # real tokens, not pads
    assert train.jitted_train_step_donated._cache_size() == 1  # one bucket: one program for both lengths
    assert run.main(common + ["-B", "2", "--out", str(tmp_path / "b2")]) == 0
    assert [r["prompt_tokens"] for r in records(str(tmp_path / "b2"))] == [13, 13]


def test_hf_directory_gives_the_tokenizer_and_stop_ids(tmp_path, capsys):
    """--hf DIR with the tokenizer files beside the weights: no --tokenizer needed; generation_config.json's ids
    stop the branches."""
    import jax

    from longstraw_jax import models

    model = models.build(models.Qwen36Config.tiny(vocab_size=VOCAB))
    ckpt = tmp_path / "ckpt"
    models.save_hf(model, model.init(jax.random.key(0)), str(ckpt))
    tiny_tokenizer(ckpt, eos_ids=[3])
    data = write_jsonl(tmp_path / "d.jsonl", rows_of(4))
    config, _ = run.parse_args(["--hf", str(ckpt), "--data", data, "--reward", "f1", "--stop-token", "9"])
    assert components.data_source(config, VOCAB).sampling.stops == (9,)  # --stop-token says otherwise
    config, _ = run.parse_args(["--hf", str(ckpt), "--data", data, "--reward", "f1"])
    source = components.data_source(config, VOCAB)
    assert source.sampling.stops == (3,) and source.sampling.pad_token == 1
    assert source.task.prompt(0).tokens.size == 6


def test_held_out_rows_from_eval_data_or_eval_fraction(tmp_path, tok_dir):
    """The trainer's held-out task: --eval-data's rows in file order, or the --eval-fraction split's; training
    draws only the other rows."""
    data = write_jsonl(tmp_path / "d.jsonl", rows_of(8))
    held_file = write_jsonl(tmp_path / "h.jsonl", [dict(r, id=100 + r["id"]) for r in rows_of(3, messages=True)])
    base = ["--vocab-size", str(VOCAB), "--tokenizer", tok_dir, "--data", data, "--reward", "f1"]
    config, _ = run.parse_args(base + ["--eval-data", held_file])
    held, _, stops, _ = components.dataset_task(config, VOCAB, held_out=True)
    assert [held.prompt(i).info["id"] for i in range(4)] == [100, 101, 102, 100]  # in order, not shuffled
    assert held.format.messages_field == "messages" and held.path == held_file and stops == (3, 1)
    assert sorted(components.dataset_task(config, VOCAB)[0].row_of(i) for i in range(8)) == list(range(8))
    config, _ = run.parse_args(base + ["--eval-fraction", "0.25"])
    train, held = components.dataset_task(config, VOCAB)[0], components.dataset_task(config, VOCAB, held_out=True)[0]
    assert sorted(train.row_of(i) for i in range(6)) == dataset.split_rows(8, 0.25)[0].tolist()
    assert [held.row_of(i) for i in range(2)] == dataset.split_rows(8, 0.25)[1].tolist()
    config, _ = run.parse_args(base)
    assert components.dataset_task(config, VOCAB, held_out=True)[0] is None


# ----- bad input -----------------------------------------------------------------------------------------------------


def test_bad_data_one_line_error_nothing_written(tmp_path, tok_dir, capsys):
    good = rows_of(4)
    big = tiny_tokenizer(tmp_path / "big", words=WORDS + [f"w{i}" for i in range(20)])
    (tmp_path / "notok").mkdir()
    cases = [
        (["--data", write_jsonl(tmp_path / "noprompt.jsonl", [good[0], {"answer": "x", "id": 1}])],
         r"noprompt.jsonl: row 1: 'prompt' is missing$"),
        (["--data", write_jsonl(tmp_path / "msg.jsonl", [{"messages": "hello", "answer": "x"}])],
         r"msg.jsonl: row 0: 'messages' must be a non-empty list of \{role, content\} messages, not 'hello' \(str\)"),
        (["--data", write_jsonl(tmp_path / "role.jsonl", [{"messages": [{"content": "hi"}], "answer": "x"}])],
         r"role.jsonl: row 0: 'messages' message 0 needs a string 'role' \(has None"),
        (["--max-prompt-len", "4"], r"d.jsonl: row \d+: 'prompt' has 6 tokens, more than --max-prompt-len=4"),
        (["--tokenizer", str(tmp_path / "notok")], r"--tokenizer .*notok: no tokenizer files there"),
        (["--tokenizer", big], r"the tokenizer has 43 tokens, more than the model's vocab_size=32"),
        (["--reward-weights", "1,2"], r"--reward-weights='1,2' has 2 weight\(s\); need one per --reward function \(3"),
        (["--data", str(tmp_path / "none.jsonl")], r"--data .*none.jsonl: no such file or directory$"),
        (["--data", write_jsonl(tmp_path / "empty.jsonl", [])], r"--data .*empty.jsonl: cannot read it|no rows"),
        (["--data", write_jsonl(tmp_path / "broken.jsonl", ["{not json"])], r"--data .*broken.jsonl: cannot read it"),
        (["--eval-fraction", "1.5"], r"--eval-fraction=1.5 must be in \(0, 1\)"),
        (["--eval-fraction", "0"], r"--eval-fraction=0.0 must be in \(0, 1\)"),
        (["--prompt-field", "question"], r"--prompt-field question: no such column"),
        (["--reward", "nonesuch", "--reward-weights", "1,0,0.5,1"],
         r"--reward 'nonesuch': unknown; built-ins: exact_match, contains, f1, math"),
        (["--answer-field", "solution"], r"--reward contains reads the reference answer from the column 'solution'"),
        (["--chat-template-kwargs", "[1]"], r"--chat-template-kwargs='\[1\]' must be a JSON object"),
        (["--eval-every", "3"], r"--eval-every=3 needs held-out rows of --data"),
    ]
    data = write_jsonl(tmp_path / "d.jsonl", good)
    for extra, message in cases:
        out = str(tmp_path / "out")
        argv = data_args(data, tok_dir, "--steps", "1", "--out", out, "--eval-every", "0")
        assert run.main(argv + extra) == 2, extra
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
        assert __import__("re").search(message, err), (message, err)
        assert not os.path.exists(out), extra
    assert run.main(["--eval-fraction", "0.5"]) == 2
    assert "--eval-fraction needs --data" in capsys.readouterr().err


def test_datasets_and_transformers_are_imported_only_when_used():
    """`import longstraw_jax` and the data / reward / tokenizer modules stay light: datasets, transformers and
    math-verify load inside the functions that need them."""
    import subprocess
    import sys

    code = ("import sys, longstraw_jax, longstraw_jax.trainer.components, longstraw_jax.trainer.evaluate\n"
            "from longstraw_jax.tasks import dataset, rewards, tokenizer\n"
            "print(sorted(m for m in ('datasets', 'transformers', 'math_verify', 'pyarrow') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"
