"""The LongStraw engine: capture the prompt once, replay each branch, and (exact mode) backpropagate into the prompt.

    capture   state = capture(prompt[:-1])                        no autograd; chunk by chunk
    replay    for g in branches (lax.scan):                        one branch's graph live at a time
                  loss_g, dparams_g = branch loss and its block-by-block backward (engine/layerwise.py)
                  exact mode: add the branch's state cotangent into one float32 buffer, in place, block by block
    prompt    for chunk in reversed(chunks):                      exact mode only
                  recompute the chunk from its boundary state, block by block under vjp with the accumulated
                  state cotangent; add its parameter gradient and its cache reads' cotangents (in place); its
                  carried input's cotangent goes to the chunk before

The prompt is shared, so the branches' cotangents on the state add linearly; one reverse pass over the prompt
turns their sum into the prompt's contribution to the gradient. The result is the gradient of the full-graph loss
(`naive_grpo_grads`). `mode="detached"` stops after the replay: the paper's behaviour, prompt state constant.

Replay input convention (`engine/replay.py`): capture prompt[:-1], replay [prompt[-1]] + response[:-1] to score
response, so every scored logit comes from the replay and the capture never touches the LM head.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from longstraw_jax.adapters.trainable import merge
from longstraw_jax.common import progress
from longstraw_jax.common.validation import check_size
from longstraw_jax.engine import mesh as mesh_engine
from longstraw_jax.engine.capture import capture_chunks, chunk_layout
from longstraw_jax.engine.replay import replay_branches, scan_groups, zeros_f32
from longstraw_jax.grpo import GroupBatch, GRPOConfig, finalize_metrics, scored, validate_batch

MODES = ("exact", "detached")


def grpo_grads(model, params, batch: GroupBatch, cfg: GRPOConfig = GRPOConfig(), mode: str = "exact",
               chunk_size: int = 2048, mesh=None, captured=None, frozen=None):
    """(loss, grads, metrics) for one group, or for B groups side by side (a batch with a group axis: prompt [B, P],
    responses [B, G, R], ...; advantages per group, the loss aggregated over the whole batch, `grpo.py`).
    `model`, `cfg`, `mode`, `chunk_size`, `mesh` are static.

    mesh: a ("data", "seq") `jax.sharding.Mesh` (sharding.make_mesh) runs the sequence-parallel engine of
    `engine/mesh.py` (Qwen3.6 and GLM-5.x; same loss and gradients, grads FSDP-sharded; the prompt is captured
    and backpropagated in rounds of about chunk_size positions; B groups are split over `data`, B a multiple of its
    size).

    captured: the sampler's capture of prompt[:-1] (`sampling.branches.Captured` on one device, with boundaries in exact
    mode; `sampling.mesh.ShardedCaptured` on a mesh), stacked over groups like the batch: the update then does not
    capture again (one capture per step). It must come from the same params, prompt and chunk_size (chunk_size on a
    mesh).

    frozen: parameters that are not trained (`trainable.split`: params and frozen are two trees of the same
    structure with holes, None, where a leaf belongs to the other; the model runs on their merge). Gradients are
    taken with respect to params only: no cotangent, no buffer for a frozen leaf (LoRA: the base matrices).

    Validates the batch on the host when its arrays are concrete (under an outer `jit` only shapes are checked).
    grads has the structure and dtype of params.
    """
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}; allowed: {', '.join(map(repr, MODES))}")
    if mesh is not None:
        model.mesh_adapter()  # a family without a sharded path says so before any work
    validate_batch(batch, model.config.vocab_size, cfg)
    return grpo_grads_unvalidated(model, params, batch, cfg, mode, check_size(chunk_size, "chunk_size"), mesh,
                                  captured, frozen)


def grpo_grads_unvalidated(model, params, batch: GroupBatch, cfg: GRPOConfig, mode: str, chunk_size: int, mesh=None,
                           captured=None, frozen=None):
    """`grpo_grads` for a caller that has checked `mode` and run `validate_batch` itself (`train.train_step`, so that
    a training step validates its batch once)."""
    chunk_layout(batch.prompt.shape[-1] - 1, chunk_size)
    if mesh is not None:
        return mesh_engine.grpo_grads(model, params, batch, cfg, mode, mesh, chunk_size=chunk_size, captured=captured,
                                  frozen=frozen)
    if captured is not None:
        check_captured(captured, batch, mode)
    return jitted_grpo_grads(model, params, batch, cfg, mode, chunk_size, captured, frozen)


def check_captured(captured, batch: GroupBatch, mode: str) -> None:
    """The one-device sampler's capture must be of prompt[:-1] (state length P - 1) and, in exact mode, carry the
    chunk boundaries the prompt backward starts from."""
    length = batch.prompt.shape[-1] - 1
    if captured.state.length != length:
        raise ValueError(f"captured state has length {captured.state.length}; the batch's prompt[:-1] has {length} "
                         "positions (capture the same prompt)")
    if mode == "exact" and captured.boundaries is None:
        raise ValueError("mode='exact' needs the capture's chunk boundaries: sample with keep_capture=True in exact "
                         "mode (captured.boundaries is None)")


@functools.partial(jax.jit, static_argnums=(0, 3, 4, 5))
def jitted_grpo_grads(model, params, batch: GroupBatch, cfg: GRPOConfig, mode: str, chunk_size: int, captured=None,
                      frozen=None):
    """The one-device `grpo_grads` as one jitted program (model, cfg, mode and chunk_size static), without the host
    checks: what ahead-of-time tools lower (tools/bench_step.py, tools/bench_glm_backward.py)."""
    trainable, params = params, merge(params, frozen)  # the accumulator is shaped like the trainable part
    grouped = batch.as_groups()
    if captured is not None and batch.groups_per_step is None:
        captured = jax.tree.map(lambda x: x[None], captured)
    grouped, weights, advantages = scored(grouped, cfg)
    groups = (grouped, weights, advantages, captured)

    def one_group(grads, xs):
        group, weights, advantages, captured = xs
        return _group_grads(model, params, group, cfg, mode, chunk_size, weights, advantages, captured, grads)

    loss, grads, sums = scan_groups(one_group, zeros_f32(trainable), groups)
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, trainable)
    return loss, grads, finalize_metrics(sums, grouped.rewards, grouped.mask)


def _group_grads(model, params, batch: GroupBatch, cfg: GRPOConfig, mode: str, chunk_size: int, weights, advantages,
                 captured, grads):
    """One group: capture prompt[:-1] (unless `captured`), replay its branches, and in exact mode backpropagate into
    the prompt, adding into the float32 `grads` (shaped like the trainable parameters: `trainable.vjp`). -> (loss,
    grads, metric sums)."""
    prompt, left_pad = batch.prompt.astype(jnp.int32), batch.left_pad
    if captured is not None:
        state, boundaries = captured.state, captured.boundaries
    else:
        exact = mode == "exact"
        state = capture_chunks(model, jax.lax.stop_gradient(params), prompt[:-1], chunk_size,
                               model.lm_head(params).dtype, keep_boundaries=exact, left_pad=left_pad)
        state, boundaries = state if exact else (state, None)
    loss, grads, state_cot, sums = replay_branches(model, params, state, batch, cfg, with_state_grad=mode == "exact",
                                                   weights=weights, advantages=advantages, grads=grads)
    if mode == "exact":
        grads = prompt_backward(model, params, prompt[:-1], chunk_size, state, boundaries, state_cot, grads, left_pad)
    return loss, grads, sums


def prompt_backward(model, params, tokens: jax.Array, chunk_size: int, state, boundaries, state_cot, grads,
                    left_pad=None):
    """grads + the parameter gradient of the prompt's computation, given the cotangent of the captured state
    (grads: the replay's float32 gradient, added to in place).

    Walks the chunks in reverse. Chunk i's entries (its keys/values, and the carried GDN state after it) are
    recomputed from its boundary (the carried state before it) and the final KV cache, read-only: positions
    < start are exactly what the chunk read during capture, later positions are never visited. The vjp maps the
    entries' cotangent (the chunk's slice of the running KV cotangent, and the carried cotangent) to a parameter
    gradient and to cotangents of what the chunk read: cache reads are added into the running KV cotangent (they
    belong to earlier chunks), the carried input's cotangent becomes chunk i - 1's carried cotangent. Both happen
    block by block inside `model.chunk_grads` (`layerwise.chunk_grads`), in place in `state_cot`.
    left_pad: the prompt's pads (int32 [] or None); no cotangent reaches them, so they add exactly nothing.
    """
    full_boundaries, last_boundary = boundaries
    num_full, remainder = chunk_layout(tokens.shape[0], chunk_size)

    def chunk_vjp(carry, chunk_tokens, start, boundary):
        grads, cot = carry
        return model.chunk_grads(params, model.with_carried(state, boundary), chunk_tokens, start, grads, cot,
                                 left_pad=left_pad)

    carry, total = (grads, state_cot), num_full + (remainder > 0)
    if remainder:
        carry = chunk_vjp(carry, tokens[num_full * chunk_size :], num_full * chunk_size, last_boundary)
        progress.tick("prompt backward", jnp.int32(1), total, remainder, after=carry)
    if num_full:
        chunks = tokens[: num_full * chunk_size].reshape(num_full, chunk_size)

        def step(carry, xs):
            index, chunk_tokens, boundary = xs
            carry = chunk_vjp(carry, chunk_tokens, index * chunk_size, boundary)
            progress.tick("prompt backward", total - index, total, chunk_size, after=carry)
            return carry, None

        carry, _ = jax.lax.scan(step, carry, (jnp.arange(num_full, dtype=jnp.int32), chunks, full_boundaries),
                                reverse=True)
    return carry[0]
