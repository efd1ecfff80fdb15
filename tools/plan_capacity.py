"""Capacity planner: per-device memory of one whole trainer step (sampling, then the update), from shapes only.

    .venv/bin/python tools/plan_capacity.py --config configs/qwen3.6-27b.json --mesh 1x8 \
        -P 2.1M,4.46M -G 2,8 --modes exact,detached --device-gb 96 --markdown
    .venv/bin/python tools/plan_capacity.py --config configs/qwen3.6-27b.json --mesh 4x8 -P 2.1M --groups-per-step 4
    .venv/bin/python tools/plan_capacity.py --config configs/qwen3.6-27b.json --mesh 1x8 -G 8 --search --device-gb 96

    .venv/bin/python tools/plan_capacity.py --config configs/glm-5.2.json --mesh 4x8 -P 2.1M -G 2,8 --train lora \
        --lora-rank 64 --json glm_lora.json

`--train lora` (`--lora-rank`, default 64; `--lora-alpha`; `--lora-targets`, default all: attention projections,
dense MLPs, shared and routed experts) sizes the trainer's `--train lora`: the adapters are added abstractly
(`jax.eval_shape` over `lora.add_adapters`), the tree is split as `run_loop.Trainer` splits it
(`trainable.split(params, trainable.adapter_leaf)`), and the update compiles `train_step(..., frozen=base)`: params
= frozen base + adapters (sampling holds both), optimizer and grads = the adapters' only. Routed experts and their
adapters are expert-parallel when the device count divides the experts (`rules.param_specs`), which the compiled
programs see and `largest_layer_bytes` (the decode's gathered layer) follows.

A trainer step has two phases; the planner sizes each per device and reports the step's peak = the larger one.

**Update phase.** For each (mode, G, P) it AOT-compiles the trainer's update (`train._train_step`: sharded
`grpo_grads` + AdamW with global-norm clipping, params and optimizer state donated) on a simulated CPU mesh of A*B
devices, from abstract arrays (`jax.ShapeDtypeStruct` with the FSDP / sequence shardings): nothing of model size is
ever allocated. The compiled `memory_analysis()` of the per-device program (arguments + outputs + temporaries -
donated aliases) is shown next to a per-device breakdown:

    params      the device's FSDP shard of the parameters (sharding.rules.param_specs)
    optimizer   its shard of the AdamW moments (like the params)
    grads       the float32 gradient accumulator's shard (the engine accumulates in float32)
    state       the prompt state of prompt[:-1]: position-indexed caches split along `seq` (Qwen3.6 KV, GLM-5.x
                latent rows and indexer keys), the GDN conv/recurrent state whole
    cotangent   exact mode: the float32 state cotangent (sharded like the state)
    rest        compiled total - the above: activations, gathered layers, the capture's block inputs (exact)
    others      (B/data - 1) x the state (+ its round boundaries in exact mode) of the slice's other groups, held
                from sampling while one group is updated

The state is captured once per step, by the sampler, and reused by the update. The compiled step still captures
internally (the engine's entry point today); a state passed in instead would sit in its arguments: the same bytes.

**Sampling phase** (analytic, plus one AOT compile of the sharded capture `sharding.api._capture` per P). Each data
slice samples its B/data groups side by side (the sampler vmapped over a group axis sharded on `data`): it captures
prompt[:-1] of each, then decodes G branches of R tokens one token at a time, G*R sequential decode steps, from the
captured state plus a small replicated *tail*. Per device:

    params, optimizer   resident all step (the same shards as in the update)
    state        B/data x the captured state of prompt[:-1] (as above), kept for the update
    boundaries   exact mode: B/data x what the exact backward needs from the capture (Qwen3.6: the GDN states
                 carried into each round, spread over `seq`); the compiled capture's output minus the state
    tail         B/data x (the decode tail, replicated: `init_state(R)` = the R response positions' KV / latent
                 rows and indexer keys, plus the GDN conv/recurrent state being advanced; plus the carried part
                 saved after prompt[-1], restored for each branch)
    decode       one decode step's transient: one layer all-gathered (the largest; expert-parallel routed experts
                 stay this device's shard), the embedding table
                 all-gathered whole (as XLA:CPU does for the capture's token lookup: an upper bound), and per group
                 4 float32 rows of [vocab] (logits, sampling logits, two log-softmaxes); one token's activations
                 are negligible
    capture      B/data x the compiled capture's temporaries (one round's activations, gathered layers)

    sampling total = params + optimizer + state + boundaries + max(capture, tail + decode)

**Expert exchange.** The compiled programs run the expert exchange XLA:CPU can run (`gathered`,
`parallel/experts.py`); GPUs and TPUs run `ragged`, whose receive buffer is min(k, E / n) times larger (dropless
worst case).
"peak ragged" / "fits (ragged)" add its extra bytes analytically (`Planner.ragged_extra`) to each phase; "peak" /
"fits" are the compiled programs' (the trainer on a GPU runs the ragged one unless told otherwise).

`--search` binary-searches the longest prompt (to --search-step positions) whose step peak fits --device-gb.

Caveats: sizes come from XLA:CPU's buffer assignment for the per-device SPMD program; a GPU compile differs
(fusion, scheduling, collective buffers), so read them as estimates. The sampling phase's tail and decode terms are
analytic (the sharded decoder is sized from its design, not compiled). bf16 sizing sets
`--xla_disable_hlo_passes=while-loop-invariant-code-motion` (otherwise the CPU compiler hoists a whole-input
float32 conversion out of loops and overstates scratch memory). Qwen3.6 and GLM-5.x configs are supported.

Imports of jax and the package are function-local on purpose: XLA_FLAGS and the simulated device count must be set
(`_setup_jax`) before JAX creates its CPU client, and `--help` should not pay for starting it.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
import time

MIB, GIB = 2**20, 2**30
UPDATE_COLUMNS = ("params", "optimizer", "grads", "state", "cotangent", "rest", "others", "total")
SAMPLING_COLUMNS = ("params", "optimizer", "state", "boundaries", "tail", "decode", "capture", "total")


def _count(text: str) -> int:
    """'2.1M' -> 2100000, '512K' -> 512000, '8192' -> 8192."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a count like 8192, 512K or 2.1M")
    return int(round(float(match[1]) * {"": 1, "k": 10**3, "m": 10**6}[match[2].lower()]))


