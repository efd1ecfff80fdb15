"""KL to a reference policy while sampling: `sampling.reference.reference_logprobs` (capture under the reference
params, replay the branches, no gradient) against a full forward of prompt + response; the trainer's reference
(`trainer/reference.py`: LoRA's base without adapters, a frozen copy of the initial params, --ref-from) and its KL
metric."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longstraw_jax import models, sharding
from longstraw_jax.adapters import lora, trainable
from longstraw_jax.sampling.reference import reference_logprobs
from longstraw_jax.sharding import rules
from longstraw_jax.trainer import cli as run, reference
from longstraw_jax.trainer.config import RunConfig
from tests.helpers import ROOT, tiny_model

B, P, G, R = 2, 21, 3, 5
PADS = np.array([0, 4], np.int32)  # group 1's prompt is left-padded: its real prompt is prompt[4:]
SMALL = ["--vocab-size", "32", "--prompt-len", "24", "--group-size", "3", "--response-len", "3", "--chunk-size", "8",
         "--eval-every", "0", "--sft-steps", "0", "--save-every", "2", "--seed", "1", "--log-samples-every", "0"]
SPREAD = "tests.trainer.test_run:token_reward"


def _inputs(vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, vocab, (B, P)).astype(np.int32), rng.integers(0, vocab, (B, G, R)).astype(np.int32))


def naive_logprobs(model, params, prompts, responses, left_pad) -> np.ndarray:
    """float32 [B, G, R] from `model.forward` of the unpadded prompt + response, one branch at a time."""
    out = np.zeros(responses.shape, np.float32)
    for b in range(prompts.shape[0]):
        prompt = prompts[b, int(left_pad[b]):]
        for g in range(responses.shape[1]):
            logits = model.forward(params, np.concatenate([prompt, responses[b, g]]))[len(prompt) - 1: -1]
            logp = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32)))
            out[b, g] = np.take_along_axis(logp, responses[b, g][:, None], 1)[:, 0]
    return out


@pytest.mark.slow  # the fast tier checks the mesh's reference log-probs against the full forward (2x4)
@pytest.mark.parametrize("family", ["qwen36", "glm52"])
def test_one_device_equals_full_forward(family):
    """Chunks of 6 over prompt[:-1] (20 positions: three full chunks and a remainder), a left-padded group, logits
    in chunks of 2 tokens (two full and a tail)."""
    model, params, _ = tiny_model(family)
    prompts, responses = _inputs(model.config.vocab_size)
    got = reference_logprobs(model, params, prompts, responses, 6, left_pad=PADS, logprob_chunk=2)
    assert got.shape == (B, G, R) and got.dtype == jnp.float32
    want = naive_logprobs(model, params, prompts, responses, PADS)
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4)
    assert np.all(np.asarray(got) < 0)


@pytest.mark.parametrize("spec", ["2x4", pytest.param("1x8", marks=pytest.mark.slow)])
def test_mesh_equals_full_forward(spec):
    """Qwen3.6 on a simulated mesh (rounds of 8 positions over seq; on 2x4 each data slice takes one group)."""
    model, params, _ = tiny_model("qwen36")
    mesh = sharding.make_mesh(spec)
    placed = jax.device_put(params, rules.named(rules.param_specs(params, mesh), mesh))
    prompts, responses = _inputs(model.config.vocab_size, seed=1)
    got = reference_logprobs(model, placed, prompts, responses, 8, mesh=mesh, left_pad=PADS)
    want = naive_logprobs(model, params, prompts, responses, PADS)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-4, rtol=1e-4)


def test_bad_inputs_name_the_field():
    model, params, _ = tiny_model("qwen36")
    prompts, responses = _inputs(model.config.vocab_size)
    with pytest.raises(ValueError, match=r"responses must be \[B, G, R\] with B = 2"):
        reference_logprobs(model, params, prompts, responses[:1], 6)
    with pytest.raises(ValueError, match=r"responses\[7\] = 999 is out of range"):
        reference_logprobs(model, params, prompts, np.where(np.arange(B * G * R).reshape(B, G, R) == 7, 999,
                                                            responses), 6)
    with pytest.raises(ValueError, match="left_pad = 20 is out of range"):
        reference_logprobs(model, params, prompts, responses, 6, left_pad=np.array([0, 20], np.int32))


def _lora_policy(model, params, key):
    """params with adapters on every target and nonzero B (as if trained): the adapted model differs from the base."""
    with_adapters = lora.add_adapters(params, lora.resolve_targets(params, "all"), 2, 4.0, key)
    return jax.tree.map(lambda w: lora.LoRA(w.base, w.a, jax.random.normal(key, w.b.shape, w.b.dtype) * 0.5, w.scale)
                        if lora.is_lora(w) else w, with_adapters, is_leaf=lora.is_lora)


def test_lora_reference_is_the_base_after_training():
    model, params, _ = tiny_model("qwen36")
    policy = _lora_policy(model, params, jax.random.key(3))
    ref = reference.Reference("base", trains=trainable.adapter_leaf)
    assert all(a is b for a, b in zip(jax.tree.leaves(ref.params(policy)), jax.tree.leaves(params)))  # no copy
    prompts, responses = _inputs(model.config.vocab_size)
    got = reference_logprobs(model, ref.params(policy), prompts, responses, 6, left_pad=PADS)
    np.testing.assert_allclose(got, naive_logprobs(model, params, prompts, responses, PADS), atol=2e-4, rtol=1e-4)
    adapted = reference_logprobs(model, policy, prompts, responses, 6, left_pad=PADS)
    assert float(jnp.max(jnp.abs(adapted - got))) > 1e-2  # the adapters do change the policy


@pytest.mark.slow  # a trainer step (~60 s on 2 shared cores)
def test_full_training_reference_stays_the_initial_params(tmp_path):
    """Trainer with --train full --kl-coef: after a (donated) update step the params changed, the reference did
    not; with --trainable only the trainable leaves are copied."""
    from longstraw_jax.trainer.loop import Trainer

    config = RunConfig(vocab_size=32, prompt_len=24, group_size=3, response_len=3, chunk_size=8, eval_every=0,
                       sft_steps=0, seed=1, learning_rate=3e-2, kl_coef=0.1, reward=SPREAD, steps=1,
                       out=str(tmp_path / "a"), log_samples_every=0)
    trainer = Trainer(config)
    initial = [np.asarray(x).copy() for x in jax.tree.leaves(trainer.params)]
    assert trainer.reference.kind == "initial"
    record = trainer.train_one()
    assert np.isfinite(record["kl"]) and record["ref_s"] > 0
    changed = [not np.array_equal(a, np.asarray(x)) for a, x in zip(initial, jax.tree.leaves(trainer.params))]
    assert sum(changed) > len(changed) // 2
    ref = trainer.reference.params(trainer.params)
    assert all(np.array_equal(a, np.asarray(x)) for a, x in zip(initial, jax.tree.leaves(ref)))

    subset = Trainer(RunConfig(**{**config.__dict__, "trainable": "embed", "out": str(tmp_path / "b")}))
    held = [x for x in jax.tree.leaves(subset.reference.held) if x is not None]
    assert len(held) == 1 and held[0].shape == subset.params["embed"].shape


def _read(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow  # two trainer runs of 2 steps
def test_trainer_logs_kl_zero_at_lora_start_then_positive(tmp_path, capsys):
    """--train lora --kl-coef 0.1 (no rollouts): step 1's policy is the base (B = 0), so its KL to the reference is
    0; the update trains the adapters, so step 2's is not. --train full: finite KL on both steps."""
    out = str(tmp_path / "lora")
    assert run.main(SMALL + ["--steps", "2", "--out", out, "--train", "lora", "--lora-rank", "2", "--learning-rate",
                             "5e-2", "--kl-coef", "0.1", "--reward", SPREAD]) == 0
    records = _read(out)
    assert [r["step"] for r in records] == [1, 2]
    assert abs(records[0]["kl"]) < 1e-9, records[0]["kl"]
    assert 1e-9 < records[1]["kl"] < 1 and np.isfinite(records[1]["loss"])
    assert "kl 0.0000" in capsys.readouterr().out
    full = str(tmp_path / "full")
    assert run.main(SMALL + ["--steps", "2", "--out", full, "--learning-rate", "3e-2", "--kl-coef", "0.1", "--reward",
                             SPREAD]) == 0
    records = _read(full)
    assert abs(records[0]["kl"]) < 1e-9 and np.isfinite(records[1]["kl"]) and records[1]["kl"] > 1e-9


