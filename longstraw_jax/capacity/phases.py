"""The two phases of a trainer step and the step's peak, per device, from their components' bytes (pure integer
arithmetic; the components come from `planner.Planner`, the model is in this package's docstring)."""
from __future__ import annotations

UPDATE_COLUMNS = ("params", "optimizer", "grads", "state", "cotangent", "rest", "others", "total")
SAMPLING_COLUMNS = ("params", "optimizer", "state", "boundaries", "tail", "decode", "capture", "total")


def local_groups(groups_per_step: int, data: int) -> int:
    """Groups each data slice holds at once: B / data. B must be a positive multiple of the mesh's data size."""
    if isinstance(groups_per_step, bool) or not isinstance(groups_per_step, int) or groups_per_step < 1 \
            or groups_per_step % data:
        raise ValueError(f"--groups-per-step {groups_per_step!r} must be a positive multiple of the mesh's data size "
                         f"{data} (each data slice samples and updates B / data whole groups)")
    return groups_per_step // data


def sampling_phase(*, params: int, optimizer: int, state: int, boundaries: int, tail: int, decode_shared: int,
                   decode_per_group: int, capture_temp: int, groups: int) -> dict[str, int]:
    """Per-device bytes of the sampling phase for `groups` (= B / data) groups per data slice (package docstring):
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
