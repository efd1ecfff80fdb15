"""`Planner`: the per-device bytes of one trainer step for a model config on a simulated mesh, from shapes only.
The update is the trainer's step AOT-compiled (`train.jitted_train_step_donated`), the capture is
`engine.capture.jitted_capture_on_mesh` AOT-compiled, the rest is analytic (the model: docs/architecture.md
section 6)."""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from longstraw_jax import models, sharding, train
from longstraw_jax.adapters import lora, trainable
from longstraw_jax.capacity.footprint import (
    decode_gathered_bytes,
    largest_layer_bytes,
    local_bytes,
    memory_total,
    tree_bytes,
)
from longstraw_jax.capacity.hardware import Hardware
from longstraw_jax.capacity.hlo import Cost, ExpertModel, Kernels, program_cost
from longstraw_jax.capacity.phases import (
    local_groups,
    ragged_exchange_bytes,
    reference_phase,
    sampling_phase,
    step_peak,
    update_phase,
    with_ref_params,
)
from longstraw_jax.capacity.timing import decode_steps_per_group, phase_costs, step_times
from longstraw_jax.engine import capture as engine_capture
from longstraw_jax.grpo import GroupBatch, GRPOConfig
from longstraw_jax.sampling import reference as sampling_reference
from longstraw_jax.sampling.branches import batched_step
from longstraw_jax.sampling.mesh import ShardedCaptured
from longstraw_jax.sharding import rules
from longstraw_jax.sharding.rules import SEQ_AXES

GIB = 2**30


def decode_step(model, params, sstate, tails, tokens, position, mesh):
    """The mesh sampler's per-token program for N branches (`sampling.branches.batched_step` over the family's
    `decode` after the sharded prompt): tails [N, ...], tokens int32 [N] -> (tails, logits [N, vocab])."""
    decode = functools.partial(model.mesh_adapter().decode, params, sstate, mesh=mesh)
    return batched_step(model, params, decode)(tails, tokens, position)


_decode_step = jax.jit(decode_step, static_argnums=(0, 6), donate_argnums=(3,))


