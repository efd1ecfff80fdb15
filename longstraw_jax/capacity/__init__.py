"""Capacity planner: per-device memory of one whole trainer step (sampling, then the update), from shapes only, and
with `--time` the seconds of each phase on a GPU kind (a roofline of the compiled programs' costs).

    python -m longstraw_jax.plan --config configs/qwen3.6-27b.json --mesh 1x8 -P 2100000 -G 2,8 --markdown

    cli.py          the command line (`python -m longstraw_jax.plan`; tools/plan_capacity.py runs the same)
    planner.py      Planner: AOT-compiles the update, the sharded capture and a decode step; what is analytic
    phases.py       the phases' arithmetic (sampling, update, --kl-coef reference) and the step's peak
    footprint.py    bytes of abstract trees and compiled programs; the largest gathered layer
    report.py       tables (text / markdown) and --json
    hlo/            per-device FLOPs, HBM bytes and collective bytes of a compiled program, loops x trip counts
    hardware.py     device kinds' peaks and the roofline
    timing.py       --time: seconds per phase of a step

The model (each phase's components, the flags, the caveats) and the time model: docs/architecture.md section 6.
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
