"""Checkpoints with Orbax: params-only init directories, and training checkpoints for `--resume`.

(Named checkpoints, plural, so that it does not read as `jax.checkpoint` (rematerialisation).)

Init directory (what `python -m longstraw_jax.convert` writes and `--init-from DIR` reads):

    DIR/config.json   HF-style config (model.config.to_hf()), readable by models.config_from_hf
    DIR/params/       Orbax checkpoint of the params pytree, exactly the nested dicts of `model.init`:
                      orbax.checkpoint.StandardCheckpointer().restore(DIR/params, abstract_params)

Training checkpoints (`TrainCheckpoints`): an Orbax `CheckpointManager` under `<out>/checkpoints`, one step
directory per save, each with two items: "state" (params, optimizer state, the run's base RNG key data) and "meta"
(JSON: step, data position, the run configuration). Orbax writes each step into a temporary directory
(`<step>.orbax-checkpoint-tmp`) and renames it when complete, so a crash mid-save never leaves a half-written
checkpoint that `latest_step` would pick; `incomplete()` lists what such a crash left behind (trainer/outdir.py removes
it). A checkpoint damaged later (a truncated or deleted file) is reported by `read_meta` / `restore` as a
`BrokenCheckpoint` naming the step and the item's directory.
"""
from __future__ import annotations

import json
import os

import jax
import numpy as np
import orbax.checkpoint as ocp

from longstraw_jax import models
from longstraw_jax.io import fault_hooks

CHECKPOINT_DIR = "checkpoints"
TMP_SUFFIX = ".orbax-checkpoint-tmp"  # Orbax's temporary step directories: <step>.orbax-checkpoint-tmp[...]


class BrokenCheckpoint(Exception):
    """A checkpoint step that cannot be read: `step`, and a one-line message naming its item directory."""

    def __init__(self, step: int, message: str):
        super().__init__(message)
        self.step = step


def _reason(error: BaseException) -> str:
    """One short line for an error from Orbax / TensorStore (whose messages run to many lines)."""
    text = (str(error).strip().splitlines() or [""])[0]
    text = text if len(text) <= 160 else text[:157] + "..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


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

    def all_steps(self) -> list[int]:
        """Complete checkpoints (renamed from their temporary directory), oldest first; not checked for damage."""
        return sorted(self._manager.all_steps())

    def step_dir(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def incomplete(self) -> list[str]:
        """Temporary directories of saves that never completed (the process died mid-save), as absolute paths."""
        return incomplete_saves(self.directory)

    def save(self, step: int, params, opt_state, rng_key: jax.Array, data_position: int, config: dict) -> None:
        """Save and wait until the step directory is committed (renamed). A failure is an OSError naming it.
        Several processes: every process calls this with the same global arrays (the RNG key replicated on the mesh,
        as Orbax refuses single-device arrays there); Orbax writes each shard once and process 0 the JSON."""
        state = {"params": params, "opt_state": opt_state, "rng": jax.random.key_data(rng_key)}
        meta = {"step": int(step), "data_position": int(data_position), "config": config}
        try:
            with fault_hooks.around_orbax_commit(step):
                self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                                 meta=ocp.args.JsonSave(meta)))
                self._manager.wait_until_finished()
        except Exception as e:
            raise OSError(f"saving checkpoint {self.step_dir(step)} failed: {_reason(e)}") from e

    def read_meta(self, step: int | None = None) -> dict:
        """The JSON part of a checkpoint (newest by default) without reading any array; BrokenCheckpoint when it
        cannot be read or lacks a field."""
        step = self.latest_step() if step is None else step
        where = os.path.join(self.step_dir(step), "meta")
        if os.path.isfile(os.path.join(where, "metadata")):  # the JSON file itself (Orbax's JsonCheckpointHandler)
            where = os.path.join(where, "metadata")
        try:
            meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception as e:
            raise BrokenCheckpoint(step, f"checkpoint {step}: {where} is unreadable ({_reason(e)})") from None
        if not (isinstance(meta, dict) and meta.get("step") == step and isinstance(meta.get("data_position"), int)
                and isinstance(meta.get("config"), dict)):
            raise BrokenCheckpoint(step, f"checkpoint {step}: {where} is not this trainer's meta (needs step = {step}, "
                                         "data_position, config)")
        return meta

    def restore(self, params_like, opt_state_like, step: int | None = None, rng_sharding=None):
        """-> (params, opt_state, rng_key, meta) of checkpoint `step` (the newest by default). The *_like trees give
        structure, shapes and dtypes (arrays or ShapeDtypeStructs, e.g. from jax.eval_shape) and, where they are
        placed arrays, the shardings to restore onto (any mesh: a checkpoint saved on another mesh or process count
        is read onto this one). rng_sharding: where the RNG key data goes (default the first local device; with
        several processes a replicated sharding of the mesh, as Orbax reads only global arrays there)."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"{self.directory}: no checkpoint to restore")
        meta = self.read_meta(step)
        rng_data = jax.random.key_data(jax.random.key(0))
        rng_like = jax.ShapeDtypeStruct(rng_data.shape, rng_data.dtype, sharding=rng_sharding)
        abstract = _on_device({"params": params_like, "opt_state": opt_state_like, "rng": rng_like})
        try:
            state = self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))
        except Exception as e:
            where = os.path.join(self.step_dir(step), "state")
            raise BrokenCheckpoint(step, f"checkpoint {step}: {where} is unreadable ({_reason(e)})") from None
        state = state["state"]
        key = jax.random.wrap_key_data(state["rng"] if rng_sharding is not None else np.asarray(state["rng"]))
        return state["params"], state["opt_state"], key, meta

    def close(self) -> None:
        """Wait for any save in flight and release the manager (again: nothing)."""
        if not getattr(self, "_closed", False):
            self._manager.close()
            self._closed = True


def incomplete_saves(checkpoint_dir: str | os.PathLike) -> list[str]:
    """Orbax temporary step directories under `checkpoint_dir` (absolute paths, sorted): saves that never
    completed."""
    checkpoint_dir = os.path.abspath(os.fspath(checkpoint_dir))
    if not os.path.isdir(checkpoint_dir):
        return []
    return sorted(os.path.join(checkpoint_dir, name) for name in os.listdir(checkpoint_dir) if TMP_SUFFIX in name)
