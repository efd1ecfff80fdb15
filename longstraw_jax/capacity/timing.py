"""The planner's time model: seconds per phase of one trainer step, per device, from the compiled programs' costs.

    capture   = groups x roofline(the sharded capture of prompt[:-1])           (all rounds: loops multiplied)
    sampling  = groups x decode_steps_per_group(G, R, N) x roofline(one decode step of N branches)
    update    = groups x roofline(the trainer's update given the captured state: replay, the prompt backward in
                exact mode, AdamW)
    step      = capture + sampling + update

`groups` = B / data, the groups one data slice handles (each slice runs in parallel with the others). Each program's
cost (`hlo.Cost`) is per device, from its compiled HLO with every loop's trip count applied (`hlo/`); the
roofline (`hardware.roofline`) is max(compute, HBM) + collectives: collectives are not overlapped with anything.

Approximations, all stated: the decode step is the sampler's per-token program for N branches (the model's mesh
`decode` vmapped over N tails and the logits; the token draw over [vocab] is left out); B / data > 1 multiplies
single-group programs by B / data, an upper bound where the slice's groups share a program (the trainer's sampler
decodes a slice's groups together: each decode step reads each layer's weights once for all of them; AdamW runs once
per step, not once per group). MoE models' routed experts are costed as a GPU's grouped matmul, not as XLA:CPU's
lowering (`hlo.ExpertModel`, chosen per program by `Planner.expert_model`).
"""
from __future__ import annotations

from longstraw_jax.capacity.hardware import Hardware, breakdown
from longstraw_jax.capacity.hlo import Cost

PHASES = ("capture", "sampling", "update")


def decode_steps_per_group(group_size: int, response_len: int, decode_batch: int | None = None) -> int:
    """Sequential decode steps to sample one group: the sampler decodes N = decode_batch branches together (default
    all G: `sampling/branches.py`), G / N batches one after another, R tokens each, so (G / N) x R (R by default).
    The one place the planner takes this number from; the decode step it times is one step of N branches."""
    n = group_size if decode_batch is None else decode_batch
    return (group_size // n) * response_len


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
