"""The trainer's options (`python -m longstraw_jax.run`): one frozen `RunConfig`, its command line, its checks and
the merge with a checkpointed run's options on `--resume`.

Each field is one option, declared once with its help text; `build_parser()` derives the argparse parser from the
fields (`--group-size` is the field `group_size`). Constructing a RunConfig checks every bound at once and raises
one ValueError naming each bad option (`--group-size=0 must be >= 1; ...`).

An option that feeds a library object has that object's name and default: `--clip-eps-low` is
`GRPOConfig.clip_eps_low`, `--learning-rate` is `train.make_optimizer`'s `learning_rate`, and so on; the default is
read from the library (`library_default`), never repeated here. An option renamed to match keeps its old spelling
(`formerly`: `--clip-low`, `--lr`, ...) as an alias on the command line, in a --config file and in a run directory's
saved options (`current_names`), so that command lines, TOML files and runs written before the rename still work.
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import math
import re
import sys
import tomllib
from typing import Collection

from longstraw_jax.engine import MODES
from longstraw_jax.grpo import LOSS_AGGS, RATIOS, GRPOConfig
from longstraw_jax.ops import kernels as kernel_choice
from longstraw_jax.sampling.branches import SamplingConfig
from longstraw_jax.sampling.turns import TurnConfig
from longstraw_jax.sharding.mesh import parse_mesh_spec
from longstraw_jax.tasks.dataset import TRUNCATE, PromptFormat
from longstraw_jax.tasks.rewards import load_rewards
from longstraw_jax.train import make_optimizer, train_step
from longstraw_jax.trainer.watchdog import DEFAULT_STEP_TIMEOUT_S

DESCRIPTION = ("Each step: take a prompt (a task's prompt number `data_position`, a --data row in the shuffled "
               "order, or the next group of a rollout file), capture it once and sample G branches from the captured "
               "state (sampling/), score them with the reward function(s), then one GRPO update (engine gradients, "
               "exact or detached; clipped AdamW). Writes to --out: metrics.jsonl (one line per step, held-out "
               "evaluation and warm-up step), metrics.png (reward, held-out accuracy, entropy, KL, grad norm, clip "
               "fraction), checkpoints/ (Orbax: params, optimizer state, RNG key, data position), and with "
               "--export-hf a safetensors checkpoint of the final params.")
# Options that may differ when resuming (everything else must match the checkpointed run's configuration).
RESUMABLE = frozenset({"config", "steps", "resume", "resume_step", "out", "export_hf", "export_peft", "force",
                       "log_every", "save_every", "coordinator", "num_processes", "process_id", "step_timeout",
                       "log_samples_every", "report_to", "profile_steps", "progress_every", "progress_rounds"})
# Options a checkpoint records and a resumed run adopts, but that may be given differently on --resume (a run saved by
# 2 processes on a 2x4 mesh continues on one process, on 2x4 or 1x8; evaluations may come more or less often).
CHANGEABLE = frozenset({"mesh", "eval_every", "decode_batch", "replay_batch", "kernels"})


MAX_EVAL_PROMPTS = 65536


class RunError(Exception):
    """A user-facing error: run.main() prints it on one line and exits with status 2."""


class _JoinAction(argparse.Action):
    """A repeatable option kept as one comma-separated string (`--reward a --reward b` == `--reward a,b`), so that
    the saved configuration holds a plain string."""

    def __call__(self, parser, namespace, values, option_string=None):
        previous = getattr(namespace, self.dest, None)
        setattr(namespace, self.dest, values if previous in (None, argparse.SUPPRESS) else f"{previous},{values}")


def _option(default, help: str | None = None, *, group: str | None = None, short: str | None = None,
            formerly: tuple[str, ...] = (), **argparse_kw):
    """A RunConfig field that is also a command-line option; `group` starts a new section of --help; `formerly`: the
    field's old names, still accepted (`--clip-low` for clip_eps_low; see `current_names`)."""
    return dataclasses.field(default=default, metadata=dict(help=help, group=group, short=short, formerly=formerly,
                                                            argparse=argparse_kw))


def library_default(owner, name: str):
    """The default of parameter `name` of a library function or config class `owner` (a dataclass's field defaults
    are its constructor's): an option that feeds the library takes its default from there, so that the command line
    and the library cannot disagree. A parameter without a default is a TypeError (at import: a bug here)."""
    default = inspect.signature(owner).parameters[name].default
    if default is inspect.Parameter.empty:
        raise TypeError(f"{owner.__qualname__}: parameter {name!r} has no default for the option to take")
    return default


