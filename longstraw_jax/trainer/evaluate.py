"""Held-out evaluation: greedy answers to K fixed prompts that training never draws.

    evaluator = Evaluator(task, reward_fn, num_prompts=K, response_len=R, chunk_size=C, mesh=None)
    metrics = evaluator(model, params)      # {"eval_accuracy", "eval_reward", "eval_entropy", ...}

The K prompts are `held_out_task(...)`'s prompts 0..K-1: the task built with seed `held_out_seed(seed)` = seed with bit
31 flipped. The trainer draws its prompts from the task built with `seed` (and the warm-up, trainer/warmup.py, from seed
with bit 30 flipped): a task whose prompts are a function of (seed, index), as the built-in retrieval task's are
(`np.random.default_rng([seed, index])`), gives the evaluation a stream of its own. (Flipping a bit keeps the seed's
number of 32-bit words: an offset such as seed + 2**32 would not, and numpy's seeding reads [s + 2**32, j] as the words
[s, 1, j], which it pads like [s, 1]: training prompt 1 would be held-out prompt 0.) Each prompt is answered by the
trainer's sampler (`sampling.groups.sample_groups`, on the mesh when there is one) with one greedy branch (temperature
0, from the captured prompt state), scored by the reward function, and by `task.is_correct` when the task has it.
Besides accuracy and reward, the first response token's distribution gives `eval_entropy` and, against the distribution
of a reference evaluation (the run's start), `eval_kl_to_start` = KL(policy || start policy).

    python -m longstraw_jax.evaluate --init-from DIR | --hf DIR | --resume OUT [--resume-step N]
        [--prompt-len P] [--depth D] [--eval-prompts K] [--mesh AxB] [--json FILE]

scores a checkpoint on its own: with --resume, the latest (or N-th) checkpoint of a trainer run, with that run's
task, model and sampling options unless given (e.g. `--prompt-len 1024` scores a policy trained on shorter prompts at
a longer range); prints one line and with --json writes the metrics (and each prompt's answer) to FILE.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import numpy as np

HELD_OUT_BIT = 1 << 31  # held-out prompts: the task built with seed ^ HELD_OUT_BIT (training uses seed)
REFERENCE_FILE = "eval_start.npy"  # in a run's --out: the start's first-token log-probs [K, V] (eval_kl_to_start)


def held_out_seed(seed: int) -> int:
    """The seed of the held-out prompt stream of a run with `seed` (>= 0): bit 31 flipped."""
    return int(seed) ^ HELD_OUT_BIT


def first_token_stats(logprobs: np.ndarray, reference: np.ndarray | None = None) -> dict:
    """logprobs float [K, V] (log-probabilities of response token 0 per prompt; reference: the same of another
    policy, or None) -> {"entropy": mean over prompts of H(p)} and with a reference also {"kl": mean over prompts
    of KL(p || reference)}. Entries with p = 0 contribute 0 (0 log 0 = 0)."""
    logprobs = np.asarray(logprobs, np.float64)
    probs = np.exp(logprobs)
    support = probs > 0
    safe = np.where(support, logprobs, 0.0)  # no 0 * -inf
    stats = {"entropy": float(np.mean(-(probs * safe).sum(-1)))}
    if reference is not None:
        reference = np.asarray(reference, np.float64)
        if reference.shape != logprobs.shape:
            raise ValueError(f"reference log-probs have shape {reference.shape}; need {logprobs.shape}")
        stats["kl"] = float(np.mean((probs * (safe - np.where(support, reference, 0.0))).sum(-1)))
    return stats


def summarize(rewards: np.ndarray, correct: np.ndarray | None) -> dict:
    """rewards float [K], correct bool [K] or None -> {"eval_reward": mean reward, "eval_accuracy": fraction
    correct (only with `correct`)}."""
    out = {"eval_reward": float(np.mean(rewards))}
    if correct is not None:
        out["eval_accuracy"] = float(np.mean(correct))
    return out


class Evaluator:
    """K fixed held-out prompts of `task` (already the held-out task: `held_out_task`), answered greedily.

    task: prompt(i) -> Prompt; reward_fn: a token-level reward function (prompt_tokens, response_tokens, info) ->
    float, or a group scorer (`tasks.as_scorer`, e.g. text rewards: then the mean of each function is reported too);
    num_prompts: K; response_len: R; stop_token / stop_tokens / pad_token as in sampling; chunk_size: the capture's
    chunk (round length on a mesh); mesh: None or the ("data", "seq") mesh (K must then be a multiple of its data
    size). Prompts of different lengths are left-padded to `buckets` (a `batches.PromptBuckets`; None: to the
    longest) and answered one bucket at a time (`batches.prompt_batches`; on a mesh all together).
    """

    def __init__(self, task, reward_fn, num_prompts: int, response_len: int, chunk_size: int,
                 stop_token: int | None = None, pad_token: int = 0, mesh=None, stop_tokens: tuple[int, ...] = (),
                 buckets=None, environments=None, turns=None, episode_reward_fn=None):
        from longstraw_jax.sampling.branches import SamplingConfig
        from longstraw_jax.trainer.components import prompt_batches

        if num_prompts < 1:
            raise ValueError(f"--eval-prompts={num_prompts} must be >= 1")
        if mesh is not None and num_prompts % mesh.shape["data"]:
            raise ValueError(f"--eval-prompts={num_prompts} must be a multiple of the mesh's data size "
                             f"{mesh.shape['data']}: each data slice scores the same number of prompts")
        self.task, self.reward_fn, self.chunk_size, self.mesh = task, reward_fn, chunk_size, mesh
        self.prompts = [task.prompt(i) for i in range(num_prompts)]
        self.batches = prompt_batches(self.prompts, buckets, 1 if mesh is None else mesh.shape["data"])
        self.sampling = SamplingConfig(response_len=response_len, temperature=0.0, stop_token=stop_token,
                                       pad_token=pad_token, stop_tokens=tuple(stop_tokens))
        self.reference = None  # [K, V] log-probs of the first response token at the reference (start) evaluation
        # agent branches: K environments (one per prompt), the TurnConfig, the episodes' reward function (or None)
        self.environments, self.turns, self.episode_reward_fn = environments, turns, episode_reward_fn

    @property
    def num_prompts(self) -> int:
        return len(self.prompts)

    @property
    def prompt_len(self) -> int:
        """P of the prompts (their mean, rounded, when they differ in length)."""
        return int(round(np.mean([len(p.tokens) for p in self.prompts])))

    def answers(self, model, params) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Greedy answers -> (responses int32 [K, R], mask float32 [K, R], first-token log-probs float32 [K, V]),
        the full values on every process (a collective with several processes: all must call it)."""
        import jax

        from longstraw_jax.sampling.groups import sample_groups
        from longstraw_jax.sharding import hosts
        from longstraw_jax.trainer.components import place_key

        def answer(tokens, left_pad, indices):
            keys = place_key(jax.random.split(jax.random.key(0), len(indices)), self.mesh)  # unused by greedy
            rollouts = sample_groups(model, params, tokens, keys, 1, self.sampling, self.chunk_size, mesh=self.mesh,
                                     keep_capture=False, left_pad=left_pad)
            responses, mask, first = hosts.to_host((rollouts.responses, rollouts.mask, rollouts.first_logprobs))
            return responses[:, 0], mask[:, 0], first  # the one branch of each prompt

        return self._per_batch(answer)

    def episodes(self, model, params) -> tuple[np.ndarray, ...]:
        """One greedy episode per prompt (agent branches) -> (responses int32 [K, R] (the transcripts), mask float32
        [K, R] (the policy's tokens), first-token log-probs float32 [K, V], rewards float32 [K] (the environment's,
        + the episode reward function's), correct float32 [K] (`episodes.episode_correctness`; zeros when the task
        judges nothing), and per reward function its values and where it applies, [K] each)."""
        import jax

        from longstraw_jax.sampling.turns import sample_episodes
        from longstraw_jax.trainer import episodes as agents
        from longstraw_jax.trainer.components import place_key

        names = list(getattr(self.episode_reward_fn, "names", ()))

        def answer(tokens, left_pad, indices):
            prompts = [self.prompts[i] for i in indices]
            keys = place_key(jax.random.split(jax.random.key(0), len(indices)), self.mesh)  # unused by greedy
            out = sample_episodes(model, params, tokens, keys, 1, self.sampling, self.turns,
                                  [self.environments[i] for i in indices], self.chunk_size, left_pad=left_pad,
                                  infos=[p.info for p in prompts], mesh=self.mesh)
            rewards, parts = agents.episode_rewards(self.task, self.episode_reward_fn, prompts, out, self.mesh)
            correct = agents.episode_correctness(self.task, out.transcripts, out.responses, out.mask, prompts)
            correct = np.zeros_like(rewards) if correct is None else correct
            columns = [x for name in names for x in parts[name]]
            return (out.responses[:, 0], out.mask[:, 0], out.first_logprobs, rewards[:, 0], correct[:, 0],
                    *(x[:, 0] for x in columns))

        whole = self._per_batch(answer)
        parts = {name: (whole[5 + 2 * i], whole[6 + 2 * i]) for i, name in enumerate(names)}
        return (*whole[:5], parts)

    def _per_batch(self, answer) -> tuple[np.ndarray, ...]:
        """answer(tokens, left_pad, indices) -> per-prompt arrays of one batch of `self.batches`; -> those arrays
        for all K prompts, in prompt order."""
        out = None
        for indices, tokens, left_pad in self.batches:
            parts = answer(tokens, left_pad, indices)
            if out is None:
                out = [np.zeros((self.num_prompts,) + np.shape(x)[1:], np.asarray(x).dtype) for x in parts]
            for whole, part in zip(out, parts):
                whole[indices] = part
        return tuple(out)

    def __call__(self, model, params, reference: bool = False) -> dict:
        """Score the K prompts -> metrics: eval_accuracy (tasks with is_correct), eval_reward, eval_reward/<name>
        (per text reward function: its mean over the answers it applies to), eval_entropy (first response token),
        eval_kl_to_start (when a reference is set), eval_prompts (K), eval_prompt_len (P, the mean when prompts
        differ), eval_s (wall time). reference=True: these answers' first-token distribution becomes the
        reference. Agent branches (`environments`): one greedy episode per prompt, scored as the trainer scores
        episodes."""
        from longstraw_jax.trainer.batches import part_means, score_groups

        start = time.perf_counter()
        if self.environments is not None:
            responses, mask, first, rewards, correct, parts = self.episodes(model, params)
            judged = hasattr(self.task, "episode_correct") or hasattr(self.task, "is_correct")
            correct = correct > 0 if judged else None
        else:
            responses, mask, first = self.answers(model, params)
            rewards, correct, parts = score_groups(self.task, self.reward_fn, self.prompts, responses[:, None],
                                                   mask[:, None], self.mesh)  # K groups of one branch, by owners
            rewards, correct = rewards[:, 0], None if correct is None else correct[:, 0] > 0
        if reference:
            self.reference = np.asarray(first, np.float32)
        stats = first_token_stats(first, self.reference)
        out = summarize(rewards, correct)
        out.update(part_means(parts, "eval_reward/"))
        out["eval_entropy"] = stats["entropy"]
        if "kl" in stats:
            out["eval_kl_to_start"] = stats["kl"]
        out.update(eval_prompts=self.num_prompts, eval_prompt_len=self.prompt_len,
                   eval_s=time.perf_counter() - start)
        self.last = {"responses": responses, "mask": mask, "rewards": rewards, "correct": correct}
        return out


