"""`grpo_grads` on a ("data", "seq") mesh (ARCHITECTURE.md 5): the engine's algorithm with the sequence-parallel
Qwen3.6 capture and replay of `sharding/qwen36.py`.

    capture   sstate = capture(prompt[:-1]) on the mesh           seq-sharded KV cache, replicated GDN state
    replay    for g in branches (lax.scan): autodiff of the branch loss through the sharded replay: parameter
              gradients (FSDP-sharded, float32) and, in exact mode, the state cotangent (sharded like the state)
    prompt    exact mode: one vjp of the sequence-parallel capture with the summed state cotangent

Gradients flow through `shard_map` by JAX's transposes of the collectives: the ring's `ppermute` runs backwards, the
layers' `all_gather` becomes a reduce-scatter (each device receives only its own shard of a layer's gradient), the
log-sum-exp merge's `psum` folds the branch's cotangent back to each shard's partial, and the GDN affine fold's
all-gather carries the cotangents of later segments' incoming states back to the segments that produced them. The
capture's layer scan is rematerialised (block inputs kept, `sharding.qwen36._scan_blocks`), so the prompt backward
holds the P / seq block inputs of each device and one block's recomputation at a time.

The `data` axis holds parameter shards (FSDP) and otherwise repeats this group's work: independent groups are what
it runs side by side. Detached mode captures in rounds (`chunk_size` positions: one round's activations live at a
time). Not yet: an exact-mode prompt backward in rounds (it differentiates a one-round capture, so its activation
memory is every block's input and one block's internals for the device's P / seq positions), and GLM-5.x (no
sequence-parallel MLA / DSA capture yet).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from longstraw_jax import engine, layerwise
from longstraw_jax.grpo import GroupBatch, GRPOConfig, finalize_metrics
from longstraw_jax.models.qwen36 import Qwen36
from longstraw_jax.sharding import qwen36 as sharded_qwen36
from longstraw_jax.sharding.prompt_backward import prompt_backward
from longstraw_jax.sharding.layout import RoundLayout
from longstraw_jax.sharding.rules import named, param_specs, prompt_state_specs


def check_supported(model) -> None:
    if not isinstance(model, Qwen36):
        raise NotImplementedError(f"sharded grpo_grads (mesh=...) supports Qwen3.6 only so far, not "
                                  f"{type(model).__name__}: pass mesh=None")


def grpo_grads(model, params, batch: GroupBatch, cfg: GRPOConfig, mode: str, mesh, round_len: int | None = None,
               attention: str = "ring"):
    """(loss, grads, metrics) as `engine.grpo_grads`, on `mesh`; grads are sharded like `rules.param_specs`.
    The batch must already be validated (engine.grpo_grads does it). Detached mode captures in rounds of about
    `round_len` positions (`sharding.qwen36.capture`); exact mode differentiates a one-round capture."""
    check_supported(model)
    layout = RoundLayout.for_prompt(batch.prompt.shape[0] - 1, mesh.shape["seq"],
                                    model.config.linear_conv_kernel_dim - 1, round_len)
    return _grpo_grads(model, params, batch, cfg, mode, mesh, layout, attention)


@functools.partial(jax.jit, static_argnums=(0, 3, 4, 5, 6, 7))
def _grpo_grads(model, params, batch: GroupBatch, cfg: GRPOConfig, mode: str, mesh, layout: RoundLayout,
                attention: str):
    stored = layout.to_stored(batch.prompt[:-1].astype("int32"))
    sstate, boundaries = sharded_qwen36._capture(model, jax.lax.stop_gradient(params), stored, mesh, layout,
                                                 attention)
    param_shardings = named(param_specs(params, mesh), mesh)
    state_shardings = named(sstate.replace(state=prompt_state_specs(sstate.state)), mesh)

    def extend_hidden(params, sstate, tokens):
        return sharded_qwen36._extend_hidden(model, params, sstate, tokens, mesh)

    loss, grads, state_cot, sums = engine.replay_branches(
        model, params, sstate, batch, cfg, with_state_grad=mode == "exact",
        branch_grads=lambda model, *args: layerwise.branch_grads_autodiff(extend_hidden, *args),
        like_params=lambda tree: jax.lax.with_sharding_constraint(tree, param_shardings),
        like_state=lambda tree: jax.lax.with_sharding_constraint(tree, state_shardings))
    if mode == "exact":
        prompt_grads = prompt_backward(model, params, stored, mesh, layout, attention, sstate.state, boundaries,
                                       state_cot.state)
        grads = jax.tree.map(jnp.add, grads, prompt_grads)
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
    return loss, jax.lax.with_sharding_constraint(grads, param_shardings), finalize_metrics(sums, batch.rewards,
                                                                                            batch.mask)