@dataclasses.dataclass(frozen=True)
class RunConfig:
    config: str | None = _option(None, "read options from a TOML file: one `name = value` per option (names as "
                                 "the flags' without dashes, e.g. group_size = 8 or \"group-size\" = 8; "
                                 "configs/demo.toml is `make run`'s); options given on the command line override it",
                                 metavar="FILE.toml")
    # model
    model: str = _option("tiny", "'tiny' (Qwen36Config.tiny with --vocab-size) or a config.json path (random init; "
                         "unknown fields are an error)", group="model (default: a random tiny Qwen3.6)")
    vocab_size: int = _option(32, "vocabulary of the 'tiny' model")
    hf: str | None = _option(None, "load config.json + *.safetensors from DIR (models.load_hf)", metavar="DIR")
    init_from: str | None = _option(None, "load an init directory (config.json + Orbax params/), e.g. written by "
                                    "python -m longstraw_jax.convert", metavar="DIR")
    dtype: str = _option("float32", "parameter dtype", choices=("float32", "bfloat16"))
    # data
    task: str = _option("retrieval", "built-in task name ('retrieval') or 'module:function' factory called with "
                        "prompt_len, vocab_size, seed", group="data")
    reward: str | None = _option(None, "reward function(s). With --task: one fn(prompt_tokens, response_tokens, info) "
                                 "-> float (default: the task's). With --data (needed there): text rewards fn(prompts, "
                                 "completions, **columns) -> list[float | None], built-ins exact_match, contains, f1, "
                                 "math or MODULE:FUNCTION; repeat the option or give a comma list",
                                 metavar="NAME|MODULE:FUNCTION", action=_JoinAction)
    reward_weights: str | None = _option(None, "--data: weights of the --reward functions, one each (default 1 each); "
                                         "the reward is sum_i w_i * r_i over the functions that apply",
                                         metavar="W1,W2,...")
    rollouts: str | None = _option(None, "train on externally generated rollouts (one group per line) instead of "
                                   "sampling; --task/--reward and the sampling options are then unused",
                                   metavar="FILE.jsonl")
    tokenizer: str | None = _option(None, "tokenizer directory (transformers AutoTokenizer) for --data, default the "
                                    "--hf / --init-from directory; for text fields in --rollouts a tokenizer.json or "
                                    "a directory holding one", metavar="DIR|tokenizer.json")
    data: str | None = _option(None, "train on a dataset of prompts instead of --task: JSONL, Parquet or a directory "
                               "written by datasets' save_to_disk; each row one prompt (--prompt-field or "
                               "--messages-field), its other columns go to the reward functions; shuffled per "
                               "--seed and epoch", metavar="PATH")
    prompt_field: str | None = _option(None, "--data: the column holding the prompt as text (default 'prompt' when "
                                       "there is one)", metavar="NAME")
    messages_field: str | None = _option(None, "--data: the column holding the prompt as chat messages (a list of "
                                         "{role, content}), rendered with the tokenizer's chat template (default "
                                         "'messages' when there is no 'prompt' column)", metavar="NAME")
    answer_field: str = _option(library_default(load_rewards, "answer_field"), "--data: the column the built-in "
                                "rewards read the reference answer from (a string, a number or a list of acceptable "
                                "answers)", metavar="NAME")
    chat_template_kwargs: str | None = _option(None, "--data: JSON object of extra chat template arguments, e.g. "
                                               "'{\"enable_thinking\": false}'", metavar="JSON")
    max_prompt_len: int | None = _option(None, "--data: the most tokens a prompt may have (default: no limit)",
                                         metavar="N")
    prompt_buckets: int | None = _option(None, "--data: prompts are left-padded (masked: results unchanged) to lengths "
                                         "--chunk-size x 2^i up to --max-prompt-len, one compiled program per "
                                         "length; at most N of them (the smallest dropped: short prompts pad more)",
                                         metavar="N")
    truncate: str = _option(library_default(PromptFormat, "truncate"), "--data: a prompt over --max-prompt-len: left "
                            "drops its oldest tokens (keeps the question at the end), right its last ones, error stops "
                            "the run", choices=TRUNCATE)
    eval_data: str | None = _option(None, "--data: held-out prompts from this file / directory (same format)",
                                    metavar="PATH")
    eval_fraction: float | None = _option(None, "--data: hold out this fraction of the rows, in (0, 1) (the same rows "
                                          "whatever --seed; never trained on)", metavar="F")
    prompt_len: int = _option(32, "prompt tokens per group (task prompts; --data prompts keep their own length)")
    depth: float | None = _option(None, "retrieval task: depth of the planted fact in [0, 1] (default: random per "
                                  "prompt)")
    max_depth: float | None = _option(None, "retrieval task: every fact in the first D of the log, random depths "
                                      "uniform in [0, D] (default: the task's, 1)", metavar="D")
    num_facts: int | None = _option(None, "retrieval task: facts per prompt, the queried one and N-1 distractors with "
                                    "other keys at random depths (default: the task's, 2)", metavar="N",
                                    formerly=("facts",))
    # sampling
    group_size: int = _option(8, "G, response branches per prompt", group="sampling", short="-G")
    groups_per_step: int | None = _option(None, "B, groups (prompts) per step, side by side on the mesh's data axis "
                                          "(a multiple of its size; default: the data size, 1 without --mesh)",
                                          short="-B", metavar="B")
    response_len: int = _option(256, "max new tokens per branch", short="-R")
    temperature: float = _option(library_default(SamplingConfig, "temperature"))
    top_p: float = _option(library_default(SamplingConfig, "top_p"))
    stop_token: int | None = _option(None, "default: the task's stop token, if it has one; with --data the "
                                     "checkpoint's end-of-turn / EOS ids (generation_config.json, the tokenizer's EOS)")
    decode_batch: int | None = _option(None, "branches decoded together, a divisor of G (default: all G; the tokens "
                                       "are the same, fewer need less memory: N tails live at once)", metavar="N")
    # agent branches (docs/architecture.md 11)
    env: str | None = _option(None, "each branch a multi-turn episode: FACTORY(vocab_size=, seed=, **--env-kwargs) "
                              "builds an environment with reset(prompt_tokens, info, branch) and step(turn) -> "
                              "(observation token ids, reward or None, done); observations are read, never trained "
                              "on; a branch's reward is the sum of its rewards (default: the task's own environment, "
                              "if it has one: --task lookup)", group="agent branches", metavar="MODULE:FACTORY")
    env_kwargs: str | None = _option(None, "JSON object of keyword arguments for the --env factory", metavar="JSON")
    tools: str | None = _option(None, "--data: a list of plain Python functions (type hints, a docstring with Args:) "
                                "the policy calls with Hermes / Qwen3 <tool_call> JSON blocks; their schemas go to "
                                "the chat template, each result (or error text) comes back as a tool message; a turn "
                                "without a call ends the episode (the --reward functions score the transcript)",
                                metavar="MODULE:LIST")
    max_turns: int = _option(library_default(TurnConfig, "max_turns"), "policy turns per episode (the environment "
                             "answers each; after the last its observation is not appended)")
    turn_len: int | None = _option(None, "tokens per policy turn at most (a turn ends at a stop token; default -R)",
                                   metavar="N")
    max_observation_len: int | None = _option(None, "observation tokens appended per turn at most (the rest cut and "
                                              "counted in env/truncated; default: what fits in -R, which holds "
                                              "policy and observation tokens together)", metavar="N")
    env_timeout: float = _option(library_default(TurnConfig, "timeout"), "seconds an environment call may take; a "
                                 "call past it ends its branch with status error", metavar="S")
    max_env_errors: float = _option(0.5, "stop the run (the step not applied, checkpoints intact) when more than this "
                                    "share of a step's branches end with an environment error; the others are left "
                                    "out of their group (weight 0)", metavar="F")
    # training
    steps: int = _option(40, "total GRPO steps (a resumed run continues up to this)", group="training")
    learning_rate: float = _option(library_default(make_optimizer, "learning_rate"), "AdamW learning rate (the "
                                   "default suits full training of a pretrained model; LoRA usually takes 1e-5 to "
                                   "1e-4, a small model from scratch more)", formerly=("lr",))
    weight_decay: float = _option(library_default(make_optimizer, "weight_decay"))
    max_grad_norm: float = _option(library_default(make_optimizer, "max_grad_norm"), "global-norm clip (0: none)")
    lr_warmup_steps: int = _option(library_default(make_optimizer, "lr_warmup_steps"), "the learning rate rises "
                                   "linearly over the first N GRPO updates (update k at rate x k / N), then stays",
                                   metavar="N")
    mode: str = _option(library_default(train_step, "mode"), "exact: gradient through the prompt (== full graph); "
                        "detached: prompt state constant", choices=MODES)
    chunk_size: int = _option(256, "prompt chunk length for capture / prompt backward")
    replay_batch: int = _option(library_default(GRPOConfig, "replay_batch"), "branches replayed together in the "
                                "update, a divisor of G: k branches' activations at once, k times fewer and larger "
                                "operations (faster for small models; the same gradients up to round-off)",
                                metavar="K")
    kernels: str = _option("auto", "attention (Qwen3.6's softmax, GLM-5.x's sparse latent) and Qwen3.6's Gated "
                           "DeltaNet as XLA ops or as Pallas kernels; auto: pallas on a GPU, xla elsewhere; pallas "
                           "on a CPU interprets the kernels (slow, for checking: the same results up to round-off)",
                           choices=kernel_choice.CHOICES)
    loss_agg: str = _option(library_default(GRPOConfig, "loss_agg"), choices=LOSS_AGGS)
    kl_coef: float = _option(library_default(GRPOConfig, "kl_coef"), "k3 KL weight to a reference policy: sampled runs "
                             "compute the reference log-probs (--train lora: the base without adapters; else the "
                             "initial params or --ref-from); --rollouts need ref_logprobs on every line")
    ref_from: str | None = _option(None, "--kl-coef > 0 with sampling: the reference policy's params from an HF "
                                   "directory (safetensors) or an init directory (config.json + Orbax params/); its "
                                   "config must equal the model's (default: the run's initial params)", metavar="DIR")
    ratio: str = _option(library_default(GRPOConfig, "ratio"), "importance ratio: token (PPO / GRPO) or sequence "
                         "(GSPO: one ratio per branch, the geometric mean of its tokens'; with --loss-agg "
                         "seq-mean-token-mean exactly GSPO's objective; it wants much narrower --clip-eps-low / "
                         "--clip-eps-high, e.g. 3e-4 / 4e-4)", choices=RATIOS)
    clip_eps_low: float = _option(library_default(GRPOConfig, "clip_eps_low"), "the ratio is clipped to "
                                  "[1 - clip_eps_low, 1 + clip_eps_high]", formerly=("clip_low",))
    clip_eps_high: float = _option(library_default(GRPOConfig, "clip_eps_high"), "(DAPO's clip-higher default)",
                                   formerly=("clip_high",))
    updates_per_batch: int = _option(1, "mu: updates from each sampled batch; updates after the first see a ratio != "
                                     "1 (clip fraction informative) and each captures the prompts afresh (the "
                                     "captured state depends on the params)", metavar="MU")
    drop_uniform_groups: bool = _option(False, "leave out of the update the groups whose G rewards are all equal "
                                        "(zero advantage; counted as uniform_groups; a step where every group is "
                                        "uniform makes no update); on a mesh the kept groups are rounded up to a "
                                        "multiple of the data size with uniform ones")
    refill_batches: int = _option(0, "with --drop-uniform-groups, DAPO's dynamic sampling: while fewer than -B "
                                  "groups carry a signal, sample up to K more batches of -B groups (the next "
                                  "prompts); the update takes the first -B groups that do (a refilled step's update "
                                  "captures its prompts afresh: the batches' captures are not held together)",
                                  metavar="K")
    # which parameters train (docs/architecture.md 10, adapters/lora.py): frozen leaves get no gradient and no optimizer
    # state
    train: str = _option("full", "full: every parameter (or those --trainable selects); lora: frozen base matrices "
                         "with low-rank adapters B A (--lora-*)", choices=("full", "lora"))
    lora_rank: int = _option(8, "--train lora: adapter rank r (at most min(out, in) of every target)")
    lora_alpha: float = _option(16.0, "--train lora: an adapter adds alpha / r * B A (B starts at 0)")
    lora_targets: str = _option("all", "--train lora: comma-separated groups (attn, mlp, shared, experts, all) or "
                                "regular expressions searched in the matrices' paths (e.g. 'full/q_proj|full/v_proj')")
    trainable: str | None = _option(None, "--train full: train only the parameters whose path (e.g. "
                                    "blocks/full/q_proj, final_norm) matches REGEX; the others are frozen",
                                    metavar="REGEX")
    mesh: str | None = _option(None, "device mesh data x seq (e.g. 1x8); on CPU raises the simulated device count "
                               "to A*B before JAX starts", metavar="AxB")
    seed: int = _option(0)
    # held-out evaluation and supervised warm-up (trainer/evaluate.py, trainer/warmup.py)
    eval_every: int = _option(0, "score K held-out prompts (greedy) before step 1, every N steps and after the last "
                              "step; 0: never (each evaluation captures K prompts: at long prompts choose N and K "
                              "with that in mind)",
                              group="held-out evaluation and warm-up (off unless asked; configs/demo.toml asks)",
                              metavar="N")
    eval_prompts: int = _option(128, "K held-out prompts: the task built with --seed's bit 31 flipped, a stream "
                                "training never draws (a multiple of the mesh's data size)", metavar="K")
    sft_steps: int = _option(0, "supervised warm-up steps before GRPO: cross-entropy on the target response (a task's "
                             "target(info), e.g. retrieval's answer; --data: each training row's --answer-field + the "
                             "stop token, one row's graph at a time), full-graph autograd; not on --resume; not with "
                             "--rollouts (0 for a task without target(info))", metavar="N")
    sft_batch: int = _option(32, "prompts per warm-up step (--data: rows, their gradients summed one row at a time)")
    sft_learning_rate: float = _option(1e-3, "warm-up AdamW learning rate (its own optimizer state, dropped after the "
                                       "warm-up)", formerly=("sft_lr",))
    sft_prompt_len: int | None = _option(None, "warm-up prompt length (default --prompt-len)")
    sft_stop_accuracy: float | None = _option(None, "end the warm-up early once the first-token accuracy of its latest "
                                              "4 batches (each scored before its update) reaches this, in (0, 1]: "
                                              "--sft-steps is then the most it runs", metavar="A")
    sft_num_facts: int | None = _option(None, "retrieval task: facts per warm-up prompt (default --num-facts); 1 "
                                        "teaches the answer format and copying, leaving which fact to copy to GRPO",
                                        metavar="N")
    sft_max_depth: float | None = _option(None, "retrieval task: every warm-up fact in the first D of the log "
                                          "(default --max-depth); 1 with a small --max-depth warms up at every depth "
                                          "and leaves the long range to GRPO", metavar="D")
    # output
    out: str | None = _option(None, "output directory (default: out/run-<UTC time>)", group="output")
    resume: bool = _option(False, "continue the run in --out from its newest intact checkpoint (a damaged newer one "
                           "is reported and moved to <out>/checkpoints-set-aside/)")
    resume_step: int | None = _option(None, "with --resume: restore checkpoint N instead (newer ones are moved to "
                                      "<out>/checkpoints-set-aside/)", metavar="N")
    save_every: int = _option(20, "checkpoint every N steps (and after the last)")
    export_hf: str | None = _option(None, "write the final params as safetensors + config.json into a new or empty "
                                    "DIR", metavar="DIR")
    export_peft: str | None = _option(None, "--train lora: write the final adapters as a PEFT LoRA adapter "
                                      "(adapter_config.json + adapter_model.safetensors) into a new or empty DIR",
                                      metavar="DIR")
    force: bool = _option(False, "with --export-hf / --export-peft: replace a non-empty DIR as a whole (written "
                          "beside it, then renamed over it)")
    log_every: int = _option(1, "print a progress line every N steps")
    # watching a run (trainer/report.py)
    log_samples_every: int = _option(10, "append the prompts' tails, completions, rewards (total and per function) and "
                                     "advantages of step 1, every N-th step and the last to <out>/samples.jsonl "
                                     "(one line per group; 0: never)", metavar="N")
    report_to: str = _option("none", "also send the metrics.jsonl scalars (steps, evaluations, warm-up) to "
                             "tensorboard (<out>/tensorboard, needs tensorboardX: the [report] extra) and / or wandb "
                             "(needs wandb; offline with WANDB_MODE=offline), as a comma list; process 0 only",
                             metavar="none|tensorboard,wandb")
    profile_steps: str | None = _option(None, "write a jax.profiler trace of GRPO steps A..B into <out>/profile/ "
                                        "(XProf / TensorBoard's profile plugin: *.xplane.pb; Perfetto: "
                                        "perfetto_trace.json.gz); those steps' timings include the tracing",
                                        metavar="A:B")
    progress_every: float = _option(30.0, "while a step's phase (sampling, update) runs longer than S seconds, print "
                                    "a line naming it with the elapsed time every S seconds (0: never)", metavar="S")
    progress_rounds: bool = _option(False, "those lines also say how far the running compiled loop is (capture and "
                                    "prompt-backward rounds, decode steps: done/total, positions/s, ETA), from host "
                                    "callbacks inside the loops (JAX keeps no program with a host callback in its "
                                    "persistent compilation cache: a restart compiles afresh)")
    # several processes (docs/cluster.md; trainer/distributed.py: also from JAX_* variables or SLURM / Open MPI)
    coordinator: str | None = _option(None, "join a multi-process run: process 0's address (all processes give the "
                                      "same)", group="multi-process (docs/cluster.md)", metavar="HOST:PORT")
    num_processes: int | None = _option(None, "processes in the run; --mesh's A*B devices are split evenly over them",
                                        metavar="N")
    process_id: int | None = _option(None, "this process's number in [0, N)", metavar="I")
    step_timeout: float = _option(DEFAULT_STEP_TIMEOUT_S, "a step running longer than max(S, 10 x the median step so "
                                  "far) (the first, which compiles: 10 x S) stops every process with one line "
                                  "(trainer/watchdog.py)", metavar="S")

    def __post_init__(self):
        errors = []
        for name, low in (("group_size", 1), ("response_len", 1), ("steps", 1), ("updates_per_batch", 1),
                          ("chunk_size", 1), ("prompt_len", 2),
                          ("save_every", 1), ("log_every", 1), ("vocab_size", 1), ("lora_rank", 1),
                          ("eval_every", 0), ("eval_prompts", 1), ("sft_steps", 0), ("sft_batch", 1),
                          ("refill_batches", 0), ("lr_warmup_steps", 0)):
            if getattr(self, name) < low:
                errors.append(f"{flag(name)}={getattr(self, name)} must be >= {low}")
        if self.refill_batches and not self.drop_uniform_groups:
            errors.append(f"--refill-batches={self.refill_batches} refills the groups --drop-uniform-groups leaves "
                          "out: give --drop-uniform-groups too")
        for name in ("learning_rate", "weight_decay", "kl_coef", "temperature", "top_p", "max_grad_norm",
                     "sft_learning_rate", "clip_eps_low", "clip_eps_high"):
            if not math.isfinite(getattr(self, name)) or getattr(self, name) < 0:
                errors.append(f"{flag(name)}={getattr(self, name)} must be a finite number >= 0")
        errors += _train_errors(self)
        if self.group_size == 1:
            errors.append("--group-size=1 must be >= 2: a GRPO advantage is a reward's difference from its group's "
                          "mean, so a group of one branch always has advantage 0 and nothing is learned")
        if self.eval_prompts > MAX_EVAL_PROMPTS:
            errors.append(f"--eval-prompts={self.eval_prompts} must be <= {MAX_EVAL_PROMPTS}: every evaluation "
                          "captures and answers each held-out prompt")
        if self.clip_eps_low >= 1:
            errors.append(f"--clip-eps-low={self.clip_eps_low} must be < 1 (the lower clip bound is 1 - clip_eps_low)")
        if self.temperature == 0:
            errors.append("--temperature=0.0 must be > 0: the G branches of a group must be sampled (greedy makes "
                          "them equal; the held-out evaluation is greedy)")
        errors += _data_errors(self)
        if self.ref_from is not None and (self.kl_coef == 0 or self.rollouts is not None):
            errors.append(f"--ref-from={self.ref_from} needs --kl-coef > 0 and sampled rollouts (a --rollouts file "
                          "carries its own ref_logprobs)")
        if self.sft_prompt_len is not None and self.sft_prompt_len < 2:
            errors.append(f"--sft-prompt-len={self.sft_prompt_len} must be >= 2")
        if self.sft_stop_accuracy is not None and not 0 < self.sft_stop_accuracy <= 1:
            errors.append(f"--sft-stop-accuracy={self.sft_stop_accuracy} must be in (0, 1]")
        for name in ("num_facts", "sft_num_facts"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                errors.append(f"{flag(name)}={getattr(self, name)} must be >= 1")
        if self.decode_batch is not None and (self.decode_batch < 1 or self.group_size % self.decode_batch):
            errors.append(f"--decode-batch={self.decode_batch} must divide --group-size={self.group_size} (G / N "
                          "batches of branches decode one after another)")
        if self.replay_batch < 1 or self.group_size % self.replay_batch:
            errors.append(f"--replay-batch={self.replay_batch} must divide --group-size={self.group_size} (G / K "
                          "replay steps of K branches each)")
        if self.groups_per_step is not None and self.groups_per_step < 1:
            errors.append(f"--groups-per-step={self.groups_per_step} must be >= 1")
        if self.num_processes is not None and self.num_processes < 1:
            errors.append(f"--num-processes={self.num_processes} must be >= 1")
        if self.process_id is not None and not 0 <= self.process_id < (self.num_processes or 1):
            errors.append(f"--process-id={self.process_id} must be in [0, --num-processes={self.num_processes})")
        if not (math.isfinite(self.step_timeout) and self.step_timeout > 0):
            errors.append(f"--step-timeout={self.step_timeout} must be a finite number of seconds > 0")
        if self.resume_step is not None and (self.resume_step < 1 or not self.resume):
            errors.append(f"--resume-step={self.resume_step} needs --resume and a step >= 1")
        if sum(x is not None for x in (self.hf, self.init_from)) + (self.model != "tiny") > 1:
            errors.append("give at most one of --model <config.json>, --hf, --init-from")
        if self.mesh is not None:
            try:
                parse_mesh_spec(self.mesh)
            except ValueError:
                errors.append(f"--mesh={self.mesh!r} must look like AxB with positive integers (data x seq), e.g. 1x8")
            else:
                data = parse_mesh_spec(self.mesh)[0]
                if self.groups_per_step is not None and self.groups_per_step >= 1 and self.groups_per_step % data:
                    errors.append(f"--groups-per-step={self.groups_per_step} must be a multiple of the mesh's data "
                                  f"size {data} (--mesh={self.mesh}): each data slice runs the same number of groups")
                if self.eval_every > 0 and self.eval_prompts >= 1 and self.eval_prompts % data:
                    errors.append(f"--eval-prompts={self.eval_prompts} must be a multiple of the mesh's data size "
                                  f"{data} (--mesh={self.mesh}): each data slice scores the same number of prompts")
        for field in dataclasses.fields(self):
            choices = field.metadata["argparse"].get("choices")
            if choices is not None and getattr(self, field.name) not in choices:
                errors.append(f"{flag(field.name)}={getattr(self, field.name)!r} must be one of {', '.join(choices)}")
        errors += _watch_errors(self)
        errors += _env_errors(self)
        if errors:
            raise ValueError("; ".join(errors))

    def task_options(self) -> dict:
        """The task factory's keyword arguments beyond prompt_len, vocab_size and seed: depth, max_depth and
        num_facts, those given (a custom factory receives only the options the command line sets)."""
        return {k: v for k, v in (("depth", self.depth), ("max_depth", self.max_depth), ("num_facts", self.num_facts))
                if v is not None}

    def saved(self) -> dict:
        """What a checkpoint (and <out>/config.json) records: every option except the RESUMABLE ones."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in RESUMABLE}

    def resumed(self, saved: dict, explicit: Collection[str] = ()) -> RunConfig:
        """This config with a checkpointed run's options (`saved()` of that run) adopted; an option given explicitly
        (`explicit`: names from `parse_args`) that contradicts them is a RunError. A run saved before an option's
        rename (`clip_low`) resumes: `current_names`."""
        saved = current_names(saved)
        unknown = sorted(set(saved) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise RunError(f"--resume: the checkpoint's configuration has options this version does not know: "
                           f"{unknown}")
        for name, value in saved.items():
            if name in explicit and getattr(self, name) != value and name not in CHANGEABLE | RESUMABLE:
                raise RunError(f"{flag(name)}={getattr(self, name)!r} differs from the run being resumed ({value!r}); "
                               f"only {sorted(RESUMABLE | CHANGEABLE)} may change on --resume")
        adopted = {k: v for k, v in saved.items() if k not in RESUMABLE and not (k in CHANGEABLE and k in explicit)}
        return dataclasses.replace(self, **adopted)


# {former name: field} of every renamed option (RunConfig's `formerly`)
FORMER_NAMES = {old: f.name for f in dataclasses.fields(RunConfig) for old in f.metadata["formerly"]}


def current_names(options: dict, source: str = "the saved options") -> dict:
    """Options keyed by field name (a run's saved options: <out>/config.json, a checkpoint's meta) with each former
    name replaced by the field's current one (`clip_low` -> `clip_eps_low`), so that a run saved before a rename
    resumes and is evaluated with the options it ran with. One option under two spellings is a ValueError naming
    `source` and both."""
    renamed, spelled = {}, {}
    for key, value in options.items():
        name = FORMER_NAMES.get(key, key)
        if name in renamed:
            raise ValueError(f"{source}: {spelled[name]!r} and {key!r} are the same option ({flag(name)}); give one")
        renamed[name], spelled[name] = value, key
    return renamed


def saved_run_config(options: dict, source: str = "the saved options", **changes) -> RunConfig:
    """A run's saved options (current_names applied; keys that are not RunConfig fields, e.g. those of a newer
    version, left out) as a RunConfig, with `changes` on top."""
    known = {f.name for f in dataclasses.fields(RunConfig)}
    return RunConfig(**{**{k: v for k, v in current_names(options, source).items() if k in known}, **changes})


def _data_errors(config: RunConfig) -> list[str]:
    """--data and its options (the data-dependent checks, e.g. columns and rows: trainer/components.py:data_source)."""
    errors = []
    needs_data = ("prompt_field", "messages_field", "chat_template_kwargs", "max_prompt_len", "eval_data",
                  "eval_fraction", "reward_weights", "prompt_buckets")
    if config.data is None:
        errors += [f"{flag(name)} needs --data" for name in needs_data if getattr(config, name) is not None]
        return errors
    if config.rollouts is not None:
        errors.append("--data and --rollouts are alternatives: give one")
    if config.prompt_field is not None and config.messages_field is not None:
        errors.append("give one of --prompt-field (text) and --messages-field (chat messages)")
    if config.eval_fraction is not None and not (math.isfinite(config.eval_fraction)
                                                 and 0 < config.eval_fraction < 1):
        errors.append(f"--eval-fraction={config.eval_fraction} must be in (0, 1)")
    if config.eval_fraction is not None and config.eval_data is not None:
        errors.append("give one of --eval-data and --eval-fraction")
    if config.prompt_buckets is not None and config.prompt_buckets < 1:
        errors.append(f"--prompt-buckets={config.prompt_buckets} must be >= 1")
    if config.max_prompt_len is not None and config.max_prompt_len < 2:
        errors.append(f"--max-prompt-len={config.max_prompt_len} must be >= 2")
    if config.reward is None:
        errors.append("--data needs --reward: built-ins exact_match, contains, f1, math, or MODULE:FUNCTION")
    elif config.reward_weights is not None:
        count = len([r for r in config.reward.split(",") if r.strip()])
        given = len(config.reward_weights.split(","))
        if given != count:
            errors.append(f"--reward-weights={config.reward_weights!r} has {given} weight(s); need one per --reward "
                          f"function ({count})")
    if config.chat_template_kwargs is not None:
        try:
            value = json.loads(config.chat_template_kwargs)
        except ValueError:
            value = None
        if not isinstance(value, dict):
            errors.append(f"--chat-template-kwargs={config.chat_template_kwargs!r} must be a JSON object, e.g. "
                          "'{\"enable_thinking\": false}'")
    return errors


REPORT_TARGETS = ("tensorboard", "wandb")


def _env_errors(config: RunConfig) -> list[str]:
    """The agent-branch options: counts >= 1, a positive timeout, a share in [0, 1], a JSON object of kwargs, no
    --env with --rollouts."""
    errors = []
    for name in ("max_turns", "turn_len", "max_observation_len"):
        value = getattr(config, name)
        if value is not None and value < (0 if name == "max_observation_len" else 1):
            errors.append(f"{flag(name)}={value} must be >= {0 if name == 'max_observation_len' else 1}")
    if not (math.isfinite(config.env_timeout) and config.env_timeout > 0):
        errors.append(f"--env-timeout={config.env_timeout} must be a finite number of seconds > 0")
    if not 0 <= config.max_env_errors <= 1:
        errors.append(f"--max-env-errors={config.max_env_errors} must be a share in [0, 1]")
    if config.env_kwargs is not None:
        try:
            kwargs = json.loads(config.env_kwargs)
        except ValueError as e:
            kwargs = e
        if not isinstance(kwargs, dict):
            errors.append(f"--env-kwargs={config.env_kwargs!r} must be a JSON object, e.g. '{{\"difficulty\": 2}}'")
    if config.env is not None and config.rollouts is not None:
        errors.append(f"--env={config.env} samples episodes; a --rollouts file brings its own (give one of them)")
    if config.tools is not None and (config.env is not None or config.data is None):
        errors.append(f"--tools={config.tools} is the environment of a --data run's episodes: give --data, and not "
                      "--env too")
    return errors


def report_targets(text: str) -> tuple[str, ...]:
    """--report-to: "none" (or empty) -> (); else the comma list's names, each once, in order; ValueError naming the
    option and the choices for any other name."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if names == ["none"] or not names:
        return ()
    bad = [n for n in names if n not in REPORT_TARGETS]
    if bad:
        raise ValueError(f"--report-to={text!r}: {', '.join(map(repr, bad))} must be one of {', '.join(REPORT_TARGETS)}"
                         " (a comma list) or none")
    return tuple(dict.fromkeys(names))