def held_out_task(config, vocab_size: int):
    """The held-out task of a RunConfig: its --task, --prompt-len and --depth with seed `held_out_seed(--seed)`."""
    from longstraw_jax.tasks import make_task

    return make_task(config.task, prompt_len=config.prompt_len, vocab_size=vocab_size,
                     seed=held_out_seed(config.seed), **config.task_options())


def for_config(config, vocab_size: int, mesh=None) -> Evaluator:
    """The Evaluator of a RunConfig: --eval-prompts held-out prompts of its task, its reward (default the task's),
    -R, stop token (default the task's) and chunk size. With --data: the first --eval-prompts rows of --eval-data /
    the --eval-fraction split (all of them when there are fewer; a multiple of the mesh's data size), scored by the
    text rewards, stopping on the checkpoint's stop ids (RunError without --eval-data or --eval-fraction)."""
    from longstraw_jax.trainer import components
    from longstraw_jax.trainer.config import RunError

    if config.data:
        task, scorer, stops, pad = components.dataset_task(config, vocab_size, held_out=True)
        if task is None:
            raise RunError("a held-out evaluation of --data needs --eval-data PATH or --eval-fraction F (or pass "
                           "--eval-every 0)")
        data_size = 1 if mesh is None else mesh.shape["data"]
        count = min(config.eval_prompts, len(task)) // data_size * data_size
        if count < 1:
            raise RunError(f"{task.path}: {len(task)} held-out row(s), fewer than the mesh's data size {data_size}")
        sampling = components.sampling_config(config, stops, pad, vocab_size, temperature=0.0)
        return Evaluator(task, scorer, count, config.response_len, config.chunk_size, stop_token=sampling.stop_token,
                         pad_token=pad, mesh=mesh, stop_tokens=sampling.stop_tokens,
                         buckets=components.prompt_buckets(config, pad),
                         **episode_options(config, task, count, vocab_size, sampling, scorer, mesh))
    task = held_out_task(config, vocab_size)
    reward_fn = components.token_reward(config, task)
    stop = config.stop_token if config.stop_token is not None else getattr(task, "stop_token", None)
    sampling = components.sampling_config(config, (stop,), getattr(task, "pad_token", 0), vocab_size, temperature=0.0)
    episodic = episode_options(config, task, config.eval_prompts, vocab_size, sampling,
                               components.load_callable(config.reward) if config.reward else None, mesh)
    return Evaluator(task, reward_fn, config.eval_prompts, config.response_len, config.chunk_size, stop_token=stop,
                     pad_token=getattr(task, "pad_token", 0), mesh=mesh, **episodic)


