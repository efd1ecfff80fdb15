"""What every model family must do, checked on each (Qwen3.6 and GLM-5.x): extend after a capture == forward (and
the captured state is the one docs/models.md lists), token-by-token decoding (`advance`) == forward, capture memory
O(chunk) not O(prompt), the tiny preset files, the real configs' parameter counts, and the errors for bad tokens and
configs. What only one family has is checked in tests/models/test_qwen36.py and tests/models/test_glm52.py. The tiny
models are built and run forward once per process (`tests.helpers.tiny_forward`), shared with those two modules."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longstraw_jax import models
from longstraw_jax.engine.capture import capture_chunks
from tests.helpers import ROOT, TINY_T, tiny_forward

CONFIGS = os.path.join(ROOT, "configs")
FAMILIES = ("qwen36", "glm52")
CONFIG = {"qwen36": models.Qwen36Config, "glm52": models.Glm52Config}
# (split, chunk) of extend-after-capture: for Qwen3.6 chunks of 1, 3, 7, 16, 64 including C > split; fewer for GLM
# (each is a compile), both with a ragged last chunk and with one chunk larger than the prompt
SPLITS = {"qwen36": [(40, 7), (40, 1), (33, 64), (64, 16), (1, 3)], "glm52": [(40, 7), (33, 64)]}


def assert_state_is_what_models_md_lists(family, model, state, length):
    """The captured state of `length` positions has the family's fields, shapes and dtypes (docs/models.md)."""
    c = model.config
    assert state.length == length
    if family == "qwen36":  # per block: 3 GDN layers' conv and recurrent state, 1 full-attention layer's keys / values
        assert state.keys.shape == (c.num_blocks, 1, length, c.num_key_value_heads, c.head_dim)
        assert state.conv.shape == (c.num_blocks, 3, c.linear_conv_kernel_dim - 1, c.conv_dim)
        assert state.recurrent.shape == (c.num_blocks, 3, c.linear_num_value_heads, c.linear_key_head_dim,
                                         c.linear_value_head_dim)
        assert state.recurrent.dtype == jnp.float32
    else:
        assert model.carried(state) == ()
        assert state.kv.shape == (4, length, c.kv_lora_rank + c.qk_rope_head_dim)  # latent + rope key, every layer
        assert state.index_keys.shape == (2, length, c.index_head_dim)  # F S F S: full layers only


SLOW_SPLITS = {("qwen36", 40, 1), ("qwen36", 64, 16)}  # the whole suite only: chunk 1, chunks that divide the prompt


@pytest.mark.parametrize("family,split,chunk", [pytest.param(f, *case, marks=pytest.mark.slow)
                                                if (f, *case) in SLOW_SPLITS else (f, *case)
                                                for f in FAMILIES for case in SPLITS[f]])
