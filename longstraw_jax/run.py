"""`python -m longstraw_jax.run`: GRPO training on long shared prompts, end to end.

Each step: take a prompt (a task's prompt number `data_position`, or the next group of a rollout file), capture it
once and sample G branches from the captured state (rollout.py), score them with the reward function, then one
GRPO update (engine gradients, exact or detached; clipped AdamW). Writes to --out: metrics.jsonl (one line per
step), metrics.png (reward and loss over steps), checkpoints/ (Orbax: params, optimizer state, RNG key, data
position), and with --export-hf a safetensors checkpoint of the final params.

With no arguments: the embedded default, a tiny Qwen3.6 (vocabulary 32) on the synthetic retrieval task (a tool
log with a fact planted at a random depth), 40 exact-mode steps on CPU.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time
import warnings

SENTINEL = object()
# Options that may differ when resuming (everything else must match the checkpointed run's configuration).
RESUMABLE = {"steps", "resume", "out", "export_hf", "log_every", "save_every"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m longstraw_jax.run", description=__doc__.split("\n\n")[1],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    m = p.add_argument_group("model (default: a random tiny Qwen3.6)")
    m.add_argument("--model", default="tiny", help="'tiny' (Qwen36Config.tiny with --vocab-size) or a config.json "
                   "path (random init; unknown fields are an error)")
    m.add_argument("--vocab-size", type=int, default=32, help="vocabulary of the 'tiny' model")
    m.add_argument("--hf", metavar="DIR", help="load config.json + *.safetensors from DIR (models.load_hf)")
    m.add_argument("--init-from", metavar="DIR", help="load an init directory (config.json + Orbax params/), "
                   "e.g. written by tools/convert_hf.py")
    m.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="parameter dtype")
    d = p.add_argument_group("data")
    d.add_argument("--task", default="retrieval", help="built-in task name ('retrieval') or 'module:function' "
                   "factory called with prompt_len, vocab_size, seed")
    d.add_argument("--reward", metavar="MODULE:FUNCTION", help="reward function (prompt_tokens, response_tokens, "
                   "info) -> float; default: the task's")
    d.add_argument("--rollouts", metavar="FILE.jsonl", help="train on externally generated rollouts (one group per "
                   "line) instead of sampling; --task/--reward and the sampling options are then unused")
    d.add_argument("--tokenizer", metavar="tokenizer.json", help="for text fields in --rollouts")
    d.add_argument("--prompt-len", type=int, default=512, help="prompt tokens per group (task prompts)")
    d.add_argument("--depth", type=float, default=None, help="retrieval task: depth of the planted fact in [0, 1] "
                   "(default: random per prompt)")
    s = p.add_argument_group("sampling")
    s.add_argument("--group-size", "-G", type=int, default=8, help="G, response branches per prompt")
    s.add_argument("--response-len", "-R", type=int, default=2, help="max new tokens per branch")
    s.add_argument("--temperature", type=float, default=1.0)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--stop-token", type=int, default=None, help="default: the task's stop token, if it has one")
    t = p.add_argument_group("training")
    t.add_argument("--steps", type=int, default=40, help="total GRPO steps (a resumed run continues up to this)")
    t.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    t.add_argument("--weight-decay", type=float, default=0.0)
    t.add_argument("--max-grad-norm", type=float, default=1.0, help="global-norm clip (0: none)")
    t.add_argument("--mode", default="exact", choices=("exact", "detached"),
                   help="exact: gradient through the prompt (== full graph); detached: prompt state constant")
    t.add_argument("--chunk-size", type=int, default=256, help="prompt chunk length for capture / prompt backward")
    t.add_argument("--loss-agg", default="token-mean",
                   choices=("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"))
    t.add_argument("--kl-coef", type=float, default=0.0, help="k3 KL weight (needs ref_logprobs in --rollouts)")
    t.add_argument("--mesh", metavar="AxB", help="device mesh data x seq (e.g. 1x8); on CPU raises the simulated "
                   "device count to A*B before JAX starts")
    t.add_argument("--seed", type=int, default=0)
    o = p.add_argument_group("output")
    o.add_argument("--out", default=None, help="output directory (default: out/run-<UTC time>)")
    o.add_argument("--resume", action="store_true", help="continue the run in --out from its newest checkpoint")
    o.add_argument("--save-every", type=int, default=20, help="checkpoint every N steps (and after the last)")
    o.add_argument("--export-hf", metavar="DIR", help="write the final params as safetensors + config.json")
    o.add_argument("--log-every", type=int, default=1, help="print a progress line every N steps")
    return p


def parse_args(argv=None) -> tuple[argparse.Namespace, set[str]]:
    """(args, names of the options given explicitly)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    probe = build_parser()
    probe.set_defaults(**{a.dest: SENTINEL for a in probe._actions if a.dest != "help"})
    explicit = {k for k, v in vars(probe.parse_args(argv)).items() if v is not SENTINEL}
    return args, explicit


