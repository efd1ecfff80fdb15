"""Expert parallelism for the routed experts of a MoE layer (GLM-5.x; docs/architecture.md 5.10).

Each device of the mesh holds E / n of a layer's experts (`rules.param_specs` splits the routed-expert weights by
expert index over the whole mesh when n divides E); they are never all-gathered. Inside the sequence-parallel
`shard_map`, a MoE layer then runs as:

1. every device routes its own tokens (the router and the shared expert stay FSDP, gathered like any layer weight);
2. the tokens, their expert ids and routing weights are all-gathered over the mesh: [n * T, D];
3. each device computes only its own experts' rows (`ops.moe.grouped_swiglu`, ids outside its range contribute
   nothing), weighted by the routing weights: partial outputs [n * T, D];
4. `psum_scatter` sums the partials over devices and returns each device its own tokens' rows [T, D].

Dropless: every (token, expert) assignment is computed exactly once, by the expert's device; the outputs equal one
device's up to the order of the floating-point sum over a token's top-k experts. Under autodiff the all-gather and
the reduce-scatter transpose into each other: an expert's weight gradient is computed on its own device, from every
token routed to it, and stays there. This path needs only all-gather and reduce-scatter, so it runs on every backend
(XLA:CPU has no `ragged_all_to_all`). Its cost is the weak point: every device runs the grouped matmul over all
n * T * k gathered (token, expert) rows, most of them another device's (masked, not skipped), so one layer's
transient is about n * T * k * (D + 3 I) floats; for GLM-5.2 on 4x8 with rounds of 2K positions per device that is
the 121 GiB capture transient of docs/benchmarks.md 4.3. Not written yet: computing only the local rows in
fixed-size blocks, and a `ragged_all_to_all` exchange (only the routed rows travel, T * k * D per device) on GPUs.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from longstraw_jax.ops.lora import shape_of
from longstraw_jax.ops.moe import grouped_swiglu
from longstraw_jax.sharding.rules import FSDP


def routed_swiglu(x: jax.Array, experts: jax.Array, weights: jax.Array, gate_proj: jax.Array, up_proj: jax.Array,
                  down_proj: jax.Array, axes=FSDP) -> jax.Array:
    """Inside `shard_map` over `axes`: this device's tokens x [T, D] with their routing (experts int [T, k] global
    ids, weights float32 [T, k]) through the experts of all devices. gate_proj, up_proj [E / n, I, D] and down_proj
    [E / n, D, I] (or LoRA nodes over them, with their experts' adapters) are this device's experts e in
    [i * E / n, (i + 1) * E / n), i = its index along `axes`. -> [T, D] in x.dtype, the same as `grouped_swiglu`
    with all E experts on one device."""
    local = shape_of(gate_proj)[0]
    first = jax.lax.axis_index(axes) * local
    everyone = lambda a: jax.lax.all_gather(a, axes, tiled=True)
    ids = everyone(experts) - first
    ids = jnp.where((ids >= 0) & (ids < local), ids, local)  # local: "another device's expert"
    partial = grouped_swiglu(everyone(x), ids, everyone(weights), gate_proj, up_proj, down_proj)
    return jax.lax.psum_scatter(partial, axes, tiled=True)
