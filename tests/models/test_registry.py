"""models/registry.py: every registered model_type reads its config from an HF dict and from a config.json file,
builds its model class, and describes itself; unknown types and config classes are errors naming what exists."""
import json

import pytest

from longstraw_jax import models
from longstraw_jax.models import registry


def hf_dict(model_type, entry):
    """The tiny preset's config.json for `model_type` ("qwen3_5" nests the text model's config)."""
    raw = entry.config_class.tiny().to_hf()
    return {"model_type": model_type, "text_config": raw} if raw["model_type"] != model_type else raw


@pytest.mark.parametrize("model_type", sorted(registry.MODEL_TYPES))
def test_every_model_type_round_trips(model_type, tmp_path):
    entry = registry.MODEL_TYPES[model_type]
    config = entry.config_class.tiny()
    raw = hf_dict(model_type, entry)
    assert registry.read_config(raw) == config
    path = tmp_path / "any_name.json"
    path.write_text(json.dumps(raw))
    assert models.config_from_hf(path) == config  # a config file with any name, as run --model reads it
    model = models.build(config)
    assert type(model) is entry.model_class and model.config == config
    assert registry.family(config) is entry
    assert models.describe(config).startswith(("Qwen3.6 ", "GLM-5.x "))


def test_unknown_model_type_and_config_class():
    with pytest.raises(ValueError, match=r"x.json: model_type='llama'; supported: glm_moe_dsa, qwen3_5, qwen3_5_text"):
        registry.read_config({"model_type": "llama"}, "x.json")
    with pytest.raises(TypeError, match="no model for config type dict"):
        models.build({"model_type": "qwen3_5_text"})


@pytest.mark.parametrize("config_class", [models.Qwen36Config, models.Glm52Config])
def test_from_hf_names_a_broken_config_file(tmp_path, config_class):
    """The config classes' own `from_hf` (the API path, not only the trainer's) names the file of a syntax error."""
    path = tmp_path / "config.json"
    path.write_text('{"model_type": ')
    with pytest.raises(ValueError, match=rf"{path}: config file is not valid JSON: Expecting value: line 1"):
        config_class.from_hf(path)
    with pytest.raises(ValueError, match=rf"{path}: config file must be a JSON object, got list"):
        path.write_text("[]")
        config_class.from_hf(tmp_path)
