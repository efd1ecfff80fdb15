"""Held-out evaluation (trainer/evaluate.py) and the supervised warm-up (trainer/warmup.py), alone and in the trainer.

- held-out prompts are a stream of their own: none of them is a training or warm-up prompt;
- first-token entropy / KL and the accuracy summary on cases computed by hand;
- the Evaluator's greedy answers are the argmax of a full forward pass, deterministic, and its accuracy is right on
  a task whose answers are chosen to make it exactly 1/2;
- the warm-up's loss is the cross-entropy a full forward gives, and a few steps lower it;
- a trainer run with --sft-steps and --eval-every logs warm-up and evaluation records (KL to the start 0 at the start,
  its reference saved and used again on --resume) and plots them; `python -m longstraw_jax.evaluate --resume OUT`
  scores the run's checkpoint and writes JSON;
- tools/bench_length.py at a tiny size (its runs share the trainer test's compiled sampler, evaluation and step).
"""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longstraw_jax import models
from longstraw_jax.models.qwen36.config import FULL, LINEAR
from longstraw_jax.tasks.base import Prompt
from longstraw_jax.tasks.retrieval import FIRST_ANSWER, STOP, RetrievalTask
from longstraw_jax.trainer import cli as run, evaluate, metrics, warmup as sft
from longstraw_jax.trainer.config import RunConfig
from tests.helpers import ROOT, o1_params

# one LLLF block: compiles faster than the tiny preset's two
SMALL_MODEL = models.Qwen36Config.tiny(vocab_size=32, num_hidden_layers=4, layer_types=(LINEAR, LINEAR, LINEAR, FULL))
SMALL = ["--vocab-size", "32", "--prompt-len", "48", "--group-size", "3", "--response-len", "2", "--chunk-size", "16",
         "--learning-rate", "3e-3", "--sft-learning-rate", "1e-3", "--sft-steps", "0", "--save-every", "2", "--seed",
         "1"]


def test_held_out_prompts_are_never_training_or_warm_up_prompts():
    config = RunConfig(prompt_len=12, seed=5)
    train = RetrievalTask(prompt_len=12, vocab_size=32, seed=5)
    warm = sft.warm_up_task(config, 32)
    held = evaluate.held_out_task(config, 32)
    seen = {train.prompt(i).tokens.tobytes() for i in range(3000)} | {warm.prompt(i).tokens.tobytes()
                                                                       for i in range(3000)}
    held_out = [held.prompt(i).tokens.tobytes() for i in range(256)]
    assert len(set(held_out)) == 256 and not seen & set(held_out)
    # the same seed gives the same stream: the evaluation set is fixed for a run
    assert evaluate.held_out_task(config, 32).prompt(7).tokens.tobytes() == held_out[7]
    assert held.seed == 5 + 2**31 and warm.seed == 5 + 2**30


def test_the_warm_up_can_plant_fewer_facts_than_grpo():
    config = RunConfig(prompt_len=24, seed=3, num_facts=3, sft_num_facts=1)
    warm, train = sft.warm_up_task(config, 32), RetrievalTask(prompt_len=24, vocab_size=32, seed=3, num_facts=3)
    assert (warm.num_facts, train.num_facts) == (1, 3)
    assert sft.warm_up_task(RunConfig(prompt_len=24, num_facts=3), 32).num_facts == 3  # the default: --num-facts
    facts = [int((warm.prompt(i).tokens == 3).sum()) for i in range(50)]  # FACT = 3
    assert facts == [1] * 50
    with pytest.raises(ValueError, match="--sft-num-facts=0 must be >= 1"):
        RunConfig(sft_num_facts=0)


def test_the_warm_up_can_plant_facts_at_every_depth_while_grpo_keeps_them_near_the_start():
    config = RunConfig(prompt_len=256, sft_prompt_len=64, max_depth=0.1, sft_max_depth=1.0)
    assert evaluate.held_out_task(config, 32).max_depth == 0.1
    assert sft.warm_up_task(config, 32).max_depth == 1.0 == sft.warm_up_max_depth(config)
    assert sft.warm_up_task(RunConfig(prompt_len=256, max_depth=0.1), 32).max_depth == 0.1  # the default: GRPO's


