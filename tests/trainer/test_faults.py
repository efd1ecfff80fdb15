"""Fault injection on real tiny trainer runs (nothing lost, nothing silent). Each case does something bad
to a run and checks the outcome AND that nothing already saved changed (sha256 of every file):

- SIGKILL inside the first and a later checkpoint save (subprocess runs; `LONGSTRAW_TEST_FAULT`, io/fault_hooks.py,
  kills at an exact point: the step's files written, the atomic rename not done): the incomplete save is removed
  with a warning, and both a new run and --resume proceed, to the same params as an uninterrupted run;
- the newest checkpoint damaged (a data file truncated, state/ deleted, meta garbled): --resume falls back to the
  older one with a warning naming the broken step's directory, which is moved aside, never deleted; --resume-step;
- metrics.jsonl with a partial last line: dropped with a warning, earlier lines kept byte for byte;
- --export-hf and --out into non-empty directories: refused before anything runs, or with --force replaced as a
  whole; --out under a file;
- Ctrl-C (SIGINT from the hook) mid-step, inside a save, and in the first step: exit 130, the last complete
  checkpoint named, the save completed; convert --dry-run warns about a non-empty --out.

One module-scoped 4-step run (checkpoints 2 and 4) is copied per case; the subprocess runs share a persistent
compilation cache, the in-process runs the compiled functions.
"""
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

from longstraw_jax import make_optimizer, models
from longstraw_jax.io import convert, fault_hooks
from longstraw_jax.io.checkpoints import TrainCheckpoints
from longstraw_jax.trainer import cli as run
from tests.helpers import ROOT

SMALL = ["--vocab-size", "32", "--prompt-len", "48", "--group-size", "3", "--response-len", "2", "--chunk-size", "16",
         "--eval-every", "0", "--sft-steps", "0", "--learning-rate", "3e-3", "--save-every", "2", "--seed", "1"]


def checksums(directory):
    """{relative path: sha256} of every file under `directory`."""
    out = {}
    for root, _, files in os.walk(directory):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                out[os.path.relpath(os.path.join(root, name), directory)] = hashlib.sha256(f.read()).hexdigest()
    return out


def bits(tree):
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


def restored_params(out, step=None):
    model = models.build(models.Qwen36Config.tiny(vocab_size=32))
    abstract = jax.eval_shape(model.init, jax.random.key(0))
    checkpoints = TrainCheckpoints(out, create=False)
    params, _, _, meta = checkpoints.restore(abstract, jax.eval_shape(make_optimizer(3e-3).init, abstract), step)
    checkpoints.close()
    assert step is None or meta["step"] == step
    return params


def steps_in(out):
    return sorted(int(n) for n in os.listdir(os.path.join(out, "checkpoints")))


def metrics_steps(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line)["step"] for line in f]


def main(argv, capsys):
    """run.main in process -> (exit status, stderr); stderr is one-line warnings, then (exit status 2) one
    one-line error."""
    code = run.main(argv)
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert all(line.startswith("warning: ") for line in lines[:-1]), err
    if code == 2:
        assert lines[-1].startswith("error: "), err
    return code, err