def _counts(text: str) -> list[int]:
    return [_count(t) for t in text.split(",")]


def local_groups(groups_per_step: int, data: int) -> int:
    """Groups each data slice holds at once: B / data. B must be a positive multiple of the mesh's data size."""
    if isinstance(groups_per_step, bool) or not isinstance(groups_per_step, int) or groups_per_step < 1 \
            or groups_per_step % data:
        raise ValueError(f"--groups-per-step {groups_per_step!r} must be a positive multiple of the mesh's data size "
                         f"{data} (each data slice samples and updates B / data whole groups)")
    return groups_per_step // data


def _setup_jax(devices: int) -> None:
    """Before JAX starts: simulated CPU devices, no while-loop hoisting of whole-input conversions, and no LLVM
    optimisation of the never-run code."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    flags = os.environ.get("XLA_FLAGS", "")
    if "while-loop-invariant-code-motion" not in flags:
        flags += " --xla_disable_hlo_passes=while-loop-invariant-code-motion"
    if "xla_backend_optimization_level" not in flags:  # LLVM only (after buffer assignment): compiles much faster
        flags += " --xla_backend_optimization_level=0"
    os.environ["XLA_FLAGS"] = flags.strip()
    import jax

    jax.config.update("jax_num_cpu_devices", devices)


def _local_bytes(abstract_tree) -> int:
    """Bytes one device holds of a tree of sharded ShapeDtypeStructs (the largest shard of each leaf)."""
    import jax
    import numpy as np

    total = 0
    for leaf in jax.tree.leaves(abstract_tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
        total += int(np.prod(shape)) * leaf.dtype.itemsize
    return total


def _tree_bytes(tree) -> int:
    """Bytes of a whole (unsharded) tree of arrays or ShapeDtypeStructs."""
    import jax

    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _memory_total(compiled) -> dict[str, int]:
    """A compiled executable's memory_analysis(): arguments, outputs, temporaries, aliases and their total."""
    m = compiled.memory_analysis()
    return dict(arguments=m.argument_size_in_bytes, outputs=m.output_size_in_bytes, temp=m.temp_size_in_bytes,
                total=m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                - m.alias_size_in_bytes)


