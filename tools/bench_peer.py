"""One GRPO update side by side with TRL's GRPOTrainer: the same tiny Qwen3.6, the same tokens, G x R, prompt P.

    .venv/bin/python tools/bench_peer.py --sides ours --quick                   # smoke run, no TRL needed
    PY=/path/to/venv-with-trl/bin/python
    flock /tmp/longstraw-bench.lock $PY tools/bench_peer.py -P 1024,4096,16384 --markdown --json-out peer.json

TRL is never a dependency of the project: `pip install -e '.[peer]'` (pyproject.toml) in a venv of its own adds it,
and `--peer-python` names another interpreter for the TRL side only (default: this one). Nothing in CI imports it.

The model: `Qwen36Config.tiny()` (8 layers LLLF x 2, D 64, vocab 512) with random O(1) weights (norms, biases, the
GDN's A_log / dt_bias / conv rescaled as tests/hf_reference.py does, matrices N(0, 1/fan_in)), saved once with
`models.save_hf` (config.json + safetensors). Ours loads it with `models.load_hf`, TRL with
`Qwen3_5ForCausalLM.from_pretrained`: the same weights, float32 on both sides.

The batch: one group, a prompt of P random token ids, G completions of exactly R random ids (every token real, so
TRL's "dapo" normalisation and our token-mean are the same number), G random rewards. Advantages are ours,
(r - mean) / (population std + 1e-6), and TRL is handed the same values, so both sides minimise the same loss and
the gradient norms must agree (both columns are printed).

What is timed -- the update alone, from token ids to updated weights, on both sides (no sampling on either side):
- ours: `train.jitted_train_step_donated` (the trainer's update program) with no sampler capture passed, so it
  captures the prompt itself (P - 1 positions, chunked), replays the G branches and, in exact mode, backpropagates
  into the prompt; then gradient clipping (1.0) and AdamW. One compiled program; compile time is reported apart.
  Exact and detached each in its own child process. `--chunk-size` (default: the trainer's, 256) and
  `--replay-batch` (default 1, the trainer's) as the trainer's options.
- TRL: `GRPOTrainer._compute_loss` on the prepared inputs (prompt_ids / completion_ids / masks / advantages, the dict
  its `_generate_and_score_completions` returns, with old log-probs absent as on-policy with num_iterations 1:
  forward of G x (P + R) tokens with the fused LM head on the R completion positions, entropies, the clipped
  surrogate), `accelerator.backward`, `clip_grad_norm_(1.0)`, `optimizer.step()` (the trainer's AdamW) and
  `zero_grad()`: what `Trainer._inner_training_loop` runs for one step after `_prepare_inputs`. TRL's own defaults
  otherwise (gradient checkpointing on: `--no-trl-gradient-checkpointing` turns it off), except bf16 off (float32, as
  ours) and per_device_train_batch_size = G (the whole group in one forward, TRL's usual setting).
TRL has no detached mode: it always backpropagates through the G copies of the prompt (our exact mode computes that
same gradient with one copy). Times are medians of --reps steps after one warm-up step, each side in its own child
process (one at a time); the ratio TRL / ours is of medians measured in one invocation.

The parent imports neither JAX nor torch; each child prints `BENCH_JSON` lines (tools/bench_harness.py).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import bench_harness
from bench_step_runner import make_snapshot

QUICK = dict(prompt_lens=[96], response_len=8, group_size=4, reps=1)


def _int_list(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-lens", "-P", type=_int_list, default=None, help="comma list (default 1024,4096,16384)")
    ap.add_argument("--response-len", "-R", type=int, default=None, help="R (default 64)")
    ap.add_argument("--group-size", "-G", type=int, default=None, help="G (default 8)")
    ap.add_argument("--modes", default="exact,detached", help="our engine's modes (comma list of exact, detached)")
    ap.add_argument("--sides", default="ours,trl", help="comma list of ours, trl")
    ap.add_argument("--reps", type=int, default=None, help="timed steps per cell after one warm-up (default 3)")
    ap.add_argument("--chunk-size", type=int, default=None,
                    help="our prompt chunk (default: the trainer's --chunk-size default)")
    ap.add_argument("--replay-batch", type=int, default=1, help="our --replay-batch K (default 1)")
    ap.add_argument("--peer-python", default=sys.executable,
                    help="the interpreter that runs the TRL side (a venv with trl; default: this one)")
    ap.add_argument("--trl-gradient-checkpointing", action=argparse.BooleanOptionalAction, default=True,
                    help="TRL's gradient checkpointing (TRL's GRPOConfig default: on)")
    ap.add_argument("--learning-rate", type=float, default=1e-5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--checkpoint", help="use (or create) the tiny checkpoint in this directory (default: a temp dir)")
    ap.add_argument("--quick", action="store_true", help="smoke run: P 96, R 8, G 4, 1 rep")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--json-out", help="write the command, the rows and every raw result to this JSON file")
    ap.add_argument("--child-timeout", type=float, default=3600)
    ap.add_argument("--snapshot", action=argparse.BooleanOptionalAction, default=True,
                    help="our children import a copy of longstraw_jax/ taken at start (default on)")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        return args
    for k, v in dict(prompt_lens=[1024, 4096, 16384], response_len=64, group_size=8, reps=3).items():
        if getattr(args, k) is None:
            setattr(args, k, QUICK[k] if args.quick else v)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    args.sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    if set(args.modes) - {"exact", "detached"} or set(args.sides) - {"ours", "trl"}:
        ap.error("--modes: exact, detached; --sides: ours, trl")
    if min(args.prompt_lens) < 2 or args.reps < 1:
        ap.error("prompt lengths must be >= 2 and --reps >= 1")
    return args


# ----- the model and the batch (both sides) -----


def batch_arrays(vocab: int, p: int, r: int, g: int, seed: int):
    """(prompt [P], completions [G, R], rewards [G], advantages [G]) as numpy: every completion token is real."""
    import numpy as np

    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, vocab, p, dtype=np.int32)
    completions = rng.integers(0, vocab, (g, r), dtype=np.int32)
    rewards = rng.random(g).astype(np.float32)
    advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-6)  # ours: GRPOConfig adv_norm "std", eps 1e-6
    return prompt, completions, rewards, advantages.astype(np.float32)


def make_checkpoint(directory: str, seed: int) -> dict:
    """The tiny Qwen3.6 with random O(1) weights, saved with `models.save_hf` (config.json + safetensors)."""
    import jax
    import numpy as np
    from flax import traverse_util

    from longstraw_jax import models

    model = models.build(models.Qwen36Config.tiny())
    shapes = jax.eval_shape(model.init, jax.random.key(0))
    rng = np.random.default_rng(seed)
    flat = {}
    for path, leaf in traverse_util.flatten_dict(shapes, sep="/").items():
        r = rng.standard_normal(leaf.shape)
        name = path.split("/")[-1]
        if name == "A_log":
            value = np.log(rng.random(leaf.shape) * 4 + 0.25)
        elif name in ("dt_bias", "conv1d"):
            value = 0.5 * r
        elif path.endswith("linear/norm"):  # the GDN's gated RMSNorm multiplies by w (not 1 + w)
            value = 1.0 + 0.3 * r
        elif name.endswith("norm"):  # (1 + w) norms
            value = 0.3 * r
        else:  # matrices [..., out, in]; the embedding at O(1)
            value = r if name == "embed" else r / np.sqrt(leaf.shape[-1])
        flat[path] = jax.numpy.asarray(value, jax.numpy.float32)
    models.save_hf(model, traverse_util.unflatten_dict(flat, sep="/"), directory)
    return dict(vocab=model.config.vocab_size)


# ----- children -----


def ours_child(spec: dict) -> None:
    """Our update in spec["mode"] at each spec["P"], one compiled program per P; one result line each."""
    import jax
    import numpy as np

    from longstraw_jax import GroupBatch, GRPOConfig, models, train
    from longstraw_jax.trainer.config import RunConfig

    for p in spec["P"]:
        model, params = models.load_hf(spec["checkpoint"])
        prompt, completions, rewards, advantages = batch_arrays(model.config.vocab_size, p, spec["R"], spec["G"],
                                                                spec["seed"])
        batch = GroupBatch(prompt=prompt, responses=completions, mask=np.ones(completions.shape, np.float32),
                           rewards=rewards, old_logprobs=None, ref_logprobs=None)
        chunk = spec["chunk"] or RunConfig().chunk_size  # the trainer's --chunk-size default
        cfg = GRPOConfig(replay_batch=spec["replay_batch"])
        optimizer = train.make_optimizer(spec["lr"])
        opt_state = optimizer.init(params)
        abstract = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
        t = time.perf_counter()
        compiled = train.jitted_train_step_donated.lower(model, abstract(params), abstract(opt_state), abstract(batch),
                                                         optimizer, cfg, spec["mode"], chunk, None).compile()
        compile_s = time.perf_counter() - t
        batch = jax.device_put(batch)
        times, first = [], None
        for i in range(spec["reps"] + 1):
            t = time.perf_counter()
            params, opt_state, metrics = jax.block_until_ready(compiled(params, opt_state, batch))
            if i == 0:
                first = {k: float(v) for k, v in metrics.items() if k in ("loss", "grad_norm")}
            else:
                times.append(time.perf_counter() - t)
        bench_harness.emit(dict(side="ours", mode=spec["mode"], P=p, R=spec["R"], G=spec["G"], chunk=chunk,
                                replay_batch=spec["replay_batch"], compile_s=compile_s, times_s=times,
                                median_s=statistics.median(times), **first, jax=jax.__version__,
                                backend=jax.default_backend()))


def trl_child(spec: dict) -> None:
    """TRL's update at each spec["P"] (see the module docstring); one result line each."""
    import warnings

    import numpy as np
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from tokenizers import Tokenizer, models as tok_models
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    warnings.filterwarnings("ignore")
    vocab = json.load(open(os.path.join(spec["checkpoint"], "config.json")))["vocab_size"]
    # a word-level tokenizer over the model's vocabulary: TRL wants a processing class; the update never tokenizes
    tok = Tokenizer(tok_models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1", unk_token="t0")
    for p in spec["P"]:
        torch.manual_seed(spec["seed"])
        model = AutoModelForCausalLM.from_pretrained(spec["checkpoint"], dtype=torch.float32)
        out_dir = tempfile.mkdtemp(prefix="bench_peer_trl_")
        config = trl.GRPOConfig(output_dir=out_dir, per_device_train_batch_size=spec["G"],
                                num_generations=spec["G"], max_completion_length=spec["R"], bf16=False,
                                gradient_checkpointing=spec["gradient_checkpointing"], learning_rate=spec["lr"],
                                max_grad_norm=1.0, report_to=[], use_cpu=True, logging_steps=1, save_strategy="no")
        dataset = Dataset.from_dict({"prompt": ["t2"] * spec["G"]})
        trainer = trl.GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                                  args=config, train_dataset=dataset, processing_class=tokenizer)
        model = trainer.model
        if spec["gradient_checkpointing"]:  # what Trainer._inner_training_loop does before the first step
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=config.gradient_checkpointing_kwargs)
        trainer.create_optimizer()
        trainer.current_gradient_accumulation_steps = 1  # set per step by Trainer._inner_training_loop (GA 1)
        optimizer = trainer.optimizer
        model.train()
        prompt, completions, rewards, advantages = batch_arrays(vocab, p, spec["R"], spec["G"], spec["seed"])
        g = spec["G"]
        inputs = dict(prompt_ids=torch.as_tensor(np.tile(prompt.astype(np.int64), (g, 1))),
                      prompt_mask=torch.ones((g, p), dtype=torch.long),
                      completion_ids=torch.as_tensor(completions.astype(np.int64)),
                      completion_mask=torch.ones(completions.shape, dtype=torch.long),
                      advantages=torch.as_tensor(advantages), num_items_in_batch=torch.tensor(float(completions.size)))
        times, first = [], None
        for i in range(spec["reps"] + 1):
            t = time.perf_counter()
            loss = trainer.compute_loss(model, inputs)
            trainer.accelerator.backward(loss)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
            optimizer.step()
            model.zero_grad(set_to_none=True)
            if i == 0:
                first = dict(loss=float(loss.detach()), grad_norm=float(grad_norm))
            else:
                times.append(time.perf_counter() - t)
        shutil.rmtree(out_dir, ignore_errors=True)
        bench_harness.emit(dict(side="trl", mode="full graph", P=p, R=spec["R"], G=g, times_s=times,
                                median_s=statistics.median(times), **first,
                                gradient_checkpointing=spec["gradient_checkpointing"], trl=trl.__version__,
                                torch=torch.__version__, transformers=transformers.__version__,
                                torch_threads=torch.get_num_threads()))


