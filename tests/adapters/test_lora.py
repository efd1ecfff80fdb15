"""LoRA and frozen parameters (docs/architecture.md 10; adapters/lora.py, adapters/trainable.py, ops/lora.py), on small
models.

- adapters with B = 0 give the base model's logits exactly (both families);
- adapter gradients of the exact engine == the full-graph oracle's (both families, one device), and the gradient
  tree holds the adapters only;
- `--trainable REGEX` (a split without adapters): gradients only for the matching leaves, equal to those leaves of
  the full gradient;
- on a 2x4 mesh (Qwen3.6, two groups: one per data slice) == one device, adapters sharded like their base matrices;
- the trainer: `--train lora` runs, checkpoints and resumes bit-identically; the optimizer state covers the adapters
  only and the base stays bit-identical; --export-hf writes the merged weights;
- the PEFT export loads into transformers through `peft` with our logits (both families);
- bad input: one-line errors before anything is written.
"""
import functools
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longstraw_jax import GRPOConfig, grpo_grads, make_optimizer, models, naive_grpo_grads, sharding
from longstraw_jax.adapters import lora, trainable
from longstraw_jax.io.checkpoints import TrainCheckpoints
from longstraw_jax.io.peft import save_peft
from longstraw_jax.ops.lora import LoRA
from longstraw_jax.sharding import rules
from longstraw_jax.trainer import cli as run
from longstraw_jax.trainer.components import prepare_training
from longstraw_jax.trainer.config import RunConfig
from tests.helpers import make_batch, o1_params, rel_err

QWEN = models.Qwen36Config.tiny(num_hidden_layers=4, layer_types=("linear_attention",) * 3 + ("full_attention",),
                                gdn_chunk_size=16)
CFG = GRPOConfig(kl_coef=0.1)
grads_fn = jax.jit(grpo_grads, static_argnums=(0, 3, 4, 5), static_argnames="mesh")
naive_fn = jax.jit(naive_grpo_grads, static_argnums=(0, 3))


def random_adapters(params, key):
    """Adapters at O(1) scale (B = 0 would hide every B-dependent term of the gradient)."""
    def draw(path, x):
        name = trainable.path_str(path)
        if not name.endswith((".a", ".b")):
            return x
        return jax.random.normal(jax.random.fold_in(key, len(name) * 131 + sum(map(ord, name))), x.shape) \
            * x.shape[-1] ** -0.5
    return jax.tree_util.tree_map_with_path(draw, params)


def family(name):
    model = models.build(QWEN if name == "qwen" else models.Glm52Config.tiny())
    return model, o1_params(model.init(jax.random.key(0)), jax.random.key(1))


@pytest.fixture(scope="module", params=["qwen", "glm"])
def adapted(request):
    model, params = family(request.param)
    base = lora.add_adapters(params, lora.resolve_targets(params, "all"), 4, 8.0, jax.random.key(2))
    return model, params, base


def test_zero_b_gives_base_logits_exactly(adapted):
    model, params, with_adapters = adapted
    assert all(float(jnp.abs(x.b).max()) == 0 for x in lora.adapters(with_adapters).values())
    tokens = np.random.default_rng(0).integers(0, model.config.vocab_size, 21)
    np.testing.assert_array_equal(model.forward(with_adapters, tokens), model.forward(params, tokens))


@functools.lru_cache(maxsize=None)
def exact_case(name):
    """(model, params with O(1) adapters on every target, its (trainable, frozen) split, a batch (Qwen: two groups), the
    exact engine's (loss, grads, metrics)): shared by the one-device and the mesh test. Chunk 32 > P - 1: one prompt
    chunk (the chunk layouts are tests/engine/test_local.py's business)."""
    model, params = family(name)
    full = random_adapters(lora.add_adapters(params, lora.resolve_targets(params, "all"), 4, 8.0, jax.random.key(2)),
                           jax.random.key(3))
    part, frozen = trainable.split(full, trainable.adapter_leaf)
    batch = make_batch(model, params, [6, 2, 5], [1.0, 0.0, 0.25], True, True, 0)
    if name == "qwen":  # two groups side by side (on the 2x4 mesh: one per data slice, `groups.over_data`)
        other = make_batch(model, params, [3, 6, 1], [0.0, 0.5, 1.0], True, True, 1)
        batch = jax.tree.map(lambda *x: np.stack(x), batch, other)
    return model, full, part, frozen, batch, grads_fn(model, part, batch, CFG, "exact", 32, frozen=frozen)


