"""Ring vs all-gather attention for sequence-parallel capture: median wall time and compiled temp memory per device.

    python tools/bench_seq_attention.py --mesh 1x8 --prompt-len 8192 --repeats 5

Runs the sharded Qwen capture (tiny-shaped model with a configurable width) on simulated CPU devices. CPU timings
rank the two designs only roughly (collectives are memcpys here); the memory column is what carries over to GPUs:
all-gather holds a whole layer's keys and values per device, the ring two shards' worth.

Imports of jax and the package are function-local on purpose: the device count comes from --mesh and must be set
before JAX creates its CPU client.
"""
import argparse
import os
import statistics
import time


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", default="1x8")
    parser.add_argument("--prompt-len", "-P", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from longstraw_jax.sharding.mesh import parse_mesh_spec
    data, seq = parse_mesh_spec(args.mesh)
    import jax
    jax.config.update("jax_num_cpu_devices", data * seq)  # before JAX first touches the backend
    import jax.numpy as jnp

    from longstraw_jax import models, sharding
    from longstraw_jax.engine import capture as api
    from longstraw_jax.models.qwen36 import Qwen36Config
    from longstraw_jax.sharding import rules, sequence

    model = models.build(Qwen36Config.tiny(hidden_size=args.hidden, num_key_value_heads=args.kv_heads,
                                             num_attention_heads=2 * args.kv_heads, head_dim=args.head_dim))
    mesh = sharding.make_mesh(args.mesh)
    params = model.init(jax.random.key(0))
    params = jax.device_put(params, rules.named(rules.param_specs(params, mesh), mesh))
    tokens = jax.random.randint(jax.random.key(1), (args.prompt_len,), 0, model.config.vocab_size, dtype=jnp.int32)
    layout = api.round_layout(model, args.prompt_len, seq, None)
    stored = layout.to_stored(tokens)
    print(f"mesh {args.mesh}, prompt {args.prompt_len}, hidden {args.hidden}, kv heads {args.kv_heads} x "
          f"{args.head_dim}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    print(f"{'method':10s} {'median s':>9s} {'min s':>7s} {'temp MiB/device':>16s}")
    for method in sequence.ATTENTION_METHODS:
        compiled = api.jitted_capture_on_mesh.lower(model, params, stored, mesh, layout, method).compile()
        temp = compiled.memory_analysis().temp_size_in_bytes / 2**20
        jax.block_until_ready(compiled(params, stored))
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            jax.block_until_ready(compiled(params, stored))
            times.append(time.perf_counter() - start)
        print(f"{method:10s} {statistics.median(times):9.3f} {min(times):7.3f} {temp:16.1f}")


if __name__ == "__main__":
    main()
