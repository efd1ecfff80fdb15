"""The child side of tools/bench_step.py: build the model, compile (and optionally run) one or more cells, print one
result line per cell (tools/bench_harness.py). Each child is `bench_step.py --one SPEC`, so that a cell's peak RSS is
its own; it imports JAX and the package only inside its functions (after the parent set its environment: XLA_FLAGS,
PYTHONPATH of the snapshot).

What a cell measures: `memory_analysis()` of the compiled step (`jax.jit(...).lower(abstract args).compile()`), the
process's RSS around compile and run, and (job["run"]) the median time of job["reps"] calls of that same executable
after one warm-up call; `--train lora` cells the trainer's whole update instead (`_train_cell`).
"""
from __future__ import annotations

import json
import resource
import statistics
import time

import bench_harness
from bench_step_format import fmt_bytes


def _proc_status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak_rss() -> bool:
    """Reset the kernel's RSS high-water mark (VmHWM) so that the run's peak can be told from the compile's."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _trim_heap() -> None:
    """Return freed heap pages to the OS (XLA's compiler leaves hundreds of MiB of freed arenas resident)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def load_config(path: str | None):
    """--config: a config.json (class chosen by its model_type), "tiny-glm" (Glm52Config.tiny()), or the Qwen3.6
    tiny preset by default."""
    from longstraw_jax import models

    if path == "tiny-glm":
        return models.Glm52Config.tiny()
    if path:
        try:
            return models.config_from_hf(path)
        except (FileNotFoundError, ValueError) as e:
            raise SystemExit(f"--config {path}: {e}") from None
    return models.Qwen36Config.tiny()


def _make_batch(vocab: int, p: int, r: int, g: int, seed: int):
    import numpy as np

    from longstraw_jax import GroupBatch

    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, vocab, p, dtype=np.int32)
    responses = rng.integers(0, vocab, (g, r), dtype=np.int32)
    lengths = rng.integers(max(1, r // 2), r + 1, g)
    mask = (np.arange(r)[None, :] < lengths[:, None]).astype(np.float32)
    rewards = rng.random(g).astype(np.float32)
    return GroupBatch(prompt=prompt, responses=responses, mask=mask, rewards=rewards,
                      old_logprobs=None, ref_logprobs=None)


def _lowerable(mode: str):
    """(jitted function, static-argument layout) for a mode: call as fn.lower(model, params, batch, cfg[, ...])."""
    import jax

    from longstraw_jax import naive_grpo_grads
    from longstraw_jax.engine.local import jitted_grpo_grads

    if mode == "naive":
        return lambda model, params, batch, cfg, chunk: jax.jit(naive_grpo_grads, static_argnums=(0, 3)).lower(
            model, params, batch, cfg)
    # jitted_grpo_grads is jax.jit(static_argnums=(0, 3, 4, 5)); grpo_grads is the same call after host-side checks.
    return lambda model, params, batch, cfg, chunk: jitted_grpo_grads.lower(model, params, batch, cfg, mode, chunk)


def child_main(spec_json: str) -> None:
    """Run the cells (jobs) of a child's spec, the JSON `bench_step_runner.spawn` passed: one result line each."""
    spec = json.loads(spec_json)
    import jax
    import jax.numpy as jnp
    import numpy as np

    import longstraw_jax
    from longstraw_jax import GRPOConfig, models
    from longstraw_jax.grpo import validate_batch
    from longstraw_jax.trainer.agreement import source_digest

    lib_file = longstraw_jax.__file__
    lib_digest = source_digest()  # of the package imported (the snapshot's, unless --no-snapshot)
    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[spec["dtype"]]
    cfg_model = load_config(spec.get("config"))
    model = models.build(cfg_model)
    grpo_cfg = GRPOConfig()
    key = jax.random.key(spec.get("seed", 0))
    params_abs = jax.eval_shape(lambda k: model.init(k, dtype=dtype), key)
    params = None
    stop_above = spec.get("stop_above_bytes")

    for job in spec["jobs"]:
        mode, p, r, g, chunk = job["mode"], job["P"], job["R"], job["G"], job["chunk"]
        batch_np = _make_batch(cfg_model.vocab_size, p, r, g, spec.get("seed", 0))
        validate_batch(batch_np, cfg_model.vocab_size)
        batch_abs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch_np)
        if job.get("train"):
            out = _train_cell(job, model, dtype, key, batch_np, batch_abs, grpo_cfg)
            out.update(jax=jax.__version__, lib=lib_file, lib_digest=lib_digest, backend=jax.default_backend(),
                       device=jax.devices()[0].device_kind,
                       ru_maxrss_kib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
            bench_harness.emit(out)
            continue
        rss_base = _proc_status_kib("VmRSS")
        t0 = time.perf_counter()
        lowered = _lowerable(mode)(model, params_abs, batch_abs, grpo_cfg, chunk)
        t1 = time.perf_counter()
        compiled = lowered.compile()
        t2 = time.perf_counter()
        ma = compiled.memory_analysis()
        out = dict(job, argument=ma.argument_size_in_bytes, output=ma.output_size_in_bytes,
                   temp=ma.temp_size_in_bytes, alias=ma.alias_size_in_bytes,
                   code=ma.generated_code_size_in_bytes, lower_s=t1 - t0, compile_s=t2 - t1,
                   rss_base_kib=rss_base, rss_after_compile_kib=_proc_status_kib("VmRSS"))
        out["total"] = out["argument"] + out["output"] + out["temp"]
        limit = job.get("max_run_bytes")
        if job.get("run") and limit is not None and out["total"] > limit:
            out["skipped_run"] = f"compiled total {fmt_bytes(out['total'])} > run limit {fmt_bytes(limit)}"
        elif job.get("run"):
            bench_harness.emit(dict(out, stage="compiled"))  # survives a crash in the run
            if params is None:
                params = jax.block_until_ready(model.init(key, dtype=dtype))
            batch = jax.device_put(batch_np)
            jax.block_until_ready(batch)
            _trim_heap()
            out["hwm_reset"] = _reset_peak_rss()
            rss_before = _proc_status_kib("VmRSS")
            t = time.perf_counter()
            loss, grads, _ = jax.block_until_ready(compiled(params, batch))  # warm-up
            out["first_call_s"] = time.perf_counter() - t
            times = []
            for _ in range(job["reps"]):
                t = time.perf_counter()
                jax.block_until_ready(compiled(params, batch))
                times.append(time.perf_counter() - t)
            leaves = [np.asarray(x, np.float64) for x in jax.tree.leaves(grads)]
            out.update(times_s=times, median_s=statistics.median(times), loss=float(loss),
                       grad_norm=float(np.sqrt(sum(float(np.sum(x * x)) for x in leaves))),
                       rss_before_run_kib=rss_before, run_hwm_kib=_proc_status_kib("VmHWM"))
            del loss, grads
            out["rss_after_run_kib"] = _proc_status_kib("VmRSS")
        out["ru_maxrss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        out["jax"] = jax.__version__
        out["lib"] = lib_file
        out["lib_digest"] = lib_digest
        out["backend"] = jax.default_backend()
        out["device"] = jax.devices()[0].device_kind
        bench_harness.emit(out)
        del lowered, compiled
        if stop_above is not None and out["total"] > stop_above:
            break  # the jobs are in increasing G: larger ones only cost more


def _train_cell(job, model, dtype, key, batch_np, batch_abs, grpo_cfg) -> dict:
    """One whole trainer update (`train.jitted_train_step_donated`: grpo_grads + clipping + AdamW, trainable params
    and optimizer state donated, as the trainer runs it) for job["train"]: "full" (every parameter trains) or "lora"
    (adapters of job["lora"] = {rank, alpha, targets} on a frozen base: `lora.add_adapters` + `trainable.split`, as
    `trainer/components.py:prepare_training` and `trainer/loop.py:Trainer` do). Compiled memory, and unless job["run"]
    is false the median time."""
    import jax
    import numpy as np

    from longstraw_jax import train
    from longstraw_jax.adapters import lora, trainable

    params = model.init(key, dtype=dtype)
    predicate = None
    if job["train"] == "lora":
        spec = job["lora"]
        paths = lora.resolve_targets(params, spec["targets"])
        params = lora.add_adapters(params, paths, spec["rank"], spec["alpha"], jax.random.fold_in(key, 0x10A))
        predicate = trainable.adapter_leaf
    part, frozen = (params, None) if predicate is None else trainable.split(params, predicate)
    optimizer = train.make_optimizer(1e-4)
    opt_state = optimizer.init(part)
    abstract = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
    step = train.jitted_train_step_donated
    count = lambda tree: sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))
    t0 = time.perf_counter()
    lowered = step.lower(model, abstract(part), abstract(opt_state), batch_abs, optimizer, grpo_cfg, job["mode"],
                         job["chunk"], None, None, None if frozen is None else abstract(frozen))
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    ma = compiled.memory_analysis()
    out = dict(job, argument=ma.argument_size_in_bytes, output=ma.output_size_in_bytes, temp=ma.temp_size_in_bytes,
               alias=ma.alias_size_in_bytes, code=ma.generated_code_size_in_bytes, lower_s=t1 - t0,
               compile_s=t2 - t1, trainable_params=count(part), params=count(params))
    out["total"] = out["argument"] + out["output"] + out["temp"] - out["alias"]
    if job.get("run"):
        batch = jax.device_put(batch_np)
        times = []
        for i in range(job["reps"] + 1):  # one warm-up call, then the timed ones
            t = time.perf_counter()
            part, opt_state, metrics = jax.block_until_ready(compiled(part, opt_state, batch, None, frozen))
            if i:
                times.append(time.perf_counter() - t)
        out.update(times_s=times, median_s=statistics.median(times), loss=float(metrics["loss"]),
                   grad_norm=float(metrics["grad_norm"]))
    return out

