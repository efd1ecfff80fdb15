"""Parity with transformers' GlmMoeDsaForCausalLM on tiny random models (float32, CPU), sparsity active.

Sequences of 80 tokens with index_topk = 16: every row past 16 attends to a strict subset of the positions it sees.
Besides logits, every full layer's top-k set is compared to the one transformers' indexer returns (shared layers
reuse it by construction), and the smallest gap between the k-th and (k+1)-th index score is reported: the
selections are only comparable where that gap is well above float32 noise, so the seeds below were picked for it.
"""
import copy
import json
import logging
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from longstraw_jax import models
from tests.glm_reference import hf_logits_and_selection, make_glm_checkpoint

VARIANTS = {
    # GLM-5 / 5.1: every layer runs its indexer; one dense layer then MoE (two segments)
    "glm5_all_full": (1, dict(index_topk_freq=1)),
    # GLM-5.2-style IndexShare F F F S F S, two dense layers, group-limited routing (2 groups, 1 kept, top-3)
    "glm52_indexshare": (1, dict(num_hidden_layers=6, index_topk_freq=2, index_skip_topk_offset=3,
                                 first_k_dense_replace=2, n_group=2, topk_group=1, num_experts_per_tok=3)),
}
TOL = 1e-4  # docs/models.md 4: GLM float32 parity ~1e-5
LENGTH, TOPK = 80, 16


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def checkpoint(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    seed, overrides = VARIANTS[request.param]
    torch_model = make_glm_checkpoint(directory, seed=seed, **overrides)
    tokens = np.random.default_rng(seed).integers(0, 256, size=LENGTH).astype(np.int32)
    model, params = models.load_hf(directory)
    return directory, torch_model, tokens, hf_logits_and_selection(torch_model, tokens), model, params


def test_forward_and_topk_sets_match_transformers(checkpoint):
    _, torch_model, tokens, (expected, hf_sets, gap), model, params = checkpoint
    assert model.config.indexer_types == tuple(torch_model.config.indexer_types)
    assert expected.std() > 0.3, "random model too flat to be a meaningful oracle"
    err = np.abs(np.asarray(model.forward(params, tokens)) - expected).max()
    ours = np.asarray(model.index_selection(params, tokens))  # [F, T, k]
    print(f"{model.config.indexer_types}: max |logit diff| = {err:.2e}, index_gap_min = {gap:.2e}")
    assert gap > 1e-5  # selections are far from ties at float32 resolution
    assert err <= TOL
    assert ours.shape == (len(hf_sets), LENGTH, TOPK)
    for layer, rows in enumerate(hf_sets):
        for t, want in enumerate(rows):
            assert set(ours[layer, t][ours[layer, t] >= 0].tolist()) == want, (layer, t)
    assert all(len(rows[t]) == TOPK < t + 1 for rows in hf_sets for t in range(TOPK, LENGTH))  # really sparse


def test_capture_extend_matches_transformers(checkpoint):
    _, _, tokens, (expected, _, _), model, params = checkpoint
    state = model.capture(params, tokens[:50], chunk_size=12)
    assert np.abs(np.asarray(model.extend(params, state, tokens[50:])) - expected[50:]).max() <= TOL


def test_save_hf_round_trip_through_transformers(checkpoint, tmp_path):
    from transformers import GlmMoeDsaForCausalLM

    _, _, tokens, (expected, _, _), model, params = checkpoint
    models.save_hf(model, params, tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    layer = model.config.mlp_layer_types.index("sparse")
    assert stored[f"model.layers.{layer}.mlp.experts.7.down_proj.weight"].shape == (64, 32)  # per expert, [out, in]
    reloaded = GlmMoeDsaForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").float().eval()
    with torch.no_grad():
        logits = reloaded(torch.as_tensor(tokens, dtype=torch.long)[None]).logits[0].numpy()
    np.testing.assert_array_equal(logits, expected)


def test_mtp_layer_on_disk_is_skipped_with_a_note(checkpoint, tmp_path, caplog):
    """A checkpoint with `num_nextn_predict_layers = 1` stores the MTP layer after the last decoder layer
    (`model.layers.78.*` for GLM-5.2): it is skipped, with a logged note, and everything else loads unchanged."""
    directory, _, _, _, model, params = checkpoint
    layers = model.config.num_hidden_layers
    tensors = load_file(os.path.join(directory, "model.safetensors"))
    tensors[f"model.layers.{layers}.eh_proj.weight"] = np.zeros((64, 128), np.float32)
    tensors[f"model.layers.{layers}.self_attn.q_a_proj.weight"] = np.zeros((32, 64), np.float32)
    save_file(tensors, tmp_path / "model.safetensors")
    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    with open(tmp_path / "config.json", "w") as f:
        json.dump({**config, "num_nextn_predict_layers": 1}, f)
    with caplog.at_level(logging.INFO, logger="longstraw_jax.models.hf"):
        mtp_model, mtp_params = models.load_hf(tmp_path)
    assert f"skipped 2 tensors under model.layers.{layers}." in caplog.text
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), mtp_params, params))
    shutil.rmtree(tmp_path)
    with pytest.raises(ValueError, match=f"unexpected keys.*model.layers.{layers}.eh_proj.weight"):
        os.makedirs(tmp_path)
        save_file(tensors, tmp_path / "model.safetensors")
        with open(tmp_path / "config.json", "w") as f:
            json.dump(config, f)  # without num_nextn_predict_layers the extra layer is an error, not ignored
        models.load_hf(tmp_path)
    assert mtp_model.hf_skipped_prefixes == (f"model.layers.{layers}.",)


@pytest.mark.slow  # bfloat16 compiles of forward, capture and extend (the fast tier checks float32 parity)
@pytest.mark.parametrize("checkpoint", ["glm52_indexshare"], indirect=True)
def test_bfloat16_end_to_end_as_close_as_transformers_own(checkpoint):
    """bf16 params and state (fp32 indexer scores, router and softmax): as close to fp32 as transformers' bf16."""
    directory, torch_model, tokens, (expected, _, _), _, _ = checkpoint
    model, params = models.load_hf(directory, dtype=jnp.bfloat16)
    state = model.capture(params, tokens[:50], chunk_size=16)
    assert state.kv.dtype == jnp.bfloat16
    ours = np.abs(np.asarray(model.extend(params, state, tokens[50:])) - expected[50:]).mean()
    with torch.no_grad():
        bf16 = copy.deepcopy(torch_model).to(torch.bfloat16)
        theirs = bf16(torch.as_tensor(tokens, dtype=torch.long)[None]).logits[0].float().numpy()
    theirs = np.abs(theirs[50:] - expected[50:]).mean()
    print(f"bf16 mean |logit diff| vs fp32: ours {ours:.3e}, transformers {theirs:.3e}")
    assert ours < 1.5 * theirs + 1e-3, (ours, theirs)
