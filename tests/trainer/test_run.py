"""The trainer CLI end to end, in process (`run.main(argv)`), on a small setting of the embedded default.

- a 3-step run writes metrics.jsonl (finite loss, every documented field), metrics.png, Orbax checkpoints and an HF
  export that loads back to the checkpointed params; --hf and --init-from start from those weights;
- resume: 2 steps, stop, --resume to 3 gives bit-identical params and identical metrics to the uninterrupted run;
- --mesh 1x8 (sharded params, optimizer state and grpo_grads) and its --resume match the one-device run;
- bad input: a one-line error naming the thing, exit status 2, and the saved run directory is not touched;
- RunConfig (trainer/config.py): bad options are one error naming each, `parse_args` tells explicit options apart, the
  merge with a checkpointed run's options on --resume; options that feed the library have its names and defaults,
  and the former spellings of renamed ones (--lr, --clip-low, ...) still parse, from TOML and saved runs too;
- a training step validates its batch once (train_step on the host; not again inside the jitted step).

All runs share one model / optimizer / sampling setting, so the sampler and the train step compile once.
"""
import dataclasses
import inspect
import json
import os
import re

import jax
import numpy as np
import pytest

from longstraw_jax import GRPOConfig, engine, make_optimizer, models, train
from longstraw_jax.common.validation import is_concrete
from longstraw_jax.grpo import validate_batch
from longstraw_jax.io.checkpoints import TrainCheckpoints, save_init_dir
from longstraw_jax.sampling.branches import SamplingConfig
from longstraw_jax.trainer import cli as run, evaluate, outdir
from longstraw_jax.trainer.config import (
    FORMER_NAMES,
    RESUMABLE,
    RunConfig,
    RunError,
    build_parser,
    current_names,
    parse_args,
)
from tests.helpers import ROOT

SMALL = ["--vocab-size", "32", "--prompt-len", "48", "--group-size", "3", "--response-len", "2", "--chunk-size", "16",
         "--eval-every", "0", "--sft-steps", "0", "--learning-rate", "3e-3", "--save-every", "2", "--seed", "1"]
FIELDS = {"step", "loss", "reward_mean", "reward_std", "kl", "clip_frac", "entropy", "grad_norm", "update_norm",
          "update_ratio", "signal_groups", "skipped", "response_len_mean", "accuracy", "prompt_tokens",
          "response_tokens", "groups", "tokens_per_s", "rollout_s", "update_s", "step_s", "peak_mem_bytes",
          "peak_mem_source"}


SPREAD = "tests.trainer.test_run:token_reward"


def token_reward(prompt_tokens, response_tokens, info):
    """Rewards that differ between branches unless all sample the same first token (non-zero advantages)."""
    return float(response_tokens[0])


def bits(tree):
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


def snapshot(directory):
    """(path, size, mtime) of every file under `directory`: any write shows up."""
    return sorted((os.path.relpath(os.path.join(root, f), directory), os.stat(os.path.join(root, f)).st_size,
                   os.stat(os.path.join(root, f)).st_mtime_ns)
                  for root, _, files in os.walk(directory) for f in files)


def restore(out, step=None, vocab_size=32):
    model = models.build(models.Qwen36Config.tiny(vocab_size=vocab_size))
    abstract = jax.eval_shape(model.init, jax.random.key(0))
    optimizer = make_optimizer(3e-3)
    checkpoints = TrainCheckpoints(out, create=False)
    params, opt_state, key, meta = checkpoints.restore(abstract, jax.eval_shape(optimizer.init, abstract), step)
    checkpoints.close()
    return params, opt_state, meta


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """A 3-step run with --export-hf, its step traced afresh (cache cleared): the step compiles once, and each step
    validates its batch once, on the host (`test_step_validates_its_batch_once` reads the calls)."""
    out = str(tmp_path_factory.mktemp("run") / "a")
    calls = []

    def counting(batch, vocab_size, cfg=None):
        calls.append(is_concrete(batch.prompt))
        return validate_batch(batch, vocab_size, cfg)

    train.jitted_train_step_donated.clear_cache()
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(train, "validate_batch", counting)
        monkeypatch.setattr(engine.local, "validate_batch", counting)
        assert run.main(SMALL + ["--steps", "3", "--out", out, "--export-hf", os.path.join(out, "hf")]) == 0
    # one compile of the step for the whole run (argument placement must not change after step 1)
    assert train.jitted_train_step_donated._cache_size() == 1
    return out, calls