def episode_options(config, task, count: int, vocab_size: int, sampling, reward_fn, mesh=None) -> dict:
    """An evaluation of agent branches (--env, --tools or a task's own environment): one greedy episode per held-out
    prompt, its reward the environment's (+ reward_fn's score of the transcript) -> the Evaluator's keyword
    arguments ({} without an environment). Each prompt's environment lives on the process owning it on `mesh`."""
    from longstraw_jax.trainer import episodes

    factory, name = episodes.environment_factory(config, task)
    if factory is None:
        return {}
    environments, _ = episodes.build_environments(config, factory, name, count, 1, vocab_size, task, sampling, mesh)
    return dict(environments=environments, turns=episodes.turn_config(config), episode_reward_fn=reward_fn)


def for_run(config, explicit, data, vocab_size: int, mesh=None) -> Evaluator | None:
    """The trainer's Evaluator, or None: --eval-every 0, a --rollouts run (no task to hold prompts out of), or a
    --data run without --eval-data / --eval-fraction (in both an explicit --eval-every N > 0 is a RunError)."""
    from longstraw_jax.trainer.config import RunError

    if config.eval_every == 0:
        return None
    if data.task is None:
        if "eval_every" in explicit:
            raise RunError(f"--eval-every={config.eval_every} needs a task to hold prompts out of; a --rollouts file "
                           "has none (pass --eval-every 0)")
        return None
    if config.data and config.eval_data is None and config.eval_fraction is None:
        if "eval_every" in explicit:
            raise RunError(f"--eval-every={config.eval_every} needs held-out rows of --data: --eval-data PATH or "
                           "--eval-fraction F (or pass --eval-every 0)")
        return None
    return for_config(config, vocab_size, mesh)


