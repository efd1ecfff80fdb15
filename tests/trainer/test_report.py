"""Watching a run (trainer/report.py, trainer/console.py PhaseTicker): samples.jsonl, --report-to tensorboard / wandb,
--profile-steps, the progress lines inside a step.

- the options: bad values are one error naming the option and the bound; they may change on --resume;
- samples.jsonl lines from a batch: prompt tails (text or ids), completions (decoded or ids), total and per-function
  rewards (None where a function does not apply), correctness, advantages; which steps are logged; the log drops the
  lines after a checkpoint, non-finite values become null;
- tensorboard: the event files read back (tags, steps, values; the warm-up beside; a resumed log hides the events
  after its checkpoint); wandb through a fake module (each namespace against its own step metric); a missing package
  is one error; a reporter that fails is dropped with a warning, metrics.jsonl goes on;
- the profiler window traces exactly its steps (an .xplane.pb appears); the phase ticker prints only for long phases;
- slow: a 3-step trainer run with all of it (samples of steps 1, 2, 3; tensorboard == metrics.jsonl; the fake wandb
  run; a trace of step 2; progress lines), its --resume from step 2 (no step listed twice, step 3's samples again
  identical), and a --data run (prompt text tails, decoded completions, per-function rewards).
"""
import importlib.util
import json
import math
import os
import re
import struct
import sys
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longstraw_jax.common import progress
from longstraw_jax.grpo import GroupBatch, GRPOConfig, batch_advantages
from longstraw_jax.tasks.base import Prompt
from longstraw_jax.trainer import cli as run, console, metrics, report
from longstraw_jax.trainer.config import RESUMABLE, RunConfig, RunError, profile_window, report_targets

SMALL = ["--vocab-size", "32", "--prompt-len", "48", "--group-size", "3", "--response-len", "2", "--chunk-size", "16",
         "--eval-every", "0", "--sft-steps", "0", "--learning-rate", "3e-3", "--save-every", "2", "--seed", "1"]


# ----- options -------------------------------------------------------------------------------------------------------


def test_options_bounds_and_resumable():
    config = RunConfig()
    assert config.log_samples_every == 10 and config.report_to == "none" and config.profile_steps is None
    assert {"log_samples_every", "report_to", "profile_steps", "progress_every"} <= RESUMABLE
    assert report_targets("none") == () and report_targets("wandb, tensorboard,wandb") == ("wandb", "tensorboard")
    assert profile_window("3:5") == (3, 5) and profile_window("4") == (4, 4)
    for bad, message in (
            (dict(log_samples_every=-1), "--log-samples-every=-1 must be >= 0"),
            (dict(report_to="tensorboard,comet"), "'comet' must be one of tensorboard, wandb"),
            (dict(profile_steps="5:3"), "--profile-steps='5:3' must be A:B with 1 <= A <= B"),
            (dict(profile_steps="0:2"), "--profile-steps='0:2' must be A:B with 1 <= A <= B"),
            (dict(profile_steps="a:b"), "--profile-steps='a:b' must be A:B"),
            (dict(profile_steps="1:2:3"), "--profile-steps='1:2:3' must be A:B"),
            (dict(progress_every=-1.0), "--progress-every=-1.0 must be a finite number of seconds >= 0"),
            (dict(progress_every=math.nan), "--progress-every=nan must be a finite number"),
            (dict(progress_rounds=True, progress_every=0.0), "--progress-rounds reports in the --progress-every")):
        with pytest.raises(ValueError, match=re.escape(message)):
            RunConfig(**bad)


# ----- samples.jsonl -------------------------------------------------------------------------------------------------


class WordTokenizer:
    """batch_decode like a tokenizer's: ids -> "w<id>" words joined by spaces (no special tokens)."""

    def batch_decode(self, rows, skip_special_tokens=False):
        assert skip_special_tokens
        return [" ".join(f"w{i}" for i in row) for row in rows]


