"""Compiled memory of exact-mode `grpo_grads` for GLM-5.x: block-by-block backward vs the autodiff fallback.

    .venv/bin/python tools/bench_glm_backward.py                         # P = 8192, 32768 (about 12 min on 2 cores)
    .venv/bin/python tools/bench_glm_backward.py --depth 78              # GLM-5.2's 78-layer layout
    .venv/bin/python tools/bench_glm_backward.py --prompt-len 4096 --quick   # smoke run
    .venv/bin/python tools/bench_glm_backward.py --mesh 1x8 --chunk-size 4096 --prompt-len 32768 131072   # per device

AOT only: `engine.local.jitted_grpo_grads.lower(abstract args).compile().memory_analysis()`, nothing is executed. The
model is GLM-5.2's layer layout cut to 22 layers (3 full_dense, (shared_sparse x 3, full_sparse) x 4, shared_sparse x
3: three segments, 7 full layers; `--depth 78`: the whole layout, (...) x 18) at small widths, in bfloat16, so that
at these prompt lengths the prompt state (MLA latent rows + indexer keys) dominates the parameters. "fallback" is
the same model through `CausalLM`'s autodiff hooks with a full float32 state cotangent (what the engine ran for GLM
before the block-by-block backward, kept as `layerwise.branch_grads_autodiff` / `chunk_grads_autodiff`); "blocks" is
the model as shipped (`layerwise` stages, no indexer-key cotangent). Temp bytes are XLA's temporaries: everything
live besides arguments and outputs (the state, its cotangent, the gradient accumulator, activations).

`--mesh SPEC` (CPU devices, e.g. 1x8): the sharded engine (`engine/mesh.py`, rounds of --chunk-size), per-device
bytes, the package as imported only (its sharded GLM path has no fallback to switch to; for the engine before GLM went
block by block, run this with PYTHONPATH at an export of commit 439adbc: `git archive 439adbc longstraw_jax | tar -x -C
DIR`). Results: docs/benchmarks.md 9.
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
    parser.add_argument("--prompt-len", "-P", type=int, nargs="+", default=[8192, 32768], help="prompt lengths P")
    parser.add_argument("--chunk-size", type=int, default=2048, help="chunk size (round length on a mesh)")
    parser.add_argument("--group-size", "-G", type=int, default=4)
    parser.add_argument("--response-len", "-R", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="the tiny preset (4 layers, one segment)")
    parser.add_argument("--depth", choices=("22", "78"), default="22",
                        help="GLM-5.2's layout cut to 22 layers, or whole (78 layers: configs/glm-5.2.json's layer "
                             "types); compile time does not depend on it (the layers are scanned)")
    parser.add_argument("--mesh", default=None, help="a data x seq mesh of CPU devices, e.g. 1x8")
    parser.add_argument("--json", action="store_true", help="one JSON line per cell")
    args = parser.parse_args()

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
                               " --xla_cpu_use_fusion_emitters=false").strip()
    import jax
    import jax.numpy as jnp

    if args.mesh:
        data, seq = map(int, args.mesh.split("x"))
        jax.config.update("jax_num_cpu_devices", data * seq)

    from longstraw_jax import GroupBatch, GRPOConfig, engine, models
    from longstraw_jax.models.base import CausalLM
    from longstraw_jax.models.glm52 import Glm52, Glm52Config

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
    g, r = args.group_size, args.response_len
    cfg_grpo = GRPOConfig(kl_coef=0.1)

    if args.mesh:
        from longstraw_jax import sharding
        from longstraw_jax.engine import mesh as mesh_engine
        from longstraw_jax.engine.capture import round_layout
        from longstraw_jax.sharding import rules

        mesh = sharding.make_mesh(args.mesh)
        named = lambda spec: jax.sharding.NamedSharding(mesh, spec)
        params = jax.tree.map(lambda p, s: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=named(s)), params,
                              rules.param_specs(params, mesh))
        arr = lambda dtype, *shape: jax.ShapeDtypeStruct(shape, dtype, sharding=named(jax.sharding.PartitionSpec()))
        methods = (("sharded", models.build(cfg)),)  # the package as imported

        def compile_step(model, batch, prompt):
            layout = round_layout(model, prompt - 1, mesh.shape["seq"], args.chunk_size)
            return mesh_engine.jitted_grpo_grads.lower(model, params, batch, cfg_grpo, "exact", mesh, layout,
                                                        "ring", None).compile()
    else:
        @dataclasses.dataclass(frozen=True)
        class AutodiffGlm(Glm52):
            branch_grads = CausalLM.branch_grads
            chunk_grads = CausalLM.chunk_grads
            differentiable_state = CausalLM.differentiable_state

        arr = lambda dtype, *shape: jax.ShapeDtypeStruct(shape, dtype)
        methods = (("fallback", AutodiffGlm(cfg)), ("blocks", models.build(cfg)))

        def compile_step(model, batch, prompt):
            lowered = engine.local.jitted_grpo_grads.lower(model, params, batch, cfg_grpo, "exact", args.chunk_size)
            return lowered.compile()

    devices = 1 if not args.mesh else data * seq
    rows = []
    for prompt in args.prompt_len:
        state = jax.eval_shape(lambda: models.build(cfg).init_state(prompt - 1, jnp.bfloat16))
        batch = GroupBatch(prompt=arr(jnp.int32, prompt), responses=arr(jnp.int32, g, r),
                           mask=arr(jnp.float32, g, r), rewards=arr(jnp.float32, g),
                           old_logprobs=arr(jnp.float32, g, r), ref_logprobs=arr(jnp.float32, g, r))
        for name, model in methods:
            start = time.perf_counter()
            mem = compile_step(model, batch, prompt).memory_analysis()
            row = dict(method=name, mesh=args.mesh, prompt=prompt, chunk=args.chunk_size, branches=g, response=r,
                       state_mib=state.nbytes() / MIB, kv_mib=nbytes(state.kv) / MIB,
                       index_keys_mib=nbytes(state.index_keys) / MIB, params_mib=param_bytes / MIB,
                       temp_mib=mem.temp_size_in_bytes / MIB, argument_mib=mem.argument_size_in_bytes / MIB,
                       output_mib=mem.output_size_in_bytes / MIB, compile_s=time.perf_counter() - start)
            rows.append(row)
            per = row["state_mib"] / devices  # per device on a mesh (the state is split along seq)
            print(json.dumps(row) if args.json else
                  f"P={prompt:>6} {name:>8}: temp {row['temp_mib']:9.1f} MiB = {row['temp_mib'] / per:.2f} x "
                  f"state{' per device' if args.mesh else ''} ({per:.1f} MiB of kv {row['kv_mib']:.1f} + index keys "
                  f"{row['index_keys_mib']:.1f}); args {row['argument_mib']:.1f} MiB; compiled in "
                  f"{row['compile_s']:.0f} s", flush=True)
    if not args.json and not args.mesh:
        print("\n| P | state MiB | fallback temp MiB | blocks temp MiB | saved MiB | saved / state |")
        print("|---:|---:|---:|---:|---:|---:|")
        for prompt in args.prompt_len:
            a, b = (next(x for x in rows if x["prompt"] == prompt and x["method"] == m) for m in ("fallback", "blocks"))
            saved = a["temp_mib"] - b["temp_mib"]
            print(f"| {prompt} | {a['state_mib']:.1f} | {a['temp_mib']:.1f} | {b['temp_mib']:.1f} | {saved:.1f} | "
                  f"{saved / a['state_mib']:.2f} |")


if __name__ == "__main__":
    main()
