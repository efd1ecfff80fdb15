"""The two phases of a trainer step and the step's peak, per device, from their components' bytes (pure integer
arithmetic; the components come from `planner.Planner`, the model: docs/architecture.md section 6)."""
from __future__ import annotations

UPDATE_COLUMNS = ("params", "optimizer", "grads", "state", "cotangent", "rest", "others", "total")
SAMPLING_COLUMNS = ("params", "optimizer", "state", "boundaries", "tail", "decode", "capture", "total")
# --kl-coef > 0: the reference log-probs between sampling and the update (sampling/reference.py), and the reference
# params copy (ref_params) held all step, also added to the other phases
REFERENCE_COLUMNS = ("params", "optimizer", "ref_params", "state", "boundaries", "ref_state", "ref_rest", "total")


def local_groups(groups_per_step: int, data: int) -> int:
    """Groups each data slice holds at once: B / data. B must be a positive multiple of the mesh's data size."""
    if isinstance(groups_per_step, bool) or not isinstance(groups_per_step, int) or groups_per_step < 1 \
            or groups_per_step % data:
        raise ValueError(f"--groups-per-step {groups_per_step!r} must be a positive multiple of the mesh's data size "
                         f"{data} (each data slice samples and updates B / data whole groups)")
    return groups_per_step // data


def sampling_phase(*, params: int, optimizer: int, state: int, boundaries: int, tail: int, decode_shared: int,
                   decode_per_group: int, capture_temp: int, groups: int) -> dict[str, int]:
    """Per-device bytes of the sampling phase for `groups` (= B / data) groups per data slice (docs/architecture.md 6):
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
    (the CPU program the planner compiles; `sharding/experts.py`): the receive buffer and its outputs hold
    n * T * min(k, E / n) rows of D, the gathered path's tokens and partial outputs n * T rows:
    2 n T (min(k, E / n) - 1) D elements, for `tokens` = T per device. 0 when the experts are not expert-parallel
    (n does not divide E) or there are none."""
    if not experts or experts % devices:
        return 0
    return 2 * devices * tokens * (min(top_k, experts // devices) - 1) * hidden * itemsize


def reference_phase(*, params: int, optimizer: int, ref_params: int, state: int, boundaries: int, ref_state: int,
                    ref_temp: int, groups: int) -> dict[str, int]:
    """Per-device bytes of the reference phase (--kl-coef > 0): resident params + optimizer + the reference params
    copy (0 for LoRA: the base without adapters), the slice's `groups` kept captures (+ boundaries), and the
    compiled reference program's temporaries `ref_temp` for one group at a time: its own capture's state
    (`ref_state`) and the rest (`ref_rest`: the capture round's activations, then one branch's replay and [chunk,
    vocab] logits)."""
    out = dict(params=params, optimizer=optimizer, ref_params=ref_params, state=groups * state,
               boundaries=groups * boundaries, ref_state=ref_state, ref_rest=max(0, ref_temp - ref_state))
    out["total"] = sum(out.values())
    return out


def with_ref_params(phase: dict, ref_params: int) -> dict:
    """A phase's components with the reference params copy held all step added ("ref_params", into "total")."""
    return dict(phase, ref_params=ref_params, total=phase["total"] + ref_params)


def step_peak(sampling: dict, update: dict, reference: dict | None = None) -> tuple[int, str]:
    """The step's per-device peak: the largest phase total, and which phase it is (sampling, update, and with
    --kl-coef the reference phase)."""
    phases = [("update", update), ("sampling", sampling)] + ([("reference", reference)] if reference else [])
    name, phase = max(phases, key=lambda item: item[1]["total"])
    return phase["total"], name