@pytest.mark.slow  # exact and naive compiles with adapters, per family
@pytest.mark.parametrize("name", ["qwen", "glm"])
def test_adapter_grads_exact_equal_naive(name):
    model, _, part, frozen, batch, (loss, grads, _) = exact_case(name)
    want_loss, want, _ = naive_fn(model, part, batch, CFG, frozen=frozen)
    # the gradient tree is the trainable part: adapters only, no leaf for a frozen matrix
    assert jax.tree.structure(grads) == jax.tree.structure(part)
    names = [trainable.path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(grads)]
    assert names and all(n.endswith((".a", ".b")) for n in names)
    assert abs(float(loss) - float(want_loss)) <= 1e-5
    assert rel_err(grads, want) <= 1e-4, rel_err(grads, want)


@pytest.mark.slow  # the exact and naive gradients of a fresh split (LoRA's own checks stay in the fast tier)
def test_trainable_regex_grads_are_the_full_grads_leaves():
    model, params = family("qwen")
    batch = make_batch(model, params, [6, 2, 5], [1.0, 0.0, 0.25], True, True, 0)
    part, frozen = trainable.split(params, lambda path: re.search(r"final_norm|full/(q_proj|mlp)", path))
    _, grads, _ = grads_fn(model, part, batch, CFG, "exact", 32, frozen=frozen)
    _, full, _ = naive_fn(model, params, batch, CFG)
    chosen = trainable.split_like(full, grads)[0]
    assert jax.tree.structure(chosen) == jax.tree.structure(grads)
    assert sorted(trainable.path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(grads)) == [
        "blocks/full/mlp/down_proj", "blocks/full/mlp/gate_proj", "blocks/full/mlp/up_proj", "blocks/full/q_proj",
        "final_norm"]
    assert rel_err(grads, chosen) <= 1e-4


@pytest.mark.slow  # LoRA's exact backward on the mesh
def test_sharded_lora_grads_match_one_device():
    model, full, _, _, batch, (loss, grads, _) = exact_case("qwen")
    mesh = sharding.make_mesh("2x4")
    specs = rules.param_specs(full, mesh)
    q = specs["blocks"]["full"]["q_proj"]  # base [nb, nf, 256, 64]: out split; a [.., r, in], b [.., out, r]
    assert (q.base, q.a, q.b) == (rules.P(None, None, rules.FSDP), rules.P(None, None, None, rules.FSDP),
                                  rules.P(None, None, rules.FSDP))
    placed_part, placed_frozen = trainable.split(jax.device_put(full, rules.named(specs, mesh)), trainable.adapter_leaf)
    got_loss, got, _ = grads_fn(model, placed_part, batch, CFG, "exact", 32, frozen=placed_frozen, mesh=mesh)
    assert abs(float(got_loss) - float(loss)) <= 1e-5
    assert rel_err(got, grads) <= 1e-4
    assert got["blocks"]["full"]["q_proj"].a.sharding.spec == q.a


# ----- the trainer ------------------------------------------------------------------------------------------------


def token_reward(prompt_tokens, response_tokens, info):
    """Rewards that differ between branches (non-zero advantages)."""
    return float(response_tokens[0])


def write_config(path, config):
    with open(path, "w") as f:
        json.dump(config.to_hf(), f)
    return str(path)


def small(tmp_path):
    return ["--model", write_config(tmp_path / "qwen.json", models.Qwen36Config.tiny(
        vocab_size=32, num_hidden_layers=4, layer_types=QWEN.layer_types)), "--prompt-len", "40", "--group-size", "3",
        "--response-len", "2", "--chunk-size", "16", "--save-every", "2", "--seed", "1", "--mode", "detached",
        "--reward", "tests.adapters.test_lora:token_reward", "--train", "lora", "--lora-rank", "4", "--lora-targets",
        "attn,mlp", "--eval-every", "0", "--learning-rate", "3e-3"]