def test_extend_after_capture_equals_forward(family, split, chunk):
    model, params, tokens, full = tiny_forward(family)
    assert float(jnp.std(full)) > 0.3
    state = model.capture(params, tokens[:split], chunk_size=chunk)
    assert_state_is_what_models_md_lists(family, model, state, split)
    np.testing.assert_allclose(model.extend(params, state, tokens[split:]), full[split:], atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_advance_decodes_token_by_token_after_a_capture_with_room(family):
    """Decoding: capture into a state with spare capacity, then `advance` one token at a time == forward."""
    model, params, tokens, full = tiny_forward(family)
    state = capture_chunks(model, params, tokens[:60], 16, jnp.float32, capacity=TINY_T)
    step = jax.jit(model.advance)
    rows = []
    for t in range(60, TINY_T):
        hidden, state = step(params, state, tokens[t : t + 1], t)
        rows.append(model.logits(params, hidden))
    np.testing.assert_allclose(jnp.concatenate(rows), full[60:], atol=1e-4)
    with pytest.raises(ValueError, match="capacity=10 is below the prompt length 60"):
        capture_chunks(model, params, tokens[:60], 16, jnp.float32, capacity=10)


def _capture_memory(model, params, prompt, chunk):
    tokens = jax.ShapeDtypeStruct((prompt,), jnp.int32)
    mem = jax.jit(model._capture, static_argnums=2).lower(params, tokens, chunk).compile().memory_analysis()
    return mem, jax.eval_shape(lambda p, t: model._capture(p, t, chunk), params, tokens).nbytes()


# family -> (tiny config overrides, chunk, bound on temporaries as a fraction of the state)
MEMORY = {"qwen36": ({}, 1024, 1 / 2), "glm52": ({"index_key_block_size": 256}, 512, 1 / 4)}


@pytest.mark.parametrize("family", FAMILIES)
def test_capture_memory_is_per_chunk_not_per_prompt(family):
    """AOT-compile capture of a 64K-token prompt: the state is the output, temporaries are O(chunk) and do not grow
    with the prompt (the caches are written and read in place, never copied; GLM, index_topk 16 << P: no [T, P]
    score or mask array exists, the indexer streams its top-k over key blocks)."""
    overrides, chunk, fraction = MEMORY[family]
    model = models.build(CONFIG[family].tiny(**overrides))
    params = jax.eval_shape(model.init, jax.random.key(0))
    mem, state_bytes = _capture_memory(model, params, 65536, chunk)
    small, _ = _capture_memory(model, params, 16384, chunk)
    print(f"{family} capture P=65536 C={chunk}: state {state_bytes / 2**20:.1f} MiB, temp "
          f"{mem.temp_size_in_bytes / 2**20:.2f} MiB (P=16384: {small.temp_size_in_bytes / 2**20:.2f} MiB)")
    assert mem.output_size_in_bytes == pytest.approx(state_bytes, rel=0.01)
    assert mem.temp_size_in_bytes < state_bytes * fraction
    assert mem.temp_size_in_bytes < 1.05 * small.temp_size_in_bytes  # 4x the prompt, same temporaries


# family -> (real config, parameter count): Qwen3.6-27B; GLM-5.2 without the MTP layer (docs/models.md 2.2)
REAL = {"qwen36": ("qwen3.6-27b.json", 26.9e9), "glm52": ("glm-5.2.json", 743.4e9)}


@pytest.mark.parametrize("family", FAMILIES)
def test_real_config_parameter_count(family):
    name, want = REAL[family]
    cfg = CONFIG[family].from_hf(os.path.join(CONFIGS, name), strict=True)
    shapes = jax.eval_shape(models.build(cfg).init, jax.random.key(0))
    count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))
    assert abs(count - want) <= 0.1e9, count


@pytest.mark.parametrize("family,name", [("qwen36", "qwen3.6-tiny.json"), ("glm52", "glm-5.2-tiny.json")])
def test_tiny_preset_file_matches_tiny(family, name):
    assert CONFIG[family].from_hf(os.path.join(CONFIGS, name), strict=True) == CONFIG[family].tiny()


# ----- bad input --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_token_errors_name_the_bound(family):
    model, params, tokens, _ = tiny_forward(family)
    bad = np.asarray(tokens).copy()
    bad[5] = model.config.vocab_size
    with pytest.raises(ValueError, match=r"tokens\[5\] = 512 .*vocab_size=512"):
        model.forward(params, bad)
    with pytest.raises(ValueError, match="out of range"):
        model.capture(params, -np.ones(4, np.int32))
    with pytest.raises(TypeError, match="integer"):
        model.extend(params, model.init_state(4), np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="rank 1"):
        model.forward(params, np.zeros((2, 3), np.int32))
    with pytest.raises(ValueError, match="empty"):
        model.forward(params, np.zeros((0,), np.int32))
    with pytest.raises(ValueError, match="chunk_size"):
        model.capture(params, tokens, chunk_size=0)


@pytest.mark.parametrize("family,other_type", [("qwen36", "llama"), ("glm52", "qwen3_5_text")])
def test_config_errors_name_the_key(family, other_type):
    """Another model_type, and unknown keys: an error with strict=True, else a warning naming them."""
    config = CONFIG[family]
    good = config.tiny().to_hf()
    with pytest.raises(ValueError, match=f"model_type='{other_type}'"):
        config.from_hf({**good, "model_type": other_type})
    with pytest.raises(ValueError, match="frobnicate"):
        config.from_hf({**good, "frobnicate": 1}, strict=True)
    with pytest.warns(UserWarning, match="frobnicate"):
        config.from_hf({**good, "frobnicate": 1})