def load_reference(out: str, evaluator: Evaluator) -> np.ndarray | None:
    """A resumed run's reference first-token log-probs (<out>/eval_start.npy), or None with a warning when the
    file is missing or was written for other prompts (then eval_kl_to_start is not logged)."""
    from longstraw_jax.trainer.outdir import warn

    path = os.path.join(out, REFERENCE_FILE)
    if not os.path.isfile(path):
        warn(f"{path} is missing: eval_kl_to_start is not logged in this run")
        return None
    reference = np.load(path)
    if reference.shape[0] != evaluator.num_prompts:
        warn(f"{path} holds {reference.shape[0]} prompts, this run scores {evaluator.num_prompts}: eval_kl_to_start "
             "is not logged")
        return None
    return reference


def describe(metrics: dict, chance: float | None = None) -> str:
    """One line: held-out accuracy / reward / entropy (/ KL) of an evaluation's metrics."""
    parts = []
    if "eval_accuracy" in metrics:
        parts.append(f"accuracy {metrics['eval_accuracy']:.3f}" + (f" (chance {chance:.3f})" if chance else ""))
    parts.append(f"reward {metrics['eval_reward']:.3f}")
    parts.append(f"entropy {metrics['eval_entropy']:.3f}")
    if metrics.get("eval_kl_to_start") is not None:
        parts.append(f"KL to start {metrics['eval_kl_to_start']:.4f}")
    return (f"held-out ({metrics['eval_prompts']} prompts of {metrics['eval_prompt_len']} tokens, greedy): "
            + ", ".join(parts))


