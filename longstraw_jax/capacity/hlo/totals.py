"""`Cost`: the per-device totals of one execution of a program or of a part of it, and how parts combine: in sequence
(`+`), repeated (`scaled`), or as alternatives of which the costliest is counted (`maximum`)."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping


@dataclasses.dataclass(frozen=True)
class Cost:
    """Per-device totals of one program execution. collective_bytes: {kind: bytes sent per device} (`collectives.py`);
    unknown_loops: names of while loops counted once for want of a trip count (the totals are then lower bounds);
    bounded_loops: names of data-dependent loops counted at their bound (upper bounds for those)."""

    flops: float = 0.0
    hbm_bytes: float = 0.0
    collective_bytes: Mapping[str, float] = dataclasses.field(default_factory=dict)
    unknown_loops: tuple[str, ...] = ()
    bounded_loops: tuple[str, ...] = ()
    expert_flops: float = 0.0       # the routed experts' part of flops (`experts.py`)
    expert_hbm_bytes: float = 0.0   # ... and of hbm_bytes
    expert_rows: Mapping[str, float] = dataclasses.field(default_factory=dict)  # internal: rows per expert loop
    # whose weight reads are charged at the enclosing expert call (`ExpertModel`)

    @property
    def collective_total(self) -> float:
        return float(sum(self.collective_bytes.values()))

    def scaled(self, k: float) -> "Cost":
        """This cost executed k times."""
        return Cost(self.flops * k, self.hbm_bytes * k, {c: b * k for c, b in self.collective_bytes.items()},
                    self.unknown_loops, self.bounded_loops, self.expert_flops * k, self.expert_hbm_bytes * k,
                    {n: r * k for n, r in self.expert_rows.items()})

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(self.flops + other.flops, self.hbm_bytes + other.hbm_bytes,
                    _merge(self.collective_bytes, other.collective_bytes, combine=sum),
                    tuple(dict.fromkeys(self.unknown_loops + other.unknown_loops)),
                    tuple(dict.fromkeys(self.bounded_loops + other.bounded_loops)),
                    self.expert_flops + other.expert_flops, self.expert_hbm_bytes + other.expert_hbm_bytes,
                    _merge(self.expert_rows, other.expert_rows, combine=sum))

    def as_dict(self) -> dict:
        """JSON-ready: flops, hbm_bytes, collective_bytes (total), collectives ({kind: bytes}), unknown_loops,
        bounded_loops, expert_flops, expert_hbm_bytes."""
        return dict(flops=self.flops, hbm_bytes=self.hbm_bytes, collective_bytes=self.collective_total,
                    collectives=dict(sorted(self.collective_bytes.items())), unknown_loops=list(self.unknown_loops),
                    bounded_loops=list(self.bounded_loops), expert_flops=self.expert_flops,
                    expert_hbm_bytes=self.expert_hbm_bytes)


def _merge(*maps, combine) -> dict:
    """{key: combine(the maps' values for key, 0 where absent)}."""
    return {k: combine([m.get(k, 0.0) for m in maps]) for k in dict.fromkeys(k for m in maps for k in m)}


def maximum(costs: list[Cost]) -> Cost:
    """Each quantity's largest value over `costs` (a conditional's branches)."""
    return Cost(max(c.flops for c in costs), max(c.hbm_bytes for c in costs),
                _merge(*(c.collective_bytes for c in costs), combine=max),
                tuple(dict.fromkeys(u for c in costs for u in c.unknown_loops)),
                tuple(dict.fromkeys(u for c in costs for u in c.bounded_loops)),
                max(c.expert_flops for c in costs), max(c.expert_hbm_bytes for c in costs),
                _merge(*(c.expert_rows for c in costs), combine=max))
