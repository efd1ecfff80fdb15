"""`python -m longstraw_jax.pretrain` (trainer/pretrain.py): next-token pre-training on a text corpus, saved as an HF
checkpoint that `models.load_hf` (and so the trainer's --hf) reads.

- the corpus: files and directories (with --glob), each file's tokens + EOS, split by file into training and
  held-out; windows drawn as a pure function of (seed, step);
- a short run on a patterned corpus lowers the training and the held-out loss, and the checkpoint it writes holds
  the trained weights (its held-out loss, recomputed from the loaded checkpoint, is the one the run reported);
- bad input: one line naming the option and the bound, exit 2, nothing written.
"""
import json
import os
import re

import numpy as np
import pytest

from longstraw_jax import models
from longstraw_jax.tasks.tokenizer import load_tokenizer
from longstraw_jax.trainer import pretrain
from tests.tasks.test_dataset import VOCAB

SENTENCES = ["the sky is blue", "the grass is green", "the sea is blue", "what colour is the sky ? blue",
             "tool log ok", "the answer is red"]


def write_corpus(directory, files: int = 6, lines: int = 40, seed: int = 0):
    rng = np.random.default_rng(seed)
    os.makedirs(directory, exist_ok=True)
    for i in range(files):
        text = "\n".join(SENTENCES[j] for j in rng.integers(0, len(SENTENCES), lines))
        (directory / f"doc{i}.txt").write_text(text + "\n")
    (directory / "skip.md").write_text("not matched by --glob *.txt")
    return str(directory)


def test_corpus_files_tokens_and_windows(tmp_path, tok_dir):
    corpus_dir = write_corpus(tmp_path / "c", files=4)
    tokenizer = load_tokenizer(tok_dir, VOCAB)
    files = pretrain.corpus_files([corpus_dir], "*.txt")
    assert [os.path.basename(f) for f in files] == ["doc0.txt", "doc1.txt", "doc2.txt", "doc3.txt"]
    assert len(pretrain.corpus_files([corpus_dir])) == 5 and pretrain.corpus_files([files[0], files[0]]) == files[:1]
    corpus = pretrain.load_corpus([corpus_dir], tokenizer, VOCAB, "*.txt", held_out=0.25, seq_len=8)
    assert [os.path.basename(f) for f in corpus.held_out_files] == ["doc3.txt"] and len(corpus.train_files) == 3
    one = pretrain.tokenize_files(files[:1], tokenizer, VOCAB)
    words = open(files[0]).read().split()
    assert one.size == len(words) + 1 and one[-1] == tokenizer.eos_token_id  # each file ends with EOS
    assert corpus.train.size == sum(pretrain.tokenize_files([f], tokenizer, VOCAB).size for f in files[:3])
    a = pretrain.windows(corpus.train, 8, 4, seed=1, step=5)
    assert a.shape == (4, 9) and a.dtype == np.int32
    np.testing.assert_array_equal(a, pretrain.windows(corpus.train, 8, 4, seed=1, step=5))
    assert not np.array_equal(a, pretrain.windows(corpus.train, 8, 4, seed=1, step=6))


def test_repeat_windows_copy_a_span_to_a_random_later_place():
    """--repeat F: the first F of each batch's windows hold one of their spans twice, at distances that vary (a
    fixed distance would teach a fixed-offset copy); the other windows and the window starts are as without it."""
    stream = np.arange(100_000, dtype=np.int32)  # every token distinct: a repeated token can only be a copy
    L, m = 63, 16
    plain = pretrain.windows(stream, L, 8, seed=3, step=2)
    mixed = pretrain.windows(stream, L, 8, seed=3, step=2, repeat=0.5)
    np.testing.assert_array_equal(mixed[4:], plain[4:])
    np.testing.assert_array_equal(mixed[:, 0], plain[:, 0])
    distances = set()
    for row, original in zip(mixed[:4], plain[:4]):
        changed = np.flatnonzero(row != original)
        assert changed.size == m and np.all(np.diff(changed) == 1)  # one span of m tokens overwritten
        k = changed[0]
        j = int(np.flatnonzero(original == row[k])[0])  # where the copy comes from
        np.testing.assert_array_equal(row[k: k + m], original[j: j + m])
        assert k - j >= m
        distances.add(k - j)
    assert len(distances) > 1
    assert np.array_equal(pretrain.windows(stream, L, 8, seed=3, step=2, repeat=0.0), plain)