def restore(out, argv):
    config = RunConfig(**{k: v for k, v in vars(run.build_parser().parse_args(argv)).items()})
    model = models.build(models.config_from_hf(config.model))
    params = jax.eval_shape(lambda k: prepare_training(config, model, model.init(k))[0], jax.random.key(0))
    part = trainable.split(params, trainable.adapter_leaf)[0]
    checkpoints = TrainCheckpoints(out, create=False)
    params, opt_state, _, meta = checkpoints.restore(params, jax.eval_shape(make_optimizer(3e-3).init, part))
    checkpoints.close()
    return model, params, opt_state, meta


def bits(tree):
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


@pytest.mark.slow  # three trainer runs
def test_trainer_lora_resume_optimizer_state_and_exports(tmp_path, capsys):
    argv = small(tmp_path)
    straight, out = str(tmp_path / "straight"), str(tmp_path / "resumed")
    exports = ["--export-hf", str(tmp_path / "hf"), "--export-peft", str(tmp_path / "peft")]
    assert run.main(argv + ["--steps", "3", "--out", straight] + exports) == 0
    assert run.main(argv + ["--steps", "2", "--out", out]) == 0
    assert run.main(["--out", out, "--resume", "--steps", "3"]) == 0
    model, params, opt_state, meta = restore(straight, argv)
    _, resumed, resumed_opt, _ = restore(out, argv)
    assert meta["step"] == 3 and bits(resumed) == bits(params) and bits(resumed_opt) == bits(straight_opt := opt_state)
    losses = [json.loads(line)["loss"] for line in open(os.path.join(straight, "metrics.jsonl"))]
    assert any(loss != 0 for loss in losses)
    # the adapters trained, the base did not move: every base leaf is the seed's init, bit for bit
    part, frozen = trainable.split(params, trainable.adapter_leaf)
    assert any(float(jnp.abs(x.b).max()) > 0 for x in lora.adapters(params).values())
    initial = jax.jit(model.init)(jax.random.key(1))
    bases = jax.tree.map(lambda x: x.base if isinstance(x, LoRA) else x, frozen, is_leaf=lambda x: isinstance(x, LoRA))
    assert bits(bases) == bits(initial)
    # AdamW state: two moments per adapter leaf (and step counts), nothing for the frozen base
    (adapter_leaves, adapter_bytes), (opt_leaves, opt_bytes) = trainable.count(part), trainable.count(straight_opt)
    assert adapter_leaves == 2 * len(lora.adapters(params)) and trainable.count(frozen)[1] > 10 * adapter_bytes
    assert 2 * adapter_bytes <= opt_bytes <= 2 * adapter_bytes + 64 and opt_leaves <= 2 * adapter_leaves + 4
    # --export-hf: the merged weights
    _, exported = models.load_hf(str(tmp_path / "hf"))
    assert bits(exported) == bits(lora.merged(params))
    assert sorted(os.listdir(tmp_path / "peft")) == ["adapter_config.json", "adapter_model.safetensors"]
    # resuming with other adapters: one line, nothing touched
    before = snapshot(out)
    for option in (["--lora-rank", "2"], ["--lora-targets", "attn"], ["--train", "full"]):
        assert run.main(["--out", out, "--resume", "--steps", "4"] + option) == 2
        err = capsys.readouterr().err
        assert re.search(rf"error: {option[0]}=.* differs from the run being resumed", err), err
    assert snapshot(out) == before


def snapshot(directory):
    return sorted((os.path.join(root, f), os.stat(os.path.join(root, f)).st_mtime_ns)
                  for root, _, files in os.walk(directory) for f in files)


