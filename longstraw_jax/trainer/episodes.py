"""The trainer's data source for agent branches (--env, or a task with its own environment such as --task lookup):
B groups per step of G multi-turn episodes (`sampling.turns.sample_episodes`; on --mesh the groups split over its
data axis, as `components.TaskSampler`'s), docs/architecture.md 11.

A branch's reward is the sum of its environment's rewards (plus, with --reward, the reward function's score of the
whole transcript, tool replies included). A branch whose environment failed (raised, timed out, returned something
malformed) ends with status "error" and is left out of its group (`GroupBatch.valid` 0: weight 0, not in the
advantage statistics); a group with fewer than 2 valid branches is left out whole. When more than --max-env-errors of
a step's branches fail, the step stops with one line naming the environment, the prompt, the branch, the turn and
the exception, before any update: the checkpoints stay as they were and the run resumes.
"""
from __future__ import annotations

import json

import jax
import numpy as np

from longstraw_jax.agents import text
from longstraw_jax.agents.environment import ERROR, make_environments
from longstraw_jax.common.callables import load_object
from longstraw_jax.grpo import GroupBatch
from longstraw_jax.sampling.turns import TurnConfig, sample_episodes
from longstraw_jax.trainer import distributed
from longstraw_jax.trainer.batches import part_means, score_groups, stack_prompts
from longstraw_jax.trainer.config import RunConfig, RunError


def environment_factory(config: RunConfig, task):
    """(the factory of --env (or --tools), or the task's own `environment`, or None; its name for messages)."""
    if config.env is not None:
        return config.env, config.env
    if config.tools is not None:
        return config.tools, f"--tools {config.tools}"
    own = getattr(task, "environment", None)
    return (own, f"the {getattr(task, 'name', 'task')} task's environment") if callable(own) else (None, None)


def turn_config(config: RunConfig) -> TurnConfig:
    return TurnConfig(max_turns=config.max_turns, turn_len=config.turn_len,
                      max_observation=config.max_observation_len, timeout=config.env_timeout)


def build_environments(config: RunConfig, factory, name: str, groups: int, group_size: int, vocab_size: int,
                       task=None, sampling=None, mesh=None) -> tuple[list, object]:
    """(groups x group_size environments with --env-kwargs, flat (branch g of group b at b * G + g); a `ToolCounts`
    for --tools or None). In a multi-process run each process builds only the environments of the groups it owns
    (`distributed.group_owners` on `mesh`: those of its data slice) and holds None for the others
    (`sampling.turns.sample_episodes` exchanges their replies). A --data run's are text environments behind
    `agents.text.TextEpisode` (the chat template checked first: `text_turns`). A factory that is missing or fails, or
    a template that cannot frame tool turns: RunError (one line, before any work; on every process when it fails on
    one)."""
    kwargs = json.loads(config.env_kwargs) if config.env_kwargs else {}
    owners = distributed.group_owners(mesh, groups)
    count = sum(owner == distributed.process_index() for owner in owners) * group_size
    with distributed.agreed("environments", (RunError,)):
        chat, counts = (text_turns(config, task, sampling) if config.data else None), None
        try:
            if config.tools is not None:
                counts = text.ToolCounts()
                functions = load_tools(config.tools)
                built = [text.ToolEnvironment(functions, counts) for _ in range(count)]
            else:
                what = "--env" if isinstance(factory, str) else f"--env ({name})"
                built = make_environments(factory, count, vocab_size, config.seed, kwargs, what=what)
        except Exception as e:
            raise RunError(str(e)) from None
    if chat is not None:
        built = [text.TextEpisode(env, chat) for env in built]
    mine = iter(built)
    environments = [next(mine) if owners[b] == distributed.process_index() else None
                    for b in range(groups) for _ in range(group_size)]
    return environments, counts


def load_tools(spec: str) -> list:
    """--tools MODULE:LIST -> the list of functions (RunError unless it is a non-empty list of callables)."""
    functions = load_object(spec)
    if not isinstance(functions, (list, tuple)) or not functions or not all(callable(f) for f in functions):
        raise RunError(f"--tools {spec}: must name a non-empty list of functions, got {type(functions).__name__}")
    return list(functions)


def text_turns(config: RunConfig, task, sampling) -> text.ChatTurns:
    """The chat template's framing of tool turns for a --data run's episodes: the policy's end-of-turn token is the
    run's first stop id; --tools' schemas passed to the template (refused when the template ignores them); the
    scripted 3-turn conversation must render alike turn by turn and whole (`ChatTurns.check`). RunError otherwise."""
    from longstraw_jax.tasks import dataset

    if sampling.stop_token is None:
        raise RunError("agent branches over text need an end-of-turn token: the checkpoint has none (--stop-token)")
    schemas = text.tool_schemas(load_tools(config.tools)) if config.tools else None
    chat = text.ChatTurns(task.tokenizer, sampling.stop_token, schemas,
                          dataset.template_kwargs(config.chat_template_kwargs))
    if schemas is not None and not chat.supports_tools():
        raise RunError(f"--tools {config.tools}: the tokenizer's chat template ignores tools (it renders the same "
                       "with and without them): its model was not trained to call them")
    try:
        chat.check()
    except text.TemplateError as e:
        raise RunError(f"--data {config.data}: {e}") from None
    return chat


def episode_rewards(task, reward_fn, prompts, episodes, mesh=None) -> tuple[np.ndarray, dict]:
    """(rewards float32 [B, G], per-function parts): the environment's rewards, plus with reward_fn (--reward; a
    --data run's text rewards) its score of the whole transcript, the tool replies included (each group scored by
    the process owning it on `mesh`: `score_groups`)."""
    if reward_fn is None:
        return episodes.rewards.copy(), {}
    length = np.array([[sum(len(x["tokens"]) for x in t.turns) for t in row] for row in episodes.transcripts])
    whole = (np.arange(episodes.responses.shape[-1]) < length[..., None]).astype(np.float32)
    scored, _, parts = score_groups(task, reward_fn, prompts, episodes.responses, whole, mesh)
    return episodes.rewards + scored, parts


