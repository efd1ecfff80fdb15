"""Compiled memory of exact-mode `grpo_grads` for GLM-5.x: block-by-block backward vs the autodiff fallback.

    .venv/bin/python tools/bench_glm_backward.py                         # P = 8192, 32768 (about 12 min on 2 cores)
    .venv/bin/python tools/bench_glm_backward.py --depth 78              # GLM-5.2's 78-layer layout
    .venv/bin/python tools/bench_glm_backward.py --prompt 4096 --quick   # smoke run

AOT only: `jax.jit(engine._grpo_grads).lower(abstract args).compile().memory_analysis()`, nothing is executed. The
model is GLM-5.2's layer layout cut to 22 layers (3 full_dense, (shared_sparse x 3, full_sparse) x 4, shared_sparse x
3: three segments, 7 full layers; `--depth 78`: the whole layout, (...) x 18) at small widths, in bfloat16, so that
at these prompt lengths the prompt state (MLA latent rows + indexer keys) dominates the parameters. "fallback" is
the same model through `CausalLM`'s autodiff hooks with a full float32 state cotangent (what the engine ran for GLM
before the block-by-block backward, kept as `layerwise.branch_grads_autodiff` / `chunk_grads_autodiff`); "blocks" is
the model as shipped (`layerwise` stages, no indexer-key cotangent). Temp bytes are XLA's temporaries: everything
live besides arguments and outputs (the state, its cotangent, the gradient accumulator, activations). Results:
docs/benchmarks.md 9.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

MIB = 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", type=int, nargs="+", default=[8192, 32768], help="prompt lengths P")
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--branches", type=int, default=4)
    parser.add_argument("--response", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="the tiny preset (4 layers, one segment)")
    parser.add_argument("--depth", choices=("22", "78"), default="22",
                        help="GLM-5.2's layout cut to 22 layers, or whole (78 layers: configs/glm-5.2.json's layer "
                             "types); compile time does not depend on it (the layers are scanned)")
    parser.add_argument("--json", action="store_true", help="one JSON line per cell")
    args = parser.parse_args()

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
                               " --xla_cpu_use_fusion_emitters=false").strip()
    import jax
    import jax.numpy as jnp

    from longstraw_jax import GroupBatch, GRPOConfig, engine, models
    from longstraw_jax.models.base import CausalLM
    from longstraw_jax.models.glm52 import Glm52, Glm52Config

    @dataclasses.dataclass(frozen=True)
    class AutodiffGlm(Glm52):
        branch_grads = CausalLM.branch_grads
        chunk_grads = CausalLM.chunk_grads
        differentiable_state = CausalLM.differentiable_state

    if args.quick:
        cfg = Glm52Config.tiny()
    else:
        indexers = ["full"] * 3 + ["shared", "shared", "shared", "full"] * (4 if args.depth == "22" else 18) + [
            "shared"] * 3
        cfg = Glm52Config.tiny(
            vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=64,
            num_hidden_layers=len(indexers), num_attention_heads=4, q_lora_rank=64, kv_lora_rank=128,
            qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32, n_routed_experts=8, num_experts_per_tok=2,
            index_topk=256, index_n_heads=8, index_head_dim=64, indexer_types=tuple(indexers),
            mlp_layer_types=("dense",) * 3 + ("sparse",) * (len(indexers) - 3), query_block_size=64,
            index_key_block_size=1024)
    print(cfg.describe())
    print("segments:", [(seg.pattern, seg.repeats) for seg in cfg.segments])
    params = jax.eval_shape(lambda: models.build(cfg).init(jax.random.key(0), jnp.bfloat16))
    nbytes = lambda x: x.size * x.dtype.itemsize
    param_bytes = sum(nbytes(x) for x in jax.tree.leaves(params))
    g, r = args.branches, args.response
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    rows = []
    for prompt in args.prompt:
        state = jax.eval_shape(lambda: models.build(cfg).init_state(prompt - 1, jnp.bfloat16))
        batch = GroupBatch(prompt=jax.ShapeDtypeStruct((prompt,), jnp.int32),
                           responses=jax.ShapeDtypeStruct((g, r), jnp.int32), mask=f32(g, r), rewards=f32(g),
                           old_logprobs=f32(g, r), ref_logprobs=f32(g, r))
        for name, model in (("fallback", AutodiffGlm(cfg)), ("blocks", models.build(cfg))):
            start = time.perf_counter()
            mem = jax.jit(engine._grpo_grads, static_argnums=(0, 3, 4, 5)).lower(
                model, params, batch, GRPOConfig(kl_coef=0.1), "exact", args.chunk).compile().memory_analysis()
            row = dict(method=name, prompt=prompt, chunk=args.chunk, branches=g, response=r,
                       state_mib=state.nbytes() / MIB, kv_mib=nbytes(state.kv) / MIB,
                       index_keys_mib=nbytes(state.index_keys) / MIB, params_mib=param_bytes / MIB,
                       temp_mib=mem.temp_size_in_bytes / MIB, argument_mib=mem.argument_size_in_bytes / MIB,
                       output_mib=mem.output_size_in_bytes / MIB, compile_s=time.perf_counter() - start)
            rows.append(row)
            print(json.dumps(row) if args.json else
                  f"P={prompt:>6} {name:>8}: temp {row['temp_mib']:9.1f} MiB = {row['temp_mib'] / row['state_mib']:.2f}"
                  f" x state ({row['state_mib']:.1f} MiB: kv {row['kv_mib']:.1f} + index keys "
                  f"{row['index_keys_mib']:.1f}); args {row['argument_mib']:.1f} MiB; compiled in "
                  f"{row['compile_s']:.0f} s", flush=True)
    if not args.json:
        print("\n| P | state MiB | fallback temp MiB | blocks temp MiB | saved MiB | saved / state |")
        print("|---:|---:|---:|---:|---:|---:|")
        for prompt in args.prompt:
            a, b = (next(x for x in rows if x["prompt"] == prompt and x["method"] == m) for m in ("fallback", "blocks"))
            saved = a["temp_mib"] - b["temp_mib"]
            print(f"| {prompt} | {a['state_mib']:.1f} | {a['temp_mib']:.1f} | {b['temp_mib']:.1f} | {saved:.1f} | "
                  f"{saved / a['state_mib']:.2f} |")


if __name__ == "__main__":
    main()