def test_bad_lora_input_one_line_error_nothing_written(tmp_path, capsys):
    argv = small(tmp_path)
    glm = write_config(tmp_path / "glm.json", models.Glm52Config.tiny(vocab_size=32))
    cases = [
        (["--lora-targets", "attn,nosuch"], r"--lora-targets: 'nosuch' matches no adaptable matrix of this model "
                                            r"\(groups: attn, mlp, shared, experts, all; matrices of this model: "
                                            r".*full/q_proj, .*linear/in_proj_a"),
        (["--lora-targets", "experts"], r"'experts' matches no adaptable matrix"),
        (["--lora-rank", "0"], r"--lora-rank=0 must be >= 1"),
        (["--lora-rank", "-3"], r"--lora-rank=-3 must be >= 1"),
        (["--lora-rank", "80"], r"--lora-rank=80 is larger than .* \[.*\] allows"),
        (["--train", "full", "--export-peft", str(tmp_path / "p")], r"--export-peft needs --train lora"),
        (["--sft-steps", "5"], r"--sft-steps=5: the supervised warm-up trains every parameter, but --train lora / "
                               r"--trainable keep some frozen \(pass --sft-steps 0\)"),
        (["--trainable", "norm"], r"--trainable selects parameters for --train full"),
        (["--train", "full", "--trainable", "nothing_like_this"], r"--trainable='nothing_like_this' matches no "
                                                                  r"parameter"),
        (["--model", glm, "--lora-targets", "attn,shared", "--export-peft", str(tmp_path / "p")],
         r"--export-peft: PEFT cannot express adapters on full_sparse/mlp/shared/.*attn,experts"),
        (["--model", glm, "--lora-targets", "experts_gate", "--export-peft", str(tmp_path / "p")],
         r"experts_gate has adapters but .*experts_up has none"),
    ]
    for extra, message in cases:
        out = str(tmp_path / "new")
        assert run.main(argv + ["--steps", "2", "--out", out] + extra) == 2, extra
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
        assert re.search(message, err), (message, err)
        assert not os.path.exists(out) and not os.path.exists(tmp_path / "p")


# ----- PEFT ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["qwen", pytest.param("glm", marks=pytest.mark.slow)])
def test_peft_export_loads_with_our_logits(name, tmp_path):
    from peft import PeftModel

    from tests.glm_reference import make_glm_checkpoint
    from tests.hf_reference import hf_logits, make_qwen_checkpoint

    if name == "qwen":
        torch_model, targets = make_qwen_checkpoint(tmp_path / "hf", seed=0, num_hidden_layers=4), "all"
    else:  # attention and routed experts (per-expert adapters, fused by PEFT into gate_up_proj / down_proj)
        torch_model, targets = make_glm_checkpoint(tmp_path / "hf", seed=1, index_topk_freq=1), "attn,experts"
    model, params = models.load_hf(tmp_path / "hf")
    adapted = random_adapters(lora.add_adapters(params, lora.resolve_targets(params, targets), 4, 8.0,
                                                jax.random.key(0)), jax.random.key(1))
    os.makedirs(tmp_path / "peft")
    save_peft(model, adapted, tmp_path / "peft")
    tokens = np.random.default_rng(0).integers(0, 256, 40)
    ours = np.asarray(model.forward(adapted, tokens))
    theirs = hf_logits(PeftModel.from_pretrained(torch_model, tmp_path / "peft").eval(), tokens)
    assert np.abs(ours - np.asarray(model.forward(params, tokens))).max() > 1  # the adapters matter
    assert np.abs(ours - theirs).max() <= 2e-4  # float32 parity (docs/models.md 4)
    assert np.abs(np.asarray(model.forward(lora.merged(adapted), tokens)) - ours).max() <= 2e-4


def test_lora_node_is_a_pytree_with_named_children():
    node = LoRA(jnp.ones((3, 4)), jnp.zeros((2, 4)), jnp.ones((3, 2)), 0.5)
    paths = [trainable.path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path({"w": node})]
    assert paths == ["w.base", "w.a", "w.b"] and node.shape == (3, 4) and node.rank == 2
    assert jax.tree.map(lambda x: x * 2, node).scale == 0.5
