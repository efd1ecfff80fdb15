"""Trainable and frozen parameters (docs/architecture.md 10): a parameter tree split into two trees of the same
structure with holes (None) where a leaf belongs to the other, and the engines' differentiation with respect to the
trainable part only.

    trainable, frozen = split(params, predicate)       # predicate(path string) -> bool, e.g. "blocks/full/q_proj.a"
    params = merge(trainable, frozen)
    loss, grads, metrics = grpo_grads(model, trainable, batch, ..., frozen=frozen)   # grads shaped like trainable

Inside the engines the float32 gradient accumulator has the trainable tree's structure, so every place that
differentiates (`layerwise`, `models/qwen36/mesh.py`, `models/glm52/mesh.py`, the autodiff defaults) finds the split in
the accumulator it adds into: `vjp(fn, params, like=grads, ...)` differentiates with respect to the leaves `like` holds
and closes over the others. XLA then computes no cotangent for a frozen leaf, and no gradient buffer or optimizer state
exists for one. A tree without holes (full training) takes the plain `jax.vjp` path: nothing changes.

Path strings (`path_str`): dict keys joined by "/", and ".base" / ".a" / ".b" inside an `ops.lora.LoRA` node
("blocks/full/q_proj.a").
"""
from __future__ import annotations

import jax

from longstraw_jax.ops.lora import LoRA


def is_hole(x) -> bool:
    return x is None


def path_str(path) -> str:
    """A key path (jax.tree_util) as a string: dict keys joined by "/", a LoRA node's children as ".base", ".a",
    ".b" ("blocks/full/q_proj.a")."""
    out = ""
    for key in path:
        if isinstance(key, jax.tree_util.GetAttrKey):
            out += "." + key.name
        else:
            name = getattr(key, "key", getattr(key, "idx", key))
            out += ("/" if out else "") + str(name)
    return out


def split(tree, predicate):
    """(trainable, frozen): two trees with tree's structure, each with None where the leaf belongs to the other;
    predicate(path string, `path_str`) -> True for a trainable leaf."""
    marks = jax.tree_util.tree_map_with_path(lambda path, _: bool(predicate(path_str(path))), tree)
    return (jax.tree.map(lambda m, x: x if m else None, marks, tree),
            jax.tree.map(lambda m, x: None if m else x, marks, tree))


def merge(trainable, frozen):
    """The whole tree from its two parts (`split`); frozen None: trainable is the whole tree."""
    if frozen is None:
        return trainable
    return jax.tree.map(lambda t, f: f if t is None else t, trainable, frozen, is_leaf=is_hole)


def split_like(tree, like):
    """(the leaves of tree where `like` (same structure, holes allowed) has a leaf, the others), both with holes."""
    part = jax.tree.map(lambda m, x: None if m is None else x, like, tree, is_leaf=is_hole)
    rest = jax.tree.map(lambda m, x: x if m is None else None, like, tree, is_leaf=is_hole)
    return part, rest


def has_holes(tree) -> bool:
    return any(x is None for x in jax.tree.leaves(tree, is_leaf=is_hole))


def vjp(fn, params, like, *primals, has_aux: bool = False):
    """`jax.vjp(fn, params, *primals)` with respect to the leaves of params that `like` holds (a gradient
    accumulator shaped like the trainable tree) and to primals; the other leaves are closed over (no cotangent is
    computed for them). The params cotangent has like's structure."""
    if not has_holes(like):
        return jax.vjp(fn, params, *primals, has_aux=has_aux)
    part, rest = split_like(params, like)
    return jax.vjp(lambda p, *xs: fn(merge(p, rest), *xs), part, *primals, has_aux=has_aux)


def count(tree) -> tuple[int, int]:
    """(leaves, bytes) of the arrays in tree (holes not counted)."""
    leaves = [x for x in jax.tree.leaves(tree) if hasattr(x, "dtype")]
    return len(leaves), sum(int(x.size) * x.dtype.itemsize for x in leaves)


def adapter_leaf(path: str) -> bool:
    """The adapters of a LoRA node (its `a` and `b`; its `base` is frozen)."""
    return path.endswith((".a", ".b"))


__all__ = ["LoRA", "adapter_leaf", "count", "has_holes", "is_hole", "merge", "path_str", "split", "split_like",
           "vjp"]
