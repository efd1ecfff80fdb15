"""Full-graph GRPO reference: the textbook implementation that the capture/replay engine must match.

G copies of the prompt, one per branch, go through `model.forward` as one vmapped graph; the loss is `grpo_loss`
and the gradient is plain `jax.value_and_grad`. Memory grows with G * (P + R) * vocab: use it as an oracle on
small inputs, never for long prompts.
"""
import jax
import jax.numpy as jnp

from longstraw_jax.adapters.trainable import merge
from longstraw_jax.grpo import GroupBatch, GRPOConfig, grpo_loss, validate_batch


def response_logprobs(model, params, prompt: jax.Array, responses: jax.Array,
                      remat: bool = False, left_pad=None) -> tuple[jax.Array, jax.Array]:
    """prompt [P], responses [G, R] -> (logp [G, R], entropy [G, R]) of each response token under `model`.

    Token t of branch g is scored by the logits at position P - 1 + t of concat(prompt, responses[g]).
    remat: recompute each block in the backward pass instead of storing its activations (same values).
    left_pad: prompt[:left_pad] are pads (int32 [] or None; `GroupBatch.left_pad`).
    """
    p, r = prompt.shape[0], responses.shape[1]
    tokens = jnp.concatenate([jnp.broadcast_to(prompt, (responses.shape[0], p)), responses], axis=1)
    # model._forward is model.forward minus its host-side token check (ids are checked by validate_batch).
    forward = lambda t: model._forward(params, t, remat=remat, left_pad=left_pad)
    logits = jax.vmap(forward)(tokens)[:, p - 1 : p - 1 + r]  # [G, R, V]
    logp_all = jax.nn.log_softmax(logits, axis=-1)
    logp = jnp.take_along_axis(logp_all, responses[..., None], axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    return logp, entropy


def naive_grpo_grads(model, params, batch: GroupBatch, cfg: GRPOConfig,
                     remat: bool = True, frozen=None) -> tuple[jax.Array, dict, dict]:
    """(loss, grads, metrics) of the GRPO loss over one group, or B groups side by side (prompt [B, P], responses
    [B, G, R], ...), through one graph over the G (B * G) copies of prompt+response.

    Jittable with `model`, `cfg` and `remat` static: `jax.jit(naive_grpo_grads, static_argnums=(0, 3, 4))`. The
    batch is validated on the host when its arrays are concrete. grads has the structure of params. remat (default)
    keeps one block input per layer block instead of every activation: the usual way to fit a full-graph step.
    frozen: parameters not differentiated (as in `engine.grpo_grads`): the model runs on merge(params, frozen).
    """
    validate_batch(batch, model.config.vocab_size, cfg)
    prompt = jnp.asarray(batch.prompt, jnp.int32)
    responses = jnp.asarray(batch.responses, jnp.int32)

    def loss_fn(params):
        params = merge(params, frozen)
        if batch.groups_per_step is None:
            logp, entropy = response_logprobs(model, params, prompt, responses, remat, batch.left_pad)
        else:
            logp, entropy = jax.vmap(lambda p, r, pad: response_logprobs(model, params, p, r, remat, pad))(
                prompt, responses, batch.left_pad)
        return grpo_loss(logp, batch, cfg, entropy=jax.lax.stop_gradient(entropy))

    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    return loss, grads, metrics