def subprocess_run(argv, fault, cache):
    """`python -m longstraw_jax.run` with LONGSTRAW_TEST_FAULT=fault -> the CompletedProcess."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), JAX_PLATFORMS="cpu",
               JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0", **{fault_hooks.ENV: fault})
    return subprocess.run([sys.executable, "-m", "longstraw_jax.run", *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """An uninterrupted 4-step run: checkpoints 2 and 4, metrics.jsonl, metrics.png, config.json."""
    out = str(tmp_path_factory.mktemp("base") / "run")
    assert run.main(SMALL + ["--steps", "4", "--out", out]) == 0
    assert steps_in(out) == [2, 4]
    return out


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("jax_cache")


@pytest.fixture(scope="module")
def killed_in_first_save(tmp_path_factory, cache):
    """A run SIGKILLed inside the save of step 2, its first checkpoint."""
    out = str(tmp_path_factory.mktemp("kill1") / "run")
    proc = subprocess_run(SMALL + ["--steps", "4", "--out", out], "save:2:SIGKILL", cache)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["2.orbax-checkpoint-tmp"]
    assert metrics_steps(out) == [1, 2]
    return out


@pytest.fixture(scope="module")
def killed_in_later_save(tmp_path_factory, killed_in_first_save, cache):
    """--resume of the run above (from step 0: it has no checkpoint), SIGKILLed inside the save of step 4."""
    out = str(tmp_path_factory.mktemp("kill2") / "run")
    shutil.copytree(killed_in_first_save, out)
    proc = subprocess_run(["--out", out, "--resume", "--steps", "4", "--save-every", "2"], "save:4:SIGKILL", cache)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert "2.orbax-checkpoint-tmp: an incomplete save" in proc.stderr
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["2", "4.orbax-checkpoint-tmp"]
    return out


def copy(source, tmp_path, name="run"):
    target = str(tmp_path / name)
    shutil.copytree(source, target)
    return target


# ----- SIGKILL inside a save -----------------------------------------------------------------------------------------


@pytest.mark.slow  # a trainer subprocess SIGKILLed in its first save
@pytest.mark.parametrize("resume", [False, True], ids=["new_run", "resume"])
def test_kill_in_first_save(base, killed_in_first_save, tmp_path, capsys, resume):
    """Both a new run and --resume proceed (the incomplete save removed, with a warning) and reach the
    uninterrupted run's params; before, a new run said 'already holds checkpoints' and --resume 'no checkpoint'."""
    out = copy(killed_in_first_save, tmp_path)
    argv = ["--out", out, "--resume", "--steps", "4", "--save-every", "2"] if resume else SMALL + ["--steps", "4",
                                                                                                   "--out", out]
    code, err = main(argv, capsys)
    assert code == 0
    assert "2.orbax-checkpoint-tmp" in err and "warning: " in err
    assert steps_in(out) == [2, 4] and metrics_steps(out) == [1, 2, 3, 4]
    assert bits(restored_params(out, 4)) == bits(restored_params(base, 4))


@pytest.mark.slow  # two trainer subprocesses, SIGKILLed in their saves
def test_kill_in_later_save(base, killed_in_later_save, tmp_path, capsys):
    """--resume removes the incomplete save of step 4 (warning), resumes from 2 (unchanged) and reaches the
    uninterrupted run's step-4 params; a new run into it is refused (it holds a checkpoint)."""
    out = copy(killed_in_later_save, tmp_path)
    saved = checksums(os.path.join(out, "checkpoints", "2"))
    code, err = main(SMALL + ["--steps", "4", "--out", out], capsys)
    assert code == 2 and "already holds checkpoints: pass --resume" in err
    code, err = main(["--out", out, "--resume", "--steps", "4", "--save-every", "2"], capsys)
    assert code == 0 and "4.orbax-checkpoint-tmp: an incomplete save" in err
    assert checksums(os.path.join(out, "checkpoints", "2")) == saved
    assert steps_in(out) == [2, 4] and metrics_steps(out) == [1, 2, 3, 4]
    assert bits(restored_params(out, 4)) == bits(restored_params(base, 4))


# ----- damaged checkpoints -------------------------------------------------------------------------------------------