def check_args(args) -> None:
    """Bounds on the numeric options (one error listing every problem)."""
    errors = []
    for name, low in (("group_size", 1), ("response_len", 1), ("steps", 1), ("chunk_size", 1), ("prompt_len", 2),
                      ("save_every", 1), ("log_every", 1), ("vocab_size", 1)):
        if getattr(args, name) < low:
            errors.append(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= {low}")
    for name in ("lr", "weight_decay", "kl_coef", "temperature", "top_p", "max_grad_norm"):
        if not math.isfinite(getattr(args, name)) or getattr(args, name) < 0:
            errors.append(f"--{name.replace('_', '-')}={getattr(args, name)} must be a finite number >= 0")
    if sum(x is not None for x in (args.hf, args.init_from)) + (args.model != "tiny") > 1:
        errors.append("give at most one of --model <config.json>, --hf, --init-from")
    if args.mesh is not None:
        parts = args.mesh.lower().split("x")
        if len(parts) != 2 or not all(x.isdigit() and int(x) >= 1 for x in parts):
            errors.append(f"--mesh={args.mesh!r} must look like AxB with positive integers (data x seq), e.g. 1x8")
    if errors:
        raise ValueError("; ".join(errors))


class RunError(Exception):
    """A user-facing error: main() prints it on one line and exits with status 2."""


def main(argv=None) -> int:
    try:
        args, explicit = parse_args(argv)
        check_args(args)
        if args.mesh is not None:
            _raise_cpu_device_count(args.mesh)
        return Trainer(args, explicit).run()
    except (RunError, ValueError, FileNotFoundError, FileExistsError, NotImplementedError) as e:
        print(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 2


def _raise_cpu_device_count(mesh: str) -> None:
    """Ask for A*B simulated CPU devices before JAX initialises its backends (no effect on accelerators)."""
    import jax

    count = math.prod(int(x) for x in mesh.lower().split("x"))
    try:
        jax.config.update("jax_num_cpu_devices", max(count, 1))
    except RuntimeError:  # backends already initialised (e.g. in-process tests): keep what exists
        pass


class Trainer:
    """The state of one run: model, data source, optimizer, output directory. `run()` trains and returns 0."""

    def __init__(self, args, explicit: set[str]):
        import jax

        from longstraw_jax import metrics, orbax_io

        self.args = args
        self.out = args.out or os.path.join("out", time.strftime("run-%Y%m%d-%H%M%S", time.gmtime()))
        # Nothing is written before every input has been checked.
        self.checkpoints = None
        saved = None
        ckpt_dir = os.path.join(self.out, orbax_io.CHECKPOINT_DIR)
        if args.resume:
            if not os.path.isdir(ckpt_dir):
                raise RunError(f"--resume: no checkpoint directory {os.path.abspath(ckpt_dir)}")
            self.checkpoints = orbax_io.TrainCheckpoints(self.out, create=False)
            if self.checkpoints.latest_step() is None:
                raise RunError(f"--resume: no checkpoint in {os.path.abspath(ckpt_dir)}")
            saved = self.checkpoints.read_meta()
            self._adopt_saved_config(saved["config"], explicit)
        args = self.args
        if saved is not None and args.steps <= saved["step"]:
            raise RunError(f"--steps={args.steps}: the checkpoint is already at step {saved['step']}")
        self.mesh = self._make_mesh()
        self.model, params = self._load_model()
        if self.mesh is not None:
            from longstraw_jax.sharding.grpo import check_supported

            check_supported(self.model)
        # committed to one device (or FSDP-sharded over --mesh) whatever the source (init, safetensors, Orbax), so
        # the jitted sampler and step see the same argument placement on every call and compile once
        self.params = self._place(params)
        self.vocab = self.model.config.vocab_size
        self._setup_data()
        from longstraw_jax import GRPOConfig

        self.grpo = GRPOConfig(loss_agg=args.loss_agg, kl_coef=args.kl_coef)
        self.optimizer = _optimizer(args.lr, args.weight_decay, args.max_grad_norm or None)
        if saved is None and os.path.isdir(ckpt_dir) and os.listdir(ckpt_dir):
            raise RunError(f"{os.path.abspath(ckpt_dir)} already holds checkpoints: pass --resume to continue "
                           "that run, or choose another --out")
        # committed like the params: a jit output built from an uncommitted init would be committed after step 1
        # and recompile the step once more
        self.opt_state = self._place(jax.jit(self.optimizer.init)(self.params))
        self.key = jax.random.key(args.seed)
        self.step, self.data_position = 0, 0
        if saved is not None:
            self.params, self.opt_state, self.key, meta = self.checkpoints.restore(self.params, self.opt_state)
            self.step, self.data_position = meta["step"], meta["data_position"]
        os.makedirs(self.out, exist_ok=True)
        if self.checkpoints is None:
            self.checkpoints = orbax_io.TrainCheckpoints(self.out)
        self.log = metrics.MetricsLog(os.path.join(self.out, "metrics.jsonl"))
        self.log.keep_until(self.step)
        if saved is None:
            with open(os.path.join(self.out, "config.json"), "w") as f:
                json.dump(self.config(), f, indent=2)

    # ----- setup -----
    def config(self) -> dict:
        return {k: v for k, v in vars(self.args).items() if k not in RESUMABLE}

    def _adopt_saved_config(self, saved: dict, explicit: set[str]) -> None:
        """On --resume the checkpointed configuration is used; an explicit option that contradicts it is an error."""
        for name, value in saved.items():
            if name in explicit and getattr(self.args, name) != value:
                raise RunError(f"--{name.replace('_', '-')}={getattr(self.args, name)!r} differs from the run being "
                               f"resumed ({value!r}); only {sorted(RESUMABLE)} may change on --resume")
            setattr(self.args, name, value)

    def _place(self, tree):
        """Params or optimizer state -> committed to the first device, or on --mesh sharded by the FSDP rules
        (`sharding.rules.param_specs`; optimizer moments like the params, step counts replicated)."""
        import jax

        if self.mesh is None:
            return jax.device_put(tree, jax.local_devices()[0])
        from longstraw_jax.sharding import rules

        params = getattr(self, "params", tree)
        specs = rules.like_params_specs(tree, params, rules.param_specs(params, self.mesh))
        return jax.device_put(tree, rules.named(specs, self.mesh))

    def _make_mesh(self):
        if self.args.mesh is None:
            return None
        try:
            from longstraw_jax.sharding import make_mesh
        except ImportError:
            raise RunError(f"--mesh {self.args.mesh}: sharding (longstraw_jax.sharding.make_mesh) is not available "
                           "in this build yet; run without --mesh") from None
        return make_mesh(self.args.mesh)

    def _load_model(self):
        import jax
        import jax.numpy as jnp

        from longstraw_jax import models, orbax_io

        dtype = jnp.dtype(self.args.dtype)
        with warnings.catch_warnings():
            # unknown config.json fields are errors here, not warnings (the model configs warn about them)
            warnings.filterwarnings("error", message=r"(?i).*unknown", category=UserWarning)
            try:
                if self.args.hf:
                    return models.load_hf(self.args.hf, dtype=dtype)
                if self.args.init_from:
                    return orbax_io.load_init_dir(self.args.init_from, dtype=dtype)
                if self.args.model == "tiny":
                    config = models.Qwen36Config.tiny(vocab_size=self.args.vocab_size)
                else:
                    if not os.path.isfile(self.args.model):
                        raise RunError(f"--model {self.args.model}: no such config file (or use 'tiny')")
                    config = _config_from_file(self.args.model)
            except UserWarning as w:
                raise RunError(str(w)) from None
        model = models.build(config)
        return model, jax.jit(model.init, static_argnums=1)(jax.random.key(self.args.seed), dtype)

    def _setup_data(self) -> None:
        from longstraw_jax.tasks import load_callable, make_task
        from longstraw_jax.tasks.rollout_file import load_rollouts

        args = self.args
        self.groups = self.task = None
        if args.rollouts:
            self.groups = load_rollouts(args.rollouts, self.vocab, args.tokenizer)
            return
        if args.kl_coef > 0:
            raise RunError(f"--kl-coef={args.kl_coef}: sampled rollouts have no reference log-probs; the KL term needs "
                           "a --rollouts file with ref_logprobs")
        self.task = make_task(args.task, prompt_len=args.prompt_len, vocab_size=self.vocab, seed=args.seed,
                              **({"depth": args.depth} if args.depth is not None else {}))
        self.reward_fn = load_callable(args.reward) if args.reward else self.task.reward
        from longstraw_jax.rollout import SamplingConfig

        stop = args.stop_token if args.stop_token is not None else getattr(self.task, "stop_token", None)
        self.sampling = SamplingConfig(max_new_tokens=args.response_len, temperature=args.temperature,
                                       top_p=args.top_p, stop_token=stop, pad_token=getattr(self.task, "pad_token", 0))
        for name in ("stop_token", "pad_token"):
            value = getattr(self.sampling, name)
            if value is not None and value >= self.vocab:
                raise RunError(f"{name}={value} is out of range: ids must be in [0, vocab_size={self.vocab})")

    # ----- one step -----
    def next_batch(self):
        """(GroupBatch, extra metrics) for the current step; sampling key = fold_in(run key, step)."""
        import jax
        import numpy as np

        from longstraw_jax import GroupBatch
        from longstraw_jax.rollout import sample_group
        from longstraw_jax.tasks import score

        if self.groups is not None:
            return self.groups[self.data_position % len(self.groups)], {}
        prompt = self.task.prompt(self.data_position)
        rollout = sample_group(self.model, self.params, prompt.tokens, self.args.group_size, self.sampling,
                               jax.random.fold_in(self.key, self.step), chunk_size=self.args.chunk_size)
        responses, mask = np.asarray(rollout.responses), np.asarray(rollout.mask)
        rewards = score(self.reward_fn, prompt, responses, mask)
        extra = {}
        if hasattr(self.task, "is_correct"):
            extra["accuracy"] = float(np.mean([self.task.is_correct(r[m > 0], prompt.info)
                                               for r, m in zip(responses, mask)]))
        batch = GroupBatch(prompt=prompt.tokens, responses=responses, mask=mask, rewards=rewards,
                           old_logprobs=np.asarray(rollout.logprobs))
        return batch, extra

    def train_one(self) -> dict:
        import jax

        from longstraw_jax import metrics, train_step

        start = time.perf_counter()
        batch, extra = self.next_batch()
        sampled = time.perf_counter()
        self.params, self.opt_state, step_metrics = train_step(
            self.model, self.params, self.opt_state, batch, self.optimizer, self.grpo, self.args.mode,
            self.args.chunk_size, **({"mesh": self.mesh} if self.mesh is not None else {}))
        step_metrics = jax.device_get(step_metrics)
        done = time.perf_counter()
        self.step += 1
        self.data_position += 1
        prompt_tokens = int(batch.prompt.shape[0])
        response_tokens = int(batch.mask.sum())
        peak, source = metrics.peak_memory()
        record = {"step": self.step, **{k: float(v) for k, v in step_metrics.items()}, **extra,
                  "prompt_tokens": prompt_tokens, "response_tokens": response_tokens,
                  "group_size": int(batch.responses.shape[0]),
                  "tokens_per_s": (prompt_tokens + response_tokens) / (done - start),
                  "rollout_s": sampled - start, "update_s": done - sampled, "step_s": done - start,
                  "peak_mem_bytes": peak, "peak_mem_source": source}
        self.log.write(record)
        return record

    # ----- the loop -----
    def run(self) -> int:
        import jax

        from longstraw_jax import metrics, models

        args = self.args
        c = self.model.config
        source = "rollout file " + args.rollouts if self.groups is not None else f"task {self.task.name}"
        print(f"model: {type(c).__name__} {c.num_hidden_layers} layers, hidden {c.hidden_size}, vocab {c.vocab_size}"
              f" ({sum(x.size for x in jax.tree.leaves(self.params)) / 1e6:.2f} M params, {args.dtype}); "
              f"devices: {len(jax.devices())} x {jax.devices()[0].platform}")
        print(f"data: {source}; prompt {args.prompt_len if self.groups is None else 'from file'} tokens, "
              f"G={args.group_size if self.groups is None else 'from file'}, mode={args.mode}, chunk {args.chunk_size}"
              f"; steps {self.step + 1}..{args.steps}; out: {self.out}")
        records = []
        wall = time.perf_counter()
        while self.step < args.steps:
            record = self.train_one()
            records.append(record)
            if self.step % args.log_every == 0 or self.step == args.steps:
                print(_progress(record, args.steps), flush=True)
            if self.step % args.save_every == 0 or self.step == args.steps:
                self.checkpoints.save(self.step, self.params, self.opt_state, self.key, self.data_position,
                                      self.config())
        wall = time.perf_counter() - wall
        self.checkpoints.close()
        history = metrics.read_metrics(self.log.path)
        metrics.plot_metrics(history, os.path.join(self.out, "metrics.png"),
                             title=f"GRPO ({args.mode}) on {source}")
        if args.export_hf:
            models.save_hf(self.model, self.params, args.export_hf)
        print(_summary(records, history, wall, self, args))
        return 0


@functools.lru_cache(maxsize=None)
def _optimizer(learning_rate: float, weight_decay: float, max_grad_norm: float | None):
    """One optimizer object per setting: `train_step` compiles once per optimizer object (a static argument), so
    runs in one process with equal settings (e.g. a run and its resumption) share the compiled step."""
    from longstraw_jax import make_optimizer

    return make_optimizer(learning_rate, weight_decay=weight_decay, max_grad_norm=max_grad_norm)


def _config_from_file(path: str):
    """A model config from an HF-style JSON file with any name (dispatch on its model_type)."""
    from longstraw_jax.models.hf import CONFIG_CLASSES

    with open(path) as f:
        model_type = json.load(f).get("model_type")
    if model_type not in CONFIG_CLASSES:
        raise RunError(f"{path}: model_type={model_type!r}; supported: {', '.join(sorted(CONFIG_CLASSES))}")
    return CONFIG_CLASSES[model_type].from_hf(path)


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _progress(r: dict, total: int, width: int = 20) -> str:
    filled = round(width * r["step"] / total)
    acc = f" acc {r['accuracy']:.2f}" if "accuracy" in r else ""
    skipped = " SKIPPED (non-finite)" if r.get("skipped") else ""
    return (f"[{'#' * filled}{'.' * (width - filled)}] {r['step']:>4}/{total} reward {r['reward_mean']:.3f}"
            f"±{r['reward_std']:.3f}{acc} loss {r['loss']:+.4f} kl {r['kl']:.4f} | {r['step_s']:.2f} s/step "
            f"(rollout {r['rollout_s']:.2f}) {r['tokens_per_s']:,.0f} tok/s | peak mem {_gib(r['peak_mem_bytes'])} "
            f"({r['peak_mem_source']}){skipped}")


def _summary(records: list[dict], history: list[dict], wall: float, trainer: Trainer, args) -> str:
    import numpy as np

    n = max(1, min(10, len(history) // 2))
    head, tail = history[:n], history[-n:]
    mean = lambda rows, k: float(np.mean([r[k] for r in rows if r.get(k) is not None]))
    lines = [f"done: {len(records)} steps this run ({records[0]['step']}..{records[-1]['step']}) in {wall:.1f} s; "
             f"median step {np.median([r['step_s'] for r in records[1:] or records]):.2f} s (first step incl. "
             f"compile {records[0]['step_s']:.1f} s)",
             f"reward mean: first {n} steps {mean(head, 'reward_mean'):.3f} -> last {n} steps "
             f"{mean(tail, 'reward_mean'):.3f}"]
    if trainer.task is not None and hasattr(trainer.task, "chance_reward"):
        lines[-1] += f" (uniform guessing among answers: {trainer.task.chance_reward:.3f})"
    if "accuracy" in history[-1]:
        chance = getattr(trainer.task, "chance_accuracy", None)
        lines.append(f"accuracy: first {n} {mean(head, 'accuracy'):.3f} -> last {n} {mean(tail, 'accuracy'):.3f}"
                     + (f" (chance {chance:.3f})" if chance is not None else ""))
    skipped = sum(int(r["skipped"]) for r in records)
    lines.append(f"loss (last step) {records[-1]['loss']:+.4f}; skipped updates {skipped}; peak mem "
                 f"{_gib(max(r['peak_mem_bytes'] for r in records))} ({records[-1]['peak_mem_source']})")
    out = trainer.out
    files = [os.path.join(out, "metrics.jsonl"), os.path.join(out, "metrics.png"),
             os.path.join(trainer.checkpoints.directory, str(trainer.step))]
    if args.export_hf:
        files.append(args.export_hf)
    lines.append("wrote: " + ", ".join(files))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
