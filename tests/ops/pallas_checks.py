"""Shared by the Pallas kernel tests: a loss that reads both outputs of an attention kernel (so the LSE's
cotangent reaches the backward, as a merge of partial results does), and the whole model's exact-mode GRPO
gradient with kernels="pallas" against kernels="xla"."""
import dataclasses

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np

from longstraw_jax import GroupBatch, GRPOConfig, grpo_grads, models
from longstraw_jax.ops.attended import MASKED


def outputs_and_grads(fn, args, options) -> tuple:
    """(out, lse, *gradients of args) of sum(out * cos weights) + sum(sin(lse)), the LSE where finite."""
    def loss(*args):
        r = fn(*args, **options)
        weights = jnp.cos(jnp.arange(r.out.size, dtype=jnp.float32)).reshape(r.out.shape)
        return jnp.sum(r.out * weights) + jnp.sum(jnp.sin(jnp.where(r.lse > MASKED / 2, r.lse, 0.0))), r

    (_, r), grads = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(args))), has_aux=True))(*args)
    return (r.out, r.lse) + tuple(g.astype(jnp.float32) for g in grads)


def pallas_grids(fn, *args) -> dict:
    """{kernel name: [grids]} of the pallas_calls in fn's jaxpr (nested jaxprs included)."""
    grids = {}

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                grids.setdefault(eqn.params["name"], []).append(eqn.params["grid_mapping"].grid)
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return grids


def assert_model_gradient_matches_xla(config, prompt_len: int, group_size: int, response_len: int):
    """Exact-mode GRPO loss and gradient of a model built from `config` with kernels="pallas" (interpreted) ==
    kernels="xla", to float32 round-off; some gradient is non-zero."""
    model = models.build(config)
    params = model.init(jax.random.key(0))
    vocab = config.vocab_size
    rng = np.random.default_rng(0)
    shape = (group_size, response_len)
    batch = GroupBatch(prompt=rng.integers(0, vocab, prompt_len).astype(np.int32),
                       responses=rng.integers(0, vocab, shape).astype(np.int32), mask=np.ones(shape, np.float32),
                       rewards=np.arange(group_size, dtype=np.float32), old_logprobs=np.full(shape, -4.0, np.float32))
    run = lambda model: grpo_grads(model, params, batch, GRPOConfig(), mode="exact", chunk_size=16)
    loss_x, grads_x, _ = run(model)
    loss_p, grads_p, _ = run(models.build(dataclasses.replace(config, kernels="pallas")))
    np.testing.assert_allclose(loss_p, loss_x, rtol=1e-5)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads_p), jax.tree.leaves(grads_x)):
        np.testing.assert_allclose(a, b, atol=2e-5 * max(1.0, float(np.abs(b).max())),
                                   err_msg=jax.tree_util.keystr(path))
    assert max(float(np.abs(g).max()) for g in jax.tree.leaves(grads_x)) > 0