def test_first_token_stats_and_summary():
    uniform = np.log(np.full((2, 4), 0.25))
    with np.errstate(divide="ignore"):
        peaked = np.log(np.array([[0.7, 0.1, 0.1, 0.1], [1.0, 0.0, 0.0, 0.0]]))  # a one-hot row: log 0 = -inf
    stats = evaluate.first_token_stats(peaked, reference=uniform)
    h0 = -(0.7 * np.log(0.7) + 0.3 * np.log(0.1))
    assert stats["entropy"] == pytest.approx((h0 + 0.0) / 2)
    kl0 = 0.7 * np.log(0.7 / 0.25) + 0.3 * np.log(0.1 / 0.25)
    assert stats["kl"] == pytest.approx((kl0 + np.log(4)) / 2)
    assert evaluate.first_token_stats(uniform, uniform)["kl"] == pytest.approx(0.0, abs=1e-12)
    assert "kl" not in evaluate.first_token_stats(uniform)
    with pytest.raises(ValueError, match=r"shape \(1, 4\); need \(2, 4\)"):
        evaluate.first_token_stats(uniform, uniform[:1])
    assert evaluate.summarize(np.array([1.0, 0.1, 0.0, 1.0]), np.array([True, False, False, True])) == \
        {"eval_reward": pytest.approx(0.525), "eval_accuracy": 0.5}
    assert evaluate.summarize(np.array([0.5]), None) == {"eval_reward": 0.5}


class HalfRight(RetrievalTask):
    """Held-out retrieval prompts whose answer is, for even indices, the model's own argmax first token (from a full
    forward pass) and for odd ones another answer token: a greedy evaluation must score accuracy exactly 1/2."""

    def __init__(self, model, params, **kw):
        super().__init__(**kw)
        object.__setattr__(self, "greedy_first", lambda tokens: int(jnp.argmax(model.forward(params, tokens)[-1])))

    def prompt(self, index):
        base = super().prompt(index)
        first = self.greedy_first(base.tokens)
        answer = first if index % 2 == 0 else (FIRST_ANSWER if first != FIRST_ANSWER else FIRST_ANSWER + 1)
        return Prompt(base.tokens, dict(base.info, answer=answer))


def test_evaluator_greedy_and_accuracy_on_a_predictable_task():
    model = models.build(SMALL_MODEL)
    params = o1_params(model.init(jax.random.key(3)), jax.random.key(4))  # O(1) weights: no near-ties in the argmax
    task = HalfRight(model, params, prompt_len=24, vocab_size=32, seed=evaluate.held_out_seed(0))
    evaluator = evaluate.Evaluator(task, task.reward, num_prompts=6, response_len=2, chunk_size=8, stop_token=STOP)
    result = evaluator(model, params, reference=True)
    first = evaluator.last["responses"][:, 0]
    assert result["eval_accuracy"] == 0.5 and result["eval_prompts"] == 6 and result["eval_prompt_len"] == 24
    assert list(evaluator.last["correct"]) == [True, False] * 3
    expected_reward = np.mean([task.reward(None, r[m > 0], p.info) for p, r, m in
                               zip(evaluator.prompts, evaluator.last["responses"], evaluator.last["mask"])])
    assert result["eval_reward"] == pytest.approx(expected_reward)
    assert result["eval_kl_to_start"] == pytest.approx(0.0, abs=1e-6) and result["eval_entropy"] > 0
    # deterministic: again, the same answers; after a parameter change the KL to the reference is positive
    again = evaluator(model, params)
    np.testing.assert_array_equal(evaluator.last["responses"][:, 0], first)
    assert again["eval_accuracy"] == 0.5
    moved = jax.tree.map(lambda x: x * 1.5, params)
    assert evaluator(model, moved)["eval_kl_to_start"] > 1e-4


def test_warm_up_loss_is_the_full_forward_cross_entropy_and_falls():
    model = models.build(SMALL_MODEL)
    params = model.init(jax.random.key(0))
    task = RetrievalTask(prompt_len=16, vocab_size=32, seed=sft.warm_up_seed(0))
    prompts, targets, mask = sft.target_batch(task, 0, 4)
    assert targets.shape == (4, 2) and np.all(targets[:, 1] == STOP) and np.all(mask == 1)
    assert [int(t) for t in targets[:, 0]] == [task.prompt(i).info["answer"] for i in range(4)]
    loss, stats = sft.sft_loss(model, params, jnp.asarray(prompts), jnp.asarray(targets), jnp.asarray(mask))
    manual = []
    for p, t in zip(prompts, targets):
        logp = jax.nn.log_softmax(model.forward(params, np.concatenate([p, t[:-1]]))[-2:])
        manual += [float(logp[0, t[0]]), float(logp[1, t[1]])]
    assert float(loss) == pytest.approx(-np.mean(manual), rel=1e-5)
    trained, records = sft.warm_up(model, params, task, steps=12, batch=4, learning_rate=3e-3)
    assert [r["sft_step"] for r in records] == list(range(1, 13)) and all(r["kind"] == "sft" for r in records)
    after, _ = sft.sft_loss(model, trained, jnp.asarray(prompts), jnp.asarray(targets), jnp.asarray(mask))
    assert float(after) < float(loss) - 0.5  # from ~log(32) towards the answer and stop tokens
    with pytest.raises(ValueError, match="has no target"):
        sft.target_batch(object(), 0, 1)