# ---------------------------------------------------------------------------------------------------------- CLI

_OVERRIDES = ("task", "reward", "prompt_len", "depth", "seed", "eval_prompts", "response_len", "stop_token",
              "chunk_size", "mesh", "dtype", "vocab_size", "model", "data", "eval_data", "eval_fraction", "tokenizer",
              "prompt_field", "messages_field", "answer_field", "chat_template_kwargs", "max_prompt_len", "truncate",
              "reward_weights")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m longstraw_jax.evaluate",
                                description="Score a policy on held-out prompts (greedy): a trainer run's checkpoint "
                                            "(--resume OUT) or weights (--init-from / --hf).")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--resume", metavar="OUT", help="a trainer run's --out: its latest checkpoint and options")
    source.add_argument("--init-from", metavar="DIR", help="an init directory (config.json + Orbax params/)")
    source.add_argument("--hf", metavar="DIR", help="config.json + *.safetensors")
    p.add_argument("--resume-step", type=int, metavar="N", help="with --resume: checkpoint N instead of the latest")
    p.add_argument("--json", metavar="FILE", help="also write the metrics and every prompt's answer to FILE")
    argparse_types = {"task": str, "reward": str, "prompt_len": int, "depth": float, "seed": int, "eval_prompts": int,
                      "response_len": int, "stop_token": int, "chunk_size": int, "mesh": str, "dtype": str,
                      "vocab_size": int, "model": str, "eval_fraction": float, "max_prompt_len": int}
    for name in _OVERRIDES:  # default: the run's option (--resume) or the trainer's default
        p.add_argument("--" + name.replace("_", "-"), type=argparse_types.get(name, str), default=argparse.SUPPRESS,
                       help="as the trainer's option (default: the resumed run's, else the trainer's default)")
    return p


def saved_mesh(out: str | None) -> str | None:
    """The --mesh of the run in `out` (its config.json), or None."""
    path = os.path.join(out, "config.json") if out else None
    if path is None or not os.path.isfile(path):
        return None
    with open(path) as f:
        mesh = json.load(f).get("mesh")
    return mesh if isinstance(mesh, str) else None


