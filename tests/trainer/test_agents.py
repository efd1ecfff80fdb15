"""Agent branches through the trainer (trainer/episodes.py, docs/architecture.md 11) on the built-in lookup task:

- a run samples multi-turn episodes (the tool's replies in the transcript, mask 0), logs env/ metrics, counts only
  the policy's tokens, writes samples.jsonl rows with the turns, and evaluates held-out prompts as episodes;
- an environment that fails on some branches leaves them out (weight 0, counted), the run goes on;
- one that fails on more than --max-env-errors of a step's branches stops the run with one line naming the
  environment, prompt, branch and turn, the step not applied and the checkpoints intact; resumed once it works
  again, the run ends where an uninterrupted run does (bit for bit);
- a factory that is missing or fails at start: one line, nothing written;
- two processes: each calls only its own groups' environments (one of them never returning), and the run equals a
  one-process run on the same mesh.
"""
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from longstraw_jax.tasks.lookup import RESULT, LookupTask
from longstraw_jax.trainer import cli as run
from tests.helpers import ROOT
from tests.trainer.test_run import bits, restore, snapshot

AGENT = ["--task", "lookup", "--vocab-size", "48", "--prompt-len", "32", "--response-len", "8", "--turn-len", "3",
         "--max-turns", "2", "--group-size", "3", "--groups-per-step", "2", "--chunk-size", "16", "--eval-every", "0",
         "--sft-steps", "0", "--learning-rate", "3e-3", "--save-every", "1", "--seed", "2"]
DOWN = "LONGSTRAW_TEST_TOOL_DOWN"


class SwitchedLookup:
    """The lookup tool; while the environment variable DOWN is set every step raises, and with `branch` set that
    branch's steps always raise."""

    def __init__(self, vocab_size, seed, branch=None):
        self.inner = LookupTask(prompt_len=32, vocab_size=vocab_size).environment(vocab_size, seed)
        self.branch = branch

    def reset(self, prompt_tokens, info, branch):
        self.inner.reset(prompt_tokens, info, branch)
        self.at = branch

    def step(self, turn):
        if os.environ.get(DOWN) or self.at == self.branch:
            raise ConnectionError("tool down")
        return self.inner.step(turn)


def read(out, name="metrics.jsonl"):
    with open(os.path.join(out, name)) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def agent_run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("agents") / "a")
    # a short warm-up on the tool episodes (the tool's reply masked out) teaches the call format
    assert run.main(AGENT + ["--steps", "3", "--out", out, "--log-samples-every", "1", "--eval-every", "3",
                             "--eval-prompts", "4", "--sft-steps", "15", "--sft-batch", "16"]) == 0
    return out