@pytest.mark.slow  # a trainer run with warm-up and evaluations, its resume, and the evaluate CLI
def test_trainer_warm_up_evaluation_resume_and_evaluate_cli(tmp_path, capsys):
    out = str(tmp_path / "run")
    flags = SMALL + ["--eval-every", "2", "--eval-prompts", "4", "--sft-steps", "3", "--sft-batch", "2", "--mode",
                     "detached"]  # detached: the cheaper step to compile (the evaluation does not depend on it)
    assert run.main(flags + ["--steps", "2", "--out", out]) == 0
    printed = capsys.readouterr().out
    assert "warm-up    3/3" in printed and "eval @ step 0: held-out (4 prompts of 48 tokens, greedy)" in printed
    assert "held-out accuracy (4 prompts of 48 tokens never trained on, greedy): step 0 " in printed
    assert f"plot: {os.path.join(out, 'metrics.png')}" in printed
    assert run.main(["--out", out, "--resume", "--steps", "3", "--eval-every", "3"]) == 0
    capsys.readouterr()
    records = metrics.read_metrics(os.path.join(out, "metrics.jsonl"))
    steps, evals, warm = metrics.split_records(records)
    assert [r["sft_step"] for r in warm] == [1, 2, 3] and [r["step"] for r in steps] == [1, 2, 3]
    assert [r["step"] for r in evals] == [0, 0, 2, 3] and evals[0]["before_warm_up"]
    # evaluation before the warm-up, the warm-up, the start of GRPO (the KL reference), then the steps
    assert [r.get("kind") for r in records[:6]] == ["eval"] + ["sft"] * 3 + ["eval", None]
    evals = evals[1:]
    assert evals[0]["eval_kl_to_start"] == pytest.approx(0.0, abs=1e-6)
    assert all(r["eval_kl_to_start"] > 0 for r in evals[1:])  # the resumed run read the start's reference
    for r in evals:
        assert 0 <= r["eval_accuracy"] <= 1 and r["eval_prompts"] == 4 and r["eval_accuracy"] * 4 % 1 == 0
    assert np.load(os.path.join(out, evaluate.REFERENCE_FILE)).shape == (4, 32)

    report = str(tmp_path / "eval.json")
    assert evaluate.main(["--resume", out, "--eval-prompts", "4", "--json", report]) == 0
    line = capsys.readouterr().out
    with open(report) as f:
        result = json.load(f)
    assert result["checkpoint"].endswith(os.path.join("checkpoints", "3")) and line.startswith(result["checkpoint"])
    assert result["metrics"]["eval_accuracy"] == pytest.approx(evals[-1]["eval_accuracy"])  # same params, prompts
    assert result["metrics"]["eval_accuracy"] == np.mean([a["correct"] for a in result["answers"]])
    assert result["config"]["prompt_len"] == 48 and len(result["answers"]) == 4


