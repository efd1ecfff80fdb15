"""The KL reference policy of a sampling run (`--kl-coef > 0` without `--rollouts`): which parameters it is, and the
reference log-probs of each step's sampled branches (`sampling.reference.reference_logprobs`: the prompt captured
again under the reference params, the branches replayed, no gradient).

Which parameters (`Reference.kind`):
- "base" (`--train lora`): the policy's own base matrices with the adapters left out (`lora.without_adapters`: the
  same arrays, nothing copied);
- "initial" (`--train full`, with or without `--trainable`): a copy of the trainable leaves as they were loaded,
  before any update (the frozen leaves never change, so the policy's are used); the copy is made before a
  checkpoint is restored, so a resumed run has the same reference (the loaded model, not the checkpoint);
- "loaded" (`--ref-from DIR`): params read from an HF or init directory, whose config must equal the model's.
"""
from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np

from longstraw_jax import models
from longstraw_jax.adapters import lora, trainable
from longstraw_jax.io import checkpoints
from longstraw_jax.sampling.reference import reference_logprobs
from longstraw_jax.sharding import hosts
from longstraw_jax.trainer.config import RunConfig, RunError

KINDS = ("base", "initial", "loaded")


@dataclasses.dataclass(frozen=True)
class Reference:
    """kind: one of KINDS (module docstring). held: the parameters this object holds (kind "initial": the copy of the
    trainable part, holes elsewhere; "loaded": the whole reference tree; "base": None). trains: the run's trainable
    predicate (`trainable.split`), None when every leaf trains."""

    kind: str
    held: object = None
    trains: object = None

    def params(self, policy):
        """The reference parameters given the policy's current ones (same placement)."""
        if self.kind == "base":
            return lora.without_adapters(policy)
        if self.kind == "loaded":
            return self.held
        frozen = None if self.trains is None else trainable.split(policy, self.trains)[1]
        return trainable.merge(self.held, frozen)

    def logprobs(self, model, policy, batch, chunk_size: int, mesh=None, logprob_chunk: int = 1024) -> np.ndarray:
        """float32 [B, G, R]: log pi_ref of batch.responses [B, G, R] after batch.prompt [B, P] (left_pad honoured);
        temperature 1, as the loss's policy log-probs. On the host (every process the whole array)."""
        ref = reference_logprobs(model, self.params(policy), batch.prompt, batch.responses, chunk_size, mesh=mesh,
                                 left_pad=batch.left_pad, logprob_chunk=logprob_chunk)
        return np.asarray(hosts.to_host(ref), np.float32)


_copy = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree))


def for_run(config: RunConfig, model, params, trains, place) -> Reference | None:
    """The run's Reference (None without --kl-coef, or with --rollouts: a file carries its own ref_logprobs).
    params: the policy's placed initial params (with adapters for --train lora); trains: the trainable predicate
    or None; place(tree) -> the tree placed like params (`components.place`), for --ref-from."""
    if config.kl_coef == 0 or config.rollouts is not None:
        return None
    if config.ref_from is not None:
        return Reference("loaded", place(load_reference(config.ref_from, model, jnp.dtype(config.dtype))))
    if config.train == "lora":
        return Reference("base", trains=trains)
    part = params if trains is None else trainable.split(params, trains)[0]
    return Reference("initial", _copy(part), trains)


def load_reference(directory: str, model, dtype):
    """--ref-from DIR -> the reference params (`dtype`), from an init directory (DIR/params exists) or an HF directory.
    Its config.json must equal `model`'s config (RunError naming the first differing key, read before any weight)
    and every leaf its shape."""
    if not os.path.isdir(directory):
        raise RunError(f"--ref-from {directory}: no such directory")
    try:
        ref_config = models.config_from_hf(directory)
    except (OSError, ValueError) as e:
        raise RunError(f"--ref-from {directory}: {e}") from None
    check_same_config(model.config, ref_config, directory)
    try:
        if os.path.isdir(os.path.join(directory, "params")):
            _, params = checkpoints.load_init_dir(directory, dtype=dtype)
        else:
            _, params = models.load_hf(directory, dtype=dtype)
    except (OSError, ValueError) as e:
        raise RunError(f"--ref-from {directory}: {e}") from None
    check_same_shapes(jax.eval_shape(lambda k: model.init(k, dtype), jax.random.key(0)), params, directory)
    return params


def check_same_config(config, ref_config, directory: str) -> None:
    """RunError unless the two model configs are equal, naming the first field that differs and both values."""
    if type(config) is not type(ref_config):
        raise RunError(f"--ref-from {directory}: a {type(ref_config).__name__}, the model is a {type(config).__name__}")
    for field in dataclasses.fields(config):
        mine, theirs = getattr(config, field.name), getattr(ref_config, field.name)
        if mine != theirs:
            raise RunError(f"--ref-from {directory}: config key {field.name} = {theirs!r}, the model's is {mine!r} "
                           "(the reference must be the same architecture)")


def check_same_shapes(expected, params, directory: str) -> None:
    """RunError naming the first leaf whose path or shape differs between `expected` and `params`."""
    want = {jax.tree_util.keystr(k): tuple(v.shape) for k, v in jax.tree_util.tree_leaves_with_path(expected)}
    got = {jax.tree_util.keystr(k): tuple(v.shape) for k, v in jax.tree_util.tree_leaves_with_path(params)}
    for key in sorted(set(want) | set(got)):
        if want.get(key) != got.get(key):
            raise RunError(f"--ref-from {directory}: parameter {key} has shape {got.get(key)}, the model's is "
                           f"{want.get(key)}")


__all__ = ["KINDS", "Reference", "check_same_config", "check_same_shapes", "for_run", "load_reference"]
