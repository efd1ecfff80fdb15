"""Odd single-process inputs: each is one clear line (exit 2, nothing written) or refused before any allocation."""
import json
import os
import types

import pytest

from longstraw_jax import models
from longstraw_jax.tasks.retrieval import RetrievalTask
from longstraw_jax.tasks.rollout_file import load_rollouts
from longstraw_jax.trainer import cli as run
from longstraw_jax.trainer.components import RunError, check_fits
from longstraw_jax.trainer.config import parse_args
from longstraw_jax.trainer.evaluate import Evaluator
from tests.helpers import ROOT


def one_line_error(argv, capsys, out) -> str:
    assert run.main(argv + ["--out", out]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert not os.path.exists(out)
    return err


def test_rollout_token_beyond_int64_and_a_directory(tmp_path, capsys):
    path = tmp_path / "groups.jsonl"
    path.write_text(json.dumps({"prompt": [1, 2, 10**30], "responses": [[1]], "rewards": [0.0]}) + "\n")
    with pytest.raises(ValueError, match=r"groups.jsonl:1: 'prompt'\[2\] = 10{30} is out of range".replace("10{30}",
                                                                                                        str(10**30))):
        load_rollouts(path, 32)
    err = one_line_error(["--rollouts", str(path)], capsys, str(tmp_path / "a"))
    assert "is out of range: token ids must be in [0, vocab_size=32)" in err
    err = one_line_error(["--rollouts", str(tmp_path)], capsys, str(tmp_path / "b"))
    assert "is a directory; --rollouts takes one JSONL file" in err


def test_a_model_that_cannot_fit_is_refused_before_allocating(tmp_path, capsys):
    with open(os.path.join(ROOT, "configs", "qwen3.6-tiny.json")) as f:
        config = json.load(f)
    config["vocab_size"] = 10**9  # 2 x 64 x 1e9 floats: 480 GiB of params and moments
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    err = one_line_error(["--model", str(path)], capsys, str(tmp_path / "a"))
    assert f"--model {path}: " in err and " B parameters need " in err and "GiB available" in err, err
    model = models.build(models.Qwen36Config.tiny(vocab_size=32))
    check_fits(model, "float32", "tiny", available=2**30)  # 0.41 M parameters fit in 1 GiB
    with pytest.raises(RunError, match=r"tiny: 0.000\d+ B parameters need 0.0 GiB .* 0.0 GiB available"):
        check_fits(model, "float32", "tiny", available=1000)


def test_bounds_that_used_to_escape(tmp_path, capsys):
    for argv, message in ((["-G", "1"], "--group-size=1 must be >= 2: a GRPO advantage"),
                          (["--eval-prompts", "20000000"], "--eval-prompts=20000000 must be <= 65536"),
                          (["--learning-rate", "-1e3"], "--learning-rate=-1000.0 must be a finite number >= 0"),
                          (["-R", "-1e1"], "error: argument --response-len/-R: invalid int value: '-1e1'")):
        if message.startswith("error: argument"):  # argparse's own error (exit 2 through SystemExit)
            with pytest.raises(SystemExit):
                parse_args(argv)
            assert message in capsys.readouterr().err
            continue
        err = one_line_error(argv, capsys, str(tmp_path / "out"))
        assert message in err, err
    # attached (to the former spelling too), then overridden as usual
    assert parse_args(["--lr", "-0.5e-3", "--learning-rate", "1e-3"])[0].learning_rate == 1e-3
    mesh = types.SimpleNamespace(shape={"data": 2, "seq": 1})
    with pytest.raises(ValueError, match=r"^--eval-prompts=3 must be a multiple of the mesh's data size 2"):
        Evaluator(RetrievalTask(prompt_len=32, vocab_size=32), None, 3, 2, 16, mesh=mesh)