def test_bad_evaluation_and_warm_up_options(tmp_path, capsys):
    with pytest.raises(ValueError) as error:
        RunConfig(eval_every=-1, eval_prompts=0, sft_steps=-2, sft_batch=0, sft_prompt_len=1, temperature=0.0)
    for part in ("--eval-every=-1 must be >= 0", "--eval-prompts=0 must be >= 1", "--sft-steps=-2 must be >= 0",
                 "--sft-batch=0 must be >= 1", "--sft-prompt-len=1 must be >= 2", "--temperature=0.0 must be > 0"):
        assert part in str(error.value), (part, str(error.value))
    with pytest.raises(ValueError, match=r"--eval-prompts=3 must be a multiple of the mesh's data size 2"):
        RunConfig(mesh="2x4", eval_prompts=3, eval_every=20)
    assert RunConfig(mesh="2x4", eval_prompts=3, eval_every=0).eval_prompts == 3  # no evaluation: no constraint
    out = str(tmp_path / "never")
    for extra, message in ((["--eval-prompts", "0"], "error: --eval-prompts=0 must be >= 1\n"),
                           (["--eval-every", "-3"], "error: --eval-every=-3 must be >= 0\n")):
        assert run.main(SMALL + ["--out", out] + extra) == 2
        assert capsys.readouterr().err == message
    rollouts = tmp_path / "groups.jsonl"
    rollouts.write_text(json.dumps({"prompt": [1, 2, 3], "responses": [[4, 5]], "rewards": [1.0]}) + "\n")
    assert run.main(SMALL + ["--out", out, "--rollouts", str(rollouts), "--eval-every", "5"]) == 2
    assert "--eval-every=5 needs a task to hold prompts out of" in capsys.readouterr().err
    assert run.main(SMALL + ["--out", out, "--rollouts", str(rollouts), "--eval-every", "0", "--sft-steps", "4"]) == 2
    assert capsys.readouterr().err == ("error: --sft-steps=4 needs task prompts: a --rollouts file has none (pass "
                                       "--sft-steps 0)\n")
    assert evaluate.main(["--resume", str(tmp_path / "missing")]) == 2
    assert "no checkpoint directory" in capsys.readouterr().err
    assert evaluate.main(["--init-from", str(tmp_path), "--resume-step", "2"]) == 2
    assert capsys.readouterr().err == "error: --resume-step needs --resume OUT\n"
    assert not os.path.exists(out)