class Planner:
    """One model config on one simulated mesh: `plan` sizes a row of the step (mode, G, P, B), `search` the longest
    prompt that fits; compiled programs are cached per shape."""

    def __init__(self, config, mesh_spec: str, dtype: str, response_len: int, chunk: int, devices=None,
                 train_mode: str = "full", lora_rank: int = 64, lora_alpha: float | None = None,
                 lora_targets: str = "all", decode_batch: int | None = None, hlo_dir: str | None = None,
                 kl_coef: float = 0.0, replay_batch: int = 1, kernels: str = "xla", compile_for: str | None = None):
        """`config`: an HF config.json path or a model config object; `devices`: the mesh's devices (default all of
        jax.devices(); a process with more passes a subset). train_mode "lora": LoRA adapters of `lora_rank` on
        `lora_targets` (`lora.resolve_targets`), built abstractly, and the trainer's split (`trainable.split` by
        `trainable.adapter_leaf`): the update compiles `train_step(..., frozen=base)`, so gradients and AdamW state
        exist for the adapters only, while params (and the sampling phase) hold base + adapters. decode_batch: the
        sampler's (branches decoded together; None: all G). hlo_dir: where the time model writes each costed
        program's HLO text (`<program>_P<P>[_G<G>_<mode>|_N<N>].hlo.txt`), to be costed again without compiling.
        kl_coef > 0: the trainer's KL to a reference policy while sampling (`trainer/reference.py`): a reference
        phase (`reference`), the reference params copy held all step (full training; LoRA's reference is the base
        without adapters: no copy), and the update compiled with the KL term. replay_batch: the update's branches
        replayed together (`GRPOConfig.replay_batch`, a divisor of every G): K branches' activations at once.
        kernels: how the time model costs the kernels' loops (softmax attention, the chunked GDN, sparse latent
        attention): "xla" (as compiled: the XLA paths' unfused loops) or "pallas" (as the Pallas kernels would run
        them on a GPU: `hlo.Kernels`, `kernel_model`); the
        programs are the XLA path's either way. compile_for: the GPU kind `devices` are compile-only devices of
        (`capacity.gpu_target`; the caller traces under `ops.triton_ir.reported_backend("gpu")`): the programs are
        XLA's GPU compiler's, whose expert exchange is the ragged one itself (no `ragged_extra` added)."""
        self.model = models.build(models.config_from_hf(config) if isinstance(config, (str, os.PathLike)) else config)
        self.model.mesh_adapter()  # a family without a sharded path says so here
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
        # the trainer's split (trainer.loop.Trainer.split): the trainable part with holes, and the frozen rest or None
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
        self.gathered_bytes = decode_gathered_bytes(self.params, self.model.mesh_adapter().linear_leaves)
        self.decode_batch = decode_batch
        self.embed_bytes = tree_bytes(params["embed"])
        # the trainer's donated step: trainable params and their AdamW state donated, the frozen part read only
        self.step = train.jitted_train_step_donated
        self._captures: dict[int, dict] = {}
        self._updates: dict[tuple, dict] = {}
        self._programs: dict[tuple, object] = {}  # compiled executables, for the time model's costs
        self._costs: dict[tuple, Cost] = {}
        self.hlo_dir = hlo_dir
        if not (math.isfinite(kl_coef) and kl_coef >= 0):
            raise ValueError(f"--kl-coef {kl_coef!r} must be a finite number >= 0")
        self.kl_coef = float(kl_coef)
        self.grpo = GRPOConfig(kl_coef=self.kl_coef, replay_batch=replay_batch)
        if kernels not in ("xla", "pallas"):
            raise ValueError(f"--kernels {kernels!r}: expected xla or pallas")
        self.kernels = kernels
        self.compile_for = compile_for
        self.kernel_model()  # a family without the kernels says so here
        self._references: dict[tuple, dict] = {}

    @property
    def data(self) -> int:
        return self.mesh.shape["data"]

    def components(self, prompt_len: int, mode: str) -> dict[str, int]:
        """Analytic per-device bytes of what the update must hold (docs/architecture.md 6)."""
        out = {"params": local_bytes(self.params), "optimizer": local_bytes(self.opt_state),
               "grads": local_bytes(jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, jnp.float32,
                                                                                sharding=p.sharding),
                                                 self.trainable))}
        state, cotangent = self._state_bytes(prompt_len - 1)
        out["state"] = state
        out["cotangent"] = 0 if mode == "detached" else cotangent
        return out

    def _state_bytes(self, prompt_positions: int) -> tuple[int, int]:
        """Per-device bytes of the prompt state at self.dtype and of its float32 cotangent: position-indexed fields
        (`rules.SEQ_AXES`, in the engine's padded round layout) split along `seq`, carried ones whole."""
        seq = self.mesh.shape["seq"]
        padded = engine_capture.round_layout(self.model, prompt_positions, seq, self.chunk).padded
        state = jax.eval_shape(lambda: self.model.init_state(padded, self.dtype))
        total = cotangent = 0
        for field in dataclasses.fields(state):
            leaf = getattr(state, field.name)
            if not isinstance(leaf, jax.ShapeDtypeStruct):
                continue
            count = int(np.prod(leaf.shape)) // (seq if field.name in SEQ_AXES else 1)
            total, cotangent = total + count * leaf.dtype.itemsize, cotangent + count * 4
        return total, cotangent

    def tail_bytes(self, response_len: int, group: int) -> int:
        """Replicated bytes of one group's decode tails: N + 1 x `init_state(R)` whole (the R response positions'
        cache entries plus the carried GDN state being advanced), one per branch decoding together
        (`branches_together`) and the tail after prompt[-1] that each batch of branches starts from."""
        tail = jax.eval_shape(lambda: self.model.init_state(response_len, self.dtype))
        return (self.branches_together(group) + 1) * tree_bytes(tail)

    def decode_bytes(self, group: int) -> tuple[int, int]:
        """One decode step's transient: (shared by the slice's groups: the largest layer's leaves that are gathered
        whole (those not applied as shards, `decode_gathered_bytes`) and the embedding table (all-gathered whole:
        an upper bound); per group: 4 float32 [vocab] rows per branch decoding together)."""
        n = self.branches_together(group)
        return self.gathered_bytes + self.embed_bytes, n * 4 * 4 * self.model.config.vocab_size

    def capture(self, prompt_len: int) -> dict:
        """The sharded capture of prompt[:-1] (`engine.capture.jitted_capture_on_mesh`, rounds of self.chunk),
        AOT-compiled once per prompt length: {"temp": its temporaries, "aux": its output minus the state (Qwen3.6's
        round boundaries), "total", "compile_s"} in per-device bytes."""
        if prompt_len not in self._captures:
            layout = engine_capture.round_layout(self.model, prompt_len - 1, self.mesh.shape["seq"], self.chunk)
            replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
            tokens = jax.ShapeDtypeStruct((layout.padded,), jnp.int32, sharding=replicated)
            start = time.perf_counter()
            compiled = engine_capture.jitted_capture_on_mesh.lower(self.model, self.params, tokens, self.mesh, layout,
                                                           "ring").compile()
            self._programs[("capture", prompt_len)] = compiled
            memory = memory_total(compiled)
            state = self._state_bytes(prompt_len - 1)[0]
            self._captures[prompt_len] = dict(temp=memory["temp"], aux=max(0, memory["outputs"] - state),
                                              total=memory["total"], compile_s=time.perf_counter() - start)
        return self._captures[prompt_len]

    def sampling(self, prompt_len: int, group: int, mode: str, groups: int) -> dict[str, int]:
        """The sampling phase's per-device bytes (docs/architecture.md 6) for `groups` groups per data slice."""
        parts = self.components(prompt_len, mode)
        capture = self.capture(prompt_len)
        shared, per_group = self.decode_bytes(group)
        return sampling_phase(params=parts["params"], optimizer=parts["optimizer"], state=parts["state"],
                              boundaries=capture["aux"] if mode == "exact" else 0,
                              tail=self.tail_bytes(self.response_len, group), decode_shared=shared,
                              decode_per_group=per_group, capture_temp=capture["temp"], groups=groups)

    def compile(self, prompt_len: int, group: int, mode: str) -> dict:
        """The update of one group, AOT-compiled (once per prompt length, G, mode and R): its components (package
        docstring), "total" and "temp" in per-device bytes, and "compile_s"."""
        key = (prompt_len, group, mode, self.response_len)
        if key not in self._updates:
            self._updates[key] = self._compile(prompt_len, group, mode)
        return self._updates[key]

    def _compile(self, prompt_len: int, group: int, mode: str) -> dict:
        batch = self._batch(prompt_len, group)
        start = time.perf_counter()
        compiled = self.step.lower(self.model, self.trainable, self.opt_state, batch, self.optimizer, self.grpo,
                                   mode, self.chunk, self.mesh, None, self.frozen).compile()
        seconds = time.perf_counter() - start
        memory = memory_total(compiled)
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
        reference, compile_s = None, compiled["compile_s"] + capture["compile_s"]
        if self.kl_coef > 0:
            reference = self.reference(prompt_len, group, mode, groups)
            sampling = with_ref_params(sampling, reference["ref_params"])
            update = with_ref_params(update, reference["ref_params"])
            compile_s += self.reference_program(prompt_len, group)["compile_s"]
        peak, phase = step_peak(sampling, update, reference)
        ragged = self.ragged_extra(mode)
        peak_gpu = max(sampling["total"] + ragged["sampling"], update["total"] + ragged["update"],
                       reference["total"] + ragged["sampling"] if reference else 0)
        return dict(train=self.train_mode, mode=mode, G=group, P=prompt_len, B=groups_per_step,
                    decode_steps=decode_steps_per_group(group, self.response_len, self.branches_together(group)),
                    sampling=sampling, update=update, **({"reference": reference} if reference else {}), peak=peak,
                    peak_phase=phase, fits=bool(peak <= limit), ragged_extra=ragged, peak_ragged=peak_gpu,
                    fits_ragged=bool(peak_gpu <= limit), compile_s=compile_s)

    def ref_params_bytes(self) -> int:
        """Per-device bytes of the reference params the trainer holds besides the policy's: a copy of the trainable
        part for full training (its FSDP shard), none for LoRA (the base without adapters is the policy's own)."""
        return 0 if self.train_mode == "lora" else local_bytes(self.trainable)

    def reference_program(self, prompt_len: int, group: int) -> dict:
        """The trainer's reference log-probs for one group per data slice (`sampling.reference.jitted_on_mesh`:
        capture prompt[:-1] under the reference params, replay G branches of R tokens, no gradient), AOT-compiled
        once per (P, G, R): {"temp", "total", "compile_s"} in per-device bytes."""
        key = (prompt_len, group, self.response_len)
        if key not in self._references:
            layout = engine_capture.round_layout(self.model, prompt_len - 1, self.mesh.shape["seq"], self.chunk)
            by_data = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec("data"))
            prompts = jax.ShapeDtypeStruct((self.data, prompt_len), jnp.int32, sharding=by_data)
            responses = jax.ShapeDtypeStruct((self.data, group, self.response_len), jnp.int32, sharding=by_data)
            ref_params = lora.without_adapters(self.params)  # full training: the copy has the params' shapes
            start = time.perf_counter()
            compiled = sampling_reference.jitted_on_mesh.lower(
                self.model, ref_params, prompts, responses, self.mesh, layout,
                min(self.grpo.logprob_chunk, self.response_len)).compile()
            memory = memory_total(compiled)
            self._references[key] = dict(temp=memory["temp"], total=memory["total"],
                                         compile_s=time.perf_counter() - start)
        return self._references[key]

    def reference(self, prompt_len: int, group: int, mode: str, groups: int) -> dict[str, int]:
        """The reference phase's per-device bytes (`phases.reference_phase`) for `groups` groups per data slice."""
        parts = self.components(prompt_len, mode)
        program = self.reference_program(prompt_len, group)
        return reference_phase(params=parts["params"], optimizer=parts["optimizer"],
                               ref_params=self.ref_params_bytes(), state=parts["state"],
                               boundaries=self.capture(prompt_len)["aux"] if mode == "exact" else 0,
                               ref_state=parts["state"], ref_temp=program["temp"], groups=groups)

    # ----- the time model (timing.py): per-device costs of the compiled programs ---------------------------------

    def capture_program(self, prompt_len: int):
        """The compiled sharded capture of prompt[:-1] (`capture`'s, compiled once per prompt length)."""
        self.capture(prompt_len)
        return self._programs[("capture", prompt_len)]

    def captured(self, prompt_len: int) -> ShardedCaptured:
        """The sampler's capture of prompt[:-1] as abstract arrays (`sampling.mesh.ShardedCaptured`): the compiled
        capture's outputs with their shardings."""
        compiled = self.capture_program(prompt_len)
        layout = engine_capture.round_layout(self.model, prompt_len - 1, self.mesh.shape["seq"], self.chunk)
        tokens = jax.ShapeDtypeStruct((layout.padded,), jnp.int32)
        shapes = jax.eval_shape(lambda p, t: engine_capture.jitted_capture_on_mesh(self.model, p, t, self.mesh, layout,
                                                                           "ring"), self.params, tokens)
        out = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes,
                           compiled.output_shardings)
        return ShardedCaptured(*out)

    def decode_program(self, prompt_len: int, group: int):
        """One decode step of the mesh sampler after a prompt of `prompt_len` (`decode_step`) for the N branches that
        decode together (`decode_batch`, default G), AOT-compiled: tokens [N] and position replicated int32, the
        tails `init_tail(R)` [N, ...] replicated, the captured state seq-sharded."""
        n = self.branches_together(group)
        key = ("decode", prompt_len, n)
        if key not in self._programs:
            sstate = self.captured(prompt_len).sstate
            replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
            family = self.model.mesh_adapter()
            tail = jax.eval_shape(lambda p, s: family.init_tail(p, s, self.response_len), self.params, sstate)
            tails = jax.tree.map(lambda x: jax.ShapeDtypeStruct((n,) + x.shape, x.dtype, sharding=replicated), tail)
            tokens = jax.ShapeDtypeStruct((n,), jnp.int32, sharding=replicated)
            position = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
            self._programs[key] = _decode_step.lower(self.model, self.params, sstate, tails, tokens, position,
                                                     self.mesh).compile()
        return self._programs[key]

    def branches_together(self, group: int) -> int:
        """N, the branches one decode step advances: `decode_batch` (must divide G), default all G."""
        n = group if self.decode_batch is None else self.decode_batch
        if group % n:
            raise ValueError(f"--decode-batch {n} must divide the group size G={group}")
        if group % self.grpo.replay_batch:
            raise ValueError(f"--replay-batch {self.grpo.replay_batch} must divide the group size G={group}")
        return n

    def update_program(self, prompt_len: int, group: int, mode: str):
        """The trainer's update given the sampler's capture (`train_step(..., captured=...)`: replay, the prompt
        backward in exact mode, AdamW; no capture of its own), AOT-compiled."""
        key = ("update", prompt_len, group, mode)
        if key not in self._programs:
            self._programs[key] = self.step.lower(self.model, self.trainable, self.opt_state,
                                                  self._batch(prompt_len, group), self.optimizer, self.grpo, mode,
                                                  self.chunk, self.mesh, self.captured(prompt_len),
                                                  self.frozen).compile()
        return self._programs[key]

    def program_costs(self, prompt_len: int, group: int, mode: str) -> dict[str, Cost]:
        """Per-device `Cost` (hlo/: loops multiplied by their trip counts) of one execution of each program:
        {"capture", "decode_step", "update"}. A loop with no bound on its trip count (`Cost.unknown_loops`) is an
        error (the time would be a lower bound); data-dependent loops are counted at their bound
        (`Cost.bounded_loops`)."""
        programs = dict(capture=lambda: self.capture_program(prompt_len),
                        decode_step=lambda: self.decode_program(prompt_len, group),
                        update=lambda: self.update_program(prompt_len, group, mode))
        out = {}
        for name, program in programs.items():
            key = (name, prompt_len) + {"update": (group, mode), "decode_step": (self.branches_together(group),),
                                         "capture": ()}[name]
            if key not in self._costs:
                compiled = program()
                if self.hlo_dir:
                    os.makedirs(self.hlo_dir, exist_ok=True)
                    tag = {"update": f"_G{group}_{mode}", "decode_step": f"_N{self.branches_together(group)}",
                           "capture": ""}[name]
                    with open(os.path.join(self.hlo_dir, f"{name}_P{prompt_len}{tag}.hlo.txt"), "w") as f:
                        f.write(compiled.as_text())
                cost = program_cost(compiled, experts=self.expert_model(name), kernels=self.kernel_model())
                if cost.unknown_loops:
                    raise ValueError(f"{name} program: while loops without a known trip count "
                                     f"{list(cost.unknown_loops)}; its time would be a lower bound")
                self._costs[key] = cost
            out[name] = self._costs[key]
        return out

    def expert_model(self, program: str) -> ExpertModel | None:
        """How the time model costs a program's routed experts: as a GPU's grouped matmul (`hlo.ExpertModel`), E
        = the config's routed experts; None for a model without them. In the decode step each branch's one token is
        the same on every seq shard and, where the experts are expert-parallel, each shard sends a 1 / seq slice of
        it, padded to one row per shard (`sharding/experts.py`, replicated_over_seq): 1 of the seq rows is real."""
        routed = getattr(self.model.config, "n_routed_experts", 0)
        if not routed:
            return None
        seq = self.mesh.shape["seq"]
        padded = program == "decode_step" and routed % self.mesh.size == 0
        return ExpertModel(routed, 1.0 / seq if padded else 1.0)

    def kernel_model(self) -> Kernels | None:
        """How the time model costs the kernels' loops: None (kernels "xla": as compiled) or, for "pallas", the
        Pallas kernels' FLOPs and compulsory HBM bytes (`hlo.Kernels` of the config: Qwen3.6's softmax attention
        and chunked GDN, GLM-5.x's sparse latent attention; inputs at the params' dtype) in place of each such loop
        of the XLA paths."""
        if self.kernels == "xla":
            return None
        return Kernels.for_config(self.model.config, self.dtype.itemsize)

    def timing(self, prompt_len: int, group: int, mode: str, groups_per_step: int, hw: Hardware) -> dict:
        """The time model of one step (timing.py) for one row: {"mode", "G", "P", "B", "decode_steps_per_group",
        "decode_step" (per-device flops, hbm_bytes, collective_bytes and by kind), "programs" (each program's
        per-device cost), "phases" (each phase's cost), "seconds" (each phase's roofline terms, "step")}."""
        groups = local_groups(groups_per_step, self.data)
        costs = self.program_costs(prompt_len, group, mode)
        steps = decode_steps_per_group(group, self.response_len, self.branches_together(group))
        phases = phase_costs(capture=costs["capture"], decode_step=costs["decode_step"], update=costs["update"],
                             steps_per_group=steps, groups=groups)
        return dict(mode=mode, G=group, P=prompt_len, B=groups_per_step, decode_steps_per_group=steps,
                    decode_step=costs["decode_step"].as_dict(),
                    programs={name: cost.as_dict() for name, cost in costs.items()},
                    phases={name: cost.as_dict() for name, cost in phases.items()},
                    seconds=step_times(phases, hw))

    def _batch(self, prompt_len: int, group: int) -> GroupBatch:
        """One group's batch as replicated abstract arrays: prompt [P], responses / mask / old log-probs [G, R],
        rewards [G]."""
        replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        arr = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=replicated)
        g, r = group, self.response_len
        return GroupBatch(prompt=arr((prompt_len,), jnp.int32), responses=arr((g, r), jnp.int32),
                          mask=arr((g, r), jnp.float32), rewards=arr((g,), jnp.float32),
                          old_logprobs=arr((g, r), jnp.float32),
                          ref_logprobs=arr((g, r), jnp.float32) if self.kl_coef > 0 else None)

    def ragged_extra(self, mode: str) -> dict[str, int]:
        """`ragged_exchange_bytes` per phase: sampling = a capture round's tokens per device (chunk / seq); update =
        the replay's (R / seq: replicated tokens are sent once per seq shard), and in exact mode the prompt
        backward's recomputed round, whose exchange also holds the rows' cotangents (twice the capture's)."""
        if self.compile_for:  # compiled for a GPU: its programs hold the ragged exchange already
            return dict(sampling=0, update=0)
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

