"""What a run may write, and where: the `--out` directory (a new run, a resumed one, or the remains of a run that
was stopped before its first checkpoint), the checkpoint to resume from, and the `--export-hf` directory.

`plan()` only reads and checks (any problem is a one-line RunError naming the path); `OutPlan.start()` makes the
changes it announced (removing incomplete saves, setting checkpoints aside), when the run first writes, i.e. after
its first step has been computed. The rules:

- a new run writes into a new or empty directory, or over the remains of a run of this trainer that completed no
  checkpoint (config.json, metrics.jsonl, samples.jsonl, tensorboard/, wandb/, profile/, checkpoints/ with only
  incomplete saves: what a kill during the first steps or the first save leaves); anything else that is not empty is
  refused;
- `--resume` restores the newest checkpoint that reads back intact; a damaged newer one is reported and moved to
  `<out>/checkpoints-set-aside/<step>`, never deleted (also the checkpoints newer than `--resume-step N`), since the
  resumed run saves those steps again; a run that completed no checkpoint starts again from step 0;
- incomplete saves (`checkpoints/<step>.orbax-checkpoint-tmp`, left by a kill mid-save) are removed, with a warning;
- `--export-hf DIR` must be new or empty, or with `--force` is replaced as a whole: the export is written beside it
  (`DIR.tmp-export-PID`) and renamed over it only when complete.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import sys

import jax

from longstraw_jax.io import checkpoints as orbax_io
from longstraw_jax.io.checkpoints import CHECKPOINT_DIR, TMP_SUFFIX, BrokenCheckpoint, TrainCheckpoints
from longstraw_jax.io.replace_dir import staged
from longstraw_jax.trainer import distributed, metrics
from longstraw_jax.trainer.config import CHANGEABLE, RunConfig, RunError, current_names

SET_ASIDE_DIR = "checkpoints-set-aside"
# what a run writes before its first checkpoint completes (*.tmp: a kill while one was being rewritten)
EARLY_RUN_FILES = frozenset({"config.json", "config.json.tmp", "metrics.jsonl", "metrics.jsonl.tmp", CHECKPOINT_DIR,
                             "eval_start.npy", "samples.jsonl", "samples.jsonl.tmp", "tensorboard", "wandb", "profile"})


def warn(message: str) -> None:
    """A one-line warning on stderr, from process 0 only (every process finds the same)."""
    if _primary():
        print(f"warning: {message}", file=sys.stderr, flush=True)


def _primary() -> bool:
    import jax

    return jax.process_index() == 0


def _without_changeable(saved: dict) -> dict:
    """A checkpoint's options without those a resumed run may change (the mesh), by their current names (a checkpoint
    saved before a rename and one saved after it by the resumed run): what makes two checkpoints one run."""
    return {k: v for k, v in current_names(saved).items() if k not in CHANGEABLE}


def _listing(directory: str, limit: int = 4) -> str:
    names = sorted(os.listdir(directory))
    return ", ".join(names[:limit]) + (f", ... ({len(names)} entries)" if len(names) > limit else "")


def check_dir_target(path: str, option: str) -> str:
    """The absolute path of a directory to be written; RunError when it exists and is not a directory, or cannot be
    created (an ancestor is a file, or is not writable)."""
    path = os.path.abspath(path)
    if os.path.lexists(path):
        if not os.path.isdir(path):
            raise RunError(f"{option} {path}: exists and is not a directory")
        if not os.access(path, os.W_OK | os.X_OK):
            raise RunError(f"{option} {path}: not writable")
        return path
    ancestor = os.path.dirname(path)
    while not os.path.lexists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        raise RunError(f"{option} {path}: cannot be created, {ancestor} is not a directory")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise RunError(f"{option} {path}: cannot be created, {ancestor} is not writable")
    return path


def early_run_config(out: str) -> dict | None:
    """The options (config.json, by their current names: `current_names`) of a run of this trainer in `out` that
    completed no checkpoint, or None when `out` holds anything else (other files, a complete checkpoint, metrics.png
    of a finished run, a foreign config.json)."""
    names = set(os.listdir(out))
    if not names <= EARLY_RUN_FILES or "config.json" not in names:
        return None
    ckpt_dir = os.path.join(out, CHECKPOINT_DIR)
    if os.path.lexists(ckpt_dir) and (not os.path.isdir(ckpt_dir)
                                      or any(TMP_SUFFIX not in name for name in os.listdir(ckpt_dir))):
        return None
    try:
        with open(os.path.join(out, "config.json")) as f:
            saved = json.load(f)
        saved = current_names(saved) if isinstance(saved, dict) else None
    except (OSError, ValueError):
        return None
    fields = {f.name for f in dataclasses.fields(RunConfig)}
    return saved if saved is not None and {"model", "task", "seed"} <= set(saved) <= fields else None


@dataclasses.dataclass
class OutPlan:
    """What `plan()` found: the run's config (merged with a resumed run's options), and the changes to make when
    the run starts writing."""
    out: str  # absolute
    config: RunConfig
    checkpoints: TrainCheckpoints | None = None  # --resume: a reader of <out>/checkpoints
    candidates: list[int] = dataclasses.field(default_factory=list)  # --resume: steps to try, newest first
    meta: dict | None = None  # the newest readable checkpoint's meta
    restart: bool = False  # over the remains of a run that completed no checkpoint: replace its files
    incomplete: list[str] = dataclasses.field(default_factory=list)  # incomplete saves to remove
    set_aside: list[int] = dataclasses.field(default_factory=list)  # checkpoint steps to move aside

    @property
    def resuming(self) -> bool:
        return bool(self.candidates)

    def restore(self, params_like, opt_state_like, key_like=None):
        """-> (params, opt_state, rng_key, meta) of the newest candidate that reads back intact; a damaged one is
        reported (and set aside at `start`); RunError when none is intact, or `--resume-step`'s is not. The *_like
        arguments give shardings: the arrays come back placed like them (key_like: the RNG key, when it is
        replicated on a mesh)."""
        problems = []
        sharding = getattr(key_like, "sharding", None)
        rng_sharding = sharding if isinstance(sharding, jax.sharding.NamedSharding) else None
        for step in self.candidates:
            try:
                params, opt_state, key, meta = self.checkpoints.restore(params_like, opt_state_like, step,
                                                                        rng_sharding=rng_sharding)
            except BrokenCheckpoint as e:
                if self.config.resume_step is not None:
                    raise RunError(f"--resume-step={step}: {e}") from None
                problems.append(str(e))
                if step != self.candidates[-1]:
                    warn(f"{e}; trying the next older checkpoint (checkpoint {step} is kept: moved to "
                         f"{os.path.join(self.out, SET_ASIDE_DIR)} when this run starts writing)")
                continue
            if _without_changeable(meta["config"]) != _without_changeable(self.meta["config"]):
                raise RunError(f"checkpoint {step} ({self.checkpoints.step_dir(step)}) has other options than "
                               f"checkpoint {self.meta['step']}; pass --resume-step to choose one")
            if self.config.steps <= step:
                raise RunError(f"--steps={self.config.steps}: the newest intact checkpoint is already at step {step}")
            self.set_aside = [s for s in self.checkpoints.all_steps() if s > step]
            return params, opt_state, key, meta
        raise RunError(f"--resume: no intact checkpoint in {self.checkpoints.directory}: " + "; ".join(problems))

    def start(self) -> TrainCheckpoints:
        """Make the announced changes and open the checkpoints for writing (call once, when the run first writes).
        A new run's config.json is written first (atomically), so a kill at any point in here leaves a directory
        that a new run or --resume accepts. Several processes: process 0 makes the changes while the others wait;
        an error there stops all of them (distributed.agreed)."""
        if self.checkpoints is not None:
            self.checkpoints.close()
        with distributed.agreed("start-writing", (OSError,)):
            if _primary():
                self._make_changes()
        return TrainCheckpoints(self.out)

    def _make_changes(self) -> None:
        os.makedirs(self.out, exist_ok=True)
        if self.restart:
            for name in ("metrics.jsonl", "metrics.jsonl.tmp", "config.json.tmp", "eval_start.npy", "samples.jsonl",
                         "samples.jsonl.tmp"):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(self.out, name))
        if not self.resuming:
            path = os.path.join(self.out, "config.json")
            with open(path + ".tmp", "w") as f:
                json.dump(self.config.saved(), f, indent=2)
            os.replace(path + ".tmp", path)
        for path in self.incomplete:
            shutil.rmtree(path)
        for step in self.set_aside:
            target = os.path.join(self.out, SET_ASIDE_DIR, str(step))
            n = 0
            while os.path.lexists(target):
                n += 1
                target = os.path.join(self.out, SET_ASIDE_DIR, f"{step}.{n}")
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.rename(os.path.join(self.out, CHECKPOINT_DIR, str(step)), target)
            warn(f"moved checkpoint {step} to {target}")


def plan(config: RunConfig, explicit, out: str) -> OutPlan:
    """Check `--out` for a new or a resumed run, and `--export-hf`; reads only (see the module docstring)."""
    """Several processes: each checks (reads only; process 0 prints the warnings), then they compare outcomes: an
    error on any process is raised on all, and processes that find different things in `out` (a filesystem that
    not every host sees alike) are an error (distributed.agree)."""
    try:
        out = check_dir_target(out, "--out")
        result = _plan_resume(config, explicit, out) if config.resume else _plan_new(config, out)
        check_export(result.config, out)
    except (RunError, ValueError, OSError) as e:
        distributed.agree("plan", str(e).splitlines()[0] if str(e) else type(e).__name__, single_raises=False)
        raise
    distributed.agree("plan", None, value=f"--out {out}: resuming from {result.candidates[:1] or 'nothing'}, "
                      f"incomplete saves {len(result.incomplete)}, restart {result.restart}")
    return result


def _plan_new(config: RunConfig, out: str) -> OutPlan:
    result = OutPlan(out, config)
    if not os.path.isdir(out) or not os.listdir(out):
        return result
    ckpt_dir = os.path.join(out, CHECKPOINT_DIR)
    if os.path.isdir(ckpt_dir) and any(TMP_SUFFIX not in name for name in os.listdir(ckpt_dir)):
        raise RunError(f"{ckpt_dir} already holds checkpoints: pass --resume to continue that run, or choose "
                       "another --out")
    if early_run_config(out) is None:
        raise RunError(f"--out {out}: not empty ({_listing(out)}) and not a run of this trainer that can be "
                       "resumed or restarted; choose a new or empty directory")
    result.restart = True
    result.incomplete = orbax_io.incomplete_saves(ckpt_dir)
    warn(f"--out {out}: holds a run that completed no checkpoint ({_listing(out)}); this run replaces it"
         + "".join(f"; removing the incomplete save {path}" for path in result.incomplete))
    return result


def _plan_resume(config: RunConfig, explicit, out: str) -> OutPlan:
    ckpt_dir = os.path.join(out, CHECKPOINT_DIR)
    if not os.path.isdir(ckpt_dir):
        raise RunError(f"--resume: no checkpoint directory {ckpt_dir}")
    checkpoints = TrainCheckpoints(out, create=False)
    steps = checkpoints.all_steps()
    result = OutPlan(out, config, checkpoints, incomplete=checkpoints.incomplete())
    for path in result.incomplete:
        warn(f"{path}: an incomplete save (the run was killed while saving); it is removed when this run starts "
             "writing")
    if not steps:
        saved = early_run_config(out)
        if saved is None:
            raise RunError(f"--resume: no checkpoint in {ckpt_dir}")
        if config.resume_step is not None:
            raise RunError(f"--resume-step={config.resume_step}: no complete checkpoint in {ckpt_dir}")
        warn(f"--resume: {ckpt_dir} holds no complete checkpoint (the run stopped before its first save "
             f"completed): starting again from step 0 with the options of {os.path.join(out, 'config.json')}")
        checkpoints.close()
        result.checkpoints, result.restart = None, True
        result.config = config.resumed(saved, explicit)
        return result
    if config.resume_step is not None:
        if config.resume_step not in steps:
            raise RunError(f"--resume-step={config.resume_step}: no checkpoint {config.resume_step} in {ckpt_dir} "
                           f"(complete: {', '.join(map(str, steps))})")
        candidates = [config.resume_step]
        newer = [s for s in steps if s > config.resume_step]
        if newer:
            warn(f"--resume-step={config.resume_step}: the newer checkpoint(s) {', '.join(map(str, newer))} are "
                 f"moved to {os.path.join(out, SET_ASIDE_DIR)} when this run starts writing")
    else:
        candidates = steps[::-1]
    problems = []
    for i, step in enumerate(candidates):
        try:
            result.meta = checkpoints.read_meta(step)
        except BrokenCheckpoint as e:
            if config.resume_step is not None:
                raise RunError(f"--resume-step={step}: {e}") from None
            problems.append(str(e))
            if i + 1 < len(candidates):
                warn(f"{e}; trying the next older checkpoint (checkpoint {step} is kept: moved to "
                     f"{os.path.join(out, SET_ASIDE_DIR)} when this run starts writing)")
            continue
        result.candidates = candidates[i:]
        break
    else:
        raise RunError(f"--resume: no intact checkpoint in {ckpt_dir}: " + "; ".join(problems))
    result.config = config.resumed(result.meta["config"], explicit)
    if result.config.steps <= min(result.candidates):
        raise RunError(f"--steps={result.config.steps}: the checkpoint is already at step {result.meta['step']}")
    metrics_path = os.path.join(out, "metrics.jsonl")
    if os.path.exists(metrics_path):
        metrics.check_metrics(metrics_path)  # a damaged line other than a partial last one is an error here
    return result


def check_export(config: RunConfig, out: str) -> None:
    """--export-hf / --export-peft: a new or empty directory, or any with --force; never one holding --out."""
    for option, target in (("--export-hf", config.export_hf), ("--export-peft", getattr(config, "export_peft", None))):
        if not target:
            continue
        path = check_dir_target(target, option)
        if os.path.commonpath([path, out]) == path:
            raise RunError(f"{option} {path}: holds --out {out}; choose another export directory")
        if os.path.isdir(path) and os.listdir(path) and not config.force:
            raise RunError(f"{option} {path}: exists and is not empty ({_listing(path)}); pass --force to replace "
                           "it as a whole")


@contextlib.contextmanager
def replaced_dir(path: str, force: bool, option: str = "--export-hf"):
    """Yield a fresh directory beside `path` to write into; when the block completes, it replaces `path` (renamed
    over it: the old one is renamed aside first and removed last, so one complete version exists at every
    moment). On any error the new directory is removed and `path` is untouched. A non-empty `path` needs `force`."""
    path = os.path.abspath(path)
    if os.path.isdir(path) and os.listdir(path) and not force:
        raise RunError(f"{option} {path}: exists and is not empty ({_listing(path)}); pass --force to replace it "
                       "as a whole")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with staged(path, "export") as staging:
        yield staging
