"""LoRA for both model families (docs/architecture.md 10): which matrices can carry adapters, adding them, merging
them back, and the PEFT export.

    paths = resolve_targets(params, "attn,mlp")            # target patterns -> leaf paths (errors list candidates)
    params = add_adapters(params, paths, rank=8, alpha=16, key=key)   # LoRA(base, a, b) nodes, b = 0
    trainable, frozen = trainable.split(params, trainable.adapter_leaf)
    ...                                                     # engines / train_step with frozen=frozen
    models.save_hf(model, merged(params), dir)              # merged weights
    save_peft(model, params, dir)                           # adapter_config.json + adapter_model.safetensors

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

import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np

from longstraw_jax.ops.lora import LoRA, is_lora, materialize
from longstraw_jax.trainable import path_str

GROUPS = {
    "attn": re.compile(r"/(q_proj|k_proj|v_proj|o_proj|in_proj_qkv|in_proj_z|out_proj|q_a_proj|q_b_proj|kv_a_proj|"
                       r"kv_b_proj)$"),
    "mlp": re.compile(r"/mlp/(gate_proj|up_proj|down_proj)$"),
    "shared": re.compile(r"/mlp/shared/(gate_proj|up_proj|down_proj)$"),
    "experts": re.compile(r"/mlp/experts_(gate|up|down)$"),
}
_OTHER = re.compile(r"/(in_proj_a|in_proj_b)$")  # candidates, in no group
_STACKED = ("blocks/", "layers/")
DEFAULT_TARGETS = "all"


def candidates(params) -> dict[str, tuple]:
    """Path -> shape of every matrix that can carry an adapter (stacked layer leaves applied as projections)."""
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(params, is_leaf=is_lora):
        name = path_str(path)
        if name.startswith(_STACKED) and "/indexer/" not in name and (
                _OTHER.search(name) or any(g.search(name) for g in GROUPS.values())):
            out[name] = tuple(leaf.shape)
    return out


def _short(path: str) -> str:
    """A candidate's name without the stacking prefix: blocks/full/q_proj -> full/q_proj, layers/1/x/... -> x/..."""
    parts = path.split("/")
    return "/".join(parts[2:] if parts[0] == "layers" else parts[1:])


