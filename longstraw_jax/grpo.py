"""GRPO objective: advantages, per-token clipped surrogate + k3 KL, loss aggregation. Pure and model-agnostic.

One group = one shared prompt [P] and G response branches [G, R] (right-padded; `mask` marks real tokens). A batch
holds one group, or B groups side by side (a leading group axis: prompt [B, P], responses [B, G, R], ...).
Advantages are per group; the loss aggregation is over the whole batch, as in verl (token-mean over all tokens of
all groups; seq-mean-token-mean over all B * G sequences; seq-mean-token-sum-norm divides by B * G * R).
Every aggregation is written as a per-token weight, `loss = sum(token_weights(mask) * per_token_loss)`, so the
loss is a sum of independent branch losses: an engine can score one branch at a time (a `lax.scan` over
branches, and over groups) and add them up. `grpo_loss` is the same sum over a whole batch at once (the oracle's
path).

Per-branch metric sums (`branch_loss`) are additive too; `finalize_metrics` turns their total into the metrics,
so no metric ever needs the `[G, R, vocab]` logits.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from longstraw_jax.common.validation import check_left_pad, is_concrete, is_int, is_real

LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
FLOAT32_MAX = float(np.finfo(np.float32).max)  # the largest reward magnitude a GroupBatch holds
ADV_NORMS = ("std", "none")
RATIOS = ("token", "sequence")


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    """Hyper-parameters of the GRPO objective (frozen, hashable: a valid `jax.jit` static argument).

    clip_eps_low/high: ratio clipped to [1 - low, 1 + high] (DAPO "clip-higher" defaults).
    kl_coef: weight of the k3 KL to `ref_logprobs` (0 disables it).
    loss_agg: token-mean (all tokens of the group equal), seq-mean-token-mean (each branch equal, tokens averaged
      within it), seq-mean-token-sum-norm (Dr. GRPO: token sums over a constant normaliser G * R).
    adv_norm: "std" -> (r - mean) / (std + eps) with the population std; "none" -> r - mean.
    ratio: "token" (PPO / GRPO: one importance ratio per token) or "sequence" (GSPO: one ratio per branch, the
      geometric mean of its tokens' ratios, clipped as a whole; with loss_agg="seq-mean-token-mean" the loss is
      GSPO's objective exactly; GSPO's clip ranges are much narrower than the token ratio's, e.g. 3e-4 / 4e-4).
    logprob_chunk: tokens per chunk when computing log-probs, so [chunk, vocab] is the largest logits array.
    replay_batch: branches replayed together (a divisor of G; the engines' replay, `engine/replay.py`): k branches'
      forward and backward at once cost k branches' activations instead of one, but run k times fewer, larger
      operations (small models are bound by per-operation overhead). The same loss and gradients up to round-off.
    """

    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.28
    kl_coef: float = 0.0
    loss_agg: str = "token-mean"
    adv_norm: str = "std"
    ratio: str = "token"
    eps: float = 1e-6
    logprob_chunk: int = 1024
    replay_batch: int = 1

    def __post_init__(self):
        errors = []

        def number(name):
            value = getattr(self, name)
            ok = is_real(value) and math.isfinite(value)
            if not ok:
                errors.append(f"{name}={value!r} must be a finite number")
            return ok

        if number("clip_eps_low") and not 0 <= self.clip_eps_low < 1:
            errors.append(f"clip_eps_low={self.clip_eps_low} must be in [0, 1) (the lower clip bound is 1 - low)")
        if number("clip_eps_high") and self.clip_eps_high < 0:
            errors.append(f"clip_eps_high={self.clip_eps_high} must be >= 0")
        if number("kl_coef") and self.kl_coef < 0:
            errors.append(f"kl_coef={self.kl_coef} must be >= 0")
        if number("eps") and self.eps <= 0:
            errors.append(f"eps={self.eps} must be > 0")
        if self.loss_agg not in LOSS_AGGS:
            errors.append(f"loss_agg={self.loss_agg!r}; allowed: {', '.join(map(repr, LOSS_AGGS))}")
        if self.adv_norm not in ADV_NORMS:
            errors.append(f"adv_norm={self.adv_norm!r}; allowed: {', '.join(map(repr, ADV_NORMS))}")
        if self.ratio not in RATIOS:
            errors.append(f"ratio={self.ratio!r}; allowed: {', '.join(map(repr, RATIOS))}")
        if not is_int(self.replay_batch) or self.replay_batch < 1:
            errors.append(f"replay_batch={self.replay_batch!r} must be a positive int")
        else:
            object.__setattr__(self, "replay_batch", int(self.replay_batch))
        chunk = self.logprob_chunk
        if not is_int(chunk) or chunk < 1:
            errors.append(f"logprob_chunk={chunk!r} must be a positive int")
        else:
            object.__setattr__(self, "logprob_chunk", int(chunk))  # one hash (jit cache entry) per value
        if errors:
            raise ValueError("invalid GRPOConfig: " + "; ".join(errors))


@struct.dataclass
class GroupBatch:
    """One GRPO group: a shared prompt and G right-padded response branches; or B groups side by side, every field
    with a leading group axis [B, ...] (prompt [B, P], responses [B, G, R], rewards [B, G], ...).

    prompt:       int32 [P], P >= 2 (engines capture prompt[:-1] and replay prompt[-1] + response[:-1]).
    responses:    int32 [G, R]; token t of branch g is scored by the logits after prompt + responses[g, :t].
    mask:         float32 [G, R], 1 for real response tokens, 0 for padding; every branch has >= 1 real token.
    rewards:      float32 [G], finite and within float32 range (|r| <= FLOAT32_MAX).
    old_logprobs: None (on-policy: ratio 1) or float32 [G, R], log-probs (<= 0) under the sampling policy.
    ref_logprobs: None or float32 [G, R], log-probs (<= 0) under the reference policy (for the k3 KL; required
                  when kl_coef > 0).
    left_pad:     None (no padding) or int32 [] ([B]: one per group), in [0, P-2]: the prompt is left-padded,
                  prompt[:left_pad] are pads and prompt[left_pad:] the real prompt (at least 2 tokens). Pads change
                  nothing: loss, metrics and gradients equal the unpadded prompt's (docs/architecture.md 4.6); so
                  B groups of different lengths stack as [B, L] (`sampling.padding.pad_left`).
    valid:        None (every branch counts) or float32 [G] ([B, G]) of 0 / 1: a branch with valid 0 is left out
                  (an agent branch whose environment failed, docs/architecture.md 11): weight 0 and no part in its
                  group's advantage statistics; its mask may be all zero. A group with fewer than 2 valid branches
                  has advantage 0 everywhere.
    Values at positions with mask = 0 are never scored, whatever they are (NaN included). Tokens there are still
    inputs of the replay: an agent branch's observation tokens (mask 0) are read by the policy tokens after them.
    """

    prompt: jax.Array
    responses: jax.Array
    mask: jax.Array
    rewards: jax.Array
    old_logprobs: jax.Array | None = None
    ref_logprobs: jax.Array | None = None
    left_pad: jax.Array | None = None
    valid: jax.Array | None = None

    @property
    def groups_per_step(self) -> int | None:
        """B for a batch of groups (leading group axis), None for one group."""
        return self.prompt.shape[0] if np.ndim(self.prompt) == 2 else None

    @property
    def group_size(self) -> int:
        return self.responses.shape[-2]

    @property
    def response_length(self) -> int:
        return self.responses.shape[-1]

    def as_groups(self) -> "GroupBatch":
        """The batch with a leading group axis (one group -> B = 1; a batch of groups unchanged)."""
        if self.groups_per_step is not None:
            return self
        return jax.tree.map(lambda x: x[None], self)

    def group(self, b: int) -> "GroupBatch":
        """Group b of a batch of groups, as a one-group batch."""
        return jax.tree.map(lambda x: x[b], self.as_groups())


def validate_batch(batch: GroupBatch, vocab_size: int, cfg: GRPOConfig | None = None) -> GroupBatch:
    """Host-side checks with errors that name the field and the bound; returns the batch unchanged.

    Shapes, ranks and dtypes are always checked (`_check_shapes`); values only for concrete arrays (`_check_values`,
    skipped for tracers, so call this before `jit`). JAX clamps out-of-range gather indices silently, so bad token
    ids must be caught here. With `cfg`, also what the objective needs: ref_logprobs when kl_coef > 0, and
    (adv_norm="none") rewards whose advantages r - mean fit in float32.
    """
    _check_shapes(batch, cfg)
    _check_values(batch, vocab_size, cfg)
    return batch


def _shape(batch: GroupBatch, name: str) -> tuple:
    return tuple(np.shape(getattr(batch, name)))


def _dtype(batch: GroupBatch, name: str) -> np.dtype:
    value = getattr(batch, name)
    return np.dtype(value.dtype if hasattr(value, "dtype") else np.asarray(value).dtype)


def _host(batch: GroupBatch, name: str) -> np.ndarray | None:
    """The field's concrete values as numpy, or None under tracing (or when the field is None)."""
    value = getattr(batch, name)
    return np.asarray(value) if value is not None and is_concrete(value) else None


def _check_shapes(batch: GroupBatch, cfg: GRPOConfig | None) -> None:
    """What tracing can see: ranks (one group: prompt [P], responses / mask [G, R], rewards [G]; B groups: a leading
    [B, ...] on each, the same B), shapes that agree with responses (mask, rewards, old / ref log-probs), B >= 1,
    P >= 2, G >= 1, R >= 1; dtypes (integer token ids, real rewards, float log-probs); ref_logprobs present when
    cfg.kl_coef > 0. ValueError / TypeError naming the field, its shape or dtype and the bound."""
    shape, dtype = functools.partial(_shape, batch), functools.partial(_dtype, batch)
    grouped = len(shape("prompt")) == 2
    lead = shape("prompt")[:1] if grouped else ()
    for name, rank, what in (("prompt", 1, "[P]"), ("responses", 2, "[G, R]"), ("mask", 2, "[G, R]"),
                             ("rewards", 1, "[G]")):
        if len(shape(name)) != rank + len(lead):
            raise ValueError(f"GroupBatch.{name} must have rank {rank} {what} (one group) or {rank + 1} "
                             f"{'[B, ' + what[1:]} (B groups, like prompt {shape('prompt')}), got shape {shape(name)}")
    if shape("responses")[: len(lead)] != lead:
        raise ValueError(f"GroupBatch.responses has {shape('responses')[0]} groups but prompt has {lead[0]} "
                         f"(shapes {shape('responses')} and {shape('prompt')})")
    for name in ("prompt", "responses"):
        if not np.issubdtype(dtype(name), np.integer):
            raise TypeError(f"GroupBatch.{name} must be an integer array (int32), got dtype {dtype(name)}")
    if grouped and lead[0] < 1:
        raise ValueError("GroupBatch has B=0 groups; need B >= 1")
    p, (g, r) = shape("prompt")[-1], shape("responses")[-2:]
    if p < 2:
        raise ValueError(f"GroupBatch.prompt has P={p} tokens; need P >= 2 (prompt[:-1] is captured, "
                         "prompt[-1] starts the replay)")
    if g < 1 or r < 1:
        raise ValueError(f"GroupBatch.responses has shape {shape('responses')}; need G >= 1 branches and R >= 1 "
                         "tokens")
    if shape("mask") != lead + (g, r):
        raise ValueError(f"GroupBatch.mask has shape {shape('mask')} but responses has shape {lead + (g, r)}")
    if shape("rewards") != lead + (g,):
        raise ValueError(f"GroupBatch.rewards has shape {shape('rewards')}; expected {'[B, G]' if grouped else '[G]'} "
                         f"= {lead + (g,)}")
    if cfg is not None and cfg.kl_coef > 0 and batch.ref_logprobs is None:
        raise ValueError(f"GRPOConfig.kl_coef={cfg.kl_coef} needs GroupBatch.ref_logprobs (reference-policy "
                         "log-probs), but it is None: pass ref_logprobs or set kl_coef=0")
    for name in ("old_logprobs", "ref_logprobs"):
        if getattr(batch, name) is not None and shape(name) != lead + (g, r):
            raise ValueError(f"GroupBatch.{name} has shape {shape(name)}; expected {lead + (g, r)} like responses")
    if batch.valid is not None and shape("valid") != lead + (g,):
        raise ValueError(f"GroupBatch.valid has shape {shape('valid')}; expected {lead + (g,)} like rewards")
    if not (np.issubdtype(dtype("rewards"), np.floating) or np.issubdtype(dtype("rewards"), np.integer)):
        raise TypeError(f"GroupBatch.rewards must be a float array (float32), got dtype {dtype('rewards')}")
    for name in ("old_logprobs", "ref_logprobs"):
        if getattr(batch, name) is not None and not np.issubdtype(dtype(name), np.floating):
            raise TypeError(f"GroupBatch.{name} must be a float array (float32), got dtype {dtype(name)}")
    # shape, dtype and (concrete) range: pads in [0, P-2], so prompt[:-1] keeps at least one real position
    check_left_pad(batch.left_pad, p - 2, "GroupBatch.left_pad", lead[0] if grouped else None)


def _check_values(batch: GroupBatch, vocab_size: int, cfg: GRPOConfig | None) -> None:
    """What only concrete arrays show (each check skipped for a traced field), on a batch `_check_shapes` passed:
    token ids in [0, vocab_size); mask values 0 or 1 with at least one 1 per branch; rewards finite and within
    float32 range (and, with cfg.adv_norm "none", r - mean too); old / ref log-probs finite and <= 0 where
    mask = 1. ValueError naming the field, the first offending index and value, and the bound."""
    host = functools.partial(_host, batch)
    grouped = len(_shape(batch, "prompt")) == 2
    for name in ("prompt", "responses"):
        ids = host(name)
        if ids is not None:
            bad = (ids < 0) | (ids >= vocab_size)
            if bad.any():
                where = tuple(int(i) for i in np.argwhere(bad)[0])
                raise ValueError(f"GroupBatch.{name}[{', '.join(map(str, where))}] = {int(ids[where])} is out of "
                                 f"range: token ids must be in [0, vocab_size={vocab_size})")
    mask, valid = host("mask"), host("valid")
    if valid is not None and not np.isin(valid, (0, 1)).all():
        raise ValueError(f"GroupBatch.valid values must be 0 or 1, found {sorted(set(np.unique(valid).tolist()))[:5]}")
    if mask is not None:
        if not np.isin(mask, (0, 1)).all():
            bad = sorted(set(np.unique(mask[~np.isin(mask, (0, 1))]).tolist()))[:5]
            raise ValueError(f"GroupBatch.mask values must be 0 or 1, found {bad}")
        empty = np.argwhere((mask.sum(axis=-1) == 0) & (True if valid is None else valid == 1))
        if empty.size:
            which = [tuple(int(i) for i in e) if grouped else int(e[0]) for e in empty]
            raise ValueError(f"GroupBatch.mask is all zero for {'(group, branch)' if grouped else 'branch(es)'} "
                             f"{which}: every response needs at least one real token (or valid = 0: left out)")
    rewards = host("rewards")
    if rewards is not None:
        rewards = rewards.astype(np.float64)
        if not np.isfinite(rewards).all():
            raise ValueError(f"GroupBatch.rewards must be finite, got {rewards.tolist()}")
        big = np.argwhere(np.abs(rewards) > FLOAT32_MAX)
        if big.size:
            where = tuple(int(i) for i in big[0])
            raise ValueError(f"GroupBatch.rewards[{', '.join(map(str, where))}] = {rewards[where]} is outside "
                             f"float32 range (|r| <= {FLOAT32_MAX:.6g})")
        centred = rewards - rewards.mean(axis=-1, keepdims=True)
        if cfg is not None and cfg.adv_norm == "none" and np.abs(centred).max() > FLOAT32_MAX:
            raise ValueError(f"GroupBatch.rewards {rewards.tolist()}: with adv_norm='none' the advantages r - mean "
                             "overflow float32; scale the rewards down or use adv_norm='std'")
    for name in ("old_logprobs", "ref_logprobs"):
        values = host(name)
        if values is not None and mask is not None:
            for bad, rule in ((~np.isfinite(values) & (mask == 1), "log-probs of real tokens must be finite"),
                              ((values > 0) & (mask == 1), "log-probs must be <= 0")):
                if bad.any():
                    where = tuple(int(i) for i in np.argwhere(bad)[0])
                    raise ValueError(f"GroupBatch.{name}[{', '.join(map(str, where))}] = {values[where]} where "
                                     f"mask = 1; {rule}")


def group_advantages(rewards: jax.Array, cfg: GRPOConfig, valid: jax.Array | None = None) -> jax.Array:
    """rewards [G] -> advantages [G]: (r - mean) / (std + eps) (population std), or r - mean for adv_norm="none";
    valid [G] (0 / 1, None: all 1): the statistics are over the valid branches only, and a left-out branch gets 0.

    A group whose (valid) rewards are all equal (including a single valid branch) gets exactly zero advantages,
    never NaN. Large rewards (up to float32's maximum) do not overflow in the mean and std: they are first scaled by
    a power of two 2^-e <= 1 (exact, so wherever the unscaled float32 arithmetic does not overflow the result is the
    same bits), which std normalisation cancels; adv_norm="none" scales back (`validate_batch` with the config
    rejects rewards whose r - mean overflows float32).
    """
    rewards = jnp.asarray(rewards, jnp.float32)
    keep = jnp.ones(rewards.shape, jnp.bool_) if valid is None else jnp.asarray(valid) > 0
    count = jnp.maximum(jnp.sum(keep), 1).astype(jnp.float32)
    _, exponent = jnp.frexp(jnp.max(jnp.where(keep, jnp.abs(rewards), 0.0)))
    exponent = jnp.clip(exponent, 0, 126)  # scale down only; 2^-126 is float32's smallest normal power
    down = jnp.ldexp(jnp.ones((), rewards.dtype), -exponent)
    scaled = jnp.where(keep, rewards * down, 0.0)
    if valid is None:  # the plain statistics (bit for bit those of every earlier release)
        mean, std = jnp.mean(scaled), jnp.std(scaled)
    else:
        mean = jnp.sum(scaled) / count
        std = jnp.sqrt(jnp.sum(jnp.where(keep, (scaled - mean) ** 2, 0.0)) / count)
    centred = scaled - mean
    if cfg.adv_norm == "std":
        centred = centred / (std + cfg.eps * down)
    else:
        centred = centred / down
    uniform = jnp.max(jnp.where(keep, rewards, -jnp.inf)) == jnp.min(jnp.where(keep, rewards, jnp.inf))
    return jnp.where(uniform | ~keep, 0.0, centred)


def token_weights(mask: jax.Array, cfg: GRPOConfig, valid: jax.Array | None = None) -> jax.Array:
    """mask [G, R] (one group) or [B, G, R] (a batch of groups) -> weights of the same shape, zero on padding, such
    that the batch loss is `sum(weights * per_token_loss)`. With N = G (or B * G) sequences:

    token-mean: mask / sum(mask); seq-mean-token-mean: mask / (N * len_n); seq-mean-token-sum-norm: mask / (N * R).
    valid ([G] / [B, G], None: all 1): left-out branches get weight 0 and N counts the valid sequences only.
    """
    mask = jnp.asarray(mask, jnp.float32)
    sequences, r = math.prod(mask.shape[:-1]), mask.shape[-1]
    if valid is not None:
        mask = mask * jnp.asarray(valid, jnp.float32)[..., None]
        sequences = jnp.maximum(jnp.sum(jnp.asarray(valid, jnp.float32)), 1.0)
    if cfg.loss_agg == "token-mean":
        return mask / jnp.maximum(jnp.sum(mask), 1.0)
    if cfg.loss_agg == "seq-mean-token-mean":
        return mask / (sequences * jnp.maximum(jnp.sum(mask, axis=-1, keepdims=True), 1.0))
    return mask / (sequences * r)


def batch_advantages(rewards: jax.Array, cfg: GRPOConfig, valid: jax.Array | None = None) -> jax.Array:
    """rewards [G] or [B, G] -> advantages of the same shape, each group normalised on its own
    (`group_advantages`; valid: which branches count, None: all)."""
    rewards = jnp.asarray(rewards, jnp.float32)
    per_group = functools.partial(group_advantages, cfg=cfg)
    if rewards.ndim == 1:
        return per_group(rewards, valid=valid)
    return jax.vmap(lambda r, v: per_group(r, valid=v))(rewards, valid)


def scored(batch: GroupBatch, cfg: GRPOConfig) -> tuple[GroupBatch, jax.Array, jax.Array]:
    """What every engine scores: (the batch with the mask of left-out branches (valid 0) zeroed, its
    `token_weights`, its `batch_advantages`). Without `valid` the batch is returned as it is."""
    weights = token_weights(batch.mask, cfg, batch.valid)
    advantages = batch_advantages(batch.rewards, cfg, batch.valid)
    if batch.valid is not None:
        batch = batch.replace(mask=jnp.asarray(batch.mask, jnp.float32)
                              * jnp.asarray(batch.valid, jnp.float32)[..., None])
    return batch, weights, advantages


def per_token_loss(logp: jax.Array, old_logp: jax.Array | None, ref_logp: jax.Array | None, advantage,
                   cfg: GRPOConfig, mask: jax.Array | None = None) -> tuple[jax.Array, dict]:
    """Clipped surrogate (+ kl_coef * k3 KL) per token of one branch. logp, old_logp, ref_logp, mask: [R];
    advantage: [].

    log_ratio = logp - old_logp, with old_logp = stop_gradient(logp) when None (on-policy: ratio 1, gradient A);
    cfg.ratio "sequence" (GSPO) replaces it on every token by the branch's mean sum(mask * log_ratio) / sum(mask)
    (needs `mask`), so ratio and clip are the branch's.
    loss = -min(ratio * A, clip(ratio, 1 - low, 1 + high) * A) + kl_coef * (exp(ref - logp) - (ref - logp) - 1).
    Returns (loss [R], {"clipped": [R] 1.0 where the clip is active (zero gradient), "kl": [R] k3, 0 without ref}).
    """
    old = jax.lax.stop_gradient(logp) if old_logp is None else old_logp
    log_ratio = logp - old
    if cfg.ratio == "sequence":
        if mask is None:
            raise ValueError("GRPOConfig.ratio='sequence' needs the branch's mask (which tokens are real)")
        mean = jnp.sum(mask * log_ratio) / jnp.maximum(jnp.sum(mask), 1.0)
        log_ratio = jnp.broadcast_to(mean, logp.shape)
    ratio = jnp.exp(log_ratio)
    surrogate = jnp.minimum(ratio * advantage,
                            jnp.clip(ratio, 1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high) * advantage)
    clipped = (((ratio > 1.0 + cfg.clip_eps_high) & (advantage > 0))
               | ((ratio < 1.0 - cfg.clip_eps_low) & (advantage < 0)))
    loss = -surrogate
    if ref_logp is None and cfg.kl_coef > 0:
        raise ValueError(f"GRPOConfig.kl_coef={cfg.kl_coef} needs reference log-probs (GroupBatch.ref_logprobs), "
                         "got None: pass ref_logprobs or set kl_coef=0")
    if ref_logp is None:
        kl = jnp.zeros_like(logp)
    else:
        log_ratio = ref_logp - logp
        kl = jnp.exp(log_ratio) - log_ratio - 1.0
        if cfg.kl_coef > 0:
            loss = loss + cfg.kl_coef * kl
    return loss, {"clipped": clipped.astype(logp.dtype), "kl": kl}


def branch_loss(logp: jax.Array, old_logp: jax.Array | None, ref_logp: jax.Array | None, advantage,
                weights: jax.Array, mask: jax.Array, cfg: GRPOConfig,
                entropy: jax.Array | None = None) -> tuple[jax.Array, dict]:
    """Loss of one branch, `sum(weights * per_token_loss)`, and its additive metric sums.

    logp, old_logp, ref_logp, weights (this branch's row of `token_weights`), mask, entropy: [R]; advantage: [].
    Padded positions get old = ref = logp before the math, so whatever they hold (NaN included) cannot leak into
    the loss or its gradient. Sums: clipped (tokens), kl (sum of k3), tokens, adv (the branch's advantage),
    adv_abs, and entropy (sum over real tokens) when given. Sum these over branches, then `finalize_metrics`.
    """
    mask = mask.astype(logp.dtype)
    real = mask > 0
    sanitise = lambda x: None if x is None else jnp.where(real, x, jax.lax.stop_gradient(logp))
    loss, stats = per_token_loss(logp, sanitise(old_logp), sanitise(ref_logp), advantage, cfg, mask)
    sums = {
        "clipped": jnp.sum(stats["clipped"] * mask),
        "kl": jnp.sum(stats["kl"] * mask),
        "tokens": jnp.sum(mask),
        "adv": jnp.asarray(advantage, jnp.float32),
        "adv_abs": jnp.abs(jnp.asarray(advantage, jnp.float32)),
    }
    if entropy is not None:
        sums["entropy"] = jnp.sum(jnp.where(real, entropy, 0.0))
    return jnp.sum(jnp.where(real, weights * loss, 0.0)), sums


def finalize_metrics(sums: dict, rewards: jax.Array, mask: jax.Array) -> dict:
    """Metric sums totalled over all branches (of all groups: rewards [G] or [B, G], mask [G, R] or [B, G, R]) ->
    scalar metrics (means over all B * G branches).

    reward_mean/std (population), clip_frac (clipped / tokens), kl (token mean of k3), response_len_mean,
    adv_mean, adv_abs_mean, and entropy (token mean) when the sums carry it.
    """
    rewards = jnp.asarray(rewards, jnp.float32)
    g = rewards.size  # branches, over all groups
    tokens = jnp.maximum(sums["tokens"], 1.0)
    metrics = {
        "reward_mean": jnp.mean(rewards),
        "reward_std": jnp.std(rewards),
        "clip_frac": sums["clipped"] / tokens,
        "kl": sums["kl"] / tokens,
        "response_len_mean": jnp.sum(jnp.asarray(mask, jnp.float32)) / g,
        "adv_mean": sums["adv"] / g,
        "adv_abs_mean": sums["adv_abs"] / g,
    }
    if "entropy" in sums:
        metrics["entropy"] = sums["entropy"] / tokens
    return metrics


def grpo_loss(logp: jax.Array, batch: GroupBatch, cfg: GRPOConfig,
              entropy: jax.Array | None = None) -> tuple[jax.Array, dict]:
    """Whole-batch loss from response log-probs logp [G, R] or [B, G, R] (entropy of the same shape optional, for
    metrics only).

    Exactly the sum over branches (and groups) of `branch_loss` (vmapped here), with the same advantages and weights.
    """
    batch, weights, advantages = scored(batch, cfg)
    mask = jnp.asarray(batch.mask, logp.dtype)
    flat = lambda x: None if x is None else jnp.reshape(x, (-1,) + jnp.shape(x)[advantages.ndim:])
    losses, sums = jax.vmap(functools.partial(branch_loss, cfg=cfg))(
        flat(logp), flat(batch.old_logprobs), flat(batch.ref_logprobs), flat(advantages), flat(weights), flat(mask),
        entropy=flat(entropy))
    sums = jax.tree.map(functools.partial(jnp.sum, axis=0), sums)
    return jnp.sum(losses), finalize_metrics(sums, batch.rewards, batch.mask)
