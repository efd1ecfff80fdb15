"""Parity with transformers' Qwen3_5ForCausalLM on tiny random models (float32, CPU)."""
import jax
import numpy as np
import pytest

from longstraw_jax import models
from tests.hf_reference import hf_logits, make_qwen_checkpoint, to_multimodal_layout

VARIANTS = {
    # both layer kinds, GQA 2:1, 3 GDN value heads per key head
    "lllf_x2": dict(),
    # different geometry: 4 layers (one block), 6/3 heads of 16, GDN 4/4 heads (no repeat), dk != dv, tied embeddings
    "lllf_x1_tied": dict(hidden_size=48, intermediate_size=80, num_hidden_layers=4, num_attention_heads=6,
                         num_key_value_heads=3, head_dim=16, linear_num_key_heads=4, linear_num_value_heads=4,
                         linear_key_head_dim=8, linear_value_head_dim=12, tie_word_embeddings=True),
    # YaRN rope (Qwen3.6 long context), positions beyond original_max_position_embeddings
    "yarn": dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                  "factor": 4.0, "original_max_position_embeddings": 32}),
}
TOL = 1e-3  # docs/models.md 4: fp32 round-off in the GDN core, amplified by the gated norm


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def checkpoint(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    torch_model = make_qwen_checkpoint(directory, seed=len(request.param), **VARIANTS[request.param])
    tokens = np.random.default_rng(0).integers(0, 256, size=96).astype(np.int32)
    return directory, torch_model, tokens, hf_logits(torch_model, tokens)


def test_forward_matches_transformers(checkpoint):
    directory, _, tokens, expected = checkpoint
    model, params = models.load_hf(directory)
    got = np.asarray(model.forward(params, tokens))
    assert expected.std() > 0.3, "random model too flat to be a meaningful oracle"
    err = np.abs(got - expected).max()
    assert err <= TOL, f"max |logit diff| = {err:.2e}"


def test_capture_extend_matches_transformers(checkpoint):
    directory, _, tokens, expected = checkpoint
    model, params = models.load_hf(directory)
    state = model.capture(params, tokens[:57], chunk_size=20)
    got = np.asarray(model.extend(params, state, tokens[57:]))
    assert np.abs(got - expected[57:]).max() <= TOL


def test_multimodal_checkpoint_layout(checkpoint, tmp_path):
    directory, _, tokens, expected = checkpoint
    to_multimodal_layout(directory, tmp_path)
    model, params = models.load_hf(tmp_path)
    assert np.abs(np.asarray(model.forward(params, tokens)) - expected).max() <= TOL


def test_save_hf_round_trip_through_transformers(checkpoint, tmp_path):
    from transformers import Qwen3_5ForCausalLM

    directory, _, tokens, expected = checkpoint
    model, params = models.load_hf(directory)
    models.save_hf(model, params, tmp_path)
    reloaded = Qwen3_5ForCausalLM.from_pretrained(tmp_path).float().eval()
    np.testing.assert_array_equal(hf_logits(reloaded, tokens), expected)


def test_load_hf_bfloat16_end_to_end(checkpoint):
    """bf16 params end to end (fp32 GDN core and recurrent state): as close to fp32 as transformers' own bf16."""
    import copy

    import jax.numpy as jnp
    import torch

    directory, torch_model, tokens, expected = checkpoint
    model, params = models.load_hf(directory, dtype=jnp.bfloat16)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
    state = model.capture(params, tokens[:50], chunk_size=16)
    assert state.keys.dtype == jnp.bfloat16 and state.recurrent.dtype == jnp.float32
    ours = np.abs(np.asarray(model.extend(params, state, tokens[50:])) - expected[50:]).mean()
    theirs = np.abs(hf_logits(copy.deepcopy(torch_model).to(torch.bfloat16), tokens)[50:] - expected[50:]).mean()
    assert ours < 1.5 * theirs + 1e-3, (ours, theirs)