def test_run_writes_metrics_plot_checkpoints_and_export(full_run, capsys):
    out, _ = full_run
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert FIELDS <= set(r), FIELDS - set(r)
        assert np.isfinite(r["loss"]) and np.isfinite(r["grad_norm"]) and r["skipped"] == 0
        assert r["prompt_tokens"] == 48 and 3 <= r["response_tokens"] <= 6 and r["peak_mem_bytes"] > 0
    with open(os.path.join(out, "metrics.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["2", "3"]
    params, _, meta = restore(out)
    assert meta["step"] == 3 and meta["data_position"] == 3 and meta["config"]["prompt_len"] == 48
    _, exported = models.load_hf(os.path.join(out, "hf"))
    assert bits(exported) == bits(params)
    assert os.path.exists(os.path.join(out, "config.json"))


def test_hf_and_init_dir_starts(full_run, tmp_path):
    """--hf and --init-from start from the exported weights: one step from each gives bit-identical params, within
    one Adam step (|update| <= lr per element) of the exported weights (a fresh init is ~0.02 away)."""
    first, _ = full_run
    model, params = models.load_hf(os.path.join(first, "hf"))
    save_init_dir(model, params, tmp_path / "init")
    results = []
    for option, source in (("--hf", os.path.join(first, "hf")), ("--init-from", str(tmp_path / "init"))):
        out = str(tmp_path / option.strip("-"))
        assert run.main(SMALL + [option, source, "--steps", "1", "--out", out, "--reward", SPREAD]) == 0
        results.append(restore(out)[0])
    assert bits(results[0]) == bits(results[1])
    change = max(float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(results[0]), jax.tree.leaves(params)))
    assert 0 < change <= 3e-3 * 1.001


def test_resume_equals_uninterrupted(full_run, tmp_path):
    first, _ = full_run
    out = str(tmp_path / "b")
    assert run.main(SMALL + ["--steps", "2", "--out", out]) == 0
    assert run.main(["--out", out, "--resume", "--steps", "3"]) == 0  # the saved configuration is reused
    resumed, resumed_opt, meta = restore(out)
    straight, straight_opt, _ = restore(first)
    assert meta["step"] == 3 and bits(resumed) == bits(straight) and bits(resumed_opt) == bits(straight_opt)
    read = lambda d: [json.loads(line) for line in open(os.path.join(d, "metrics.jsonl"))]
    drop = {"tokens_per_s", "rollout_s", "update_s", "step_s", "peak_mem_bytes"}  # timings differ
    assert [{k: v for k, v in r.items() if k not in drop} for r in read(out)] == \
           [{k: v for k, v in r.items() if k not in drop} for r in read(first)]


@pytest.mark.slow  # a one-device and a 2x4 trainer run (and its resume)
def test_mesh_run_with_groups_and_resume_match_one_device(tmp_path):
    """--mesh 2x4 -B 2: FSDP-sharded params and optimizer state; each data slice samples and updates one of the two
    groups, sequence-parallel over its 4 devices; 2 steps, then --resume to 3 (restoring onto the shardings) gives
    the one-device run's rewards, losses and grad norms (the same two groups per step).

    Both at --learning-rate 1e-5: AdamW's first steps move every parameter by about lr whatever the size of its
    gradient, so at SMALL's 3e-3 round-off in a near-zero gradient (the mesh sampler sums the old log-probs in another
    order, ~1e-6) becomes a full-size difference by step 3 (measured up to 1.7% in the grad norm); at 1e-5 the two
    runs stay comparable at rtol 1e-4."""
    slow = SMALL + ["--learning-rate", "1e-5", "-B", "2"]
    single, out = str(tmp_path / "one"), str(tmp_path / "mesh")
    assert run.main(slow + ["--steps", "3", "--out", single]) == 0
    assert run.main(slow + ["--steps", "2", "--out", out, "--mesh", "2x4"]) == 0
    assert run.main(["--out", out, "--resume", "--steps", "3"]) == 0
    read = lambda d: [json.loads(line) for line in open(os.path.join(d, "metrics.jsonl"))]
    sharded, reference = read(out), read(single)
    assert [r["step"] for r in sharded] == [1, 2, 3]
    assert sharded[0]["groups"] == reference[0]["groups"] == 2 and sharded[0]["prompt_tokens"] == 2 * 48
    for got, want in zip(sharded, reference):
        assert got["reward_mean"] == want["reward_mean"]
        np.testing.assert_allclose([got["loss"], got["grad_norm"]], [want["loss"], want["grad_norm"]], rtol=1e-4,
                                   atol=1e-6)
    params, _, _ = restore(out)
    np.testing.assert_allclose(params["embed"], restore(single)[0]["embed"], rtol=1e-4, atol=1e-5)


def write(path, text):
    with open(path, "w") as f:
        f.write(text)
    return str(path)


def boom_reward(prompt_tokens, response_tokens, info):
    raise RuntimeError("boom")


def text_reward(prompt_tokens, response_tokens, info):
    return "1.0"


def hf_dir_with(path, config: bytes, weights: bytes | None):
    os.makedirs(path)
    write(os.path.join(path, "config.json"), config.decode())
    if weights is not None:
        with open(os.path.join(path, "model.safetensors"), "wb") as f:
            f.write(weights)
    return str(path)


def test_bad_input_one_line_error_and_nothing_touched(full_run, tmp_path, capsys):
    out, _ = full_run
    before = snapshot(out)
    config = models.Qwen36Config.tiny(vocab_size=32).to_hf()
    hf_config = json.dumps(config).encode()
    good_group = {"prompt": [1, 2, 3], "responses": [[4, 5]], "rewards": [1.0]}
    cases = [
        (["--model", write(tmp_path / "config.json", json.dumps(dict(config, foo_bar=1)))], "foo_bar"),
        (["--rollouts", write(tmp_path / "ids.jsonl", json.dumps(dict(good_group, prompt=[1, 999])))],
         r"ids.jsonl:1: 'prompt'\[1\] = 999 is out of range"),
        (["--group-size", "0"], "--group-size=0 must be >= 1"),
        (["--rollouts", write(tmp_path / "empty.jsonl", json.dumps(good_group) + "\n"
                              + json.dumps(dict(good_group, responses=[[]])))],
         r"empty.jsonl:2: 'responses\[0\]' is empty"),
        (["--rollouts", write(tmp_path / "nan.jsonl", '{"prompt": [1, 2], "responses": [[3]], "rewards": [NaN]}')],
         r"nan.jsonl:1: 'rewards'\[0\] = nan"),
        (["--mesh", "2"], "--mesh='2' must look like AxB"),
        (["--mesh", "2x4", "-B", "3"], r"--groups-per-step=3 must be a multiple of the mesh's data size 2"),
        (["--rollouts", write(tmp_path / "ragged.jsonl", json.dumps(good_group) + "\n"
                              + json.dumps(dict(good_group, prompt=[1, 2, 3, 4]))), "-B", "2"],
         r"--groups-per-step=2 stacks groups side by side.*2 different shapes"),
        ([], "already holds checkpoints: pass --resume"),
        (["--learning-rate", "0.5", "--resume"], r"--learning-rate=0.5 differs from the run being resumed \(0.003\)"),
        # KL without reference log-probs, bad rewards and log-probs in a rollout file, broken --hf files
        (["--kl-coef", "0.1", "--rollouts", write(tmp_path / "noref.jsonl", json.dumps(good_group))],
         r"noref.jsonl:1: 'ref_logprobs' is missing; --kl-coef=0.1 needs reference log-probs on every line$"),
        (["--rollouts", write(tmp_path / "true.jsonl", json.dumps(dict(good_group, rewards=[True])))],
         r"true.jsonl:1: 'rewards'\[0\] = True \(bool\); a reward must be a real number"),
        (["--rollouts", write(tmp_path / "huge.jsonl", json.dumps(dict(good_group, rewards=[1e308])))],
         r"huge.jsonl:1: 'rewards'\[0\] = 1e\+308; rewards must be within float32 range"),
        (["--rollouts", write(tmp_path / "pos.jsonl", json.dumps(dict(good_group, old_logprobs=[[-1.0, 0.5]])))],
         r"pos.jsonl:1: 'old_logprobs'\[0\]\[1\] = 0.5; log-probs must be <= 0$"),
        (["--hf", hf_dir_with(tmp_path / "short", hf_config, b"\0" * 5)],
         r"short/model.safetensors: 5 bytes: too short for a safetensors file"),
        (["--hf", hf_dir_with(tmp_path / "badjson", b'{"model_type": ', None)],
         r"badjson/config.json: config file is not valid JSON: Expecting value: line 1 column 16"),
        (["--hf", str(tmp_path / "no_such_dir")], r"no_such_dir: no such file or directory$"),
        (["--model", write(tmp_path / "broken.json", "{")], r"broken.json: config file is not valid JSON"),
    ]
    for extra, message in cases:
        assert run.main(SMALL + ["--steps", "5", "--out", out] + extra) == 2, extra
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
        assert __import__("re").search(message, err), (message, err)
        assert snapshot(out) == before, extra

    missing = str(tmp_path / "missing")
    assert run.main(["--out", missing, "--resume"]) == 2
    assert "--resume: no checkpoint directory" in capsys.readouterr().err and not os.path.exists(missing)

    fresh = str(tmp_path / "nan_reward")
    assert run.main(SMALL + ["--steps", "2", "--out", fresh, "--reward", "tests.tasks.test_loader:nan_reward"]) == 2
    assert "rewards must be finite" in capsys.readouterr().err
    assert not os.path.exists(fresh)  # the first batch is scored before --out is created

    # whatever the reward function raises or wrongly returns: one line naming it, exit 2, nothing written
    for reward, message in (("boom_reward", "error: reward function tests.trainer.test_run:boom_reward raised "
                                            "RuntimeError on branch 0: boom\n"),
                            ("text_reward", "error: reward function tests.trainer.test_run:text_reward returned '1.0' "
                                            "(str) for branch 0; a reward must be a real number (int or float, not "
                                            "bool or str)\n")):
        fresh = str(tmp_path / reward)
        assert run.main(SMALL + ["--steps", "2", "--out", fresh, "--reward", f"tests.trainer.test_run:{reward}"]) == 2
        assert capsys.readouterr().err == message
        assert not os.path.exists(fresh)  # the step fails before --out is created


def test_run_config_names_every_bad_option():
    with pytest.raises(ValueError) as error:
        RunConfig(group_size=0, learning_rate=float("nan"), hf="a", init_from="b", mesh="2", mode="fast")
    for part in ("--group-size=0 must be >= 1", "--learning-rate=nan must be a finite number >= 0",
                 "give at most one of --model <config.json>, --hf, --init-from", "--mesh='2' must look like AxB",
                 "--mode='fast' must be one of exact, detached"):
        assert part in str(error.value), (part, str(error.value))
    assert RunConfig(mesh="2x4").mesh == "2x4"
    with pytest.raises(ValueError, match=r"--decode-batch=3 must divide --group-size=8"):
        RunConfig(decode_batch=3)
    with pytest.raises(ValueError, match=r"--replay-batch=3 must divide --group-size=8"):
        RunConfig(replay_batch=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        RunConfig().steps = 3


def test_parse_args_defaults_and_explicit_options():
    assert parse_args([]) == (RunConfig(), frozenset())
    config, explicit = parse_args(["-G", "3", "--learning-rate", "0.1", "--resume", "--mesh", "1x8"])
    assert (config.group_size, config.learning_rate, config.resume, config.mesh) == (3, 0.1, True, "1x8")
    assert explicit == {"group_size", "learning_rate", "resume", "mesh"}
    with pytest.raises(ValueError, match="--steps=0 must be >= 1"):
        parse_args(["--steps", "0"])


def test_config_file_options_and_command_line_overrides(tmp_path):
    """--config FILE.toml: its options count as given (explicit), the command line overrides them; the demo's file
    (`make run`) parses; an unknown name, a wrong type, bad TOML or a missing file is one error naming the file."""
    path = tmp_path / "run.toml"
    path.write_text('group-size = 4\nlearning_rate = 1\nmode = "detached"\nsft_steps = 3\n')
    config, explicit = parse_args(["--config", str(path), "--learning-rate", "0.5"])
    assert (config.group_size, config.learning_rate, config.mode, config.sft_steps) == (4, 0.5, "detached", 3)
    assert isinstance(config.learning_rate, float)
    assert explicit == {"config", "group_size", "learning_rate", "mode", "sft_steps"}
    demo, _ = parse_args(["--config", os.path.join(ROOT, "configs", "demo.toml")])
    assert (demo.sft_steps, demo.eval_every, demo.response_len, demo.steps) == (150, 20, 2, 80)
    defaults = RunConfig()  # a real run's defaults: no warm-up, no held-out evaluation unless asked
    assert (defaults.sft_steps, defaults.eval_every) == (0, 0)
    for text, message in (("bogus = 1", "unknown option 'bogus'"),
                          ("group_size = 2.5", "group_size = 2.5 must be an int"),
                          ("learning_rate = \"fast\"", "learning_rate = 'fast' must be a float"),
                          ("steps = true", "must be an int"), ("group_size = 2\ngroup-size = 3", "'group_size' and "
                                                               "'group-size' are the same option (--group-size)"),
                          ("config = \"x.toml\"", "unknown option 'config'"), ("steps =", "not valid TOML"),
                          ("[sampling]\ngroup_size = 2", "unknown option 'sampling'")):
        path.write_text(text)
        with pytest.raises(ValueError, match=re.escape(f"--config {path}: ") + ".*" + re.escape(message)):
            parse_args(["--config", str(path)])
    with pytest.raises(ValueError, match="no such file"):
        parse_args(["--config", str(tmp_path / "missing.toml")])
    path.write_text("steps = 0")
    with pytest.raises(ValueError, match="--steps=0 must be >= 1"):  # the file's values are checked like flags
        parse_args(["--config", str(path)])


def test_resume_merge():
    """The checkpoint stores every option but RESUMABLE; resuming adopts them, keeps this invocation's RESUMABLE
    ones, and refuses an explicit option that contradicts the saved run."""
    first = RunConfig(learning_rate=0.01, prompt_len=48, steps=2, out="a", save_every=2)
    saved = json.loads(json.dumps(first.saved()))  # as the checkpoint's JSON meta holds it
    assert set(saved) == {f.name for f in dataclasses.fields(RunConfig)} - RESUMABLE
    resumed = RunConfig(steps=5, out="a", resume=True).resumed(saved, {"steps", "out", "resume"})
    assert resumed == dataclasses.replace(first, steps=5, resume=True, save_every=20)
    # explicit and equal: fine
    assert RunConfig(learning_rate=0.01, resume=True).resumed(saved, {"learning_rate", "resume"}).learning_rate == 0.01
    assert RunConfig(learning_rate=0.5).resumed(saved).learning_rate == 0.01  # not explicit (a default): saved wins
    with pytest.raises(RunError, match=r"--learning-rate=0.5 differs from the run being resumed \(0.01\)"):
        RunConfig(learning_rate=0.5).resumed(saved, {"learning_rate"})
    with pytest.raises(RunError, match=r"options this version does not know: \['bogus'\]"):
        RunConfig().resumed(dict(saved, bogus=1))


# the options renamed to their library names (former name -> field), each with a value that is not its default
RENAMED = {"clip_low": ("clip_eps_low", 0.1), "clip_high": ("clip_eps_high", 0.3), "lr": ("learning_rate", 1e-4),
           "sft_lr": ("sft_learning_rate", 2e-3), "facts": ("num_facts", 3)}


def test_options_have_the_librarys_names_and_defaults():
    """An option that feeds a library object is spelled as its field / argument and takes its default from it:
    the command line and the library cannot disagree (the learning rate: make_optimizer's 1e-6)."""
    defaults, grpo, sampling = RunConfig(), GRPOConfig(), SamplingConfig()
    for name in ("clip_eps_low", "clip_eps_high", "kl_coef", "loss_agg", "ratio", "replay_batch"):
        assert getattr(defaults, name) == getattr(grpo, name), name
    assert (defaults.temperature, defaults.top_p) == (sampling.temperature, sampling.top_p)
    optimizer = inspect.signature(make_optimizer).parameters
    for name in ("learning_rate", "weight_decay", "max_grad_norm"):
        assert getattr(defaults, name) == optimizer[name].default, name
    assert defaults.learning_rate == 1e-6
    assert defaults.mode == inspect.signature(train.train_step).parameters["mode"].default


def test_former_option_names_still_parse(tmp_path):
    """The former spellings (--clip-low, --lr, ...) on the command line and in a --config file give the same
    RunConfig and the same explicit options as the library's names; --help lists both; a file that gives one option
    under both spellings is an error naming them."""
    assert FORMER_NAMES == {old: new for old, (new, _) in RENAMED.items()}
    flag = lambda name: "--" + name.replace("_", "-")
    new = [x for new, value in RENAMED.values() for x in (flag(new), str(value))]
    old = [x for name, (_, value) in RENAMED.items() for x in (flag(name), str(value))]
    config, explicit = parse_args(new)
    assert parse_args(old) == (config, explicit) and explicit == {new for new, _ in RENAMED.values()}
    assert all(getattr(config, new) == value for new, value in RENAMED.values())
    old_file, new_file = tmp_path / "old.toml", tmp_path / "new.toml"
    old_file.write_text("".join(f"{name.replace('_', '-') if i % 2 else name} = {value}\n"
                                for i, (name, (_, value)) in enumerate(RENAMED.items())))
    new_file.write_text("".join(f"{new} = {value}\n" for new, value in RENAMED.values()))
    from_old, from_new = parse_args(["--config", str(old_file)]), parse_args(["--config", str(new_file)])
    assert from_old[1] == from_new[1] == explicit | {"config"}
    assert dataclasses.replace(from_old[0], config=None) == dataclasses.replace(from_new[0], config=None) == config
    assert "--clip-eps-low CLIP_EPS_LOW, --clip-low CLIP_EPS_LOW" in build_parser().format_help()
    old_file.write_text("lr = 1e-4\nlearning_rate = 1e-5\n")
    with pytest.raises(ValueError, match=re.escape("'lr' and 'learning_rate' are the same option (--learning-rate)")):
        parse_args(["--config", str(old_file)])


def test_options_saved_under_former_names_are_read_with_the_current_ones(tmp_path):
    """A run saved before the renames (its config.json and checkpoint meta hold clip_low, lr, ...) resumes with its
    options, and an explicit option is compared with the saved one it replaces; a run that completed no checkpoint is
    still recognised (and restarted or resumed); one option saved under both names is an error."""
    saved = RunConfig(**{new: value for new, value in RENAMED.values()}, prompt_len=48).saved()
    former = {next((old for old, (n, _) in RENAMED.items() if n == k), k): v for k, v in saved.items()}
    assert set(former) - set(saved) == set(RENAMED) and current_names(former) == saved
    assert RunConfig().resumed(former) == RunConfig().resumed(saved)
    with pytest.raises(RunError, match=r"--clip-eps-low=0.5 differs from the run being resumed \(0.1\)"):
        RunConfig(clip_eps_low=0.5).resumed(former, {"clip_eps_low"})
    with pytest.raises(ValueError, match=r"'lr' and 'learning_rate' are the same option \(--learning-rate\)"):
        current_names(dict(former, learning_rate=1e-4))
    (tmp_path / "config.json").write_text(json.dumps(former))
    assert outdir.early_run_config(str(tmp_path)) == saved


def test_resume_of_a_run_saved_under_former_names(full_run, tmp_path):
    """A 2-step run whose config.json and checkpoint meta are rewritten to the former names (as a run saved before
    the renames holds them) resumes to step 3 bit-identical to the uninterrupted run, and `python -m
    longstraw_jax.evaluate --resume` reads its options."""
    first, _ = full_run
    out = str(tmp_path / "old")
    assert run.main(SMALL + ["--steps", "2", "--out", out]) == 0
    for path in (os.path.join(out, "config.json"), os.path.join(out, "checkpoints", "2", "meta", "metadata")):
        with open(path) as f:
            stored = json.load(f)
        options = stored.get("config", stored)
        for old, (new, _) in RENAMED.items():
            options[old] = options.pop(new)
        with open(path, "w") as f:
            json.dump(stored, f)
    assert "lr" in restore(out)[2]["config"]
    config, _ = evaluate.config_of(evaluate.build_parser().parse_args(["--resume", out]))
    assert (config.learning_rate, config.clip_eps_low, config.sft_learning_rate) == (3e-3, 0.2, 1e-3)
    assert run.main(["--out", out, "--resume", "--steps", "3", "--lr", "3e-3"]) == 0  # explicit, former, equal
    resumed, resumed_opt, meta = restore(out)
    straight, straight_opt, _ = restore(first)
    assert meta["step"] == 3 and bits(resumed) == bits(straight) and bits(resumed_opt) == bits(straight_opt)
    assert meta["config"]["learning_rate"] == 3e-3 and "lr" not in meta["config"]  # saved again by current names


def test_step_validates_its_batch_once(full_run):
    """train_step validates on the host and its jitted step calls engine.grpo_grads_unvalidated: one validation per
    step, the first step (which traces the step: its cache was cleared) included."""
    _, calls = full_run
    assert calls == [True, True, True]


def test_replay_batch_reaches_the_update(tmp_path):
    """--replay-batch K: the update replays K branches at a time (all G here), the same run up to float round-off
    (the same samples: the update's params feed the next step's sampling); it may change on --resume."""
    from longstraw_jax.trainer.config import CHANGEABLE

    runs = {}
    for k in (1, 3):
        out = str(tmp_path / f"k{k}")
        assert run.main(SMALL + ["--steps", "2", "--out", out, "--replay-batch", str(k)]) == 0
        runs[k] = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
        assert json.load(open(os.path.join(out, "config.json")))["replay_batch"] == k
    # step 1: the same params and samples, only the replay's summation order differs; step 2 samples from params
    # one AdamW step apart, and AdamW's normalised update turns round-off in a near-zero gradient component into a
    # difference of up to the learning rate (3e-3) in that parameter. The loss is 0 up to round-off (the group's
    # advantages sum to zero, ratios 1 on the first epoch): compared absolutely, at float32 round-off of O(1) terms.
    for a, b, rtol in zip(runs[1], runs[3], (1e-5, 1e-3), strict=True):
        assert a["reward_mean"] == b["reward_mean"] and a["grad_norm"] > 0
        np.testing.assert_allclose(a["grad_norm"], b["grad_norm"], rtol=rtol)
        np.testing.assert_allclose(a["loss"], b["loss"], rtol=0, atol=1e-6)
    assert "replay_batch" in CHANGEABLE


@pytest.mark.slow  # two trainer runs, one with the attention kernels interpreted
def test_pallas_kernels_run_the_same_training(tmp_path):
    """--kernels pallas on a CPU interprets the flash-attention kernels: the same samples, losses and grad norms as
    --kernels xla up to float round-off; auto resolves to xla here; it may change on --resume."""
    from longstraw_jax.trainer.components import with_kernels
    from longstraw_jax.trainer.config import CHANGEABLE

    runs = {}
    for kernels in ("xla", "pallas"):
        out = str(tmp_path / kernels)
        assert run.main(SMALL + ["--steps", "2", "--out", out, "--kernels", kernels]) == 0
        runs[kernels] = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    # step 1 from the same params; step 2 after an AdamW update, which turns round-off-sized gradients of a few
    # elements into lr-sized steps (measured: 1.7e-4 relative on the grad norm). The loss is a sum of advantages
    # near 0 (its value is round-off), the grad norm about 50.
    for a, b, rtol in zip(runs["xla"], runs["pallas"], (1e-5, 1e-3), strict=True):
        assert a["reward_mean"] == b["reward_mean"] and a["grad_norm"] > 0
        np.testing.assert_allclose([a["loss"], a["grad_norm"]], [b["loss"], b["grad_norm"]], rtol=rtol, atol=1e-6)
    tiny = models.build(models.Qwen36Config.tiny())
    assert with_kernels(tiny, "auto").config.kernels == "xla"
    assert with_kernels(tiny, "pallas").config.kernels == "pallas"
    assert with_kernels(models.build(models.Glm52Config.tiny()), "pallas").config.kernels == "pallas"
    assert "kernels" in CHANGEABLE


def test_decode_batch_reaches_the_sampler():
    """--decode-batch N: the task sampler's SamplingConfig decodes N branches at a time (default: all G); it may
    change on --resume (the tokens do not depend on it)."""
    from longstraw_jax.trainer.components import data_source
    from longstraw_jax.trainer.config import CHANGEABLE

    assert data_source(parse_args(["-G", "4", "--decode-batch", "2"])[0], 32).sampling.decode_batch == 2
    assert data_source(parse_args(["-G", "4"])[0], 32).sampling.decode_batch is None
    assert "decode_batch" in CHANGEABLE