def child_main(spec_json: str) -> None:
    spec = json.loads(spec_json)
    if spec["kind"] == "checkpoint":
        bench_harness.emit(make_checkpoint(spec["checkpoint"], spec["seed"]))
    elif spec["kind"] == "ours":
        ours_child(spec)
    else:
        trl_child(spec)


# ----- the parent -----


def _run(python: str, spec: dict, timeout: float, snapshot: str | None = None) -> list[dict]:
    """One child `python this-script --one SPEC` (snapshot: a copy of longstraw_jax/ first on its path); its result
    rows (a failure is reported and returns none)."""
    cmd = [python, os.path.abspath(__file__), "--one", json.dumps(spec)]
    path = [snapshot, os.path.dirname(os.path.abspath(__file__)), os.environ.get("PYTHONPATH")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, path)))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        print(f"[bench_peer] {spec['kind']} timed out after {timeout:.0f} s", file=sys.stderr, flush=True)
        return []
    rows = bench_harness.result_rows(proc.stdout)
    for r in rows:
        if "median_s" in r:
            print(f"[bench_peer] {r['side']} {r['mode']} P={r['P']}: median {r['median_s']:.3f} s "
                  f"{[round(t, 3) for t in r['times_s']]}", file=sys.stderr, flush=True)
    if proc.returncode != 0:
        print(f"[bench_peer] {spec['kind']} exited {proc.returncode}:\n{proc.stderr[-3000:]}", file=sys.stderr,
              flush=True)
    return rows