def two_groups():
    """A batch of B=2 groups, G=3 branches of R=4 tokens (ragged masks), prompts of 100 ids; rewards [2, 3]."""
    responses = np.arange(24, dtype=np.int32).reshape(2, 3, 4)
    mask = np.array([[[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]],
                     [[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]]], np.float32)
    rewards = np.array([[1.0, 0.0, 0.5], [2.0, 2.0, 2.0]], np.float32)
    prompt = np.arange(200, dtype=np.int32).reshape(2, 100)
    return GroupBatch(prompt=prompt, responses=responses, mask=mask, rewards=rewards)


def test_sample_rows_text_and_ids():
    batch = two_groups()
    advantages = np.asarray(batch_advantages(batch.rewards, GRPOConfig()))
    prompts = [Prompt(batch.prompt[0], {}, "x" * 50 + "y" * 200), Prompt(batch.prompt[1], {}, None)]
    parts = {"f1": (np.array([[0.5, 0.0, 1.0], [0, 0, 0]]), np.array([[1, 1, 0], [0, 0, 0]], bool))}
    correct = np.array([[1, 0, 0], [1, 1, 1]], np.float32)
    rows = report.sample_rows(7, batch, advantages, WordTokenizer(), prompts, parts, correct)
    assert [(r["step"], r["group"], r["prompt_tokens"]) for r in rows] == [(7, 0, 100), (7, 1, 100)]
    assert rows[0]["prompt_tail"] == "y" * 200 and "prompt_tail_ids" not in rows[0]
    assert rows[1]["prompt_tail_ids"] == list(range(200 - report.PROMPT_TAIL_IDS, 200))  # no text: the last ids
    first = rows[0]["completions"]
    assert [c["text"] for c in first] == ["w0 w1 w2 w3", "w4 w5", "w8"] and [c["tokens"] for c in first] == [4, 2, 1]
    assert [c["reward"] for c in first] == [1.0, 0.0, 0.5]
    assert [c["rewards"] for c in first] == [{"f1": 0.5}, {"f1": 0.0}, {"f1": None}]  # None: does not apply
    assert [c["correct"] for c in first] == [True, False, False]
    # advantages: (r - mean) / std of the group; a uniform group has zero advantages
    np.testing.assert_allclose([c["advantage"] for c in first], (np.array([1, 0, .5]) - .5) / np.std([1, 0, .5]),
                               rtol=1e-5)
    assert [c["advantage"] for c in rows[1]["completions"]] == [0.0, 0.0, 0.0]
    # without a tokenizer, prompts, parts or correctness: ids and the total reward only
    bare = report.sample_rows(1, batch, advantages)
    assert bare[0]["completions"][1] == {"ids": [4, 5], "tokens": 2, "reward": 0.0,
                                         "advantage": pytest.approx(first[1]["advantage"])}
    assert bare[0]["prompt_tail_ids"] == list(range(100 - report.PROMPT_TAIL_IDS, 100))
    json.dumps(rows)  # plain JSON values


def test_step_samples_reads_the_data_source():
    """The data source's last scored prompts / parts / correctness and its task's tokenizer; a rollout file (no
    task, no last_scored) gives ids."""
    batch = two_groups()
    prompts = [Prompt(batch.prompt[b], {}, f"prompt {b}") for b in range(2)]
    sampler = types.SimpleNamespace(task=types.SimpleNamespace(tokenizer=WordTokenizer()),
                                    last_scored=(prompts, {}, None))
    rows = report.step_samples(3, batch, GRPOConfig(), sampler)
    assert rows[1]["prompt_tail"] == "prompt 1" and rows[0]["completions"][2]["text"] == "w8"
    assert "rewards" not in rows[0]["completions"][0] and "correct" not in rows[0]["completions"][0]
    rows = report.step_samples(3, batch, GRPOConfig(adv_norm="none"), types.SimpleNamespace(task=None))
    assert rows[0]["completions"][0]["ids"] == [0, 1, 2, 3]
    assert rows[0]["completions"][0]["advantage"] == pytest.approx(0.5)  # r - mean without std normalisation