def truncate_data(step_dir):
    files = [os.path.join(root, f) for root, _, names in os.walk(os.path.join(step_dir, "state")) for f in names]
    big = max(files, key=os.path.getsize)
    os.truncate(big, os.path.getsize(big) // 2)
    return "state"


def delete_state(step_dir):
    shutil.rmtree(os.path.join(step_dir, "state"))
    return "state"


def garble_meta(step_dir):
    with open(os.path.join(step_dir, "meta", "metadata"), "w") as f:
        f.write('{"step": 4, "data_po')
    return os.path.join("meta", "metadata")


@pytest.mark.parametrize("damage", [truncate_data, delete_state, garble_meta])
def test_damaged_newest_checkpoint_falls_back(base, tmp_path, capsys, damage):
    """--resume warns naming the broken step's item directory, restores step 2, moves the broken checkpoint aside
    unchanged, and redoes steps 3-4 to the uninterrupted run's params."""
    out = copy(base, tmp_path)
    item = damage(os.path.join(out, "checkpoints", "4"))
    broken, older = (checksums(os.path.join(out, "checkpoints", s)) for s in ("4", "2"))
    code, err = main(["--out", out, "--resume", "--steps", "4"], capsys)
    assert code == 0, err
    assert f"checkpoint 4: {os.path.join(out, 'checkpoints', '4', item)} is unreadable" in err
    assert f"moved checkpoint 4 to {os.path.join(out, 'checkpoints-set-aside', '4')}" in err
    assert "metrics.jsonl: dropped the records of steps 3..4" in err
    assert checksums(os.path.join(out, "checkpoints-set-aside", "4")) == broken
    assert checksums(os.path.join(out, "checkpoints", "2")) == older
    assert steps_in(out) == [2, 4] and metrics_steps(out) == [1, 2, 3, 4]
    assert bits(restored_params(out, 4)) == bits(restored_params(base, 4))


def test_resume_step_and_unusable_checkpoints(base, tmp_path, capsys):
    out = copy(base, tmp_path)
    before = checksums(out)
    for argv, message in [
        (["--resume-step", "3"], r"--resume-step=3: no checkpoint 3 in .*checkpoints \(complete: 2, 4\)"),
        (["--resume-step", "2", "--steps", "2"], "--steps=2"),
        (["--steps", "4"], "--steps=4: the newest intact checkpoint is already at step 4"),
    ]:
        code, err = main(["--out", out, "--resume"] + argv, capsys)
        assert code == 2 and __import__("re").search(message, err), err
        assert checksums(out) == before
    delete_state(os.path.join(out, "checkpoints", "4"))
    before = checksums(out)
    code, err = main(["--out", out, "--resume", "--resume-step", "4", "--steps", "5"], capsys)
    assert code == 2 and f"--resume-step=4: checkpoint 4: {os.path.join(out, 'checkpoints', '4', 'state')}" in err
    assert checksums(out) == before
    garble_meta(os.path.join(out, "checkpoints", "2"))
    before = checksums(out)
    code, err = main(["--out", out, "--resume", "--steps", "5"], capsys)
    assert code == 2 and "--resume: no intact checkpoint in" in err.splitlines()[-1], err
    assert checksums(out) == before

    # --resume-step 2 with an intact newer checkpoint: 4 is moved aside unchanged, and recomputed identically
    out = copy(base, tmp_path, "pick")
    newer = checksums(os.path.join(out, "checkpoints", "4"))
    code, err = main(["--out", out, "--resume", "--resume-step", "2", "--steps", "4"], capsys)
    assert code == 0 and "--resume-step=2: the newer checkpoint(s) 4 are moved to" in err
    assert checksums(os.path.join(out, "checkpoints-set-aside", "4")) == newer
    assert bits(restored_params(out, 4)) == bits(restored_params(base, 4))


# ----- metrics.jsonl ------------------------------------------------------------------------------------------------


def test_partial_metrics_line_is_dropped(base, tmp_path, capsys):
    """A crash while writing step 5's record (after checkpoint 4): --resume drops the partial line with a warning
    naming file:line; the earlier lines stay byte for byte. A damaged line before the last is an error naming it."""
    out = copy(base, tmp_path)
    path = os.path.join(out, "metrics.jsonl")
    with open(path) as f:
        lines = f.read()
    with open(path, "a") as f:
        f.write('{"step": 5, "loss": 0.1')
    checkpoint = checksums(os.path.join(out, "checkpoints", "4"))
    code, err = main(["--out", out, "--resume", "--steps", "5"], capsys)
    assert code == 0 and f"{path}:5: dropped a partial last line" in err
    with open(path) as f:
        assert f.read().startswith(lines)
    assert metrics_steps(out) == [1, 2, 3, 4, 5]
    assert checksums(os.path.join(out, "checkpoints", "4")) == checkpoint

    out = copy(base, tmp_path, "garbled")
    path = os.path.join(out, "metrics.jsonl")
    with open(path) as f:
        rows = f.readlines()
    rows[1] = rows[1][:20] + "\n"
    with open(path, "w") as f:
        f.writelines(rows)
    before = checksums(out)
    code, err = main(["--out", out, "--resume", "--steps", "5"], capsys)
    assert code == 2 and f"{path}:2: not a metrics record" in err
    assert checksums(out) == before


# ----- exports and --out into non-empty directories --------------------------------------------------------------


def test_export_into_non_empty_directory(base, tmp_path, capsys):
    """An older sharded export in DIR: refused before training (DIR and the run unchanged); with --force DIR is
    replaced as a whole (no old shard or index left), and load_hf reads the trained params."""
    out = copy(base, tmp_path)
    export = str(tmp_path / "hf")
    model = models.build(models.Qwen36Config.tiny(vocab_size=32))
    models.save_hf(model, restored_params(base, 2), export, max_shard_bytes=1 << 18)
    assert "model.safetensors.index.json" in os.listdir(export)
    old, run_before = checksums(export), checksums(out)
    code, err = main(["--out", out, "--resume", "--steps", "5", "--export-hf", export], capsys)
    assert code == 2 and f"--export-hf {export}: exists and is not empty" in err and "--force" in err
    assert checksums(export) == old and checksums(out) == run_before
    code, err = main(["--out", out, "--resume", "--steps", "5", "--export-hf", export, "--force"], capsys)
    assert code == 0, err
    assert sorted(os.listdir(export)) == ["config.json", "model.safetensors"]
    assert sorted(os.listdir(tmp_path)) == ["hf", "run"]  # no staging or old copy left beside it
    assert bits(models.load_hf(export)[1]) == bits(restored_params(out, 5))
    code, err = main(["--out", out, "--resume", "--steps", "6", "--export-hf", out], capsys)
    assert code == 2 and "holds --out" in err


def test_out_must_be_new_empty_or_ours(base, tmp_path, capsys, monkeypatch):
    others = tmp_path / "others"
    others.mkdir()
    (others / "notes.txt").write_text("mine")
    finished = copy(base, tmp_path, "finished")  # an earlier run whose checkpoints were removed
    for step in ("2", "4"):
        shutil.rmtree(os.path.join(finished, "checkpoints", step))
    afile = tmp_path / "afile"
    afile.write_text("x")
    before = checksums(tmp_path)
    for out, message in [(str(others), "not empty (notes.txt) and not a run of this trainer"),
                         (finished, "not a run of this trainer that can be resumed or restarted"),
                         (str(afile / "sub"), f"cannot be created, {afile} is not a directory"),
                         (str(afile), "exists and is not a directory")]:
        code, err = main(SMALL + ["--steps", "2", "--out", out], capsys)
        assert code == 2 and message in err, (out, err)
        assert checksums(tmp_path) == before
    code, err = main(["--out", finished, "--resume"], capsys)
    assert code == 2 and "--resume: no checkpoint in" in err
    # an unwritable parent: permissions are simulated (root, as in CI, may write anywhere)
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if os.fspath(p) == str(locked) else real_access(p, mode))
    code, err = main(SMALL + ["--steps", "2", "--out", str(locked / "run")], capsys)
    assert code == 2 and "is not writable" in err and not os.path.exists(locked / "run")


