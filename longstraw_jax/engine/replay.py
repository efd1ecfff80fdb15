"""The replay: G response branches after one shared prompt state, one branch's forward and backward at a time
(`lax.scan`). Used by the one-device engine (`engine/local.py`) and the sharded one (`engine/mesh.py`).

Replay input convention: the capture covers prompt[:-1]; a branch replays [prompt[-1]] + response[:-1] to score
response, so every scored logit comes from the replay and the capture never touches the LM head.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from longstraw_jax.grpo import GroupBatch, GRPOConfig, branch_loss, group_advantages, token_weights
from longstraw_jax.ops.dtypes import accum_dtype
from longstraw_jax.ops.logprobs import token_logprobs


def zeros_f32(tree):
    """Zeros like tree, floating leaves at least float32 (the gradient accumulators)."""
    return jax.tree.map(lambda x: jnp.zeros(x.shape, accum_dtype(x.dtype)), tree)


def _add(acc, tree):
    return jax.tree.map(lambda a, x: a + x.astype(a.dtype), acc, tree)


def replay_branches(model, params, state, batch: GroupBatch, cfg: GRPOConfig, with_state_grad: bool,
                    branch_grads=None, like_params=lambda tree: tree, like_state=lambda tree: tree,
                    weights=None, advantages=None, grads=None):
    """Scan over the G branches; each step runs one branch's forward and backward to completion, so only one
    branch's graph is ever live (the replay is recomputed per branch; nothing is stored across steps). With
    cfg.replay_batch = k > 1 each step runs k branches at once (G / k steps): tokens [k, R] go to branch_grads, whose
    blocks run per branch (vmapped) on the shared params and state, so their cotangents arrive summed over the k.

    branch_grads(params, state, tokens, head, grads, acc) -> (loss, aux, grads, acc) does one branch and adds its
    parameter gradient into `grads` (default `model.branch_grads`; the sharded engine passes the family's own).
    like_params / like_state place the float32 accumulators (a sharding constraint on a mesh).
    batch: one group. weights [G, R] / advantages [G]: this group's rows of the whole batch's `token_weights` /
    `batch_advantages` (default: those of this group alone). grads: the float32 accumulator to add into (default
    zeros; an engine running several groups passes its running sum).

    batch.left_pad (None or int32 []): the state's prompt is left-padded; every branch hides its pads.

    Returns (loss, param grads (float32), state cotangent summed over branches (float32, the leaves of
    `model.differentiable_state(state)`; None unless with_state_grad), metric sums).
    """
    branch_grads = functools.partial(model.branch_grads if branch_grads is None else branch_grads,
                                     left_pad=batch.left_pad)
    responses = batch.responses.astype(jnp.int32)
    group_size, length = responses.shape
    inputs = jnp.concatenate([jnp.full((group_size, 1), batch.prompt[-1], jnp.int32), responses[:, :-1]], axis=1)
    xs = dict(inputs=inputs, targets=responses, mask=batch.mask.astype(jnp.float32),
              weights=token_weights(batch.mask, cfg) if weights is None else weights,
              advantage=group_advantages(batch.rewards, cfg) if advantages is None else advantages,
              old=batch.old_logprobs, ref=batch.ref_logprobs)
    chunk = min(cfg.logprob_chunk, length)
    together = cfg.replay_batch
    if group_size % together:
        raise ValueError(f"replay_batch={together} must divide the group size G={group_size}")

    def one_head(params, hidden, x):
        logp, entropy = token_logprobs(hidden, model.lm_head(params), x["targets"], chunk)
        return branch_loss(logp, x["old"], x["ref"], x["advantage"], x["weights"], x["mask"], cfg,
                           entropy=jax.lax.stop_gradient(entropy))

    if together == 1:
        head = one_head
    else:  # k branches a step: hidden [k, R, D], every x leaf [k, ...]; the branches' losses and sums added
        xs = jax.tree.map(lambda a: a.reshape((group_size // together, together) + a.shape[1:]), xs)

        def head(params, hidden, x):
            losses, sums = jax.vmap(lambda h, x: one_head(params, h, x))(hidden, x)
            return jnp.sum(losses), jax.tree.map(lambda s: jnp.sum(s, axis=0), sums)

    def step(carry, x):
        loss, grads, state_cot, sums = carry
        branch, branch_sums, grads, state_cot = branch_grads(
            params, state, x["inputs"], lambda p, h: head(p, h, x), grads, state_cot)
        state_cot = None if state_cot is None else like_state(state_cot)
        return (loss + branch, like_params(grads), state_cot, _add(sums, branch_sums)), None

    head_matrix = model.lm_head(params)  # [V, D]
    hidden = jax.ShapeDtypeStruct((together,) * (together > 1) + (length, head_matrix.shape[1]), head_matrix.dtype)
    loss0, sums0 = jax.eval_shape(lambda h: head(params, h, jax.tree.map(lambda a: a[0], xs)), hidden)
    carry = (zeros_f32(loss0), like_params(zeros_f32(params) if grads is None else grads),
             like_state(zeros_f32(model.differentiable_state(state))) if with_state_grad else None, zeros_f32(sums0))
    (loss, grads, state_cot, sums), _ = jax.lax.scan(step, carry, xs)
    return loss, grads, state_cot, sums


def scan_groups(one_group, grads, groups):
    """Groups one after another (`lax.scan` over the leading group axis of `groups`): one_group(grads, group) ->
    (loss, grads, metric sums) adds one group's gradient into the float32 accumulator. Returns (the sum of the
    groups' losses, grads, the metric sums summed over groups). Only one group's work is live at a time."""
    def step(grads, group):
        loss, grads, sums = one_group(grads, group)
        return grads, (loss, sums)

    grads, (losses, sums) = jax.lax.scan(step, grads, groups)
    return jnp.sum(losses, axis=0), grads, jax.tree.map(lambda s: jnp.sum(s, axis=0), sums)