def resolve_targets(params, patterns: str) -> tuple[str, ...]:
    """Comma-separated groups / regular expressions -> the sorted candidate paths they select. ValueError naming an
    item that selects nothing (or is not a valid expression), with the groups and the candidate names."""
    found = candidates(params)
    items = [p.strip() for p in str(patterns).split(",") if p.strip()]
    names = ", ".join(dict.fromkeys(_short(p) for p in found))
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
            raise ValueError(f"--lora-rank={rank} is larger than {_short(path)} [{out_dim}, {in_dim}] allows (the "
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


def adapters(params) -> dict[str, LoRA]:
    """Path -> LoRA node of every adapted matrix."""
    return {path_str(p): x for p, x in jax.tree_util.tree_leaves_with_path(params, is_leaf=is_lora) if is_lora(x)}


# ----- PEFT export ------------------------------------------------------------------------------------------------


# model types whose routed experts transformers 5 fuses into 3-d parameters, and for which PEFT (0.21) rewrites every
# `gate_proj` / `up_proj` / `down_proj` target into those parameters (`peft/utils/transformers_weight_conversion.py`:
# glm_moe_dsa maps to its "qwen2_moe" conversion): per-expert adapters saved under transformers 4's per-expert names
# are fused on load (A concatenated, B block-diagonal, rank and alpha doubled for gate_up_proj: the same scale), but
# an adapter on a dense MLP or a shared expert, whose names end the same way, is taken for an expert one.
_PEFT_FUSED_EXPERTS = ("glm_moe_dsa",)


def peft_layout(model, params) -> tuple[dict[str, tuple[str, tuple]], list[str]]:
    """(PEFT module name, e.g. "model.layers.3.self_attn.q_proj" or "model.layers.1.mlp.experts.5.gate_proj" -> (our
    adapted path, index into its stacked axes), the adapter config's target_modules). ValueError naming the targets
    PEFT cannot express (`_PEFT_FUSED_EXPERTS`: GLM-5.x's dense MLPs and shared experts, and a routed expert's
    gate_proj without its up_proj or the other way round)."""
    nodes = adapters(params)
    if not nodes:
        raise ValueError("--export-peft: the params have no LoRA adapters (train with --train lora)")
    fused = model.config.to_hf().get("model_type") in _PEFT_FUSED_EXPERTS
    if fused:
        bad = sorted(_short(p) for p in nodes if GROUPS["mlp"].search(p) or GROUPS["shared"].search(p))
        if bad:
            raise ValueError(f"--export-peft: PEFT cannot express adapters on {', '.join(dict.fromkeys(bad))}: for "
                             f"this model type it loads every gate_proj / up_proj / down_proj adapter onto the routed "
                             f"experts (fused in transformers 5); choose --lora-targets without mlp and shared, e.g. "
                             f"attn,experts")
        for path in nodes:
            if path.endswith(("/experts_gate", "/experts_up")):
                other = path[: path.rindex("_")] + ("_up" if path.endswith("_gate") else "_gate")
                if other not in nodes:
                    raise ValueError(f"--export-peft: {_short(path)} has adapters but {_short(other)} has none; PEFT "
                                     "fuses the routed experts' gate and up projections (gate_up_proj), so adapt "
                                     "both or neither")
    by_path = {}
    for name, slot in model.hf_layout().items():
        if slot.path in nodes:
            by_path.setdefault(slot.path, []).append((name, slot))
    missing = sorted(set(nodes) - set(by_path))
    if missing:
        raise ValueError(f"--export-peft: no transformers module for {', '.join(missing)}")
    layout = {name[: -len(".weight")]: (path, slot.index) for path, entries in by_path.items()
              for name, slot in entries}
    experts = {m for m in layout if ".mlp.experts." in m}
    if experts and not fused:
        raise ValueError("--export-peft: routed-expert adapters of this model type have no PEFT layout")
    targets = sorted(set(layout) - experts, key=_natural)
    targets += sorted({m.rsplit(".", 1)[-1] for m in experts})  # gate_proj / up_proj / down_proj: PEFT fuses them
    return layout, targets


def check_peft(model, params) -> None:
    """Raises the ValueError `save_peft` would, without writing anything (abstract params suffice)."""
    peft_layout(model, params)


def save_peft(model, params, directory: str | os.PathLike, dtype=None) -> None:
    """Write a PEFT LoRA adapter into `directory` (must exist): adapter_config.json (r, lora_alpha, the exact module
    names as target_modules; routed experts by their projection name) and adapter_model.safetensors
    ("base_model.model.<module>.lora_A.weight" [r, in], ".lora_B.weight" [out, r]; routed experts one module per
    expert, transformers 4's names, which PEFT fuses on load). `peft.PeftModel.from_pretrained(<transformers model
    of the base weights>, directory)` then computes our adapted model's logits (scaling = lora_alpha / r, as
    ours)."""
    from longstraw_jax.models.hf import write_safetensors

    layout, targets = peft_layout(model, params)
    nodes = adapters(params)
    ranks = {x.rank for x in nodes.values()}
    scales = {x.scale for x in nodes.values()}
    if len(ranks) != 1 or len(scales) != 1:
        raise ValueError("--export-peft: every adapter must have the same rank and scale (one PEFT config)")
    rank, scale = ranks.pop(), scales.pop()
    tensors, values = [], {}
    for module in sorted(layout, key=_natural):
        path, index = layout[module]
        node = nodes[path]
        for part, array in (("lora_A", node.a[index]), ("lora_B", node.b[index])):
            value = np.asarray(jnp.asarray(array, dtype or array.dtype))
            name = f"base_model.model.{module}.{part}.weight"
            tensors.append((name, value.dtype, value.shape))
            values[name] = value
    directory = os.fspath(directory)
    write_safetensors(os.path.join(directory, "adapter_model.safetensors"), tensors, lambda name: [values[name]])
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": scale * rank,
        "target_modules": targets, "lora_dropout": 0.0, "bias": "none",
        "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "init_lora_weights": True,
        "inference_mode": True, "modules_to_save": None, "base_model_name_or_path": None,
    }
    with open(os.path.join(directory, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)


def _natural(name: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]




# ----- the trainer (run_loop.py) --------------------------------------------------------------------------------


def prepare_run(config, model, params):
    """--train / --lora-* / --trainable / --export-peft of a RunConfig -> (params, with adapters for --train lora;
    the trainable predicate for `trainable.split`, None when every leaf trains). Every model-dependent check happens
    here, before the run writes anything: unknown targets, a rank beyond a target's dimensions, a PEFT export of
    targets PEFT cannot express, a --trainable expression that matches nothing."""
    from longstraw_jax import trainable

    if config.train == "lora":
        paths = resolve_targets(params, config.lora_targets)
        check_rank(params, paths, config.lora_rank)
        key = jax.random.fold_in(jax.random.key(config.seed), 0x10A)
        params = add_adapters(params, paths, config.lora_rank, config.lora_alpha, key)
        if config.export_peft:
            check_peft(model, params)
        return params, trainable.adapter_leaf
    if config.trainable is not None:
        expression = re.compile(config.trainable)
        names = [path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]
        if not any(expression.search(n) for n in names):
            shown = ", ".join(dict.fromkeys(_short(n) if n.startswith(_STACKED) else n for n in names))
            raise ValueError(f"--trainable={config.trainable!r} matches no parameter; paths: {shown}")
        return params, lambda path: bool(expression.search(path))
    return params, None


__all__ = ["DEFAULT_TARGETS", "GROUPS", "LoRA", "add_adapters", "adapters", "candidates", "check_peft",
           "check_rank", "merged", "prepare_run", "resolve_targets", "save_peft"]
