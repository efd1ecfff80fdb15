"""The planner's time model: seconds per phase of one trainer step, per device, from the compiled programs' costs.

    capture   = groups x roofline(the sharded capture of prompt[:-1])           (all rounds: loops multiplied)
    sampling  = groups x decode_steps_per_group(G, R) x roofline(one decode step)
    update    = groups x roofline(the trainer's update given the captured state: replay, the prompt backward in
                exact mode, AdamW)
    step      = capture + sampling + update

`groups` = B / data, the groups one data slice handles (each slice runs in parallel with the others). Each program's
cost (`cost.Cost`) is per device, from its compiled HLO with every loop's trip count applied (`cost.py`); the
roofline (`hardware.roofline`) is max(compute, HBM) + collectives: collectives are not overlapped with anything.

Approximations, all stated: the decode step is the sampler's per-token program (the model's mesh `decode` and the
logits; the token draw over [vocab] is left out); B / data > 1 multiplies single-group programs by B / data, an upper
bound where the slice's groups share a program (vmapped decode steps read and gather each layer once for all of them;
AdamW runs once per step, not once per group).
"""
from __future__ import annotations

from longstraw_jax.capacity.cost import Cost
from longstraw_jax.capacity.hardware import Hardware, breakdown

PHASES = ("capture", "sampling", "update")


def decode_steps_per_group(group_size: int, response_len: int) -> int:
    """Sequential decode steps to sample one group: the sampler decodes its G branches one after another, R tokens
    each (`sampling/branches.py`), so G x R. The one place the planner takes this number from (a sampler that
    decodes the G branches together would make it R, with a decode step of G tokens)."""
    return group_size * response_len


def phase_costs(*, capture: Cost, decode_step: Cost, update: Cost, steps_per_group: int, groups: int) \
        -> dict[str, Cost]:
    """Per-device Cost of each phase of one step (module docstring): {"capture", "sampling", "update"}."""
    return dict(capture=capture.scaled(groups), sampling=decode_step.scaled(steps_per_group * groups),
                update=update.scaled(groups))


def step_times(costs: dict[str, Cost], hw: Hardware) -> dict[str, dict[str, float]]:
    """Each phase's roofline terms in seconds ({"compute", "memory", "collectives", "total"}) and "step": the sum
    of the phases' totals (the phases run one after another)."""
    out = {phase: breakdown(costs[phase], hw) for phase in PHASES}
    out["step"] = {"total": sum(out[phase]["total"] for phase in PHASES)}
    return out


__all__ = ["PHASES", "decode_steps_per_group", "phase_costs", "step_times"]