def config_of(args: argparse.Namespace):
    """The command line -> (RunConfig to evaluate with, the run directory or None). With --resume OUT the
    checkpoint's options, with the ones given here replacing them."""
    from longstraw_jax.io.checkpoints import BrokenCheckpoint, TrainCheckpoints
    from longstraw_jax.trainer.config import RunConfig, RunError, saved_run_config

    given = {name: getattr(args, name) for name in _OVERRIDES if hasattr(args, name)}
    if args.resume is None:
        if args.resume_step is not None:
            raise RunError("--resume-step needs --resume OUT")
        return RunConfig(**given, init_from=args.init_from, hf=args.hf), None
    if not os.path.isdir(os.path.join(args.resume, "checkpoints")):
        raise RunError(f"--resume {args.resume}: no checkpoint directory (checkpoints/) there")
    checkpoints = TrainCheckpoints(args.resume, create=False)
    try:
        step = args.resume_step if args.resume_step is not None else checkpoints.latest_step()
        if step is None or step not in checkpoints.all_steps():
            raise RunError(f"--resume {args.resume}: no checkpoint {'' if step is None else step} there "
                           f"(have: {checkpoints.all_steps()})")
        saved = checkpoints.read_meta(step)["config"]
    except BrokenCheckpoint as e:
        raise RunError(str(e)) from None
    finally:
        checkpoints.close()
    config = saved_run_config(saved, resume=True, resume_step=step)  # a run saved before a rename too
    return dataclasses.replace(config, **given), args.resume


def main(argv=None) -> int:
    """Evaluate as the command line says: one line on stdout (and --json FILE) -> 0; 2 with a one-line error."""
    from longstraw_jax.trainer.config import RunError
    from longstraw_jax.trainer.distributed import DistributedError

    try:
        args = build_parser().parse_args(argv)
        from longstraw_jax.trainer.config import RunConfig
        from longstraw_jax.trainer.distributed import start_jax

        # before anything touches a JAX backend (reading the checkpoint does): the mesh's devices, or join the
        # processes of a cluster job; the mesh is --mesh, else the run's (its config.json, read without JAX)
        start_jax(RunConfig(mesh=getattr(args, "mesh", None) or saved_mesh(args.resume)))
        config, out = config_of(args)
        result = evaluate(config, out)
    except (RunError, DistributedError, ValueError, OSError, NotImplementedError) as e:
        print(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 2
    from longstraw_jax.trainer import distributed

    if distributed.is_primary():
        print(result["line"])
        if args.json:
            with open(args.json, "w") as f:
                json.dump({k: v for k, v in result.items() if k != "line"}, f, indent=1)
    return 0


def evaluate(config, out: str | None) -> dict:
    """Load the policy (the run's checkpoint when `out` is given, else --init-from / --hf) and score it ->
    {"metrics", "answers", "config", "checkpoint", "line"}."""
    import jax

    from longstraw_jax.io.checkpoints import BrokenCheckpoint, TrainCheckpoints
    from longstraw_jax.trainer import components
    from longstraw_jax.trainer.config import RunError

    mesh = components.mesh_for(config)
    model, params = components.load_model(config)
    if mesh is not None:
        model.mesh_adapter()
    params = components.place(params, mesh)
    checkpoint = None
    if out is not None:
        optimizer = components.run_optimizer(config)
        opt_like = components.place(jax.jit(optimizer.init)(params), mesh, params)
        checkpoints = TrainCheckpoints(out, create=False)
        try:
            params, _, _, meta = checkpoints.restore(params, opt_like, config.resume_step)
        except BrokenCheckpoint as e:
            raise RunError(str(e)) from None
        finally:
            checkpoints.close()
        checkpoint = checkpoints.step_dir(meta["step"])
    evaluator = for_config(config, model.config.vocab_size, mesh)
    metrics = evaluator(model, params)
    chance = getattr(evaluator.task, "chance_accuracy", None)
    line = f"{checkpoint or config.init_from or config.hf}: " + describe(metrics, chance)
    answers = [{"index": i, "response": r[m > 0].tolist(), "reward": float(w),
                **({"correct": bool(c)} if c is not None else {}), "info": p.info}
               for i, (p, r, m, w, c) in enumerate(zip(evaluator.prompts, evaluator.last["responses"],
                                                       evaluator.last["mask"], evaluator.last["rewards"],
                                                       evaluator.last["correct"]
                                                       if evaluator.last["correct"] is not None
                                                       else [None] * evaluator.num_prompts))]
    return {"metrics": metrics, "chance_accuracy": chance, "checkpoint": checkpoint,
            "config": {k: getattr(config, k) for k in _OVERRIDES}, "answers": answers, "line": line}


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["Evaluator", "HELD_OUT_BIT", "describe", "first_token_stats", "for_config", "held_out_seed",
           "held_out_task", "summarize"]
