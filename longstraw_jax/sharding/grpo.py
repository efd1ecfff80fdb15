"""`grpo_grads` on a ("data", "seq") mesh (ARCHITECTURE.md 5): the engine's algorithm with the sequence-parallel
capture and replay of `sharding/qwen36.py` and `sharding/glm52.py`.

    capture   sstate = capture(prompt[:-1]) on the mesh, in rounds    seq-sharded caches, replicated GDN state
    replay    for g in branches (lax.scan): parameter gradients (FSDP-sharded, float32) and, in exact mode, the
              state cotangent (sharded like the state). Qwen3.6: block by block (`layerwise.branch_grads`, each
              block in its own shard_map), the cotangent added in place one block slice at a time; GLM-5.x: autodiff
              of the sharded replay (no block protocol yet), a sharded state-sized cotangent per branch
    prompt    exact mode: rounds in reverse (Qwen3.6: and blocks in reverse, sharding/prompt_backward.py; GLM-5.x:
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
from jax.sharding import PartitionSpec as P

from longstraw_jax import engine, layerwise
from longstraw_jax.grpo import GroupBatch, GRPOConfig, finalize_metrics
from longstraw_jax.models.glm52 import Glm52
from longstraw_jax.models.qwen36 import Qwen36
from longstraw_jax.ops.norms import rms_norm_1p
from longstraw_jax.sharding import glm52 as sharded_glm52
from longstraw_jax.sharding import qwen36 as sharded_qwen36
from longstraw_jax.sharding.layout import RoundLayout
from longstraw_jax.sharding.prompt import round_layout
from longstraw_jax.sharding.prompt_backward import prompt_backward
from longstraw_jax.sharding.rules import block_slice_specs, named, param_specs, prompt_state_specs


def check_supported(model) -> None:
    if not isinstance(model, (Qwen36, Glm52)):
        raise NotImplementedError(f"sharded grpo_grads (mesh=...) supports Qwen3.6 and GLM-5.x, not "
                                  f"{type(model).__name__}: pass mesh=None")


def grpo_grads(model, params, batch: GroupBatch, cfg: GRPOConfig, mode: str, mesh, round_len: int | None = None,
               attention: str = "ring"):
    """(loss, grads, metrics) as `engine.grpo_grads`, on `mesh`; grads are sharded like `rules.param_specs`.
    The batch must already be validated (engine.grpo_grads does it). The prompt is captured (and, in exact mode,
    backpropagated) in rounds of about `round_len` positions (None: one round)."""
    check_supported(model)
    layout = round_layout(model, batch.prompt.shape[0] - 1, mesh.shape["seq"], round_len)
    return _grpo_grads(model, params, batch, cfg, mode, mesh, layout, attention)


@functools.partial(jax.jit, static_argnums=(0, 3, 4, 5, 6, 7))
def _grpo_grads(model, params, batch: GroupBatch, cfg: GRPOConfig, mode: str, mesh, layout: RoundLayout,
                attention: str):
    stored = layout.to_stored(batch.prompt[:-1].astype("int32"))
    frozen = jax.lax.stop_gradient(params)
    specs = param_specs(params, mesh)
    if isinstance(model, Glm52):
        # no block protocol (IndexShare selections cross layers): each branch by autodiff of the sharded replay
        sstate = sharded_glm52._capture(model, frozen, stored, mesh, layout)
        extend_hidden = sharded_glm52.extend_hidden_fn(model, mesh, specs)
        branch_grads = lambda model, *args: layerwise.branch_grads_autodiff(extend_hidden, *args)
        backward = lambda state_cot, grads: sharded_glm52.prompt_backward(model, params, stored, mesh, layout,
                                                                           sstate.state, state_cot, grads)
    else:
        sstate, boundaries = sharded_qwen36._capture(model, frozen, stored, mesh, layout, attention)
        on_mesh = _BlocksOnMesh(model, mesh, layout, specs["blocks"])
        branch_grads = lambda model, *args: layerwise.branch_grads(on_mesh, *args)
        backward = lambda state_cot, grads: prompt_backward(model, params, stored, mesh, layout, attention,
                                                            sstate.state, boundaries, state_cot, grads)
    param_shardings = named(specs, mesh)
    state_shardings = named(sstate.replace(state=prompt_state_specs(sstate.state)), mesh)
    loss, grads, state_cot, sums = engine.replay_branches(
        model, params, sstate, batch, cfg, with_state_grad=mode == "exact", branch_grads=branch_grads,
        like_params=lambda tree: jax.lax.with_sharding_constraint(tree, param_shardings),
        like_state=lambda tree: jax.lax.with_sharding_constraint(tree, state_shardings))
    if mode == "exact":
        grads = backward(state_cot.state, grads)
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
    return loss, jax.lax.with_sharding_constraint(grads, param_shardings), finalize_metrics(sums, batch.rewards,
                                                                                            batch.mask)


class _BlocksOnMesh:
    """The block protocol of `layerwise` for the sharded replay: `block` runs one block in its own `shard_map` over
    the seq-sharded state slice, so `layerwise.branch_grads` backpropagates block by block and adds each block's
    slice of the state cotangent into the accumulator in place (no full-size cotangent per branch)."""

    def __init__(self, model, mesh, rounds: RoundLayout, block_specs):
        self.cfg, self.mesh, self.rounds, self.block_specs = model.config, mesh, rounds, block_specs
        self.num_blocks = model.config.num_blocks
        self.slice_specs = block_slice_specs(block_specs)

    def embed(self, params, tokens):
        return params["embed"][tokens]

    def block_params(self, params):
        return params["blocks"]

    def with_block_params(self, params, blocks):
        return dict(params, blocks=blocks)

    def final_norm(self, params, h):
        return rms_norm_1p(h, params["final_norm"], self.cfg.rms_norm_eps)

    def block(self, bp, h, state_block, positions, cache_length):
        """One block over tokens h [T, D] (replicated); state_block: a ShardedPromptState sliced at one block."""
        state = jax.tree.map(lambda a: a[None], state_block.state)  # leading block axis of 1: indexed by b = 0

        def local(bp, h, state):
            return sharded_qwen36.extend_block(self.cfg, self.block_specs, self.rounds, bp, h, state, 0)

        h = jax.shard_map(local, mesh=self.mesh, in_specs=(self.slice_specs, P(), prompt_state_specs(state)),
                          out_specs=P(), check_vma=False)(bp, h, state)
        return h, None