def test_bad_reward_writes_nothing(tmp_path, capsys):
    """A reward function that fails on the first batch: the error comes before --out is created."""
    out = str(tmp_path / "nan")
    code, err = main(SMALL + ["--steps", "2", "--out", out, "--reward", "tests.tasks.test_loader:nan_reward"], capsys)
    assert code == 2 and not os.path.exists(out)


# ----- Ctrl-C ---------------------------------------------------------------------------------------------------------


@pytest.fixture
def sigint_raises():
    """Python's own SIGINT handler (KeyboardInterrupt) for the test, whatever the test runner installed."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c(base, tmp_path, capsys, monkeypatch, sigint_raises):
    """SIGINT mid-step 3: exit 130 naming checkpoint 2, no traceback; --resume reaches the uninterrupted params.
    SIGINT inside the save of step 4: the save completes first. SIGINT in step 1: nothing written at all."""
    out = str(tmp_path / "run")
    monkeypatch.setenv(fault_hooks.ENV, "step:3:SIGINT")
    code, err = main(SMALL + ["--steps", "4", "--out", out], capsys)
    assert code == 130
    assert err.strip() == (f"interrupted (Ctrl-C) after 2 completed steps: the last complete checkpoint is step 2 "
                           f"({os.path.join(out, 'checkpoints', '2')}); continue with --out {out} --resume")
    assert steps_in(out) == [2] and metrics_steps(out) == [1, 2]
    saved = checksums(os.path.join(out, "checkpoints", "2"))
    monkeypatch.setenv(fault_hooks.ENV, "save:4:SIGINT")
    code, err = main(["--out", out, "--resume", "--steps", "4"], capsys)
    assert code == 130 and "the last complete checkpoint is step 4" in err
    assert checksums(os.path.join(out, "checkpoints", "2")) == saved
    assert bits(restored_params(out, 4)) == bits(restored_params(base, 4))

    monkeypatch.setenv(fault_hooks.ENV, "step:1:SIGINT")
    fresh = str(tmp_path / "fresh")
    code, err = main(SMALL + ["--steps", "4", "--out", fresh], capsys)
    assert code == 130 and "no checkpoint was saved" in err and not os.path.exists(fresh)


# ----- convert --dry-run -------------------------------------------------------------------------------------------


def test_convert_dry_run_warns_about_non_empty_out(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(models.Qwen36Config.tiny(vocab_size=32).to_hf()))
    out = tmp_path / "out"
    out.mkdir()
    (out / "x").write_text("x")
    assert convert.main(["hf2orbax", "--hf", str(config), "--dry-run", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert f"warning: --out {out} exists and is not empty; a real run needs --force" in captured.err
