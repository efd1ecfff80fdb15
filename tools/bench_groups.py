"""Groups side by side: step time of B groups on a `data x seq` mesh vs the same B groups on one data slice.

    python tools/bench_groups.py --groups-per-step 2 --prompt-len 256 --chunk-size 64 --repeats 3

On 8 simulated CPU devices: `grpo_grads` (exact and detached) of B groups on 1x4 (4 of the devices: the B groups run
one after another on one slice) and on 2x4 (each data slice runs B/2 groups). The same total work: if each slice
computes only its own groups, 2x4 takes about as long as 1x4 when the second slice's devices have their own cores; if
every slice repeated every group (the old behaviour of `data`), 2x4 would do twice the work. A 2-core CPU runs all
simulated devices on the same 2 cores, so there the ratio mixes both effects. Prints a markdown table with medians and
the ratio.

XLA:CPU can start two independent collectives of one program in different orders on different simulated devices, which
then wait for each other forever; which programs meet this depends on XLA:CPU's HLO schedule (docs/benchmarks.md 6b).
This tool's exact 2x4 step at --prompt-len 1024 --chunk-size 256 hangs with the default (concurrency-optimised) schedule
and runs with the memory-optimised one, so the tool asks for the latter (unless XLA_FLAGS names the flag).
"""
import argparse
import os
import statistics
import time

SCHEDULE_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler"


def main():
    if SCHEDULE_FLAG not in os.environ.get("XLA_FLAGS", ""):  # XLA reads its flags when the backend starts
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" {SCHEDULE_FLAG}=false").strip()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups-per-step", "-B", type=int, default=2)
    parser.add_argument("--prompt-len", "-P", type=int, default=256)
    parser.add_argument("--group-size", "-G", type=int, default=2)
    parser.add_argument("--response-len", "-R", type=int, default=8)
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", default="detached,exact")
    args = parser.parse_args()
    import jax
    jax.config.update("jax_num_cpu_devices", 8)  # before JAX first touches the backend
    import numpy as np

    from longstraw_jax import GroupBatch, GRPOConfig, grpo_grads, models, sharding
    from longstraw_jax.sharding import rules

    model = models.build(models.Qwen36Config.tiny())
    params = model.init(jax.random.key(0))
    rng = np.random.default_rng(0)
    b, g, r, vocab = args.groups_per_step, args.group_size, args.response_len, model.config.vocab_size
    batch = GroupBatch(prompt=rng.integers(0, vocab, (b, args.prompt_len)).astype(np.int32),
                       responses=rng.integers(0, vocab, (b, g, r)).astype(np.int32),
                       mask=np.ones((b, g, r), np.float32), rewards=rng.normal(size=(b, g)).astype(np.float32))
    rows = []
    for mode in args.modes.split(","):
        times = {}
        for spec, devices in (("1x4", jax.devices()[:4]), ("2x4", jax.devices())):
            mesh = sharding.make_mesh(spec, devices)
            placed = jax.device_put(params, rules.named(rules.param_specs(params, mesh), mesh))
            run = lambda: jax.block_until_ready(grpo_grads(model, placed, batch, GRPOConfig(), mode,
                                                           chunk_size=args.chunk_size, mesh=mesh))
            run()  # compile
            samples = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                run()
                samples.append(time.perf_counter() - start)
            times[spec] = statistics.median(samples)
        rows.append((mode, times["1x4"], times["2x4"], times["2x4"] / times["1x4"]))
    print("| mode | B | P | 1x4 median s | 2x4 median s | 2x4 / 1x4 |\n| --- | ---: | ---: | ---: | ---: | ---: |")
    for mode, one, two, ratio in rows:
        print(f"| {mode} | {b} | {args.prompt_len} | {one:.2f} | {two:.2f} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
