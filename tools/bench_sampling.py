"""Benchmark the sampler: branches decoded one after another (--decode-batch 1) vs all G together, per family; and
agent branches (episodes with tool turns) vs the same number of tokens decoded without turns.

    .venv/bin/python tools/bench_sampling.py --quick                 # smoke run (tiny models, P 256, G 4, R 8)
    .venv/bin/python tools/bench_sampling.py                         # P 2048, G 8, R 64, one device and 1x8
    .venv/bin/python tools/bench_sampling.py --families qwen36 --mesh 1x8,2x4 --markdown

For each family (a tiny Qwen3.6 / GLM-5.x at O(1) scale), where (one device, or a simulated CPU mesh) and decode
batch (1, then G), it compiles `sampling.groups.sample_groups` once (the trainer's sampler: B = the mesh's data size
groups, captures kept), checks that both batches draw the same tokens, and times --reps calls after a warm-up: the
median seconds and the ratio sequential / batched, all measured in one run (compare ratios, not absolute times,
across machines). "decode steps" is the sampling phase's sequential length per group: G x R one at a time, R
together. On CPU the ratio shows the removed sequential steps; on a GPU it also shows the batched matmuls.

The second table (one device, --turns K > 0): G episodes of K policy turns of --turn-len tokens, an environment
answering each but the last with --observation-len tokens (`sampling.turns.sample_episodes`), against
`sample_groups` decoding the same number of positions, K x turn-len + (K - 1) x observation-len, without turns;
the episodes' time split into the prompt's capture, policy decoding, the environment's calls and the observation
extends.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

QUICK = dict(prompt_len=256, group_size=4, response_len=8, reps=2, chunk_size=64, turns=2, turn_len=4,
             observation_len=4)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", default="qwen36,glm52", help="comma-separated: qwen36, glm52")
    p.add_argument("--mesh", default="1x8", help="comma-separated meshes (data x seq) besides one device; '' for none")
    p.add_argument("--prompt-len", "-P", type=int, default=2048)
    p.add_argument("--group-size", "-G", type=int, default=8)
    p.add_argument("--response-len", "-R", type=int, default=64)
    p.add_argument("--chunk-size", type=int, default=512)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--turns", type=int, default=4, help="policy turns per episode in the agent table (0: no table)")
    p.add_argument("--turn-len", type=int, default=16, help="tokens per policy turn in the agent table")
    p.add_argument("--observation-len", type=int, default=16, help="tokens of each observation in the agent table")
    p.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK}")
    p.add_argument("--markdown", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        for name, value in QUICK.items():
            setattr(args, name, value)
    return args


def _setup_jax(meshes: list[str]) -> None:
    """Enough simulated CPU devices for the largest mesh, before JAX starts."""
    devices = max([1] + [int(a) * int(b) for a, b in (m.split("x") for m in meshes)])
    import jax

    jax.config.update("jax_num_cpu_devices", devices)  # the CPU backend's; a GPU run ignores it


def _model(family: str):
    import jax

    from longstraw_jax import models

    config = (models.Qwen36Config.tiny(vocab_size=512) if family == "qwen36"
              else models.Glm52Config.tiny(vocab_size=512))
    model = models.build(config)
    params = model.init(jax.random.key(0))
    # O(1)-scale weights (the default init makes every distribution nearly uniform)
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    scaled = [x + 0.3 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    return model, jax.tree.unflatten(tree, scaled)


def measure(family: str, mesh_spec: str | None, args) -> list[dict]:
    """Rows for one family and place: decode batch 1 and G, same key, same tokens."""
    import jax
    import numpy as np

    from longstraw_jax import sharding
    from longstraw_jax.sampling.branches import SamplingConfig
    from longstraw_jax.sampling.groups import sample_groups
    from longstraw_jax.sharding import rules

    model, params = _model(family)
    mesh = sharding.make_mesh(mesh_spec) if mesh_spec else None
    groups = mesh.shape["data"] if mesh else 1
    if mesh:
        params = jax.device_put(params, rules.named(rules.param_specs(params, mesh), mesh))
    prompts = np.random.default_rng(0).integers(0, 512, (groups, args.prompt_len)).astype(np.int32)
    keys = jax.random.split(jax.random.key(2), groups)
    rows, tokens = [], {}
    for batch in (1, args.group_size):
        sampling = SamplingConfig(response_len=args.response_len, decode_batch=batch)
        call = lambda: jax.block_until_ready(sample_groups(model, params, prompts, keys, args.group_size, sampling,
                                                           args.chunk_size, mesh=mesh))
        start = time.perf_counter()
        rollouts, _ = call()
        first = time.perf_counter() - start
        times = []
        for _ in range(args.reps):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        tokens[batch] = np.asarray(rollouts.responses)
        steps = (args.group_size // batch) * args.response_len
        rows.append(dict(family=family, where=mesh_spec or "1 device", batch=batch, decode_steps=steps,
                         compile_and_first_s=first, median_s=statistics.median(times)))
    same = bool(np.array_equal(tokens[1], tokens[args.group_size]))
    for row in rows:
        row["same_tokens"] = same
        row["ratio"] = rows[0]["median_s"] / row["median_s"]
    return rows


class FixedReplies:
    """An environment answering every turn with `length` token ids (never done: episodes run --turns turns)."""

    def __init__(self, vocab_size, seed, length=16):
        self.reply = list(range(2, 2 + length))

    def reset(self, prompt_tokens, info, branch):
        pass

    def step(self, turn):
        return self.reply, 0.0, False


def measure_turns(family: str, args) -> dict:
    """One device: G episodes with --turns tool turns vs the same positions decoded without turns (median of
    --reps each, after a first call that compiles)."""
    import jax
    import numpy as np

    from longstraw_jax.sampling.branches import SamplingConfig
    from longstraw_jax.sampling.groups import sample_groups
    from longstraw_jax.sampling.turns import TurnConfig, sample_episodes

    model, params = _model(family)
    prompts = np.random.default_rng(0).integers(0, 512, (1, args.prompt_len)).astype(np.int32)
    keys = jax.random.split(jax.random.key(2), 1)
    positions = args.turns * args.turn_len + (args.turns - 1) * args.observation_len
    sampling = SamplingConfig(response_len=positions)  # no stop token: every turn is turn-len tokens
    turns = TurnConfig(max_turns=args.turns, turn_len=args.turn_len)
    envs = [FixedReplies(512, 0, args.observation_len) for _ in range(args.group_size)]
    episodes = lambda: sample_episodes(model, params, prompts, keys, args.group_size, sampling, turns, envs,
                                       args.chunk_size)
    plain = lambda: jax.block_until_ready(sample_groups(model, params, prompts, keys, args.group_size, sampling,
                                                        args.chunk_size))
    row = dict(family=family, positions=positions)
    for name, call in (("plain", plain), ("episodes", episodes)):
        call()
        times, splits = [], []
        for _ in range(args.reps):
            start = time.perf_counter()
            out = call()
            times.append(time.perf_counter() - start)
            if name == "episodes":
                splits.append(out.timings)
                transcript = out.transcripts[0][0]
        row[name] = statistics.median(times)
    for part in ("capture_s", "decode_s", "env_s", "observe_s"):
        row[part] = statistics.median(s[part] for s in splits)
    row["observed"] = transcript.observation_tokens
    row["ratio"] = row["episodes"] / row["plain"]
    return row


def format_turns(rows: list[dict], args, markdown: bool) -> str:
    head = ["family", "positions / branch", "observation tokens", "no turns s", "with turns s", "ratio",
            "capture s", "policy decode s", "environment s", "observation extend s"]
    body = [[r["family"], str(r["positions"]), str(r["observed"]), f"{r['plain']:.3f}", f"{r['episodes']:.3f}",
             f"{r['ratio']:.2f}x", f"{r['capture_s']:.3f}", f"{r['decode_s']:.3f}", f"{r['env_s']:.3f}",
             f"{r['observe_s']:.3f}"] for r in rows]
    return _table(head, body, markdown)


def _table(head: list[str], body: list[list[str]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in body])
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    return "\n".join("  ".join(x.rjust(w) for x, w in zip(r, widths)) for r in [head] + body)


def format_table(rows: list[dict], markdown: bool) -> str:
    head = ["family", "where", "decode batch", "decode steps / group", "first call s", "median s", "speed-up",
            "same tokens"]
    body = [[r["family"], r["where"], str(r["batch"]), f"{r['decode_steps']:,}", f"{r['compile_and_first_s']:.2f}",
             f"{r['median_s']:.3f}", f"{r['ratio']:.2f}x", "yes" if r["same_tokens"] else "NO"] for r in rows]
    return _table(head, body, markdown)


def main(argv=None) -> int:
    args = parse_args(argv)
    meshes = [m for m in args.mesh.split(",") if m]
    _setup_jax(meshes)
    rows = []
    for family in args.families.split(","):
        for mesh_spec in [None] + meshes:
            rows += measure(family, mesh_spec, args)
    print(f"sampling: P {args.prompt_len}, G {args.group_size}, R {args.response_len}, chunk {args.chunk_size}, "
          f"median of {args.reps}")
    print(format_table(rows, args.markdown))
    if args.turns:
        turns = [measure_turns(family, args) for family in args.families.split(",")]
        print(f"\nagent branches, one device: G {args.group_size} episodes of {args.turns} turns x {args.turn_len} "
              f"tokens, observations of {args.observation_len} tokens, vs the same positions without turns; median of "
              f"{args.reps}")
        print(format_turns(turns, args, args.markdown))
    return 0 if all(r["same_tokens"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