def profile_window(text: str) -> tuple[int, int]:
    """--profile-steps "A:B" (or "A": A:A) -> (A, B) with 1 <= A <= B; ValueError naming the option otherwise."""
    parts = text.split(":")
    try:
        first, last = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, -1)
    except ValueError:
        first, last = 0, -1
    if not 1 <= first <= last:
        raise ValueError(f"--profile-steps={text!r} must be A:B with 1 <= A <= B (GRPO steps, e.g. 3:5)")
    return first, last


def _watch_errors(config: RunConfig) -> list[str]:
    """--log-samples-every, --report-to, --profile-steps, --progress-every, --progress-rounds."""
    errors = []
    if config.log_samples_every < 0:
        errors.append(f"--log-samples-every={config.log_samples_every} must be >= 0")
    if not (math.isfinite(config.progress_every) and config.progress_every >= 0):
        errors.append(f"--progress-every={config.progress_every} must be a finite number of seconds >= 0")
    elif config.progress_rounds and not config.progress_every:
        errors.append("--progress-rounds reports in the --progress-every lines: give --progress-every > 0")
    for parse, value in ((report_targets, config.report_to), (profile_window, config.profile_steps)):
        try:
            if value is not None:
                parse(value)
        except ValueError as e:
            errors.append(str(e))
    return errors