@pytest.mark.slow  # ~40 s: compiles of the tiny model's forward and backward
def test_a_short_run_lowers_the_loss_and_saves_the_trained_weights(tmp_path, tok_dir):
    corpus_dir = write_corpus(tmp_path / "c")
    out = str(tmp_path / "base")
    argv = ["--text", corpus_dir, "--glob", "*.txt", "--tokenizer", tok_dir, "--vocab-size", str(VOCAB),
            "--seq-len", "16", "--batch", "8", "--steps", "40", "--learning-rate", "3e-3", "--held-out", "0.2",
            "--log-every", "10", "--out", out]
    lines = []
    summary = pretrain.pretrain(pretrain.parse_args(argv), say=lambda line, **_: lines.append(line))
    assert summary["loss_last"] < 0.5 * summary["loss_first"], summary
    assert summary["held_out_after"] < 0.6 * summary["held_out_before"], summary
    assert lines[-1].startswith("loss ") and f"wrote {out}" in lines[-1]
    records = [json.loads(line) for line in open(os.path.join(out, "pretrain.jsonl"))]
    assert [r["step"] for r in records] == [0, 10, 20, 30, 40, 40]
    model, params = models.load_hf(out)
    assert model.config.vocab_size == VOCAB
    tokenizer = load_tokenizer(out, VOCAB)  # the tokenizer travels with the checkpoint
    corpus = pretrain.load_corpus([corpus_dir], tokenizer, VOCAB, "*.txt", held_out=0.2, seq_len=16)
    again = pretrain.held_out_loss(model, params, corpus.held_out, 16, 8)
    assert again == pytest.approx(summary["held_out_after"], rel=1e-5)


def test_bad_input_is_one_line_and_writes_nothing(tmp_path, tok_dir, capsys):
    corpus_dir = write_corpus(tmp_path / "c", files=2)
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9")
    base = ["--tokenizer", tok_dir, "--vocab-size", str(VOCAB), "--steps", "1", "--seq-len", "8"]
    out = str(tmp_path / "out")
    cases = [
        (["--text", str(tmp_path / "missing")], "--text .*missing: no such file or directory"),
        (["--text", corpus_dir, "--glob", "*.py"], r"no file matching '\*.py'"),
        (["--text", str(tmp_path / "latin1.txt")], "latin1.txt: not UTF-8 text"),
        (["--text", corpus_dir, "--glob", "*.txt", "--held-out", "0.9"], "--held-out 0.9: 2 file.* leave none"),
        (["--text", corpus_dir, "--glob", "*.txt", "--seq-len", "100000"], "fewer than one window of --seq-len"),
    ]
    for extra, message in cases:
        assert pretrain.main(base + extra + ["--out", out]) == 2, message
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: "), err
        assert re.search(message, err), (message, err)
        assert not os.path.exists(out)
    small = ["--tokenizer", tok_dir, "--vocab-size", "8", "--text", corpus_dir, "--out", out]
    assert pretrain.main(small) == 2 and "more than the model's vocab_size=8" in capsys.readouterr().err
    os.makedirs(out)
    with pytest.raises(SystemExit):
        pretrain.parse_args(base + ["--text", corpus_dir, "--out", out])
    assert "already exists" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        pretrain.parse_args(base + ["--text", corpus_dir, "--out", str(tmp_path / "o2"), "--batch", "0"])
    assert "--batch=0 must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        pretrain.parse_args(base + ["--text", corpus_dir, "--out", str(tmp_path / "o2"), "--repeat", "1.5"])
    assert "--repeat=1.5 must be in [0, 1]" in capsys.readouterr().err
