"""`grpo_grads` on a ("data", "seq") mesh: the engine's algorithm with the family's sequence-parallel capture,
replay and prompt backward (`model.sequence_parallel()`: `sharding/qwen36.py`, `sharding/glm52.py`).

    capture   sstate = capture(prompt[:-1]) on the mesh, in rounds    seq-sharded caches, replicated GDN state
    replay    for g in branches (lax.scan): parameter gradients (FSDP-sharded, float32) and, in exact mode, the
              state cotangent (sharded like the state). Qwen3.6: block by block (`layerwise.branch_grads`, each
              block in its own shard_map), the cotangent added in place one block slice at a time; GLM-5.x: autodiff
              of the sharded replay (no block protocol yet), a sharded state-sized cotangent per branch
    prompt    exact mode: rounds in reverse (Qwen3.6: and blocks in reverse, sharding/qwen36.prompt_backward; GLM-5.x:
              sharding/glm52.prompt_backward)

Gradients flow through `shard_map` by JAX's transposes of the collectives: the layers' `all_gather` becomes a
reduce-scatter (each device receives only its own shard of a layer's gradient), the log-sum-exp merge's `psum`
hands each shard the cotangent of its own partial, the ring's `ppermute` runs backwards, the GDN affine fold's
all-gather carries later segments' cotangents back to the segments that produced them, and GLM's all-gathered latent
rows send each gathered row's cotangent back to the shard that holds it.

The `data` axis holds parameter shards (FSDP) and otherwise repeats this group's work: independent groups are what
it runs side by side.
"""
from __future__ import annotations

import functools

import jax

from longstraw_jax.grpo import GroupBatch, GRPOConfig, finalize_metrics
from longstraw_jax.replay import replay_branches
from longstraw_jax.sharding.api import round_layout
from longstraw_jax.sharding.layout import RoundLayout
from longstraw_jax.sharding.rules import named, param_specs, prompt_state_specs


def grpo_grads(model, params, batch: GroupBatch, cfg: GRPOConfig, mode: str, mesh, round_len: int | None = None,
               attention: str = "ring"):
    """(loss, grads, metrics) as `engine.grpo_grads`, on `mesh`; grads are sharded like `rules.param_specs`.
    The batch must already be validated (engine.grpo_grads does it). The prompt is captured (and, in exact mode,
    backpropagated) in rounds of about `round_len` positions (None: one round)."""
    layout = round_layout(model, batch.prompt.shape[0] - 1, mesh.shape["seq"], round_len)
    return _grpo_grads(model, params, batch, cfg, mode, mesh, layout, attention)


@functools.partial(jax.jit, static_argnums=(0, 3, 4, 5, 6, 7))
def _grpo_grads(model, params, batch: GroupBatch, cfg: GRPOConfig, mode: str, mesh, layout: RoundLayout,
                attention: str):
    family = model.sequence_parallel()
    stored = layout.to_stored(batch.prompt[:-1].astype("int32"))
    specs = param_specs(params, mesh)
    sstate, capture_aux = family.capture(jax.lax.stop_gradient(params), stored, mesh, layout, attention)
    param_shardings = named(specs, mesh)
    state_shardings = named(sstate.replace(state=prompt_state_specs(sstate.state)), mesh)
    loss, grads, state_cot, sums = replay_branches(
        model, params, sstate, batch, cfg, with_state_grad=mode == "exact",
        branch_grads=family.branch_grads(mesh, layout, specs),
        like_params=lambda tree: jax.lax.with_sharding_constraint(tree, param_shardings),
        like_state=lambda tree: jax.lax.with_sharding_constraint(tree, state_shardings))
    if mode == "exact":
        grads = family.prompt_backward(params, stored, mesh, layout, attention, sstate, capture_aux, state_cot.state,
                                       grads)
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
    return loss, jax.lax.with_sharding_constraint(grads, param_shardings), finalize_metrics(sums, batch.rewards,
                                                                                            batch.mask)