@pytest.mark.slow  # the benchmark tool's trainer runs (two seeds)
def test_bench_length_smoke(tmp_path, capsys):
    """Two seeds of one mode, two GRPO steps each after a 2-step warm-up at 24 tokens: the table, figure and JSON
    hold every evaluation, the warm start is evaluated at both lengths and is the same policy for a given seed."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_length", os.path.join(ROOT, "tools", "bench_length.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    out = str(tmp_path / "length")
    assert tool.main(["--short", "24", "--long", "48", "--sft-steps", "2", "--sft-batch", "2", "--sft-lr", "1e-3",
                      "--steps", "2", "--lr", "3e-3", "--eval-every", "1", "--eval-prompts", "4", "-G", "3", "-B", "1",
                      "--chunk-size", "16", "--seeds", "0,1", "--modes", "detached", "--out", out]) == 0
    printed = capsys.readouterr().out
    assert "| GRPO step | detached: mean [min, max] |" in printed and "chance 0.250" in printed
    with open(os.path.join(out, "length.json")) as f:
        result = json.load(f)
    for seed in ("0", "1"):
        assert sorted(result["accuracy"]["detached"][seed]) == ["0", "1", "2"]
        assert result["warm_start_short"]["detached"][seed] is not None
        steps, evals, warm = metrics.split_records(metrics.read_metrics(os.path.join(out, f"detached-seed{seed}",
                                                                                    "metrics.jsonl")))
        assert [r["eval_prompt_len"] for r in evals] == [48, 24, 48, 48, 48] and len(warm) == 2 and len(steps) == 2
        assert evals[0]["before_warm_up"] and evals[1]["step"] == 0
    with open(os.path.join(out, "length.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    # --reuse: the completed runs are read back, not run again; the same numbers come out
    os.remove(os.path.join(out, "length.json"))
    assert tool.main(["--short", "24", "--long", "48", "--sft-steps", "2", "--sft-batch", "2", "--sft-lr", "1e-3",
                      "--steps", "2", "--lr", "3e-3", "--eval-every", "1", "--eval-prompts", "4", "-G", "3", "-B", "1",
                      "--chunk-size", "16", "--seeds", "0,1", "--modes", "detached", "--out", out, "--reuse"]) == 0
    printed = capsys.readouterr().out
    assert printed.count("reusing") == 2 and "longstraw_jax.run" not in printed
    with open(os.path.join(out, "length.json")) as f:
        again = json.load(f)
    assert again["accuracy"] == result["accuracy"] and again["wall_s"] == result["wall_s"]
    # other options than the run directory's: an error, not a mix
    with pytest.raises(SystemExit, match="was run with other options"):
        tool.main(["--short", "24", "--long", "48", "--sft-steps", "2", "--sft-batch", "2", "--sft-lr", "1e-3",
                   "--steps", "2", "--lr", "1e-3", "--eval-every", "1", "--eval-prompts", "4", "-G", "3", "-B", "1",
                   "--chunk-size", "16", "--seeds", "0", "--modes", "detached", "--out", out, "--reuse"])


def test_bench_length_max_depth_keeps_the_long_prompts_facts_near_the_start():
    """tools/bench_length.py --max-depth 0.1: GRPO's and the long evaluation's facts in the first 10 % of the log,
    the warm-up's (and the short evaluation's) at every depth."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_length", os.path.join(ROOT, "tools", "bench_length.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    args, extra = tool.parse(["--long", "1024", "--max-depth", "0.1"])
    config, _ = run.parse_args(tool.trainer_args(args, "exact", 0, "/tmp/unused", extra))
    assert (config.prompt_len, config.max_depth, config.sft_max_depth, config.sft_prompt_len) == (1024, 0.1, 1.0, 32)
    long_facts = [np.flatnonzero(evaluate.held_out_task(config, 32).prompt(i).tokens == 3) for i in range(20)]
    assert max(f.max() for f in long_facts) < 0.11 * 1024
    warm = sft.warm_up_task(config, 32)
    assert (warm.prompt_len, warm.max_depth) == (32, 1.0)
    assert "--max-depth" not in tool.trainer_args(tool.parse([])[0], "exact", 0, "/tmp/unused", [])


def test_length_answers_classify():
    """tools/length_answers.classify: over the prompts whose distractor holds another value than the answer, a first
    token is the answer, the distractor's value, another answer id or no answer; other prompts are not counted."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("length_answers", os.path.join(ROOT, "tools", "length_answers.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    task = RetrievalTask(prompt_len=48, vocab_size=32, seed=3, num_facts=2)
    rows, expected = [], {"prompts": 0, "correct": 0, "distractor": 0, "other answer": 0, "not an answer": 0}
    for i in range(40):
        p = task.prompt(i)
        facts = np.flatnonzero(p.tokens[:-2] == 3)
        values = {int(p.tokens[j + 2]) for j in facts}
        other = sorted(values - {p.info["answer"]})
        if not other:
            rows.append({"index": i, "response": [STOP], "info": p.info})
            continue
        unused = sorted(set(range(FIRST_ANSWER, FIRST_ANSWER + 4)) - values)
        kind, first = [("correct", p.info["answer"]), ("distractor", other[0]), ("other answer", unused[0]),
                       ("not an answer", STOP)][i % 4]
        expected["prompts"] += 1
        expected[kind] += 1
        rows.append({"index": i, "response": [first, STOP], "info": p.info})
    assert tool.classify(task, rows) == expected and 0 < expected["prompts"] < 40


def test_the_warm_up_stops_once_its_latest_batches_reach_the_accuracy(monkeypatch):
    """--sft-stop-accuracy: the mean first-token accuracy of the latest warmup.STOP_WINDOW batches (each scored before
    its update) ends the warm-up; never before STOP_WINDOW batches; --sft-steps bounds it."""
    accuracies = [1.0, 1.0, 1.0, 0.25, 0.5, 1.0, 1.0, 1.0, 1.0, 0.0]  # window means from step 4: .81 .69 .69 .69 .88 1
    calls = []

    def fake_step(params, opt_state, prompts, targets, mask, left_pad):
        calls.append(prompts.shape)
        return params, opt_state, {"sft_loss": 1.0, "sft_accuracy": accuracies[len(calls) - 1], "sft_exact": 0.0,
                                   "sft_grad_norm": 1.0}

    monkeypatch.setattr(sft, "_jitted_step", lambda *args: fake_step)
    model = models.build(SMALL_MODEL)
    params = model.init(jax.random.key(0), jnp.float32)
    task, said = RetrievalTask(prompt_len=16, vocab_size=32), []

    def steps_run(steps, stop):
        said.clear(), calls.clear()
        records = sft.warm_up(model, params, task, steps, 2, 1e-3, stop_accuracy=stop,
                              say=lambda line, **_: said.append(line))[1]
        assert len(calls) == len(records) and [r["sft_step"] for r in records] == list(range(1, len(records) + 1))
        return len(records)

    assert sft.STOP_WINDOW == 4
    assert steps_run(10, 0.8) == 4 and "warm-up stopped at step 4/10: accuracy 0.812" in said[-1]
    assert steps_run(10, 0.85) == 8  # not at step 3: the first 3 batches are all right, but the window is 4
    assert steps_run(10, 1.0) == 9
    assert steps_run(8, 1.0) == 8 and not any("stopped" in line for line in said)  # --sft-steps bounds it
    assert steps_run(10, None) == 10
    with pytest.raises(ValueError, match=r"--sft-stop-accuracy=0.0 must be in \(0, 1\]"):
        RunConfig(sft_stop_accuracy=0.0)