def largest_layer_bytes(params) -> int:
    """Bytes of the largest single layer as `rules.gather_layer` holds it right before using it: whole, except the
    routed-expert weights (and their adapters) that expert parallelism splits by expert index
    (`rules.expert_parallel`: never all-gathered; this device's experts only). `params`: ShapeDtypeStructs, sharded
    (`sharding`: the mesh's specs decide what is expert-parallel) or not (everything counted whole). Stacked leaves
    (under `blocks` / `layers`, [stack, per_stack, ...]) are grouped by their kind (the path up to the stacked
    leaves: Qwen3.6 `blocks/linear`, GLM-5.x `layers/<segment>/<group>`); one layer of a kind is the sum of its
    leaves with both stacked axes indexed away. LoRA nodes count base + a + b."""
    import jax

    from longstraw_jax.parallel.rules import STACKED_ROOTS, expert_parallel

    kinds: dict[tuple, int] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        keys = tuple(getattr(k, "key", getattr(k, "idx", None)) for k in path)
        if keys and keys[0] in STACKED_ROOTS:
            kind = keys[:2] if keys[0] == "blocks" else keys[:3]
            shape = leaf.shape
            sharding = getattr(leaf, "sharding", None)
            if sharding is not None and expert_parallel(path, sharding.spec, 2):
                shape = sharding.shard_shape(leaf.shape)  # this device's experts stay local
            kinds[kind] = kinds.get(kind, 0) + math.prod(shape[2:]) * leaf.dtype.itemsize
    return max(kinds.values(), default=0)


def sampling_phase(*, params: int, optimizer: int, state: int, boundaries: int, tail: int, decode_shared: int,
                   decode_per_group: int, capture_temp: int, groups: int) -> dict[str, int]:
    """Per-device bytes of the sampling phase for `groups` (= B / data) groups per data slice (module docstring):
    resident params + optimizer + the groups' states (+ boundaries), then the larger of the capture's transient
    (groups x capture_temp) and the decode's (groups x (tail + decode_per_group) + decode_shared)."""
    out = dict(params=params, optimizer=optimizer, state=groups * state, boundaries=groups * boundaries,
               tail=groups * tail, decode=decode_shared + groups * decode_per_group, capture=groups * capture_temp)
    out["total"] = (params + optimizer + out["state"] + out["boundaries"]
                    + max(out["capture"], out["tail"] + out["decode"]))
    return out


def update_phase(compiled: dict[str, int], *, state: int, boundaries: int, groups: int, mode: str) -> dict[str, int]:
    """Per-device bytes of the update phase: the compiled one-group step (`compiled`: its components and "total")
    plus the other groups' states (and boundaries in exact mode) kept from sampling, (groups - 1) of them."""
    out = {c: compiled[c] for c in UPDATE_COLUMNS if c not in ("others", "total")}
    out["others"] = (groups - 1) * (state + (boundaries if mode == "exact" else 0))
    out["total"] = compiled["total"] + out["others"]
    return out