def table(args, results: list[dict]) -> tuple[list[str], list[list[str]]]:
    """One row per P: TRL's median, ours per mode, and TRL / ours."""
    cell = {(r["side"], r["mode"], r["P"]): r for r in results}
    head = ["P"]
    if "trl" in args.sides:
        head.append("TRL update")
    for mode in args.modes if "ours" in args.sides else []:
        head.append(f"ours {mode}")
    if "trl" in args.sides and "ours" in args.sides:
        head += [f"TRL / {mode}" for mode in args.modes]
    head += ["loss TRL / ours", "grad norm TRL / ours exact", "chunk"]
    rows = []
    for p in args.prompt_lens:
        trl_r = cell.get(("trl", "full graph", p))
        ours = {m: cell.get(("ours", m, p)) for m in args.modes}
        fmt = lambda r: "—" if r is None else f"{r['median_s']:.3f} s"
        row = [str(p)]
        if "trl" in args.sides:
            row.append(fmt(trl_r))
        if "ours" in args.sides:
            row += [fmt(ours[m]) for m in args.modes]
        if "trl" in args.sides and "ours" in args.sides:
            row += ["—" if trl_r is None or ours[m] is None else f"{trl_r['median_s'] / ours[m]['median_s']:.2f}x"
                    for m in args.modes]
        any_ours = next((r for r in ours.values() if r), None)
        row.append(" / ".join("—" if r is None else f"{r['loss']:.3g}" for r in (trl_r, any_ours)))
        row.append(" / ".join("—" if r is None else f"{r['grad_norm']:.6g}" for r in (trl_r, ours.get("exact"))))
        row.append(str(any_ours["chunk"]) if any_ours else "—")
        rows.append(row)
    return head, rows


