"""Low-rank adapters on frozen matrices (docs/architecture.md 10): the `LoRA` pytree node that the projections
dispatch on, so that the same model code runs adapted and unadapted.

A matrix leaf `w [..., out, in]` (transformers orientation; leading stacked layer / expert axes allowed) becomes
`LoRA(base=w, a [..., r, in], b [..., out, r], scale=alpha / r)`, standing for `base + scale * b @ a` without ever
forming it: `ops/mlp.linear` computes `x @ base^T + scale * ((x @ a^T) @ b^T)`, and the grouped expert matmul of
`ops/moe.py` does the same per expert. So the backward pass produces `d a` and `d b` ([r, in], [out, r]) and a
cotangent for `base` only if `base` is differentiated (it is not when frozen: `adapters/trainable.py`), never a
full-size `dW` of the merged matrix. `scale` is static (part of the tree structure).

Code that indexes parameters with `jax.tree.map` (layer scans, `a[j]`, FSDP all-gathers) handles the node like any
other subtree: base, a and b keep the same leading axes.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.tree_util.register_pytree_with_keys_class
class LoRA:
    """base [..., out, in] + scale * b [..., out, r] @ a [..., r, in]. Children may be None (a tree with holes:
    `trainable.split`), so no shape is checked here (`lora.add_adapters` builds them)."""

    __slots__ = ("base", "a", "b", "scale")

    def __init__(self, base, a, b, scale: float):
        self.base, self.a, self.b, self.scale = base, a, b, float(scale)

    def tree_flatten_with_keys(self):
        key = jax.tree_util.GetAttrKey
        return ((key("base"), self.base), (key("a"), self.a), (key("b"), self.b)), self.scale

    @classmethod
    def tree_unflatten(cls, scale, children):
        return cls(*children, scale=scale)

    def __repr__(self):
        shape = lambda x: None if x is None else tuple(getattr(x, "shape", ()))
        return f"LoRA(base={shape(self.base)}, a={shape(self.a)}, b={shape(self.b)}, scale={self.scale})"

    @property
    def rank(self) -> int:
        return self.a.shape[-2]

    @property
    def shape(self) -> tuple:
        """The shape of the matrix it stands for (the base's), from the adapters when base is a hole."""
        if self.base is not None:
            return tuple(self.base.shape)
        return tuple(self.b.shape[:-1]) + tuple(self.a.shape[-1:])


def is_lora(x) -> bool:
    return isinstance(x, LoRA)


def materialize(w):
    """The dense matrix of a LoRA node (base + scale * b @ a, in the base's dtype), or w itself. Only for a weight
    that is not applied as `linear` (GLM's kv_b_proj, reshaped per head; transient, one layer) and for export."""
    if not is_lora(w):
        return w
    delta = jnp.einsum("...or,...ri->...oi", w.b, w.a, preferred_element_type=jnp.promote_types(w.b.dtype,
                                                                                                jnp.float32))
    return (w.base.astype(delta.dtype) + w.scale * delta).astype(w.base.dtype)


def linear(x: jax.Array, w, precision=None) -> jax.Array:
    """x [..., in] @ w[out, in].T -> [..., out] for a plain matrix or a LoRA node (low-rank path added, never
    merged)."""
    if not is_lora(w):
        return _dense(x, w, precision)
    y = _dense(x, w.base, precision)
    low = jnp.einsum("...i,ri->...r", x, w.a.astype(x.dtype), precision=precision)
    return (y + w.scale * jnp.einsum("...r,or->...o", low, w.b.astype(x.dtype), precision=precision)).astype(y.dtype)


def _dense(x, w, precision):
    """x @ w^T; a matrix that applies itself (`w.linear`: a device's shard applied tensor-parallel while decoding,
    `sharding/tensor.py`) does so."""
    if hasattr(w, "linear"):
        return w.linear(x, precision)
    return jnp.einsum("...i,oi->...o", x, w, precision=precision)


def grouped(matmul, lhs: jax.Array, w, groups: jax.Array) -> jax.Array:
    """A grouped expert matmul `matmul(lhs [M, in], rhs [E, out, in], groups) -> [M, out]` (float32) for a plain
    expert stack or a LoRA node over it (per-expert adapters a [E, r, in], b [E, out, r]). groups: what `matmul`
    takes to find each row's expert (its group sizes, rows sorted by expert; or each row's expert id)."""
    if not is_lora(w):
        return matmul(lhs, w, groups)
    low = matmul(lhs, w.a.astype(lhs.dtype), groups).astype(lhs.dtype)  # [M, r]: each row through its expert
    return matmul(lhs, w.base, groups) + w.scale * matmul(low, w.b.astype(lhs.dtype), groups)


def shape_of(w) -> tuple:
    """The shape of a matrix leaf or of the matrix a LoRA node stands for."""
    return w.shape if is_lora(w) else tuple(w.shape)