def ragged_exchange_bytes(*, devices: int, experts: int, top_k: int, hidden: int, itemsize: int,
                          tokens: int) -> int:
    """Extra per-device bytes of one MoE layer when the expert exchange is `ragged` (GPU/TPU) instead of `gathered`
    (the CPU program the planner compiles; `parallel/experts.py`): the receive buffer and its outputs hold
    n * T * min(k, E / n) rows of D, the gathered path's tokens and partial outputs n * T rows:
    2 n T (min(k, E / n) - 1) D elements, for `tokens` = T per device. 0 when the experts are not expert-parallel
    (n does not divide E) or there are none."""
    if not experts or experts % devices:
        return 0
    return 2 * devices * tokens * (min(top_k, experts // devices) - 1) * hidden * itemsize


def step_peak(sampling: dict, update: dict) -> tuple[int, str]:
    """The step's per-device peak: the larger phase total, and which phase it is."""
    return (update["total"], "update") if update["total"] >= sampling["total"] else (sampling["total"], "sampling")


class Planner:
    def __init__(self, config, mesh_spec: str, dtype: str, response_len: int, chunk: int, devices=None,
                 train_mode: str = "full", lora_rank: int = 64, lora_alpha: float | None = None,
                 lora_targets: str = "all"):
        """`config`: an HF config.json path or a model config object; `devices`: the mesh's devices (default all of
        jax.devices(); a process with more passes a subset). train_mode "lora": LoRA adapters of `lora_rank` on
        `lora_targets` (`lora.resolve_targets`), built abstractly, and the trainer's split (`trainable.split` by
        `trainable.adapter_leaf`): the update compiles `train_step(..., frozen=base)`, so gradients and AdamW state
        exist for the adapters only, while params (and the sampling phase) hold base + adapters."""
        import jax
        import jax.numpy as jnp

        from longstraw_jax import lora, models, sharding, train, trainable
        from longstraw_jax.parallel import rules

        self.jax, self.rules, self.train = jax, rules, train
        self.model = models.build(models.config_from_hf(config) if isinstance(config, (str, os.PathLike)) else config)
        self.model.sequence_parallel()  # a family without a sharded path says so here
        self.mesh = sharding.make_mesh(mesh_spec, devices)
        self.dtype = jnp.dtype(dtype)
        self.response_len, self.chunk = response_len, chunk
        if train_mode not in ("full", "lora"):
            raise ValueError(f"--train {train_mode!r}: expected full or lora")
        self.train_mode = train_mode
        params = jax.eval_shape(lambda key: self.model.init(key, self.dtype), jax.random.key(0))
        self.lora = None
        if train_mode == "lora":  # as lora.prepare_run does, on abstract arrays (adapters in the params' dtype)
            paths = lora.resolve_targets(params, lora_targets)
            lora.check_rank(params, paths, lora_rank)
            alpha = 2.0 * lora_rank if lora_alpha is None else float(lora_alpha)
            params = jax.eval_shape(lambda p, key: lora.add_adapters(p, paths, lora_rank, alpha, key), params,
                                    jax.random.key(0))
            self.lora = dict(rank=lora_rank, alpha=alpha, targets=lora_targets, matrices=len(paths))
        self.param_shardings = rules.named(rules.param_specs(params, self.mesh), self.mesh)
        self.params = jax.tree.map(lambda p, s: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=s), params,
                                   self.param_shardings)
        # the trainer's split (run_loop.Trainer.split): the trainable part with holes, and the frozen rest or None
        if train_mode == "lora":
            self.trainable, self.frozen = trainable.split(self.params, trainable.adapter_leaf)
        else:
            self.trainable, self.frozen = self.params, None
        part = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), self.trainable)
        self.optimizer = train.make_optimizer(1e-6)
        opt = jax.eval_shape(self.optimizer.init, part)  # AdamW state for the trainable part only
        opt_specs = rules.like_params_specs(opt, part, rules.param_specs(part, self.mesh))
        self.opt_state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), opt,
                                      rules.named(opt_specs, self.mesh))
        self.num_params = sum(math.prod(p.shape) for p in jax.tree.leaves(params))
        self.num_trainable = sum(math.prod(p.shape) for p in jax.tree.leaves(self.trainable))
        self.layer_bytes = largest_layer_bytes(self.params)
        self.embed_bytes = _tree_bytes(params["embed"])
        # the trainer's donated step: trainable params and their AdamW state donated, the frozen part read only
        self.step = jax.jit(train._train_step.__wrapped__, static_argnums=train._STATIC, donate_argnums=(1, 2))
        self._captures: dict[int, dict] = {}
        self._updates: dict[tuple, dict] = {}

    @property
    def data(self) -> int:
        return self.mesh.shape["data"]

    def components(self, prompt_len: int, mode: str) -> dict[str, int]:
        """Analytic per-device bytes of what the update must hold (see the module docstring)."""
        import jax
        import jax.numpy as jnp

        out = {"params": _local_bytes(self.params), "optimizer": _local_bytes(self.opt_state),
               "grads": _local_bytes(jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, jnp.float32,
                                                                                 sharding=p.sharding),
                                                  self.trainable))}
        state, cotangent = self._state_bytes(prompt_len - 1)
        out["state"] = state
        out["cotangent"] = 0 if mode == "detached" else cotangent
        return out

    def _state_bytes(self, prompt_positions: int) -> tuple[int, int]:
        """Per-device bytes of the prompt state at self.dtype and of its float32 cotangent: position-indexed fields
        (`rules.SEQ_AXES`, in the engine's padded round layout) split along `seq`, carried ones whole."""
        import jax
        import numpy as np

        from longstraw_jax.parallel.rules import SEQ_AXES
        from longstraw_jax.sharding.prompt import round_layout

        seq = self.mesh.shape["seq"]
        padded = round_layout(self.model, prompt_positions, seq, self.chunk).padded
        state = jax.eval_shape(lambda: self.model.init_state(padded, self.dtype))
        total = cotangent = 0
        for field in dataclasses.fields(state):
            leaf = getattr(state, field.name)
            if not isinstance(leaf, jax.ShapeDtypeStruct):
                continue
            count = int(np.prod(leaf.shape)) // (seq if field.name in SEQ_AXES else 1)
            total, cotangent = total + count * leaf.dtype.itemsize, cotangent + count * 4
        return total, cotangent

    def tail_bytes(self, response_len: int) -> int:
        """Replicated bytes of one group's decode tail: `init_state(R)` whole (the R response positions' cache
        entries plus the carried GDN state being advanced) and the carried part saved after prompt[-1]."""
        import jax

        tail = jax.eval_shape(lambda: self.model.init_state(response_len, self.dtype))
        return _tree_bytes(tail) + _tree_bytes(self.model.carried(tail))

    def decode_bytes(self) -> tuple[int, int]:
        """One decode step's transient: (shared by the slice's groups: the largest layer and the embedding table,
        all-gathered whole; per group: 4 float32 [vocab] rows)."""
        return self.layer_bytes + self.embed_bytes, 4 * 4 * self.model.config.vocab_size

    def capture(self, prompt_len: int) -> dict:
        """The sharded capture of prompt[:-1] (`sharding.api._capture`, rounds of self.chunk), AOT-compiled once per
        prompt length: {"temp": its temporaries, "aux": its output minus the state (Qwen3.6's round boundaries),
        "total", "compile_s"} in per-device bytes."""
        if prompt_len not in self._captures:
            import jax
            import jax.numpy as jnp

            from longstraw_jax.sharding import prompt as api

            layout = api.round_layout(self.model, prompt_len - 1, self.mesh.shape["seq"], self.chunk)
            replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
            tokens = jax.ShapeDtypeStruct((layout.padded,), jnp.int32, sharding=replicated)
            start = time.perf_counter()
            compiled = api._capture.lower(self.model, self.params, tokens, self.mesh, layout, "ring").compile()
            memory = _memory_total(compiled)
            state = self._state_bytes(prompt_len - 1)[0]
            self._captures[prompt_len] = dict(temp=memory["temp"], aux=max(0, memory["outputs"] - state),
                                              total=memory["total"], compile_s=time.perf_counter() - start)
        return self._captures[prompt_len]

    def sampling(self, prompt_len: int, group: int, mode: str, groups: int) -> dict[str, int]:
        """The sampling phase's per-device bytes (module docstring) for `groups` groups per data slice."""
        del group  # the branches are decoded one after another: G changes the sequential length, not the memory
        parts = self.components(prompt_len, mode)
        capture = self.capture(prompt_len)
        shared, per_group = self.decode_bytes()
        return sampling_phase(params=parts["params"], optimizer=parts["optimizer"], state=parts["state"],
                              boundaries=capture["aux"] if mode == "exact" else 0,
                              tail=self.tail_bytes(self.response_len), decode_shared=shared,
                              decode_per_group=per_group, capture_temp=capture["temp"], groups=groups)

    def compile(self, prompt_len: int, group: int, mode: str) -> dict:
        """The update of one group, AOT-compiled (once per prompt length, G, mode and R): its components (module
        docstring), "total" and "temp" in per-device bytes, and "compile_s"."""
        key = (prompt_len, group, mode, self.response_len)
        if key not in self._updates:
            self._updates[key] = self._compile(prompt_len, group, mode)
        return self._updates[key]

    def _compile(self, prompt_len: int, group: int, mode: str) -> dict:
        import jax
        import jax.numpy as jnp

        from longstraw_jax import GroupBatch, GRPOConfig

        replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        arr = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=replicated)
        g, r = group, self.response_len
        batch = GroupBatch(prompt=arr((prompt_len,), jnp.int32), responses=arr((g, r), jnp.int32),
                           mask=arr((g, r), jnp.float32), rewards=arr((g,), jnp.float32),
                           old_logprobs=arr((g, r), jnp.float32), ref_logprobs=None)
        start = time.perf_counter()
        compiled = self.step.lower(self.model, self.trainable, self.opt_state, batch, self.optimizer, GRPOConfig(),
                                   mode, self.chunk, self.mesh, None, self.frozen).compile()
        seconds = time.perf_counter() - start
        memory = _memory_total(compiled)
        parts = self.components(prompt_len, mode)
        parts["rest"] = memory["total"] - sum(parts.values())
        return dict(P=prompt_len, G=group, mode=mode, total=memory["total"], temp=memory["temp"],
                    arguments=memory["arguments"], compile_s=seconds, **parts)

    def plan(self, prompt_len: int, group: int, mode: str, groups_per_step: int, limit: float) -> dict:
        """One row of the whole step: {"mode", "G", "P", "B", "decode_steps" (G*R, the sampling phase's sequential
        length), "sampling": {...}, "update": {...} (per-device bytes, each with its "total"), "peak", "peak_phase",
        "fits" (peak <= limit bytes), "compile_s"}."""
        groups = local_groups(groups_per_step, self.data)
        compiled = self.compile(prompt_len, group, mode)
        sampling = self.sampling(prompt_len, group, mode, groups)
        capture = self.capture(prompt_len)
        update = update_phase(compiled, state=compiled["state"], boundaries=capture["aux"], groups=groups, mode=mode)
        peak, phase = step_peak(sampling, update)
        ragged = self.ragged_extra(mode)
        peak_gpu = max(sampling["total"] + ragged["sampling"], update["total"] + ragged["update"])
        return dict(train=self.train_mode, mode=mode, G=group, P=prompt_len, B=groups_per_step,
                    decode_steps=group * self.response_len,
                    sampling=sampling, update=update, peak=peak, peak_phase=phase, fits=bool(peak <= limit),
                    ragged_extra=ragged, peak_ragged=peak_gpu, fits_ragged=bool(peak_gpu <= limit),
                    compile_s=compiled["compile_s"] + capture["compile_s"])

    def ragged_extra(self, mode: str) -> dict[str, int]:
        """`ragged_exchange_bytes` per phase: sampling = a capture round's tokens per device (chunk / seq); update =
        the replay's (R / seq: replicated tokens are sent once per seq shard), and in exact mode the prompt
        backward's recomputed round, whose exchange also holds the rows' cotangents (twice the capture's)."""
        c = self.model.config
        seq = self.mesh.shape["seq"]
        extra = lambda tokens: ragged_exchange_bytes(
            devices=self.mesh.size, experts=getattr(c, "n_routed_experts", 0),
            top_k=getattr(c, "num_experts_per_tok", 1), hidden=c.hidden_size, itemsize=self.dtype.itemsize,
            tokens=tokens)
        capture = extra(-(-self.chunk // seq))
        replay = extra(-(-self.response_len // seq))
        return dict(sampling=capture, update=max(replay, 2 * capture if mode == "exact" else 0))

    def search(self, group: int, mode: str, groups_per_step: int, limit: int, step: int, log) \
            -> tuple[int, dict | None]:
        """Longest prompt (a multiple of `step`) whose step peak is <= limit bytes: doubling, then bisection."""
        best, lo, hi = None, 0, step
        while True:
            row = self.plan(hi, group, mode, groups_per_step, limit)
            print(f"  search {mode} G={group} P={hi:,}: {row['peak'] / GIB:.2f} GiB", file=log, flush=True)
            if not row["fits"]:
                break
            lo, best, hi = hi, row, hi * 2
        while hi - lo > step:
            mid = (lo + hi) // 2 // step * step
            row = self.plan(mid, group, mode, groups_per_step, limit)
            print(f"  search {mode} G={group} P={mid:,}: {row['peak'] / GIB:.2f} GiB", file=log, flush=True)
            lo, best, hi = (mid, row, hi) if row["fits"] else (lo, best, mid)
        return lo, best


def _table(head: list[str], lines: list[list[str]], markdown: bool, left: int) -> str:
    if markdown:
        out = ["| " + " | ".join(head) + " |", "| " + " | ".join(["---"] * left + ["---:"] * (len(head) - left)) + " |"]
        return "\n".join(out + ["| " + " | ".join(line) + " |" for line in lines])
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(head)]
    fmt = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))
    return "\n".join([fmt(head)] + [fmt(line) for line in lines])


def format_rows(rows: list[dict], device_gb: float, markdown: bool, unit: str = "GiB") -> str:
    """Three tables: the step (each phase's total, the peak, "fits"), then each phase's components."""
    scale = {"GiB": GIB, "MiB": MIB}[unit]
    key = lambda row: [row.get("train", "full"), row["mode"], str(row["G"]), f"{row['P']:,}", str(row["B"])]
    num = lambda x: f"{x / scale:.2f}"
    yes = lambda flag: "yes" if flag else "no"
    step = _table(["train", "mode", "G", "P", "B", f"sampling {unit}", f"update {unit}", f"peak {unit}", "peak phase",
                   "decode steps", f"fits {device_gb:g} GB", f"peak ragged {unit}", "fits (ragged)"],
                  [key(r) + [num(r["sampling"]["total"]), num(r["update"]["total"]), num(r["peak"]), r["peak_phase"],
                             f"{r['decode_steps']:,}", yes(r["fits"]), num(r["peak_ragged"]), yes(r["fits_ragged"])]
                   for r in rows], markdown, 5)
    sampling = _table(["train", "mode", "G", "P", "B"] + [f"{c} {unit}" for c in SAMPLING_COLUMNS],
                      [key(r) + [num(r["sampling"][c]) for c in SAMPLING_COLUMNS] for r in rows], markdown, 5)
    update = _table(["train", "mode", "G", "P", "B"] + [f"{c} {unit}" for c in UPDATE_COLUMNS],
                    [key(r) + [num(r["update"][c]) for c in UPDATE_COLUMNS] for r in rows], markdown, 5)
    return f"Step (per device)\n{step}\n\nSampling phase\n{sampling}\n\nUpdate phase\n{update}"


def write_json(path: str, rows: list[dict], args, planner) -> None:
    """{"setup": the run's options (train mode, LoRA rank / alpha / targets, parameter counts), "rows": one object
    per row (`Planner.plan`): train, mode, G, P, B, decode_steps, the
    "sampling" and "update" phases' components and "total" in bytes per device, "peak", "peak_phase", and "fits"
    (peak <= device_gb * 1e9)}."""
    setup = dict(config=args.config, mesh=args.mesh, dtype=args.dtype, response_len=args.response_len,
                 chunk=args.chunk, device_gb=args.device_gb, groups_per_step=args.groups_per_step,
                 params=planner.num_params, train=planner.train_mode, trainable_params=planner.num_trainable,
                 lora=planner.lora, largest_layer_bytes=planner.layer_bytes)
    with open(path, "w") as f:
        json.dump(dict(setup=setup, rows=rows), f, indent=1)
        f.write("\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="HF config.json of the model (e.g. configs/qwen3.6-27b.json)")
    ap.add_argument("--mesh", required=True, help="AxB: data x seq devices (simulated on CPU)")
    ap.add_argument("--prompt-len", "-P", type=_counts, default=[], help="comma list, e.g. 2.1M,4.46M")
    ap.add_argument("--group", "-G", type=_counts, default=[8], help="comma list of group sizes (default 8)")
    ap.add_argument("--response-len", "-R", type=_count, default=1024, help="response tokens per branch (1024)")
    ap.add_argument("--groups-per-step", "-B", type=_count, default=None,
                    help="groups per step, a multiple of the mesh's data size (default: the data size); each data "
                         "slice holds B / data groups' captured states at once")
    ap.add_argument("--modes", default="exact,detached")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device-gb", type=float, default=96.0, help="device memory in GB (1e9 bytes; default 96)")
    ap.add_argument("--search", action="store_true", help="binary-search the longest prompt whose step fits")
    ap.add_argument("--search-step", type=_count, default=65536, help="search resolution in positions (64K)")
    ap.add_argument("--chunk", type=_count, default=16384,
                    help="capture / prompt-backward round length in positions (default 16K: a round's working set "
                         "is most of the exact step's transient memory)")
    ap.add_argument("--train", choices=("full", "lora"), default="full",
                    help="full: every parameter trains (AdamW + fp32 grads for all); lora: frozen base + adapters "
                         "(grads and AdamW for the adapters only), as the trainer's --train lora")
    ap.add_argument("--lora-rank", type=int, default=64, help="--train lora: adapter rank (default 64)")
    ap.add_argument("--lora-alpha", type=float, default=None, help="--train lora: alpha (default 2 x rank; no "
                    "effect on memory)")
    ap.add_argument("--lora-targets", default="all", help="--train lora: groups (attn, mlp, shared, experts, all) "
                    "or expressions, as the trainer's (default all: attention projections and every MLP / expert "
                    "matrix)")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--unit", choices=("GiB", "MiB"), default="GiB", help="table unit (default GiB)")
    ap.add_argument("--json", metavar="FILE", help="also write every row as JSON (bytes per phase; 'fits' per row)")
    args = ap.parse_args(argv)
    from longstraw_jax.parallel.mesh import parse_mesh_spec

    try:
        data, seq = parse_mesh_spec(args.mesh)
        args.groups_per_step = data if args.groups_per_step is None else args.groups_per_step
        local_groups(args.groups_per_step, data)
        _setup_jax(data * seq)
        planner = Planner(args.config, args.mesh, args.dtype, args.response_len, args.chunk, train_mode=args.train,
                          lora_rank=args.lora_rank, lora_alpha=args.lora_alpha, lora_targets=args.lora_targets)
    except (ValueError, NotImplementedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import jax

    cfg = planner.model.config
    print(f"{type(cfg).__name__} from {args.config}: {planner.num_params / 1e9:.2f}B params at {args.dtype}; mesh "
          f"{args.mesh} (simulated, jax {jax.__version__}, XLA:CPU); R={args.response_len}; "
          f"B={args.groups_per_step} groups per step; rounds of {args.chunk:,} positions; device "
          f"{args.device_gb:g} GB", flush=True)
    if planner.lora is not None:
        print(f"--train lora: rank {planner.lora['rank']} on {planner.lora['matrices']} stacked matrices "
              f"({args.lora_targets}); {planner.num_trainable / 1e6:.1f}M trainable parameters (adapters), base frozen",
              flush=True)
    rows, limit = [], int(args.device_gb * 1e9)
    for mode in args.modes.split(","):
        for group in args.group:
            for prompt_len in args.prompt_len:
                rows.append(planner.plan(prompt_len, group, mode, args.groups_per_step, limit))
                print(f"  {mode} G={group} P={prompt_len:,}: sampling {rows[-1]['sampling']['total'] / GIB:.2f} "
                      f"GiB, update {rows[-1]['update']['total'] / GIB:.2f} GiB (compile {rows[-1]['compile_s']:.0f} "
                      "s)", flush=True)
            if args.search:
                longest, row = planner.search(group, mode, args.groups_per_step, limit, args.search_step, sys.stdout)
                print(f"  longest prompt whose step fits ({mode}, G={group}): {longest:,} positions", flush=True)
                if row is not None:
                    rows.append(dict(row, mode=mode + " (longest)"))
    print(format_rows(rows, args.device_gb, args.markdown, args.unit))
    if args.json:
        write_json(args.json, rows, args, planner)
    for mode in args.modes.split(","):
        for prompt_len in args.prompt_len:
            cells = {row["G"]: row["peak"] for row in rows if row["mode"] == mode and row["P"] == prompt_len}
            if len(cells) > 1:
                lo, hi = min(cells), max(cells)
                print(f"{mode} P={prompt_len:,}: G {lo} -> {hi} costs {(cells[hi] - cells[lo]) / 1e9:+.4f} GB "
                      f"({cells[hi] - cells[lo]:+,} bytes) at the step's peak")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
