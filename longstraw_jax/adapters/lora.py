"""LoRA for both model families (docs/architecture.md 10): which matrices can carry adapters, adding them, merging
them back (the PEFT export: io/peft.py; the trainer's options: trainer/components.py).

    paths = resolve_targets(params, "attn,mlp")            # target patterns -> leaf paths (errors list candidates)
    params = add_adapters(params, paths, rank=8, alpha=16, key=key)   # LoRA(base, a, b) nodes, b = 0
    trainable, frozen = trainable.split(params, trainable.adapter_leaf)
    ...                                                     # engines / train_step with frozen=frozen
    models.save_hf(model, merged(params), dir)              # merged weights
    io.peft.save_peft(model, params, dir)                   # adapter_config.json + adapter_model.safetensors

Targets are stacked layer matrices that the layer code applies as a projection (`ops/mlp.linear`, the grouped
expert matmul of `ops/moe.py`), named by their path ("blocks/full/q_proj", "layers/1/shared_sparse/mlp/experts_up",
`trainable.path_str`). `--lora-targets` takes comma-separated items, each a group or a regular expression searched
in those paths:

    attn     attention projections: Qwen3.6 q/k/v/o_proj and the Gated DeltaNet in_proj_qkv, in_proj_z, out_proj;
             GLM-5.x q_a_proj, q_b_proj, kv_a_proj, kv_b_proj, o_proj (the DSA indexer gets no gradient)
    mlp      dense SwiGLU MLPs (gate_proj, up_proj, down_proj)
    shared   GLM-5.x shared experts
    experts  GLM-5.x routed experts (per-expert adapters a [E, r, in], b [E, out, r])
    all      all of the above (the default)

Qwen3.6's in_proj_a / in_proj_b (Hv rows each) are candidates by name only. GLM's kv_b_proj is reshaped per head
rather than applied as a linear, so its adapted matrix is merged for the layer that uses it (`ops.lora.materialize`;
one layer, transient).
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np

from longstraw_jax.adapters.trainable import path_str
from longstraw_jax.ops.lora import LoRA, is_lora, materialize

GROUPS = {
    "attn": re.compile(r"/(q_proj|k_proj|v_proj|o_proj|in_proj_qkv|in_proj_z|out_proj|q_a_proj|q_b_proj|kv_a_proj|"
                       r"kv_b_proj)$"),
    "mlp": re.compile(r"/mlp/(gate_proj|up_proj|down_proj)$"),
    "shared": re.compile(r"/mlp/shared/(gate_proj|up_proj|down_proj)$"),
    "experts": re.compile(r"/mlp/experts_(gate|up|down)$"),
}
_OTHER = re.compile(r"/(in_proj_a|in_proj_b)$")  # candidates, in no group
STACKED = ("blocks/", "layers/")
DEFAULT_TARGETS = "all"


def candidates(params) -> dict[str, tuple]:
    """Path -> shape of every matrix that can carry an adapter (stacked layer leaves applied as projections)."""
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(params, is_leaf=is_lora):
        name = path_str(path)
        if name.startswith(STACKED) and "/indexer/" not in name and (
                _OTHER.search(name) or any(g.search(name) for g in GROUPS.values())):
            out[name] = tuple(leaf.shape)
    return out


def short_path(path: str) -> str:
    """A candidate's name without the stacking prefix: blocks/full/q_proj -> full/q_proj, layers/1/x/... -> x/..."""
    parts = path.split("/")
    return "/".join(parts[2:] if parts[0] == "layers" else parts[1:])


def resolve_targets(params, patterns: str) -> tuple[str, ...]:
    """Comma-separated groups / regular expressions -> the sorted candidate paths they select. ValueError naming an
    item that selects nothing (or is not a valid expression), with the groups and the candidate names."""
    found = candidates(params)
    items = [p.strip() for p in str(patterns).split(",") if p.strip()]
    names = ", ".join(dict.fromkeys(short_path(p) for p in found))
    menu = f"groups: {', '.join(GROUPS)}, all; matrices of this model: {names}"
    if not items:
        raise ValueError(f"--lora-targets={patterns!r} names no target ({menu})")
    chosen = set()
    for item in items:
        if item == "all":
            hit = {p for p in found if any(g.search(p) for g in GROUPS.values())}
        elif item in GROUPS:
            hit = {p for p in found if GROUPS[item].search(p)}
        else:
            try:
                expression = re.compile(item)
            except re.error as e:
                raise ValueError(f"--lora-targets: {item!r} is not a valid regular expression ({e})") from None
            hit = {p for p in found if expression.search(p)}
        if not hit:
            raise ValueError(f"--lora-targets: {item!r} matches no adaptable matrix of this model ({menu})")
        chosen |= hit
    return tuple(sorted(chosen))


def check_rank(params, paths, rank: int) -> None:
    """rank must be >= 1 and at most min(out, in) of every target. ValueError naming the first offending one."""
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or rank < 1:
        raise ValueError(f"--lora-rank={rank!r} must be an integer >= 1")
    shapes = candidates(params)
    for path in paths:
        out_dim, in_dim = shapes[path][-2:]
        if rank > min(out_dim, in_dim):
            raise ValueError(f"--lora-rank={rank} is larger than {short_path(path)} [{out_dim}, {in_dim}] allows (the "
                             f"rank must be <= min(out, in) = {min(out_dim, in_dim)} of every target)")


def add_adapters(params, paths, rank: int, alpha: float, key: jax.Array, dtype=None):
    """params with each leaf at `paths` replaced by LoRA(base, a, b, alpha / rank): a [..., r, in] ~ U(-1/sqrt(in),
    1/sqrt(in)) (PEFT's default), b [..., out, r] = 0, so the adapted model's logits equal the base model's exactly.
    dtype: the adapters' (default the base's)."""
    check_rank(params, paths, rank)
    wanted = {p: i for i, p in enumerate(sorted(paths))}

    def adapt(path, w):
        name = path_str(path)
        if name not in wanted or is_lora(w):
            return w
        *lead, out_dim, in_dim = w.shape
        kind = dtype or w.dtype
        bound = in_dim ** -0.5
        a = jax.random.uniform(jax.random.fold_in(key, wanted[name]), (*lead, rank, in_dim), jnp.float32, -bound,
                               bound).astype(kind)
        return LoRA(w, a, jnp.zeros((*lead, out_dim, rank), kind), alpha / rank)

    return jax.tree_util.tree_map_with_path(adapt, params, is_leaf=is_lora)


def merged(params):
    """params with every LoRA node replaced by its dense matrix base + scale * b @ a (base dtype): the weights an
    `--export-hf` writes."""
    return jax.tree.map(materialize, params, is_leaf=is_lora)


def without_adapters(params):
    """params with every LoRA node replaced by its base matrix (the same array: nothing is copied): the frozen base
    model, e.g. the KL reference of a LoRA run (`trainer/reference.py`)."""
    return jax.tree.map(lambda w: w.base if is_lora(w) else w, params, is_leaf=is_lora)


def adapters(params) -> dict[str, LoRA]:
    """Path -> LoRA node of every adapted matrix."""
    return {path_str(p): x for p, x in jax.tree_util.tree_leaves_with_path(params, is_leaf=is_lora) if is_lora(x)}


__all__ = ["DEFAULT_TARGETS", "GROUPS", "STACKED", "LoRA", "add_adapters", "adapters", "candidates", "check_rank",
           "merged", "resolve_targets", "short_path", "without_adapters"]