def episode_correctness(task, transcripts, responses, mask, prompts) -> np.ndarray | None:
    """float32 [B, G]: each episode judged by the task, on its policy turns as the episode split them
    (`task.episode_correct(turns, info)`) or else on the policy's tokens (`task.is_correct`); None when the task
    judges neither way."""
    if hasattr(task, "episode_correct"):
        return np.array([[task.episode_correct([x["tokens"] for x in t.turns if x["role"] == "assistant"], p.info)
                          for t in row] for row, p in zip(transcripts, prompts)], np.float32)
    if hasattr(task, "is_correct"):
        return np.array([[task.is_correct(r[m > 0], p.info) for r, m in zip(rs, ms)]
                         for rs, ms, p in zip(responses, mask, prompts)], np.float32)
    return None


class EpisodeSampler:
    """B groups of G episodes per step: group b of step position p is the task's prompt p * B + b (key fold_in(
    fold_in(run key, step), b), as `components.TaskSampler`), its branches run by environments[b * G + g]. The
    update reuses the episodes' captures. Extra metrics: accuracy (`episode_correctness`), reward/<name> (text
    rewards), tools/calls and tools/failures (--tools), and env/...: turns (policy turns per branch),
    observation_tokens (per branch), truncated (observation tokens cut), errors (branches that ended with an
    environment error, their share in errors_share, the first's text in first_error), left_out_groups, time_s, and
    the sampling split capture_s / decode_s / observe_s."""

    def __init__(self, task, environments: list, env_name: str, sampling, turns: TurnConfig, group_size: int,
                 chunk_size: int, groups_per_step: int = 1, buckets=None, reward_fn=None, max_errors: float = 0.5,
                 mesh=None, tool_counts=None):
        self.task, self.environments, self.env_name = task, environments, env_name
        self.sampling, self.turns, self.buckets = sampling, turns, buckets
        self.group_size, self.chunk_size, self.groups_per_step = group_size, chunk_size, groups_per_step
        self.reward_fn, self.max_errors, self.mesh, self.tool_counts = reward_fn, max_errors, mesh, tool_counts
        self.description = f"task {task.name} with {env_name}"
        self.last_scored = None
        self.last_transcripts = None

    def batch(self, model, params, key, step: int, position: int) -> tuple[GroupBatch, dict, object]:
        first = position * self.groups_per_step
        prompts = [self.task.prompt(first + b) for b in range(self.groups_per_step)]
        tokens, left_pad = stack_prompts(prompts, self.buckets)
        step_key = jax.random.fold_in(key, step)
        keys = jax.vmap(lambda b: jax.random.fold_in(step_key, b))(np.arange(self.groups_per_step))
        episodes = sample_episodes(model, params, tokens, keys, self.group_size, self.sampling, self.turns,
                                   self.environments, self.chunk_size, left_pad=left_pad,
                                   infos=[p.info for p in prompts], mesh=self.mesh)
        transcripts = episodes.transcripts
        status = np.array([[t.status for t in row] for row in transcripts])
        failed = status == ERROR
        if failed.mean() > self.max_errors:
            b, g = (int(i) for i in np.argwhere(failed)[0])
            raise RunError(f"{self.env_name} failed on {int(failed.sum())} of {failed.size} branches of step "
                           f"{step + 1} (more than --max-env-errors={self.max_errors}): prompt {first + b}, branch "
                           f"{g}, {transcripts[b][g].error}; the step was not applied")
        rewards, parts = episode_rewards(self.task, self.reward_fn, prompts, episodes, self.mesh)
        valid = (~failed).astype(np.float32)
        few = valid.sum(axis=1) < 2
        valid[few] = 0.0
        correct = episode_correctness(self.task, transcripts, episodes.responses, episodes.mask, prompts)
        self.last_scored, self.last_transcripts = (prompts, parts, correct), transcripts
        flat = [t for row in transcripts for t in row]
        extra = {"accuracy": float(correct.mean())} if correct is not None else {}
        extra.update(part_means(parts))
        extra.update({
            "env/turns": float(np.mean([t.policy_turns for t in flat])),
            "env/observation_tokens": float(np.mean([t.observation_tokens for t in flat])),
            "env/truncated": int(sum(x.get("truncated", 0) for t in flat for x in t.turns if x["role"] == "tool")),
            "env/errors": int(failed.sum()), "env/errors_share": float(failed.mean()),
            "env/left_out_groups": int(few.sum()),
            "env/time_s": episodes.timings["env_s"], "env/capture_s": episodes.timings["capture_s"],
            "env/decode_s": episodes.timings["decode_s"], "env/observe_s": episodes.timings["observe_s"]})
        if self.tool_counts is not None:
            # each process counts the calls of its own environments
            calls, failures = distributed.sum_over_processes(np.array(self.tool_counts.take()))
            extra.update({"tools/calls": int(calls), "tools/failures": int(failures)})
        if failed.any():
            b, g = (int(i) for i in np.argwhere(failed)[0])
            extra["env/first_error"] = f"prompt {first + b}, branch {g}: {transcripts[b][g].error}"
        batch = GroupBatch(prompt=tokens, responses=episodes.responses, mask=episodes.mask, rewards=rewards,
                           old_logprobs=episodes.logprobs, left_pad=left_pad, valid=valid)
        return batch, extra, episodes.captured
