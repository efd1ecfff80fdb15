"""Random parameters at O(1) scale for tests: the models' default init (small matrices, identity norms) hides bugs."""
import jax


def o1_params(params, key):
    """Every leaf re-drawn: matrices ~ N(0, 1/fan_in), vectors (norms, biases, decays) ~ N(0, 0.3^2)."""
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(key, len(leaves))
    out = [jax.random.normal(k, x.shape, x.dtype) * (x.shape[-1] ** -0.5 if x.ndim >= 2 and x.shape[-1] > 4 else 0.3)
           for k, x in zip(keys, leaves)]
    return jax.tree.unflatten(tree, out)
