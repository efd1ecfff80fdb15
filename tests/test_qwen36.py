"""Qwen3.6 model: capture/extend consistency, bf16, memory of capture, real-size parameter count, bad input."""
import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longstraw_jax import models
from longstraw_jax.models.base import capture_chunks
from longstraw_jax.models.qwen36 import Qwen36Config
from tests.helpers import o1_params

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "configs")


@pytest.fixture(scope="module")
def tiny():
    model = models.build(Qwen36Config.tiny())
    params = o1_params(model.init(jax.random.key(0)), jax.random.key(1))
    tokens = jax.random.randint(jax.random.key(2), (75,), 0, model.config.vocab_size, dtype=jnp.int32)
    return model, params, tokens, model.forward(params, tokens)


@pytest.mark.parametrize("split,chunk", [(40, 7), (40, 1), (33, 64), (64, 16), (1, 3)])
def test_extend_after_capture_equals_forward(tiny, split, chunk):
    model, params, tokens, full = tiny
    assert float(jnp.std(full)) > 0.3
    state = model.capture(params, tokens[:split], chunk_size=chunk)
    assert state.length == split
    got = model.extend(params, state, tokens[split:])
    np.testing.assert_allclose(got, full[split:], atol=1e-4)


def test_advance_decodes_token_by_token_after_a_capture_with_room(tiny):
    """Decoding: capture into a state with spare capacity, then `advance` one token at a time == forward."""
    model, params, tokens, full = tiny
    state = capture_chunks(model, params, tokens[:60], 16, jnp.float32, capacity=75)
    step = jax.jit(model.advance)
    rows = []
    for t in range(60, 75):
        hidden, state = step(params, state, tokens[t : t + 1], t)
        rows.append(model.logits(params, hidden))
    np.testing.assert_allclose(jnp.concatenate(rows), full[60:], atol=1e-4)
    with pytest.raises(ValueError, match="capacity=10 is below the prompt length 60"):
        capture_chunks(model, params, tokens[:60], 16, jnp.float32, capacity=10)


def test_capture_state_holds_what_models_md_lists(tiny):
    model, params, tokens, _ = tiny
    c = model.config
    state = model.capture(params, tokens[:30], chunk_size=8)
    assert state.keys.shape == (c.num_blocks, 1, 30, c.num_key_value_heads, c.head_dim)
    assert state.conv.shape == (c.num_blocks, 3, c.linear_conv_kernel_dim - 1, c.conv_dim)
    assert state.recurrent.shape == (c.num_blocks, 3, c.linear_num_value_heads, c.linear_key_head_dim,
                                     c.linear_value_head_dim)
    assert state.recurrent.dtype == jnp.float32


def test_extend_does_not_depend_on_chunk_size_or_gdn_implementation(tiny):
    model, params, tokens, full = tiny
    sequential = models.build(dataclasses.replace(model.config, gdn_impl="sequential", attention_block_size=16))
    state = sequential.capture(params, tokens[:50], chunk_size=13)
    np.testing.assert_allclose(sequential.extend(params, state, tokens[50:]), full[50:], atol=1e-4)


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


def _capture_memory(model, params, prompt, chunk):
    tokens = jax.ShapeDtypeStruct((prompt,), jnp.int32)
    mem = jax.jit(model._capture, static_argnums=2).lower(params, tokens, chunk).compile().memory_analysis()
    state = jax.eval_shape(lambda p, t: model._capture(p, t, chunk), params, tokens)
    return mem, state.nbytes()


def test_capture_memory_is_per_chunk_not_per_prompt():
    """AOT-compile capture of a 64K-token prompt: the state is the output, temporaries are O(chunk) and do not grow
    with the prompt (the KV cache is written and read in place, never copied)."""
    model = models.build(Qwen36Config.tiny())
    params = jax.eval_shape(model.init, jax.random.key(0))
    chunk = 1024
    mem, state_bytes = _capture_memory(model, params, 65536, chunk)
    small, _ = _capture_memory(model, params, 16384, chunk)
    print(f"capture P=65536 C={chunk}: state {state_bytes / 2**20:.1f} MiB, temp {mem.temp_size_in_bytes / 2**20:.1f}"
          f" MiB (P=16384: {small.temp_size_in_bytes / 2**20:.1f} MiB)")
    assert mem.output_size_in_bytes == pytest.approx(state_bytes, rel=0.01)
    assert mem.temp_size_in_bytes < state_bytes / 2
    assert mem.temp_size_in_bytes < 1.05 * small.temp_size_in_bytes  # 4x the prompt, same temporaries


def test_real_config_parameter_count():
    cfg = Qwen36Config.from_hf(os.path.join(CONFIGS, "qwen3.6-27b.json"), strict=True)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (64, 5120, 248320)
    assert cfg.layer_types.count("full_attention") == 16 and cfg.block_pattern == ("linear_attention",) * 3 + (
        "full_attention",)
    assert cfg.rope.theta == 1e7 and cfg.rotary_dim == 64
    shapes = jax.eval_shape(models.build(cfg).init, jax.random.key(0))
    count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))
    assert abs(count - 26.9e9) <= 0.1e9, count


def test_tiny_preset_file_matches_tiny():
    assert Qwen36Config.from_hf(os.path.join(CONFIGS, "qwen3.6-tiny.json"), strict=True) == Qwen36Config.tiny()


# ----- bad input -----


def test_token_errors_name_the_bound(tiny):
    model, params, tokens, _ = tiny
    bad = np.asarray(tokens).copy()
    bad[5] = model.config.vocab_size
    with pytest.raises(ValueError, match=r"tokens\[5\] = 512 .*vocab_size=512"):
        model.forward(params, bad)
    with pytest.raises(ValueError, match="out of range"):
        model.capture(params, -np.ones(4, np.int32))
    with pytest.raises(TypeError, match="integer"):
        model.extend(params, model.capture(params, tokens[:4]), np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="rank 1"):
        model.forward(params, np.zeros((2, 3), np.int32))
    with pytest.raises(ValueError, match="empty"):
        model.forward(params, np.zeros((0,), np.int32))
    with pytest.raises(ValueError, match="chunk_size"):
        model.capture(params, tokens, chunk_size=0)


def test_config_errors():
    good = Qwen36Config.tiny().to_hf()
    with pytest.raises(ValueError, match="model_type='llama'"):
        Qwen36Config.from_hf({**good, "model_type": "llama"})
    with pytest.raises(ValueError, match="num_key_value_heads"):
        Qwen36Config.from_hf({**good, "num_key_value_heads": 3})
    with pytest.raises(ValueError, match="linear_num_value_heads"):
        Qwen36Config.from_hf({**good, "linear_num_value_heads": 5})
    with pytest.raises(ValueError, match="frobnicate"):
        Qwen36Config.from_hf({**good, "frobnicate": 1}, strict=True)
    with pytest.warns(UserWarning, match="frobnicate"):
        Qwen36Config.from_hf({**good, "frobnicate": 1})
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
