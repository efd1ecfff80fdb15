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

--group-ratio prints only a third table (one device): a group of G branches decoded together against a group of one
branch (`sample_groups` with group_size G and 1, the trainer's sampler: the prompt's capture included), the decode
part alone (`sample_captured` after a capture made once, timed apart: a group's branch loop), and the capture alone,
median seconds and the ratios G / 1, all in one run. Branches decoded together should cost about one branch's weight
reads plus the per-branch work (issue 41 item 7: <= 2x at G 8, P 512, R 256); --width D widens the model (hidden D),
so that the weights a group reads once weigh against the per-branch work:

    .venv/bin/python tools/bench_sampling.py --group-ratio -P 512 -R 256 -G 8
    .venv/bin/python tools/bench_sampling.py --group-ratio -P 512 -R 256 -G 8 --width 512
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
    p.add_argument("--group-ratio", action="store_true",
                   help="only the table of a group of G branches decoded together vs a group of 1 (one device)")
    p.add_argument("--width", type=int, default=64,
                   help="the models' width D (hidden D, MLPs in the preset's proportions; 64: the preset)")
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


def _model(family: str, width: int = 64):
    """The family's tiny preset at O(1) scale; `width` D: hidden size D and the MLPs' widths in the preset's
    proportions (Qwen3.6's intermediate 2 D, GLM-5.x's experts D / 2), heads as the preset's (D 64: the preset)."""
    import jax

    from longstraw_jax import models

    config = (models.Qwen36Config.tiny(vocab_size=512, hidden_size=width, intermediate_size=2 * width)
              if family == "qwen36" else
              models.Glm52Config.tiny(vocab_size=512, hidden_size=width, intermediate_size=2 * width,
                                      moe_intermediate_size=max(1, width // 2)))
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

    model, params = _model(family, args.width)
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

    model, params = _model(family, args.width)
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
    return render_table(head, body, markdown)


FIRST_TOLERANCE = 1e-4  # max |difference| of the two groups' first-token log-probs (float32 round-off)


def measure_group_ratio(family: str, args) -> dict:
    """One device: a group of G branches decoded together vs a group of one branch, each timed two ways:
    `sample_groups` (the trainer's sampler: the prompt's capture, then the branches) and the decode alone
    (`sample_captured` after a capture made once), and the capture alone. Each call is compiled first, then --reps
    rounds call every variant once in turn (so that a change in the machine's load touches all of them alike); the
    medians and the ratios G / 1 are of this one run.

    Both groups share the prompt and the key, and a group's branch g samples with `jax.random.split(key, G)[g]`,
    the same key for g = 0 whatever G: the group of one is branch 0 of the group of G (`same_branch`: the same
    tokens), and both captures give the same first-token log-probs (`same_first`: within FIRST_TOLERANCE; the two
    programs are compiled apart, so their float32 round-off may differ)."""
    import jax
    import numpy as np

    from longstraw_jax.sampling import branches as rollout
    from longstraw_jax.sampling.branches import SamplingConfig
    from longstraw_jax.sampling.groups import sample_groups

    model, params = _model(family, args.width)
    prompts = np.random.default_rng(0).integers(0, 512, (1, args.prompt_len)).astype(np.int32)
    keys = jax.random.split(jax.random.key(2), 1)
    sampling = SamplingConfig(response_len=args.response_len)  # no stop token: every branch decodes R tokens
    capture = jax.jit(lambda params, prompt: rollout.capture_prompt(model, params, prompt, args.chunk_size, True))
    state = jax.block_until_ready(capture(params, prompts[0]).state)
    decode = jax.jit(lambda params, state, prompt, key, g: rollout.sample_captured(model, params, state, prompt, key,
                                                                                   g, sampling), static_argnums=4)
    sizes = (1, args.group_size)
    calls = {"capture": lambda: capture(params, prompts[0])}
    for g in sizes:
        calls[f"total_{g}"] = lambda g=g: sample_groups(model, params, prompts, keys, g, sampling, args.chunk_size)
        calls[f"decode_{g}"] = lambda g=g: decode(params, state, prompts[0], keys[0], g)
    outs = {name: jax.block_until_ready(call()) for name, call in calls.items()}  # compiles
    times = {name: [] for name in calls}
    for _ in range(args.reps):
        for name, call in calls.items():
            start = time.perf_counter()
            jax.block_until_ready(call())
            times[name].append(time.perf_counter() - start)
    row = dict(family=family, width=args.width, **{name: statistics.median(t) for name, t in times.items()})
    rollouts = {g: outs[f"total_{g}"][0] for g in sizes}
    for g in sizes:  # one sampler, two ways: sample_groups' group 0 is sample_captured's group
        assert np.array_equal(np.asarray(outs[f"decode_{g}"].responses), np.asarray(rollouts[g].responses[0]))
    one, group = rollouts[1], rollouts[args.group_size]
    row["first_diff"] = float(np.max(np.abs(np.asarray(one.first_logprobs) - np.asarray(group.first_logprobs))))
    row["same_first"] = row["first_diff"] <= FIRST_TOLERANCE
    row["same_branch"] = bool(np.array_equal(np.asarray(one.responses[0, 0]), np.asarray(group.responses[0, 0])))
    g = args.group_size
    row["ratio_total"] = row[f"total_{g}"] / row["total_1"]
    row["ratio_decode"] = row[f"decode_{g}"] / row["decode_1"]
    return row


def format_group_ratio(rows: list[dict], args, markdown: bool) -> str:
    g = args.group_size
    head = ["family", "width", "capture s", "G 1 s", f"G {g} s", f"G {g} / G 1", "decode G 1 s", f"decode G {g} s",
            f"decode G {g} / G 1", "first log-probs max diff", "branch 0 same tokens"]
    body = [[r["family"], str(r["width"]), f"{r['capture']:.3f}", f"{r['total_1']:.3f}", f"{r[f'total_{g}']:.3f}",
             f"{r['ratio_total']:.2f}x", f"{r['decode_1']:.3f}", f"{r[f'decode_{g}']:.3f}", f"{r['ratio_decode']:.2f}x",
             f"{r['first_diff']:.1e}" + ("" if r["same_first"] else " (NO)"), "yes" if r["same_branch"] else "NO"]
            for r in rows]
    return render_table(head, body, markdown)


def render_table(head: list[str], body: list[list[str]], markdown: bool) -> str:
    """A table as aligned text, or as Markdown (tools/bench_gated_delta.py's too)."""
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
    return render_table(head, body, markdown)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.group_ratio:
        _setup_jax([])
        rows = [measure_group_ratio(family, args) for family in args.families.split(",")]
        print(f"a group of G {args.group_size} decoded together vs a group of 1, one device: P {args.prompt_len}, "
              f"R {args.response_len}, chunk {args.chunk_size}, median of {args.reps}")
        print(format_group_ratio(rows, args, args.markdown))
        return 0 if all(r["same_first"] and r["same_branch"] for r in rows) else 1
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
