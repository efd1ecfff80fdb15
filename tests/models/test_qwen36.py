"""Qwen3.6 model: what only it has (GDN implementations, bf16, its real config, config and checkpoint errors);
the checks every family passes are in tests/models/test_families.py."""
import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longstraw_jax import models
from longstraw_jax.models.qwen36 import Qwen36Config
from tests.helpers import ROOT, tiny_forward

CONFIGS = os.path.join(ROOT, "configs")


@pytest.fixture(scope="module")
def tiny():
    return tiny_forward("qwen36")


def test_extend_does_not_depend_on_chunk_size_or_gdn_implementation(tiny):
    model, params, tokens, full = tiny
    sequential = models.build(dataclasses.replace(model.config, gdn_impl="sequential", attention_block_size=16))
    state = sequential.capture(params, tokens[:50], chunk_size=13)
    np.testing.assert_allclose(sequential.extend(params, state, tokens[50:]), full[50:], atol=1e-4)


def test_the_gdn_chunk_rule_and_an_explicit_chunk(tiny, monkeypatch):
    """gdn_chunk_size None: 16 tokens per chunk on the XLA path on a CPU (the tests' backend), 64 for XLA on
    another backend, 32 for the Pallas kernels (config.gdn_chunk_for); a size given is used by both, the kernels' at
    most 32 (MAX_CHUNK, what fits an H100's shared memory); a bad size is refused naming the field. The model's
    output does not depend on the chunk (tiny_forward's logits come from the default, 16)."""
    model, params, tokens, full = tiny
    config = model.config
    assert config.gdn_chunk_size is None and config.kernels == "xla" and jax.default_backend() == "cpu"
    assert (config.gdn_chunk, config.gdn_chunk_for("xla"), config.gdn_chunk_for("pallas")) == (16, 16, 32)
    assert dataclasses.replace(config, kernels="pallas").gdn_chunk == 32
    with monkeypatch.context() as patched:
        patched.setattr(jax, "default_backend", lambda: "gpu")
        assert config.gdn_chunk == config.gdn_chunk_for("xla") == 64
    chunk64 = dataclasses.replace(config, gdn_chunk_size=64)
    assert (chunk64.gdn_chunk_for("xla"), chunk64.gdn_chunk_for("pallas")) == (64, 32)
    assert dataclasses.replace(config, gdn_chunk_size=16).gdn_chunk_for("pallas") == 16
    np.testing.assert_allclose(models.build(chunk64).forward(params, tokens), full, atol=1e-4)
    for bad in (0, -16, 16.0):
        with pytest.raises(ValueError, match=f"gdn_chunk_size={bad!r}; must be a positive int or None"):
            dataclasses.replace(config, gdn_chunk_size=bad)


def test_bfloat16_params_track_float32(tiny):
    model, params, tokens, full = tiny
    bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    state = model.capture(bf16, tokens[:40], chunk_size=16)
    assert state.keys.dtype == jnp.bfloat16 and state.recurrent.dtype == jnp.float32
    logits = model.extend(bf16, state, tokens[40:])
    assert logits.dtype == jnp.float32
    err = jnp.abs(logits - full[40:])
    # bf16 has 8 mantissa bits: per-op relative error ~4e-3, compounded over 8 layers
    assert float(jnp.mean(err)) < 0.05 * float(jnp.std(full)), float(jnp.mean(err))
    assert float(jnp.max(err)) < 0.5 * float(jnp.std(full))
    agree = jnp.mean(jnp.argmax(logits, -1) == jnp.argmax(full[40:], -1))
    assert float(agree) > 0.8


def test_real_config():
    """The fields of configs/qwen3.6-27b.json (its parameter count: tests/models/test_families.py)."""
    cfg = Qwen36Config.from_hf(os.path.join(CONFIGS, "qwen3.6-27b.json"), strict=True)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (64, 5120, 248320)
    assert cfg.layer_types.count("full_attention") == 16 and cfg.block_pattern == ("linear_attention",) * 3 + (
        "full_attention",)
    assert cfg.rope.theta == 1e7 and cfg.rotary_dim == 64


# ----- bad input (the errors every family gives: tests/models/test_families.py) -----


def test_config_errors():
    good = Qwen36Config.tiny().to_hf()
    with pytest.raises(ValueError, match="num_key_value_heads"):
        Qwen36Config.from_hf({**good, "num_key_value_heads": 3})
    with pytest.raises(ValueError, match="linear_num_value_heads"):
        Qwen36Config.from_hf({**good, "linear_num_value_heads": 5})
    with pytest.raises(ValueError, match="missing required field 'hidden_size'"):
        Qwen36Config.from_hf({k: v for k, v in good.items() if k != "hidden_size"})
    with pytest.raises(ValueError, match="rope_type"):
        Qwen36Config.from_hf({**good, "rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4}})
    nested = {"model_type": "qwen3_5", "text_config": {**good, "model_type": "qwen3_5_text"}}
    assert Qwen36Config.from_hf(nested) == Qwen36Config.tiny()


def test_checkpoint_key_errors(tmp_path):
    from safetensors.numpy import load_file, save_file

    model = models.build(Qwen36Config.tiny())
    models.save_hf(model, model.init(jax.random.key(0)), tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.3.self_attn.k_norm.weight"]
    tensors["model.layers.0.linear_attn.bogus.weight"] = np.zeros(3, np.float32)
    tensors["model.norm.weight"] = np.zeros(7, np.float32)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError) as info:
        models.load_hf(tmp_path)
    message = str(info.value)
    assert "missing keys (1): model.layers.3.self_attn.k_norm.weight" in message
    assert "unexpected keys (1): model.layers.0.linear_attn.bogus.weight" in message
    assert "model.norm.weight: (7,) (expected (64,))" in message
    os.remove(tmp_path / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        models.load_hf(tmp_path)
