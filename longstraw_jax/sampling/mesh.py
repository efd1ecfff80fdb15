"""Sampling G branches on a ("data", "seq") mesh: the prompt is captured sequence-parallel (the engine's sharded
capture, so the update can reuse it) and decoding reads the seq-sharded cache in place.

    sstate, aux = capture(prompt[:-1]) on the mesh, in rounds          = what engine/mesh.py computes
    tail = init_tail(...)        replicated: room for R decoded positions P-1.. + the carried GDN state
    branches.sample_after_prompt: decode prompt[-1] once, then N branches at a time (vmap over their tails):
        while t < R and some branch has not stopped: sample, h, tails = decode(tokens) at P + t

One decode step runs the model's layer code on every shard through a reader
(`models/qwen36/mesh_forward.py:ReplayReader` with decoding=True, `models/glm52/mesh_forward.py:DecodeReader`):
attention is the log-sum-exp merge of this shard's prompt slots (merged over `seq`) with the tail's positions before the
token and the token itself; GLM's DSA top-k runs over prompt, tail and token, as on one device. Nothing of size P is
replicated: the prompt cache stays seq-sharded, read-only, and the tail holds R positions. For the same key the tokens
and log-probs are the one-device sampler's (`sampling.branches.sample_group`), up to float round-off.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
from flax import struct

from longstraw_jax.common.validation import check_left_pad
from longstraw_jax.engine.capture import round_layout
from longstraw_jax.sampling.branches import Rollout, SamplingConfig, check_sampling_inputs, sample_after_prompt
from longstraw_jax.sharding import sequence
from longstraw_jax.sharding.layout import RoundLayout, ShardedPromptState


@struct.dataclass
class ShardedCaptured:
    """The mesh sampler's capture of prompt[:-1], as `engine/mesh.py` computes it (same layout, same family
    capture): sstate (ShardedPromptState, length P-1, seq-sharded) and capture_aux (what the family's exact backward
    needs, e.g. Qwen3.6's GDN round boundaries; None for GLM-5.x)."""

    sstate: ShardedPromptState
    capture_aux: Any


def sample_group(model, params, prompt, group_size: int, sampling: SamplingConfig, key: jax.Array, mesh,
                 chunk_size: int | None = None, attention: str = "ring", keep_capture: bool = False, left_pad=None):
    """`sampling.branches.sample_group` on `mesh`: G branches after prompt (int [P], P >= 2), prompt[:-1] captured in
    rounds of about `chunk_size` positions (None: one round) with `attention` ("ring" / "allgather", Qwen3.6's choice).

    Host-side checks, then one jitted call (`sample_traced`). Returns the Rollout (replicated), or with keep_capture
    (Rollout, ShardedCaptured). params: ideally placed by `rules.param_specs` (FSDP). left_pad: as in
    `sampling.branches.sample_group` (the pads sit in the first shard(s))."""
    prompt, group_size = check_sampling_inputs(model, prompt, group_size, sampling)
    left_pad = check_left_pad(left_pad, prompt.shape[0] - 2)
    if attention not in sequence.ATTENTION_METHODS:
        raise ValueError(f"attention={attention!r}; allowed: {sequence.ATTENTION_METHODS}")
    model.mesh_adapter()  # a family without a sharded path says so before any work
    layout = round_layout(model, prompt.shape[0] - 1, mesh.shape[sequence.SEQ], chunk_size)
    return _sample_group(model, params, prompt, key, group_size, sampling, mesh, layout, attention, keep_capture,
                         left_pad)


def sample_traced(model, params, prompt, key, group_size: int, sampling: SamplingConfig, mesh, layout: RoundLayout,
                  attention: str = "ring", keep_capture: bool = False, left_pad=None):
    """The mesh sampler without host checks (jittable; `jax.vmap(..., spmd_axis_name="data")`-able over a leading
    group axis of prompt [N, P] and key [N]). layout: `engine.capture.round_layout(model, P - 1, seq, chunk_size)`.
    model, group_size, sampling, mesh, layout, attention and keep_capture are static; left_pad None or int32 []."""
    captured = capture_prompt(model, params, prompt, mesh, layout, attention, left_pad)
    rollout = sample_captured(model, params, captured.sstate, prompt, key, group_size, sampling, mesh, left_pad)
    return (rollout, captured) if keep_capture else rollout


def capture_prompt(model, params, prompt, mesh, layout: RoundLayout, attention: str = "ring",
                   left_pad=None) -> ShardedCaptured:
    """The engine's sharded capture of prompt[:-1] in `layout`'s rounds (prompt[:left_pad] pads; None: none)."""
    sstate, capture_aux = model.mesh_adapter().capture(params, layout.to_stored(prompt[:-1]), mesh, layout,
                                                            attention, left_pad)
    return ShardedCaptured(sstate, capture_aux)


def sample_captured(model, params, sstate: ShardedPromptState, prompt, key, group_size: int,
                    sampling: SamplingConfig, mesh, left_pad=None) -> Rollout:
    """G branches after sstate, the sharded capture of prompt[:-1] (its pads < left_pad hidden). Under `jax.vmap`
    over groups (sstate, prompt, key and left_pad batched) the groups' branches decode together."""
    family = model.mesh_adapter()
    decode = functools.partial(family.decode, params, sstate, mesh=mesh, left_pad=left_pad)
    return sample_after_prompt(model, params, decode, family.init_tail(params, sstate, sampling.response_len),
                               prompt, key, group_size, sampling)


_sample_group = jax.jit(sample_traced, static_argnums=(0, 4, 5, 6, 7, 8, 9))

__all__ = ["Rollout", "ShardedCaptured", "sample_group", "sample_traced"]