def render(head, rows, markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "| " + " | ".join("---" if i == 0 else "---:" for i in
                                                                      range(len(head))) + " |"]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    return "\n".join("  ".join(x.rjust(w) for x, w in zip(r, widths)) for r in [head, *rows])


def _commit() -> str:
    """The checkout's commit (+ "-dirty" when the working tree differs), or "?" outside git."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=repo,
                              timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "longstraw_jax"],
                               capture_output=True, text=True, cwd=repo, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "?"
    return (head or "?") + ("-dirty" if dirty else "")


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.one:
        child_main(args.one)
        return
    start, commit = time.perf_counter(), _commit()  # the source the run measures (its snapshot is taken now)
    tmp = None if args.checkpoint else tempfile.mkdtemp(prefix="bench_peer_")
    ckpt = args.checkpoint or os.path.join(tmp, "tiny-qwen36")
    snapshot = make_snapshot() if args.snapshot else None
    results = []
    try:
        common = dict(checkpoint=ckpt, R=args.response_len, G=args.group_size, seed=args.seed, reps=args.reps,
                      lr=args.learning_rate)
        if not os.path.exists(os.path.join(ckpt, "config.json")):
            if not _run(sys.executable, dict(common, kind="checkpoint"), args.child_timeout, snapshot):
                raise SystemExit("bench_peer: could not write the checkpoint")
        for p in args.prompt_lens:  # one P at a time, both sides next to each other
            if "ours" in args.sides:
                for mode in args.modes:
                    results += _run(sys.executable, dict(common, kind="ours", mode=mode, P=[p], chunk=args.chunk_size,
                                                         replay_batch=args.replay_batch), args.child_timeout,
                                    snapshot)
            if "trl" in args.sides:
                results += _run(args.peer_python, dict(common, kind="trl", P=[p],
                                                       gradient_checkpointing=args.trl_gradient_checkpointing),
                                args.child_timeout)
    finally:
        for d in (tmp, snapshot):
            if d:
                shutil.rmtree(d, ignore_errors=True)
    wall = time.perf_counter() - start
    cmd = "tools/bench_peer.py " + " ".join(sys.argv[1:] if argv is None else argv)
    head, rows = table(args, results)
    versions = {k: v for r in results for k, v in r.items() if k in ("jax", "trl", "torch", "transformers")}
    info = (f"commit {commit} G={args.group_size} R={args.response_len} reps={args.reps} "
            f"replay_batch={args.replay_batch} "
            f"TRL gradient checkpointing={'on' if args.trl_gradient_checkpointing else 'off'} "
            + " ".join(f"{k}={v}" for k, v in sorted(versions.items())))
    print(f"{'`' + cmd + '`' if args.markdown else cmd} — wall time {wall:.0f} s\n{info}\n")
    print(render(head, rows, args.markdown))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(dict(command=cmd, info=info, wall_s=wall, head=head, rows=rows, results=results), f, indent=1)


if __name__ == "__main__":
    main()