def test_sample_steps():
    assert [s for s in range(1, 26) if report.sample_step(s, 10, 25)] == [1, 10, 20, 25]
    assert [s for s in range(1, 4) if report.sample_step(s, 1, 3)] == [1, 2, 3]
    assert not any(report.sample_step(s, 0, 5) for s in range(1, 6))


def test_samples_log_keeps_until_the_checkpoint(tmp_path):
    path = tmp_path / "samples.jsonl"
    log = metrics.MetricsLog(path)
    log.write_many([{"step": 1, "group": 0, "completions": [{"advantage": math.nan, "reward": 1.0}]},
                    {"step": 1, "group": 1, "completions": []}])
    log.write_many([{"step": 2, "group": 0}, {"step": 3, "group": 0}])
    with open(path, "a") as f:
        f.write('{"step": 4, "gro')  # a kill mid-write
    notes = log.keep_until(2)
    assert "dropped a partial last line" in notes[0] and "dropped the records of steps 3..3" in notes[1]
    lines = [json.loads(line) for line in open(path)]
    assert [(r["step"], r["group"]) for r in lines] == [(1, 0), (1, 1), (2, 0)]
    assert lines[0]["completions"][0] == {"advantage": None, "reward": 1.0}  # nested NaN -> null


def test_no_log_has_the_metrics_log_interface():
    """Processes other than 0 hold a NoLog where process 0 holds a MetricsLog: the same methods."""
    public = lambda cls: {n for n in vars(cls) if not n.startswith("_") and callable(getattr(cls, n))}
    assert public(metrics.MetricsLog) == public(metrics.NoLog) == {"keep_until", "write", "write_many", "close"}


# ----- tensorboard / wandb -------------------------------------------------------------------------------------------


def read_events(directory):
    """[(file name, Event)] of the event files directly in `directory`, files in name order (TensorBoard's), each a
    TFRecord stream: uint64 length, uint32 crc, the Event bytes, uint32 crc."""
    from tensorboardX.proto import event_pb2

    events = []
    for name in sorted(n for n in os.listdir(directory) if "tfevents" in n):
        with open(os.path.join(directory, name), "rb") as f:
            data = f.read()
        i = 0
        while i < len(data):
            (length,) = struct.unpack("<Q", data[i:i + 8])
            events.append((name, event_pb2.Event.FromString(data[i + 12:i + 12 + length])))
            i += 12 + length + 4
    return events


def shown_scalars(directory):
    """{tag: [(step, value)]} as TensorBoard shows them: a SessionLog START at step s (a resumed writer's purge_step)
    hides the earlier events at steps >= s."""
    from tensorboardX.proto.event_pb2 import SessionLog

    shown = {}
    for _, event in read_events(directory):
        if event.HasField("session_log") and event.session_log.status == SessionLog.START:
            shown = {tag: [(s, v) for s, v in points if s < event.step] for tag, points in shown.items()}
        for value in event.summary.value:
            shown.setdefault(value.tag, []).append((event.step, value.simple_value))
    return shown


RECORDS = [{"step": 0, "kind": "sft", "sft_step": 1, "sft_loss": 2.5, "sft_accuracy": 0.25},
           {"step": 0, "kind": "sft", "sft_step": 2, "sft_loss": 1.5, "sft_accuracy": 0.5},
           {"step": 0, "kind": "eval", "eval_accuracy": 0.5, "eval_prompts": 4, "before_warm_up": True},
           {"step": 0, "kind": "eval", "eval_accuracy": 0.75, "eval_prompts": 4},
           {"step": 1, "loss": 0.25, "reward_mean": 1.0, "skipped": 0.0, "peak_mem_source": "host_rss",
            "accuracy": None},
           {"step": 2, "loss": -0.5, "reward_mean": 2.0, "skipped": 0.0, "peak_mem_source": "host_rss"}]