def test_ref_from_mismatch_one_line_error_nothing_written(tmp_path, capsys):
    """--ref-from a directory of another config: one line naming the key, exit 2, --out not created; a matching
    directory gives exactly the model it holds; --ref-from without --kl-coef is refused."""
    other = models.build(models.Qwen36Config.tiny(vocab_size=48))
    models.save_hf(other, other.init(jax.random.key(0)), tmp_path / "other")
    out = str(tmp_path / "out")
    assert run.main(SMALL + ["--steps", "1", "--out", out, "--kl-coef", "0.1", "--ref-from",
                             str(tmp_path / "other")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: --ref-from ") and "config key vocab_size = 48" in err, err
    assert not os.path.exists(out)
    assert run.main(SMALL + ["--steps", "1", "--out", out, "--ref-from", str(tmp_path / "other")]) == 2
    assert "--ref-from=" in capsys.readouterr().err and not os.path.exists(out)

    model = models.build(models.Qwen36Config.tiny(vocab_size=32))
    params = model.init(jax.random.key(7))
    models.save_hf(model, params, tmp_path / "same")
    loaded = reference.load_reference(str(tmp_path / "same"), model, jnp.float32)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(params)))
    with pytest.raises(Exception, match=r"parameter \['embed'\] has shape \(3, 4\)"):
        reference.check_same_shapes(params, dict(params, embed=jnp.zeros((3, 4))), "d")