def _train_errors(config: RunConfig) -> list[str]:
    """--train, --lora-*, --trainable, --export-peft (model-dependent checks, e.g. targets and rank against the
    matrices: trainer/components.py:prepare_training)."""
    errors = []
    if not math.isfinite(config.lora_alpha) or config.lora_alpha <= 0:
        errors.append(f"--lora-alpha={config.lora_alpha} must be a finite number > 0")
    if config.export_peft is not None and config.train != "lora":
        errors.append(f"--export-peft needs --train lora (a --train {config.train} run has no adapters to export)")
    if config.trainable is not None:
        if config.train == "lora":
            errors.append("--trainable selects parameters for --train full; with --train lora only the adapters train")
        try:
            re.compile(config.trainable)
        except re.error as e:
            errors.append(f"--trainable={config.trainable!r} is not a valid regular expression ({e})")
    return errors


def flag(name: str) -> str:
    """The command-line spelling of a field: group_size -> --group-size."""
    return "--" + name.replace("_", "-")


_TYPES = {"int": int, "float": float, "str": str}


def build_parser(explicit_only: bool = False) -> argparse.ArgumentParser:
    """The argparse parser of RunConfig's fields. explicit_only: options not given are left out of the namespace
    (so that `parse_args` can tell which ones the user gave)."""
    p = argparse.ArgumentParser(prog="python -m longstraw_jax.run", description=DESCRIPTION,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                **({"argument_default": argparse.SUPPRESS} if explicit_only else {}))
    group = p
    for field in dataclasses.fields(RunConfig):
        meta = field.metadata
        if meta["group"] is not None:
            group = p.add_argument_group(meta["group"])
        # the current spelling first (argparse's dest), then the former ones (aliases), then the short option
        flags = [flag(field.name), *map(flag, meta["formerly"])] + ([meta["short"]] if meta["short"] else [])
        kw = dict(meta["argparse"], help=meta["help"])
        if not explicit_only:
            kw["default"] = field.default
        if field.type == "bool":
            kw["action"] = "store_true"
        else:
            kw["type"] = _TYPES[field.type.split(" | ")[0]]
        group.add_argument(*flags, **kw)
    return p