def test_scalars_tags():
    assert report.scalars(RECORDS[0]) == ("sft", 1, {"sft/loss": 2.5, "sft/accuracy": 0.25})
    assert report.scalars(RECORDS[2]) == ("eval_before_warm_up", 0, {"eval_before_warm_up/accuracy": 0.5,
                                                                     "eval_before_warm_up/prompts": 4.0})
    assert report.scalars(RECORDS[3])[2] == {"eval/accuracy": 0.75, "eval/prompts": 4.0}
    # numbers only: strings and None are left out
    assert report.scalars(RECORDS[4]) == ("train", 1, {"train/loss": 0.25, "train/reward_mean": 1.0,
                                                       "train/skipped": 0.0})


def test_tensorboard_reads_back_and_resume_hides_the_replayed_steps(tmp_path):
    logdir = str(tmp_path / "tensorboard")
    reporter = report.TensorBoardReporter(logdir)
    for record in RECORDS:
        reporter.report(record)
    reporter.report({"step": 3, "loss": 9.0})  # after the checkpoint of step 2: replayed by the resumed run
    reporter.close()
    shown = shown_scalars(logdir)
    assert shown["train/loss"] == [(1, 0.25), (2, -0.5), (3, 9.0)]
    assert shown["eval/accuracy"] == [(0, 0.75)] and shown["eval_before_warm_up/accuracy"] == [(0, 0.5)]
    assert "sft/loss" not in shown  # the warm-up has its own directory, against the warm-up step
    assert shown_scalars(os.path.join(logdir, report.WARM_UP_DIR))["sft/loss"] == [(1, 2.5), (2, 1.5)]
    resumed = report.TensorBoardReporter(logdir, resume_step=2)
    resumed.report({"step": 3, "loss": 0.125})
    resumed.close()
    assert len({name for name, _ in read_events(logdir)}) == 2  # a second file beside the first
    assert shown_scalars(logdir)["train/loss"] == [(1, 0.25), (2, -0.5), (3, 0.125)]
    # a new run over the remains of one that completed no checkpoint starts the log afresh
    report.TensorBoardReporter(logdir).close()
    assert shown_scalars(logdir) == {} and not os.path.exists(os.path.join(logdir, report.WARM_UP_DIR))


class FakeWandb:
    """The part of the wandb module a WandbReporter uses, recording the calls."""

    def __init__(self):
        self.runs = []

    def init(self, **kwargs):
        run = types.SimpleNamespace(init=kwargs, metrics={}, logged=[], finished=False)
        run.define_metric = lambda name, step_metric=None: run.metrics.__setitem__(name, step_metric)
        run.log = lambda data: run.logged.append(data)
        run.finish = lambda: setattr(run, "finished", True)
        self.runs.append(run)
        return run


def test_wandb_with_a_fake_module(tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    report.check_available("wandb")  # a module that is there
    out = str(tmp_path / "my-run")
    reporters = report.open_reporters("wandb", out, {"lr": 1e-3}, None)
    log = report.ReportedLog(metrics.MetricsLog(tmp_path / "metrics.jsonl"), reporters)
    for record in RECORDS:
        log.write(record)
    log.close()
    (run_,) = fake.runs
    assert run_.init == {"dir": out, "name": "my-run", "config": {"lr": 1e-3}} and run_.finished
    assert run_.metrics["train/*"] == run_.metrics["eval/*"] == "step" and run_.metrics["sft/*"] == "sft/step"
    assert run_.logged[0] == {"sft/step": 1, "sft/loss": 2.5, "sft/accuracy": 0.25}
    assert run_.logged[-1] == {"step": 2, "train/loss": -0.5, "train/reward_mean": 2.0, "train/skipped": 0.0}
    assert [r["step"] for r in metrics.read_metrics(tmp_path / "metrics.jsonl")] == [0, 0, 0, 0, 1, 2]


def test_missing_package_is_one_error(monkeypatch):
    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, package=None: None)
    with pytest.raises(RunError, match=r"--report-to wandb needs the wandb package, which is not installed: pip "
                                       r"install wandb"):
        report.check_available("tensorboard,wandb")
    report.check_available("none")


