"""The entry points: `hlo_cost` of an HLO module's text, `program_cost` of a compiled JAX program, and XLA's own
`xla_cost` (loop bodies counted once) to compare with."""
from __future__ import annotations

from collections.abc import Mapping

from longstraw_jax.capacity.hlo.experts import ExpertModel
from longstraw_jax.capacity.hlo.kernels import KernelModel, Kernels
from longstraw_jax.capacity.hlo.totals import Cost
from longstraw_jax.capacity.hlo.walk import Walk


def hlo_cost(text: str, trip_counts: Mapping[str, float] | None = None, experts: ExpertModel | None = None,
             project: bool = True, kernels: Kernels | KernelModel | None = None) -> Cost:
    """Per-device Cost of one execution of an HLO module's text (`compiled.as_text()`), loops multiplied by their
    trip counts (`walk.py`). trip_counts: {while instruction name: n} for loops XLA has no
    `known_trip_count` for (overrides it where both exist; for a body without data-dependent loops of its own, a
    mean over the enclosing loops' iterations gives exact totals). experts: cost the routed experts as a GPU's
    grouped matmul (`ExpertModel`); None: as compiled (`Cost.expert_flops` / `expert_hbm_bytes` still say how much
    of the totals they are). project: False keys every walk by all known scalar values (the brute-force reference
    of the relevance caching, `walk.py`; same totals, slower). kernels: cost the XLA paths' softmax attention, chunked
    GDN and sparse latent attention as the Pallas kernels would run them (`Kernels`, `kernels.py`; a KernelModel:
    softmax attention alone); None: as compiled."""
    walk = Walk(text, dict(trip_counts or {}), experts, project, kernels)
    cost = walk.walk(walk.program.entry, False)
    if cost.expert_rows:  # every expert loop inside a call is charged by that call: never reached
        raise ValueError(f"expert loops {sorted(cost.expert_rows)} were not charged by an expert call")
    return cost


def program_cost(compiled, trip_counts: Mapping[str, int] | None = None, experts: ExpertModel | None = None,
                 kernels: Kernels | KernelModel | None = None) -> Cost:
    """`hlo_cost` of a compiled JAX program (`jax.jit(f).lower(...).compile()`): its per-device HLO."""
    return hlo_cost(compiled.as_text(), trip_counts, experts, kernels=kernels)


def xla_cost(compiled) -> dict[str, float]:
    """XLA's own `cost_analysis()` (loop bodies counted once): {"flops", "bytes accessed"} of the first device."""
    analysis = compiled.cost_analysis()
    if isinstance(analysis, (list, tuple)):
        analysis = analysis[0]
    return {k: float(analysis.get(k, 0.0)) for k in ("flops", "bytes accessed")}