def parse_args(argv=None) -> tuple[RunConfig, frozenset[str]]:
    """Command line -> (RunConfig, names of the options given explicitly: on the command line or in the --config
    file, whose values the command line overrides). Bad values raise ValueError (argparse's own errors, e.g. an
    unknown option, exit with status 2 as usual)."""
    argv = negative_values_attached(sys.argv[1:] if argv is None else list(argv))
    given = vars(build_parser(explicit_only=True).parse_args(argv))
    from_file = read_config_file(given["config"]) if given.get("config") else {}
    parser = build_parser()
    parser.set_defaults(**from_file)
    return RunConfig(**vars(parser.parse_args(argv))), frozenset(given) | frozenset(from_file)


_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-(inf|nan)$", re.IGNORECASE)


def negative_values_attached(argv: list[str]) -> list[str]:
    """`--lr -1e3` -> `--lr=-1e3`: argparse takes a value that starts with '-' for an option unless it looks like
    a plain negative number (-1, -0.5); a number in exponent form (or -inf / -nan) after an option of RunConfig that
    takes a value is attached to it, so that the bound check names it instead of argparse saying "expected one
    argument"."""
    options = [f for f in dataclasses.fields(RunConfig) if f.type != "bool"]
    takes_value = {flag(name) for f in options for name in (f.name, *f.metadata["formerly"])}
    takes_value |= {f.metadata["short"] for f in options if f.metadata["short"]}
    out, i = [], 0
    while i < len(argv):
        if argv[i] in takes_value and i + 1 < len(argv) and _NUMBER.match(argv[i + 1]):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def read_config_file(path: str) -> dict:
    """A --config TOML file -> {field name: value}: flat `name = value` lines whose names are RunConfig's fields
    (dashes or underscores; a renamed option's former name too, e.g. clip_low for clip_eps_low); an unknown name, one
    option given twice (group_size and group-size, lr and learning_rate), a nested table, `config` itself or a value
    of the wrong type is a ValueError naming the file and the option."""
    try:
        with open(path, "rb") as f:
            table = tomllib.load(f)
    except FileNotFoundError:
        raise ValueError(f"--config {path}: no such file") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"--config {path}: not valid TOML ({e})") from None
    fields = {f.name: f for f in dataclasses.fields(RunConfig) if f.name != "config"}
    values, spelled = {}, {}
    for key, value in table.items():
        name = FORMER_NAMES.get(key.replace("-", "_"), key.replace("-", "_"))
        if name not in fields:
            raise ValueError(f"--config {path}: unknown option {key!r} (options are the flags' names, e.g. "
                             "group_size or group-size; see --help)")
        if name in values:
            raise ValueError(f"--config {path}: {spelled[name]!r} and {key!r} are the same option ({flag(name)}); "
                             "give it once")
        spelled[name] = key
        kind = fields[name].type.split(" | ")[0]
        ok = {"bool": isinstance(value, bool), "int": isinstance(value, int) and not isinstance(value, bool),
              "float": isinstance(value, (int, float)) and not isinstance(value, bool),
              "str": isinstance(value, str)}[kind]
        if not ok:
            raise ValueError(f"--config {path}: {key} = {value!r} must be a{'n' if kind == 'int' else ''} {kind}")
        values[name] = float(value) if kind == "float" else value
    return values