def test_a_failing_reporter_is_dropped_with_a_warning(tmp_path, capsys):
    class Broken:
        calls = 0

        def report(self, record):
            Broken.calls += 1
            raise OSError("No space left on device")

        def close(self):
            pass

    log = report.ReportedLog(metrics.MetricsLog(tmp_path / "metrics.jsonl"), {"tensorboard": Broken()})
    for record in RECORDS[4:]:
        log.write(record)
    assert Broken.calls == 1 and len(metrics.read_metrics(tmp_path / "metrics.jsonl")) == 2
    assert capsys.readouterr().err.count("--report-to tensorboard failed (OSError: No space left on device)") == 1


# ----- profiler, progress --------------------------------------------------------------------------------------------


def traces(directory):
    return sorted(os.path.relpath(os.path.join(root, f), directory) for root, _, files in os.walk(directory)
                  for f in files if f.endswith(".xplane.pb"))


def test_profile_window_traces_its_steps(tmp_path):
    f = jax.jit(lambda x: jnp.sin(x).sum())
    x = jnp.ones(8)
    window = report.ProfileWindow(2, 3, str(tmp_path / "profile"))
    for step in (1, 2, 3, 4):
        window.before(step)
        assert window.active == (step in (2, 3))
        f(x).block_until_ready()
        window.after(step)
    assert not window.active and len(traces(tmp_path / "profile")) == 1
    assert any(name.endswith("perfetto_trace.json.gz") for _, _, files in os.walk(tmp_path / "profile")
               for name in files)
    # a resumed run inside the window starts at its first step; one beyond the run's end stops at close()
    late = report.ProfileWindow(1, 9, str(tmp_path / "late"))
    late.before(5)
    assert late.active
    late.close()
    assert not late.active and len(traces(tmp_path / "late")) == 1


def test_phase_ticker_prints_only_for_long_phases():
    lines = []
    say = lambda text, flush=False: lines.append(text)
    ticker = console.PhaseTicker(say, 0.02)
    with ticker.phase(3, 10, "sampling"):
        time.sleep(0.15)
    assert lines[0].startswith("  step 3/10: sampling, ") and lines[0].endswith(" s so far")
    assert lines[-1].startswith("  step 3/10: sampling done in ") and len(lines) >= 3
    lines.clear()
    with console.PhaseTicker(say, 5.0).phase(1, 2, "update"):
        pass
    with console.PhaseTicker(say, 0.0).phase(1, 2, "update"):
        time.sleep(0.05)
    with console.PhaseTicker(None, 0.01).phase(1, 2, "update"):  # another process: silent
        time.sleep(0.05)
    assert lines == []