def test_a_run_samples_episodes_and_shows_them(agent_run):
    records = [r for r in read(agent_run) if "kind" not in r]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert {"env/turns", "env/observation_tokens", "env/errors", "env/time_s", "accuracy"} <= set(r)
        assert 1 <= r["env/turns"] <= 2 and r["env/errors"] == 0
    rows = read(agent_run, "samples.jsonl")
    assert len(rows) == 6  # 3 steps x 2 groups
    calls = 0
    for row in rows:
        step = next(r for r in records if r["step"] == row["step"])
        for completion in row["completions"]:
            turns = completion["turns"]
            assert turns[0]["role"] == "assistant" and completion["status"] in ("done", "length", "max_turns")
            assert [t["role"] for t in turns] == ["assistant", "tool"] * (len(turns) // 2)
            assert completion["ids"] == [x for t in turns if t["role"] == "assistant" for x in t["tokens"]]
            for tool in turns[1::2]:
                if tool["tokens"]:  # the tool answered a call: RESULT and the table's value
                    calls += 1
                    assert tool["tokens"][0] == RESULT and len(tool["tokens"]) == 2 and tool["reward"] == 0
        # token counts are the policy's only
        assert sum(c["tokens"] for c in row["completions"]) <= step["response_tokens"]
    assert sum(r["response_tokens"] for r in records) == sum(c["tokens"] for row in rows for c in row["completions"])
    assert calls > 0  # after the warm-up branches call the tool with an id
    evals = [r for r in read(agent_run) if r.get("kind") == "eval"]
    assert [e["step"] for e in evals] == [0, 0, 3] and all(0 <= e["eval_accuracy"] <= 1 for e in evals)


def test_failed_branches_are_left_out_and_the_run_goes_on(tmp_path):
    out = str(tmp_path / "flaky")
    assert run.main(AGENT + ["--steps", "2", "--out", out, "--env", "tests.trainer.test_agents:SwitchedLookup",
                             "--env-kwargs", '{"branch": 1}', "--log-samples-every", "1"]) == 0
    records = read(out)
    assert all(r["env/errors"] == 2 and r["env/errors_share"] == pytest.approx(1 / 3) for r in records)
    assert all("branch 1" in r["env/first_error"] and "ConnectionError: tool down" in r["env/first_error"]
               for r in records)
    for row in read(out, "samples.jsonl"):
        failed = row["completions"][1]
        assert failed["status"] == "error" and failed["advantage"] == 0.0


def test_an_environment_down_stops_the_run_and_it_resumes(agent_run, tmp_path, capsys, monkeypatch):
    out = str(tmp_path / "down")
    switched = AGENT + ["--env", "tests.trainer.test_agents:SwitchedLookup"]
    assert run.main(switched + ["--steps", "2", "--out", out]) == 0
    before = snapshot(os.path.join(out, "checkpoints"))
    monkeypatch.setenv(DOWN, "1")
    capsys.readouterr()
    assert run.main(["--out", out, "--resume", "--steps", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "SwitchedLookup" in err[0] and "prompt 4, branch 0, turn 0: ConnectionError" in err[0]
    assert "the step was not applied" in err[0]
    assert snapshot(os.path.join(out, "checkpoints")) == before and len(read(out)) == 2
    monkeypatch.delenv(DOWN)
    assert run.main(["--out", out, "--resume", "--steps", "3"]) == 0
    straight = str(tmp_path / "straight")
    assert run.main(switched + ["--steps", "3", "--out", straight]) == 0
    drop = {"tokens_per_s", "rollout_s", "update_s", "step_s", "peak_mem_bytes", "env/time_s", "env/decode_s",
            "env/observe_s", "env/capture_s"}
    strip = lambda records: [{k: v for k, v in r.items() if k not in drop} for r in records]
    assert strip(read(out)) == strip(read(straight))
    (resumed, resumed_opt, _), (whole, whole_opt, _) = (restore(d, vocab_size=48) for d in (out, straight))
    assert bits(resumed) == bits(whole) and bits(resumed_opt) == bits(whole_opt)


def test_factory_errors_are_one_line_and_write_nothing(tmp_path, capsys):
    for spec, message in (("tests.trainer.test_agents:Nope", "has no attribute 'Nope'"),
                          ("tests.trainer.test_agents:broken_factory", "failed at start: OSError: no sandbox")):
        out = str(tmp_path / "x")
        assert run.main(AGENT + ["--steps", "1", "--out", out, "--env", spec]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0] and not os.path.exists(out)


def broken_factory(vocab_size, seed):
    raise OSError("no sandbox")


def test_the_lookup_task():
    task = LookupTask(prompt_len=32, vocab_size=48, seed=0)
    for i in range(20):
        prompt = task.prompt(i)
        info = prompt.info
        tokens = list(prompt.tokens)
        assert len(tokens) == 32 and tokens[-2:] == [4, info["key"]]
        at = next(j for j in range(len(tokens) - 2) if tokens[j:j + 2] == [3, info["key"]])
        assert tokens[at + 2] == info["id"] and info["answer"] == info["table"][info["id"] - task.first_id]
        env = task.environment(48, 0)
        env.reset(prompt.tokens, info, 0)
        assert env.step([info["answer"], 1]) == ([], 0.0, True)  # a guess, even a right one, is not rewarded
        env.reset(prompt.tokens, info, 0)
        assert env.step([5, info["id"], 1]) == ([RESULT, info["answer"]], None, False)
        assert env.step([info["answer"], 1]) == ([], 1.0, True)
        target, mask = task.target(info)
        assert task.is_correct(target[mask > 0], info) and not task.is_correct(target[:3], info)
        assert not task.is_correct(target[-2:], info)  # the answer alone: no call
    assert task.call_any_accuracy == pytest.approx(1 / 8 + 7 / 64)


@pytest.mark.slow  # a 2x4 trainer run of the lookup task
def test_a_mesh_run_samples_the_same_episodes(tmp_path):
    """--mesh 2x4 with B = 2 (a group per data slice): the episodes, rewards and env metrics of the one-device run
    (2 steps, no warm-up), the losses equal up to float round-off."""
    outs = {}
    for where in ("one", "mesh"):
        outs[where] = str(tmp_path / where)
        extra = ["--mesh", "2x4"] if where == "mesh" else []
        assert run.main(AGENT + ["--steps", "2", "--out", outs[where], "--log-samples-every", "1"] + extra) == 0
    one, mesh = read(outs["one"]), read(outs["mesh"])
    for a, b in zip(one, mesh):
        for key in ("reward_mean", "accuracy", "env/turns", "env/observation_tokens", "response_tokens"):
            assert a[key] == b[key], key
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
    turns = lambda out: [c["turns"] for row in read(out, "samples.jsonl") for c in row["completions"]]
    assert turns(outs["one"]) == turns(outs["mesh"])


def test_the_agent_demo_config_builds_episodes():
    """configs/agent_demo.toml parses, and its data source samples episodes with the lookup task's own tool."""
    from longstraw_jax.trainer import components
    from longstraw_jax.trainer.config import parse_args

    config, _ = parse_args(["--config", os.path.join(ROOT, "configs", "agent_demo.toml")])
    assert (config.task, config.mode, config.max_turns, config.response_len) == ("lookup", "exact", 2, 8)
    source = components.data_source(config, config.vocab_size)
    assert isinstance(source, components.episodes.EpisodeSampler)
    assert source.env_name == "the lookup task's environment" and len(source.environments) == 16 * 8


def test_agent_options_name_every_bad_value():
    from longstraw_jax.trainer.config import parse_args

    with pytest.raises(ValueError) as info:
        parse_args(["--max-turns", "0", "--env-timeout", "0", "--max-env-errors", "2", "--env-kwargs", "[1]",
                    "--env", "a:b", "--rollouts", "r.jsonl", "--turn-len", "0"])
    for part in ("--max-turns=0 must be >= 1", "--turn-len=0 must be >= 1", "--env-timeout=0.0 must be",
                 "--max-env-errors=2.0 must be a share in [0, 1]", "--env-kwargs='[1]' must be a JSON object",
                 "a --rollouts file brings its own"):
        assert part in str(info.value), part
    with pytest.raises(ValueError, match="--tools=m:T is the environment of a --data run"):
        parse_args(["--tools", "m:T"])


class WatchedLookup:
    """The lookup tool, recording each step's caller ("process prompt-head branch" lines in
    $LONGSTRAW_TEST_CALLED.<process>); branch `hang` of a prompt whose key is a multiple of 4 never returns from its
    step (seed 2, B = 2: in step 1 on process 0, in step 2 on process 1, none in step 3)."""

    def __init__(self, vocab_size, seed, hang=None):
        self.inner = LookupTask(prompt_len=32, vocab_size=vocab_size).environment(vocab_size, seed)
        self.hang = hang

    def reset(self, prompt_tokens, info, branch):
        self.inner.reset(prompt_tokens, info, branch)
        self.head, self.branch, self.key = " ".join(map(str, prompt_tokens[:8])), branch, info["key"]

    def step(self, turn):
        import jax

        with open(f"{os.environ['LONGSTRAW_TEST_CALLED']}.{jax.process_index()}", "a") as f:
            f.write(f"{jax.process_index()} {self.head} {self.branch}\n")
        if self.branch == self.hang and self.key % 4 == 0:
            time.sleep(3600)  # abandoned after --env-timeout (a daemon thread)
        return self.inner.step(turn)


@pytest.mark.slow  # a 2-process launch and a one-process run of 3 steps, side by side
def test_two_processes_call_their_own_environments(tmp_path):
    """`launch --processes 2 -- --mesh 2x1` with --env (B = 2: a group per process): each process builds and calls
    only its own group's environments, the replies are exchanged, and the run equals a one-process --mesh 2x1 run:
    transcripts, rewards, env metrics, losses, held-out episodes; a step that never returns (on either process) ends
    only its branch after --env-timeout, no hang."""
    from tests.trainer.test_distributed import env, run_cli

    args = AGENT + ["--steps", "3", "--mesh", "2x1", "--log-samples-every", "1", "--save-every", "3",
                    "--env", "tests.trainer.test_agents:WatchedLookup", "--env-kwargs", '{"hang": 1}',
                    "--env-timeout", "2", "--max-env-errors", "0.9", "--eval-every", "3", "--eval-prompts", "4"]
    called = {n: str(tmp_path / f"called-{n}") for n in ("one", "two")}
    outs = {n: str(tmp_path / n) for n in ("one", "two")}
    cache = tmp_path / "cache"
    single = run_cli(args + ["--out", outs["one"]], cache, LONGSTRAW_TEST_CALLED=called["one"])
    two = subprocess.run([sys.executable, "-m", "longstraw_jax.launch", "--processes", "2", "--", *args, "--out",
                          outs["two"]], cwd=ROOT, capture_output=True, text=True, timeout=900,
                         env=env(LONGSTRAW_TEST_CALLED=called["two"]))
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-2000:]
    output = single.communicate(timeout=900)[0]
    assert single.returncode == 0, output[-3000:]
    got, want = read(outs["two"]), read(outs["one"])
    evals = lambda rows: [(r["step"], r["eval_accuracy"], round(r["eval_entropy"], 4)) for r in rows if "kind" in r]
    assert evals(got) == evals(want) and len(evals(want)) == 2  # greedy episodes of held-out prompts, steps 0 and 3
    got, want = ([r for r in records if "kind" not in r] for records in (got, want))
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3]
    for g, w in zip(got, want):
        for key in ("reward_mean", "accuracy", "env/turns", "env/observation_tokens", "env/errors", "response_tokens"):
            assert g[key] == w[key], key
        np.testing.assert_allclose([g["loss"], g["grad_norm"]], [w["loss"], w["grad_norm"]], rtol=1e-4, atol=1e-6)
    assert [r["env/errors"] for r in want] == [1, 1, 0]  # the hanging branches, ended by the timeout
    assert all("timed out after 2 s" in r["env/first_error"] for r in want if r["env/errors"])
    turns = lambda out: [(c["turns"], c["status"]) for row in read(out, "samples.jsonl") for c in row["completions"]]
    assert turns(outs["two"]) == turns(outs["one"])
    # every step call of the one-process run was made once in the two-process run, by the process owning the group
    lines = lambda path: sorted(line.split(" ", 1)[1] for line in open(path))
    mine = {p: lines(f"{called['two']}.{p}") for p in (0, 1)}
    assert sorted(mine[0] + mine[1]) == lines(f"{called['one']}.0")
    heads = {p: {line.rsplit(" ", 1)[0] for line in mine[p]} for p in (0, 1)}
    assert heads[0] and heads[1] and not heads[0] & heads[1]
