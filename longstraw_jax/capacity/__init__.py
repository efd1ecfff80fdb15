"""Capacity planner: per-device memory of one whole trainer step (sampling, then the update), from shapes only.

    python -m longstraw_jax.plan --config configs/qwen3.6-27b.json --mesh 1x8 -P 2100000 -G 2,8 --markdown

The command line (`cli.py`, `python -m longstraw_jax.plan`; tools/plan_capacity.py runs the same) sizes a model
config on a simulated CPU mesh; `Planner` (`planner.py`) is the same from Python. Modules: `phases.py` (the two
phases' arithmetic and the step's peak), `footprint.py` (bytes of abstract trees and compiled programs),
`planner.py` (what is compiled and what is analytic), `report.py` (tables, --json), `cli.py`. The planner is
library-level: it lowers the package's public jitted programs and never imports the trainer app or io/.

`--train lora` (`--lora-rank`, default 64; `--lora-alpha`; `--lora-targets`, default all: attention projections,
dense MLPs, shared and routed experts) sizes the trainer's `--train lora`: the adapters are added abstractly
(`jax.eval_shape` over `lora.add_adapters`), the tree is split as `trainer.loop.Trainer` splits it
(`trainable.split(params, trainable.adapter_leaf)`), and the update compiles `train_step(..., frozen=base)`: params
= frozen base + adapters (sampling holds both), optimizer and grads = the adapters' only. Routed experts and their
adapters are expert-parallel when the device count divides the experts (`rules.param_specs`), which the compiled
programs see and `largest_layer_bytes` (the update's gathered layer) follows.

A trainer step has two phases; the planner sizes each per device and reports the step's peak = the larger one.

**Update phase.** For each (mode, G, P) it AOT-compiles the trainer's update (`train.jitted_train_step_donated`:
sharded `grpo_grads` + AdamW with global-norm clipping, params and optimizer state donated) on a simulated CPU mesh of
A*B devices, from abstract arrays (`jax.ShapeDtypeStruct` with the FSDP / sequence shardings): nothing of model size is
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

**Sampling phase** (analytic, plus one AOT compile of the sharded capture `engine.capture.jitted_capture_on_mesh` per
P).
Each data slice samples its B/data groups side by side (the sampler vmapped over a group axis sharded on `data`): it
captures prompt[:-1] of each, then decodes the branches from the captured state, N = `--decode-batch` of a group at
a time (default all G) and all the slice's groups together, R sequential decode steps per batch ((G / N) x R per
group), each branch into a small replicated *tail*. Per device:

    params, optimizer   resident all step (the same shards as in the update)
    state        B/data x the captured state of prompt[:-1] (as above), kept for the update
    boundaries   exact mode: B/data x what the exact backward needs from the capture (Qwen3.6: the GDN states
                 carried into each round, spread over `seq`); the compiled capture's output minus the state
    tail         B/data x (N + 1) x the decode tail, replicated: `init_state(R)` = the R response positions' KV /
                 latent rows and indexer keys, plus the GDN conv/recurrent state being advanced; one per branch
                 decoding and the one after prompt[-1] that each batch starts from
    decode       one decode step's transient: the largest layer's leaves that are gathered whole (norm vectors,
                 conv kernels, GLM's kv_b_proj, indexer weights_proj and router: the matrices applied through
                 `linear` stay this device's shards, `sharding/tensor.py`; expert-parallel experts too), the
                 embedding table all-gathered whole (as XLA:CPU does for the capture's token lookup: an upper
                 bound), and per branch decoding 4 float32 rows of [vocab] (logits, sampling logits, two
                 log-softmaxes); the tokens' activations are negligible
    capture      B/data x the compiled capture's temporaries (one round's activations, gathered layers)

    sampling total = params + optimizer + state + boundaries + max(capture, tail + decode)

**Expert exchange.** The compiled programs run the expert exchange XLA:CPU can run (`gathered`,
`sharding/experts.py`); GPUs and TPUs run `ragged`, whose receive buffer is min(k, E / n) times larger (dropless
worst case).
"peak ragged" / "fits (ragged)" add its extra bytes analytically (`Planner.ragged_extra`) to each phase; "peak" /
"fits" are the compiled programs' (the trainer on a GPU runs the ragged one unless told otherwise).

**Reference phase** (`--kl-coef > 0`: the trainer's KL to a reference policy while sampling, `trainer/reference.py`).
Between sampling and the update each data slice computes its groups' reference log-probs one group at a time
(`sampling.reference.jitted_on_mesh`, AOT-compiled for one group per slice): the prompt captured again under the
reference params, then the branches replayed without gradient. Per device:

    params, optimizer, state, boundaries    as in sampling (the kept captures wait for the update)
    ref_params   the reference params held all step: full training a copy of the params' shard (also added to the
                 sampling and update phases); LoRA none (the base without adapters is the policy's own)
    ref_state    the reference capture's state of one group (part of the reference program's temporaries)
    ref_rest     the reference program's other temporaries: a capture round, one branch's replay, [chunk, vocab]
                 logits

The update is compiled with the KL term (`ref_logprobs` [G, R] in its batch). The time model does not cost the
reference phase.

`--search` binary-searches the longest prompt (to --search-step positions) whose step peak fits --device-gb.

**Time model** (`--time --hardware h20|h100|h200`): per device, the seconds of each phase, a roofline of the
compiled programs' costs with every loop's trip count applied (`hlo/`: FLOPs, HBM bytes and collective bytes
from the compiled HLO; `hardware.py`: the device kinds' peaks and `roofline`; `timing.py`: the phases,
`decode_steps_per_group`). Besides the capture and the update it compiles one decode step of the mesh sampler
(`planner.decode_step`) and the update given the sampler's capture (no capture of its own). Routed experts (GLM-5.x)
are costed as a GPU's grouped matmul, not as XLA:CPU runs them (`hlo.ExpertModel`, `Planner.expert_model`);
`--hlo-dir DIR` writes each costed program's HLO text (to cost it again without compiling). docs/architecture.md 6.

Caveats: sizes come from XLA:CPU's buffer assignment for the per-device SPMD program; a GPU compile differs
(fusion, scheduling, collective buffers), so read them as estimates. The sampling phase's tail and decode terms are
analytic (the sharded decoder is sized from its design, not compiled). bf16 sizing sets
`--xla_disable_hlo_passes=while-loop-invariant-code-motion` (otherwise the CPU compiler hoists a whole-input
float32 conversion out of loops and overstates scratch memory). Qwen3.6 and GLM-5.x configs are supported.

JAX must be set up before its backend starts (`cli.setup_jax`: the simulated device count and the XLA flag above);
a Python caller passes `devices` (a subset of an already started backend's) to `Planner` instead.
"""
from longstraw_jax.capacity.footprint import largest_layer_bytes, local_bytes, memory_total, tree_bytes
from longstraw_jax.capacity.hardware import HARDWARE, Hardware, hardware, roofline
from longstraw_jax.capacity.hlo import Cost, hlo_cost, program_cost
from longstraw_jax.capacity.phases import (
    REFERENCE_COLUMNS,
    SAMPLING_COLUMNS,
    UPDATE_COLUMNS,
    local_groups,
    ragged_exchange_bytes,
    reference_phase,
    sampling_phase,
    step_peak,
    update_phase,
)
from longstraw_jax.capacity.planner import Planner
from longstraw_jax.capacity.report import format_rows, format_times, write_json
from longstraw_jax.capacity.timing import decode_steps_per_group, phase_costs, step_times

__all__ = ["Cost", "HARDWARE", "Hardware", "Planner", "REFERENCE_COLUMNS", "SAMPLING_COLUMNS", "UPDATE_COLUMNS",
           "decode_steps_per_group", "format_rows", "format_times", "hardware", "hlo_cost", "largest_layer_bytes",
           "local_bytes", "local_groups", "memory_total", "phase_costs", "program_cost", "ragged_exchange_bytes",
           "reference_phase", "roofline", "sampling_phase", "step_peak", "step_times", "tree_bytes", "update_phase",
           "write_json"]