# ----- the trainer ---------------------------------------------------------------------------------------------------


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow  # two trainer runs (compiles)
def test_run_with_samples_reports_profile_and_progress_then_resume(tmp_path, monkeypatch, capsys):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    out = str(tmp_path / "run")
    assert run.main(SMALL + ["--steps", "3", "--out", out, "--log-samples-every", "2", "--report-to",
                             "tensorboard,wandb", "--profile-steps", "2:2", "--progress-every", "0.001",
                             "--progress-rounds"]) == 0
    printed = capsys.readouterr().out
    for phase in ("sampling", "update"):
        assert f"  step 2/3: {phase}, " in printed and f"  step 2/3: {phase} done in " in printed
    # --progress-rounds: the lines say how far the compiled loops are (capture chunks of 16 of prompt[:-1] = 47)
    assert re.search(r"  step 2/3: sampling, \d+ s so far; (capture [1-3]/3|sampling [12]/2)", printed), printed[-3000:]
    assert not progress.enabled()  # the programs traced after the run have no ticks
    steps = read_jsonl(os.path.join(out, "metrics.jsonl"))
    samples = read_jsonl(os.path.join(out, "samples.jsonl"))
    assert [(s["step"], s["group"]) for s in samples] == [(1, 0), (2, 0), (3, 0)]  # step 1, every 2nd, the last
    for s, record in zip(samples, steps):
        completions = s["completions"]
        assert len(completions) == 3 and s["prompt_tokens"] == 48 and len(s["prompt_tail_ids"]) == 48
        assert np.mean([c["reward"] for c in completions]) == pytest.approx(record["reward_mean"], abs=1e-6)
        assert np.mean([c["correct"] for c in completions]) == pytest.approx(record["accuracy"])
        assert sum(c["advantage"] for c in completions) == pytest.approx(0, abs=1e-5)
        assert sum(c["tokens"] for c in completions) == record["response_tokens"]
        assert all(1 <= len(c["ids"]) <= 2 for c in completions)
    shown = shown_scalars(os.path.join(out, "tensorboard"))
    assert [s for s, _ in shown["train/loss"]] == [1, 2, 3]
    np.testing.assert_allclose([v for _, v in shown["train/loss"]], [r["loss"] for r in steps], rtol=1e-6, atol=1e-9)
    (wandb_run,) = fake.runs
    assert [d["step"] for d in wandb_run.logged] == [1, 2, 3] and wandb_run.finished
    assert wandb_run.logged[2]["train/reward_mean"] == pytest.approx(steps[2]["reward_mean"])
    assert len(traces(os.path.join(out, "profile"))) == 1
    # resume from checkpoint 2 (checkpoint 3 set aside): samples and tensorboard events of step 3 are not listed twice
    assert run.main(["--out", out, "--resume", "--resume-step", "2", "--steps", "3", "--log-samples-every", "2",
                     "--report-to", "tensorboard", "--progress-every", "0"]) == 0
    again = read_jsonl(os.path.join(out, "samples.jsonl"))
    assert [(s["step"], s["group"]) for s in again] == [(1, 0), (2, 0), (3, 0)]
    assert again == samples  # the same step 3 (the same key, params and prompt)
    shown = shown_scalars(os.path.join(out, "tensorboard"))
    assert [s for s, _ in shown["train/loss"]] == [1, 2, 3]
    assert len(fake.runs) == 1  # no wandb this time


@pytest.mark.slow  # a trainer run on a dataset (compiles)
def test_data_run_samples_have_text(tmp_path, monkeypatch):
    from tests.tasks.test_dataset import QUESTIONS, data_args, rows_of, tiny_tokenizer, write_jsonl

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    (tmp_path / "tok").mkdir()
    tok_dir = tiny_tokenizer(tmp_path / "tok", eos_ids=[3, 1])
    data = write_jsonl(tmp_path / "d.jsonl", rows_of(4))
    out = str(tmp_path / "run")
    assert run.main(data_args(data, tok_dir, "--steps", "1", "--out", out, "--log-samples-every", "1")) == 0
    (sample,) = read_jsonl(os.path.join(out, "samples.jsonl"))
    (record,) = read_jsonl(os.path.join(out, "metrics.jsonl"))
    assert sample["prompt_tail"] in {question for question, _ in QUESTIONS}  # the row's text (under 200 characters)
    completions = sample["completions"]
    assert all(isinstance(c["text"], str) and "ids" not in c for c in completions)
    assert set(completions[0]["rewards"]) == {"length_reward", "row_id", "contains"}
    for name in ("length_reward", "row_id", "contains"):
        assert np.mean([c["rewards"][name] for c in completions]) == pytest.approx(record[f"reward/{name}"])
    for c in completions:  # the weights 1, 0, 0.5 of data_args
        assert c["reward"] == pytest.approx(c["rewards"]["length_reward"] + 0.5 * c["rewards"]["contains"], abs=1e-6)
        assert c["rewards"]["length_reward"] == pytest.approx(len(c["text"]) / 10)

