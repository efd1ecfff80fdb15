"""Reference-policy log-probs of sampled branches, for GRPO's KL term (`GroupBatch.ref_logprobs`), by the engine's
own capture and replay under the reference parameters: no gradient, no autograd, nothing of size P kept.

    ref = reference_logprobs(model, ref_params, prompts, responses, chunk_size, mesh=None, left_pad=None)
    prompts int [B, P], responses int [B, G, R] -> float32 [B, G, R]

Per group (one after another: one reference state lives at a time, next to the policy's kept captures):

    state = capture(prompt[:-1]) under ref_params        the engine's capture (one device: `capture_chunks` in chunks
                                                         of chunk_size; mesh: the family's sharded capture in rounds)
    for each branch g (lax.map, one at a time):          hidden = extend_hidden([prompt[-1]] + responses[g, :-1])
        ref[g] = log_softmax(hidden @ head^T)[responses[g]]   `ops.logprobs.token_logprobs`, logprob_chunk tokens

The captured state depends on the parameters, so the policy's capture cannot be reused: the reference needs its own.
Logits processing: log_softmax of the raw logits, temperature 1, no top-p: the same as the policy log-probs the GRPO
loss compares them with (`replay.replay_branches` -> `token_logprobs`) and as `Rollout.logprobs`, whatever
temperature / top-p the branches were sampled with. Values at padded positions (mask 0) are whatever the pad tokens
score; the loss never reads them.

On a mesh the B groups are split over `data` (`sharding.groups.over_data`, B a multiple of its size): each data slice
captures its groups' prompts sequence-parallel and replays its branches with the family's `extend_hidden`.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from longstraw_jax.common.validation import check_left_pad, check_size, check_tokens
from longstraw_jax.engine.capture import capture_chunks, chunk_layout, round_layout
from longstraw_jax.ops.logprobs import token_logprobs
from longstraw_jax.sharding.groups import check_groups, over_data
from longstraw_jax.sharding.layout import RoundLayout


def reference_logprobs(model, ref_params, prompts, responses, chunk_size: int, mesh=None, left_pad=None,
                       logprob_chunk: int = 1024) -> jax.Array:
    """log pi_ref(responses[b, g, t] | prompts[b], responses[b, g, :t]) as float32 [B, G, R].

    ref_params: the reference parameters (a plain tree, or one with LoRA nodes: the model runs on whatever it is
    given; on a mesh placed by `rules.param_specs`). prompts int [B, P] (P >= 2), responses int [B, G, R];
    left_pad None or int [B] in [0, P-2] (group b's prompt[:left_pad[b]] are pads, as in `sample_groups`).
    chunk_size: capture chunk (one device) or round length (mesh), as the engine's. logprob_chunk: tokens per
    [chunk, vocab] logits block. Host checks (ids, shapes, sizes, left_pad, B a multiple of the data size), then
    one jitted call."""
    prompts, responses = np.asarray(prompts), np.asarray(responses)
    if prompts.ndim != 2 or prompts.shape[1] < 2:
        raise ValueError(f"prompts must be [B, P] with P >= 2, got shape {prompts.shape}")
    if responses.ndim != 3 or responses.shape[0] != prompts.shape[0] or min(responses.shape) < 1:
        raise ValueError(f"responses must be [B, G, R] with B = {prompts.shape[0]} (one group per prompt) and G, "
                         f"R >= 1, got shape {responses.shape}")
    vocab = model.config.vocab_size
    prompts = check_tokens(prompts.reshape(-1), vocab, name="prompts").reshape(prompts.shape)
    responses = check_tokens(responses.reshape(-1), vocab, name="responses").reshape(responses.shape)
    chunk_size = check_size(chunk_size, "chunk_size")
    logprob_chunk = check_size(logprob_chunk, "logprob_chunk")
    chunk_layout(prompts.shape[1] - 1, chunk_size)
    left_pad = check_left_pad(left_pad, prompts.shape[1] - 2, "left_pad", prompts.shape[0])
    if mesh is None:
        return _one_device(model, ref_params, prompts, responses, chunk_size, min(logprob_chunk, responses.shape[2]),
                           left_pad)
    model.mesh_adapter()  # a family without a sharded path says so before any work
    check_groups(prompts.shape[0], mesh)
    layout = round_layout(model, prompts.shape[1] - 1, mesh.shape["seq"], chunk_size)
    return jitted_on_mesh(model, ref_params, prompts, responses, mesh, layout, min(logprob_chunk, responses.shape[2]),
                    left_pad)


def branch_inputs(prompt, responses) -> jax.Array:
    """The replay's inputs: [prompt[-1]] + responses[g, :-1] per branch, int32 [G, R] (the capture covers
    prompt[:-1])."""
    responses = responses.astype(jnp.int32)
    first = jnp.full((responses.shape[0], 1), prompt[-1], jnp.int32)
    return jnp.concatenate([first, responses[:, :-1]], axis=1)


def group_logprobs(model, params, prompt, responses, extend_hidden, logprob_chunk: int) -> jax.Array:
    """One group's branches one at a time after a captured prompt: extend_hidden(inputs [R]) -> final-normed hidden
    [R, D]; -> float32 [G, R] (temperature 1: `token_logprobs`)."""
    head = model.lm_head(params)

    def branch(x):
        inputs, targets = x
        return token_logprobs(extend_hidden(inputs), head, targets, logprob_chunk)[0]

    return jax.lax.map(branch, (branch_inputs(prompt, responses), responses.astype(jnp.int32)))


@functools.partial(jax.jit, static_argnums=(0, 4, 5))
def _one_device(model, params, prompts, responses, chunk_size: int, logprob_chunk: int, left_pad=None):
    def one(x):
        prompt, group, pad = x
        state = capture_chunks(model, params, prompt[:-1], chunk_size, model.lm_head(params).dtype, left_pad=pad)
        extend = lambda tokens: model._extend_hidden(params, state, tokens, left_pad=pad)
        return group_logprobs(model, params, prompt, group, extend, logprob_chunk)

    return jax.lax.map(one, (prompts, responses, left_pad))


@functools.partial(jax.jit, static_argnums=(0, 4, 5, 6))
def jitted_on_mesh(model, params, prompts, responses, mesh, layout: RoundLayout, logprob_chunk: int, left_pad=None):
    """The mesh path as one jitted program (model, mesh, layout, logprob_chunk static), without host checks: what
    the capacity planner lowers. layout: `engine.capture.round_layout(model, P - 1, seq, chunk_size)`."""
    family = model.mesh_adapter()

    def slice_groups(params, local):
        def one(x):
            prompt, group, pad = x
            sstate, _ = family.capture(params, layout.to_stored(prompt[:-1]), mesh, layout, "ring", pad)
            extend = lambda tokens: family.extend_hidden(params, sstate, tokens, mesh, pad)
            return group_logprobs(model, params, prompt, group, extend, logprob_chunk)

        return jax.lax.map(one, local)

    return over_data(mesh, slice_groups, params, (prompts, responses, left_pad), summed=False)


__all__ = ["branch_inputs", "group_logprobs", "jitted_on_mesh", "reference_logprobs"]