def test_step_peak_names_the_reference_phase():
    from longstraw_jax.capacity import phases

    sampling, update = dict(total=5), dict(total=7)
    assert phases.step_peak(sampling, update) == (7, "update")
    assert phases.step_peak(sampling, update, dict(total=9)) == (9, "reference")
    assert phases.step_peak(sampling, update, dict(total=7)) == (7, "update")  # ties: the update, as before
    assert phases.with_ref_params(dict(params=1, total=5), 3) == dict(params=1, ref_params=3, total=8)


@pytest.mark.slow  # AOT compiles of two updates, a capture and the reference program (~1.5 min)
def test_planner_kl_coef_adds_the_reference_memory():
    """Tiny Qwen3.6 on 1x8, P = 64: with --kl-coef the sampling and update phases grow by the reference params copy
    (full training: the params' shard; LoRA: nothing), and the reference phase holds params, optimizer, the copy,
    the kept state, one reference state and the reference program's other temporaries."""
    from longstraw_jax.capacity import Planner, local_bytes

    config = os.path.join(ROOT, "configs", "qwen3.6-tiny.json")
    kwargs = dict(dtype="float32", response_len=4, chunk=32, devices=jax.devices()[:8])
    plain = Planner(config, "1x8", **kwargs).plan(64, 2, "detached", 1, 1e12)
    planner = Planner(config, "1x8", **kwargs, kl_coef=0.1)
    row = planner.plan(64, 2, "detached", 1, 1e12)
    copy = local_bytes(planner.trainable)
    assert "reference" not in plain and copy == local_bytes(planner.params) > 0
    assert row["sampling"]["total"] - plain["sampling"]["total"] == copy == row["sampling"]["ref_params"]
    grown = row["update"]["total"] - plain["update"]["total"]  # + the copy, + the [G, R] ref log-probs argument
    assert copy <= grown <= copy + 4096, (grown, copy)
    ref = row["reference"]
    assert ref["ref_params"] == copy and ref["ref_state"] == ref["state"] == plain["update"]["state"] > 0
    assert ref["ref_rest"] > 0 and ref["boundaries"] == 0
    assert ref["total"] == sum(v for k, v in ref.items() if k != "total")
    assert row["peak"] == max(row[p]["total"] for p in ("sampling", "update", "reference"))
    assert Planner(config, "1x8", **kwargs, kl_coef=0.1, train_mode="lora", lora_rank=2).ref_params_bytes() == 0
