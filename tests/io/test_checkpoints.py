"""Init directories (config.json + Orbax params/) and training checkpoints round-trip bit-exactly."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from longstraw_jax import make_optimizer, models
from longstraw_jax.io.checkpoints import TrainCheckpoints, load_init_dir, save_init_dir
from longstraw_jax.models.qwen36.config import FULL, LINEAR

CONFIG = models.Qwen36Config.tiny(num_hidden_layers=4, layer_types=(LINEAR, LINEAR, LINEAR, FULL), vocab_size=64)


def bits(tree):
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


@pytest.fixture(scope="module")
def model_params():
    model = models.build(CONFIG)
    return model, jax.jit(model.init, static_argnums=1)(jax.random.key(0), jnp.float32)


def test_init_dir_round_trip(tmp_path, model_params):
    model, params = model_params
    directory = tmp_path / "init"
    save_init_dir(model, params, directory)
    assert sorted(os.listdir(directory)) == ["config.json", "params"]
    assert models.config_from_hf(directory) == CONFIG
    loaded_model, loaded = load_init_dir(directory)
    assert loaded_model == model
    assert jax.tree.structure(loaded) == jax.tree.structure(params) and bits(loaded) == bits(params)
    # the documented contract: a plain StandardCheckpointer restores it with the abstract params of model.init
    abstract = jax.eval_shape(model.init, jax.random.key(0))
    plain = ocp.StandardCheckpointer().restore(os.path.join(directory, "params"), abstract)
    assert bits(plain) == bits(params)
    _, half = load_init_dir(directory, dtype=jnp.bfloat16)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(half))
    with pytest.raises(FileExistsError, match="not empty"):
        save_init_dir(model, params, directory)


def test_init_dir_mismatch_is_reported(tmp_path, model_params):
    model, params = model_params
    directory = tmp_path / "init"
    save_init_dir(model, params, directory)
    config = json.loads((directory / "config.json").read_text())
    config["intermediate_size"] = 96
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"\['blocks'\]\['full'\]\['mlp'\]\['down_proj'\] has shape \(1, 1, 64, 128\), "
                                         r"expected \(1, 1, 64, 96\)"):
        load_init_dir(directory)
    with pytest.raises(FileNotFoundError, match="no params checkpoint"):
        load_init_dir(tmp_path / "nowhere")


def test_train_checkpoints_round_trip(tmp_path, model_params):
    model, params = model_params
    optimizer = make_optimizer(1e-3)
    opt_state = jax.jit(optimizer.init)(params)  # jitted: one compile, not one per leaf shape and primitive
    grads = jax.tree.map(jnp.ones_like, params)
    _, opt_state = jax.jit(optimizer.update)(grads, opt_state, params)  # non-trivial moments and count
    key = jax.random.fold_in(jax.random.key(5), 3)
    checkpoints = TrainCheckpoints(tmp_path, max_to_keep=2)
    assert checkpoints.latest_step() is None
    for step in (1, 2, 3):
        checkpoints.save(step, params, opt_state, key, data_position=10 + step, config={"lr": 1e-3})
    assert checkpoints.latest_step() == 3 and sorted(os.listdir(checkpoints.directory)) == ["2", "3"]
    assert checkpoints.read_meta() == {"step": 3, "data_position": 13, "config": {"lr": 1e-3}}
    checkpoints.close()

    fresh = TrainCheckpoints(tmp_path, create=False)
    abstract_params = jax.eval_shape(model.init, jax.random.key(0))
    abstract_opt = jax.eval_shape(optimizer.init, abstract_params)
    got_params, got_opt, got_key, meta = fresh.restore(abstract_params, abstract_opt)
    assert meta["step"] == 3 and meta["data_position"] == 13
    assert bits(got_params) == bits(params) and bits(got_opt) == bits(opt_state)
    assert jax.tree.structure(got_opt) == jax.tree.structure(opt_state)
    np.testing.assert_array_equal(jax.random.key_data(got_key), jax.random.key_data(key))
    _, _, _, meta2 = fresh.restore(abstract_params, abstract_opt, step=2)
    assert meta2["data_position"] == 12
