"""Checkpoints with Orbax: params-only init directories, and training checkpoints for `--resume`.

(Named orbax_io, not checkpoint, so that it does not read as `jax.checkpoint` (rematerialisation).)

Init directory (what `tools/convert_hf.py` writes and `--init-from DIR` reads):

    DIR/config.json   HF-style config (model.config.to_hf()), readable by models.config_from_hf
    DIR/params/       Orbax checkpoint of the params pytree, exactly the nested dicts of `model.init`:
                      orbax.checkpoint.StandardCheckpointer().restore(DIR/params, abstract_params)

Training checkpoints (`TrainCheckpoints`): an Orbax `CheckpointManager` under `<out>/checkpoints`, one step
directory per save, each with two items: "state" (params, optimizer state, the run's base RNG key data) and "meta"
(JSON: step, data position, the run configuration). Orbax writes each step into a temporary directory and renames
it when complete, so a crash mid-save never leaves a half-written checkpoint that `latest_step` would pick.
"""
from __future__ import annotations

import json
import os

import jax
import numpy as np
import orbax.checkpoint as ocp

from longstraw_jax import models

CHECKPOINT_DIR = "checkpoints"


def _on_device(tree, dtype=None):
    """Abstract arrays (ShapeDtypeStruct) placed like each leaf when it is a placed array (e.g. FSDP-sharded), else
    on the first local device; optionally cast to `dtype`."""
    first = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype or x.dtype,
                                                       sharding=getattr(x, "sharding", None) or first), tree)


def save_init_dir(model, params: dict, directory: str | os.PathLike) -> None:
    """Write DIR/config.json and DIR/params (params in their own dtype). DIR must not exist yet, or be empty."""
    directory = os.path.abspath(os.fspath(directory))
    if os.path.exists(directory) and os.listdir(directory):
        raise FileExistsError(f"{directory} exists and is not empty; refusing to overwrite an init directory")
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(model.config.to_hf(), f, indent=2)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(os.path.join(directory, "params"), params)
    checkpointer.wait_until_finished()


def load_init_dir(directory: str | os.PathLike, dtype=None):
    """DIR/config.json + DIR/params -> (model, params). dtype=None keeps each stored leaf's dtype.

    The stored tree must have exactly the structure and shapes of `model.init` for that config: any missing,
    unexpected or mis-shaped leaf is reported (all of them, by path) before anything is read.
    """
    directory = os.path.abspath(os.fspath(directory))
    params_dir = os.path.join(directory, "params")
    if not os.path.isdir(params_dir):
        raise FileNotFoundError(f"{params_dir}: no params checkpoint (an init directory has config.json and params/)")
    model = models.build(models.config_from_hf(directory))
    expected = jax.eval_shape(model.init, jax.random.key(0))
    checkpointer = ocp.StandardCheckpointer()
    stored = checkpointer.metadata(params_dir).item_metadata.tree
    flat_expected = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(expected)}
    flat_stored = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(stored)}
    problems = [f"missing {k}" for k in sorted(set(flat_expected) - set(flat_stored))]
    problems += [f"unexpected {k}" for k in sorted(set(flat_stored) - set(flat_expected))]
    problems += [f"{k} has shape {tuple(flat_stored[k].shape)}, expected {flat_expected[k].shape}"
                 for k in sorted(set(flat_expected) & set(flat_stored))
                 if tuple(flat_stored[k].shape) != flat_expected[k].shape]
    if problems:
        raise ValueError(f"{params_dir} does not match {type(model.config).__name__} from its config.json: "
                         + "; ".join(problems))
    abstract = jax.tree.map(lambda e, s: jax.ShapeDtypeStruct(e.shape, dtype or s.dtype), expected, stored)
    return model, checkpointer.restore(params_dir, _on_device(abstract))


class TrainCheckpoints:
    """Training checkpoints under `<out>/checkpoints` (Orbax CheckpointManager; keeps the newest `max_to_keep`).

    save(step, params, opt_state, rng_key, data_position, config) / restore(abstract params, abstract opt_state)
    -> (params, opt_state, rng_key, meta). `step` counts completed updates; `data_position` is the index of the
    next prompt (or rollout-file group) to use.
    """

    def __init__(self, out_dir: str | os.PathLike, max_to_keep: int = 2, create: bool = True):
        self.directory = os.path.join(os.path.abspath(os.fspath(out_dir)), CHECKPOINT_DIR)
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=create)
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, params, opt_state, rng_key: jax.Array, data_position: int, config: dict) -> None:
        state = {"params": params, "opt_state": opt_state, "rng": jax.random.key_data(rng_key)}
        meta = {"step": int(step), "data_position": int(data_position), "config": config}
        self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                         meta=ocp.args.JsonSave(meta)))
        self._manager.wait_until_finished()

    def read_meta(self, step: int | None = None) -> dict:
        """The JSON part of a checkpoint (newest by default) without reading any array."""
        step = self.latest_step() if step is None else step
        return self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def restore(self, params_like, opt_state_like, step: int | None = None):
        """-> (params, opt_state, rng_key, meta) of checkpoint `step` (the newest by default). The *_like trees give
        structure, shapes and dtypes (arrays or ShapeDtypeStructs, e.g. from jax.eval_shape)."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"{self.directory}: no checkpoint to restore")
        rng_like = jax.random.key_data(jax.random.key(0))
        abstract = _on_device({"params": params_like, "opt_state": opt_state_like, "rng": rng_like})
        out = self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                                  meta=ocp.args.JsonRestore()))
        state = out["state"]
        key = jax.random.wrap_key_data(np.asarray(state["rng"]))
        return state["params"], state["opt_state"], key, out["meta"]

    def close(self) -> None:
        self._manager.close()
