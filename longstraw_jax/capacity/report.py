"""The planner's output: three tables (the step, then each phase's components) and the `--json` file."""
from __future__ import annotations

import json

from longstraw_jax.capacity.phases import REFERENCE_COLUMNS, SAMPLING_COLUMNS, UPDATE_COLUMNS

MIB, GIB = 2**20, 2**30


def _table(head: list[str], lines: list[list[str]], markdown: bool, left: int) -> str:
    if markdown:
        out = ["| " + " | ".join(head) + " |", "| " + " | ".join(["---"] * left + ["---:"] * (len(head) - left)) + " |"]
        return "\n".join(out + ["| " + " | ".join(line) + " |" for line in lines])
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(head)]
    fmt = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))
    return "\n".join([fmt(head)] + [fmt(line) for line in lines])


def format_rows(rows: list[dict], device_gb: float, markdown: bool, unit: str = "GiB") -> str:
    """Three tables: the step (each phase's total, the peak, "fits"), then each phase's components."""
    scale = {"GiB": GIB, "MiB": MIB}[unit]
    key = lambda row: [row.get("train", "full"), row["mode"], str(row["G"]), f"{row['P']:,}", str(row["B"])]
    num = lambda x: f"{x / scale:.2f}"
    yes = lambda flag: "yes" if flag else "no"
    step = _table(["train", "mode", "G", "P", "B", f"sampling {unit}", f"update {unit}", f"peak {unit}", "peak phase",
                   "decode steps", f"fits {device_gb:g} GB", f"peak ragged {unit}", "fits (ragged)"],
                  [key(r) + [num(r["sampling"]["total"]), num(r["update"]["total"]), num(r["peak"]), r["peak_phase"],
                             f"{r['decode_steps']:,}", yes(r["fits"]), num(r["peak_ragged"]), yes(r["fits_ragged"])]
                   for r in rows], markdown, 5)
    kl = any("reference" in r for r in rows)  # --kl-coef: the reference params column and the reference phase
    columns = lambda names: names[:-1] + ("ref_params", "total") if kl else names
    phase = lambda name, names: _table(["train", "mode", "G", "P", "B"] + [f"{c} {unit}" for c in names],
                                       [key(r) + [num(r[name][c]) for c in names] for r in rows], markdown, 5)
    out = (f"Step (per device)\n{step}\n\nSampling phase\n{phase('sampling', columns(SAMPLING_COLUMNS))}\n\n"
           f"Update phase\n{phase('update', columns(UPDATE_COLUMNS))}")
    if kl:
        out += f"\n\nReference phase (--kl-coef)\n{phase('reference', REFERENCE_COLUMNS)}"
    return out


def _figure(x: float) -> str:
    """A positive quantity for a table: thousands separated from 100 up, 3 significant digits below."""
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def format_times(rows: list[dict], hw, markdown: bool) -> str:
    """The time model's tables (`Planner.timing` rows): per row the decode step's per-device figures (FLOPs, HBM GB,
    collective GB), decode steps per group, and each phase's estimated seconds, what bounds each phase; then each
    compiled program's per-device cost; then the assumptions."""
    head = ["mode", "G", "P", "B", "decode step GFLOP", "decode step HBM GB", "decode step collective GB",
            "decode steps / group", "capture s", "sampling s", "update s", "step s"]
    lines = [[r["mode"], str(r["G"]), f"{r['P']:,}", str(r["B"]), _figure(r["decode_step"]["flops"] / 1e9),
              _figure(r["decode_step"]["hbm_bytes"] / 1e9), _figure(r["decode_step"]["collective_bytes"] / 1e9),
              f"{r['decode_steps_per_group']:,}"]
             + [_figure(r["seconds"][phase]["total"]) for phase in ("capture", "sampling", "update", "step")]
             for r in rows]
    bound = lambda r, phase: max(("compute", "memory", "collectives"), key=lambda k: r["seconds"][phase][k])
    bounded = lambda r: sum(len(p["bounded_loops"]) for p in r["programs"].values())
    notes = [f"{r['mode']} G={r['G']} P={r['P']:,}: " + ", ".join(
        f"{phase} {bound(r, phase)}-bound ({r['seconds'][phase]['collectives']:.3g} s of collectives)"
        for phase in ("capture", "sampling", "update"))
        + (f"; {bounded(r)} data-dependent loops counted at their bound (hlo/walk.py)" if bounded(r) else "")
        for r in rows]
    programs = _table(["mode", "G", "P", "program", "GFLOP", "HBM GB", "collective GB", "by kind GB"],
                      [[r["mode"], str(r["G"]), f"{r['P']:,}", name, _figure(c["flops"] / 1e9),
                        _figure(c["hbm_bytes"] / 1e9), _figure(c["collective_bytes"] / 1e9),
                        ", ".join(f"{k} {_figure(v / 1e9)}" for k, v in c["collectives"].items()) or "-"]
                       for r in rows for name, c in r["programs"].items()], markdown, 4)
    return (f"Time per step (per device, {hw.name}: {hw.flops_per_s / 1e12:g} TFLOP/s bf16 dense, "
            f"{hw.hbm_per_s / 1e12:g} TB/s HBM, {hw.link_per_s / 1e9:g} GB/s NVLink per direction)\n"
            + _table(head, lines, markdown, 4) + "\n" + "\n".join(notes) + "\n\n"
            "Programs (per device, one execution each, loops multiplied by their trip counts)\n" + programs + "\n"
            "roofline per program: max(FLOPs / FLOP/s, HBM bytes / HBM B/s) + collective bytes / link B/s "
            "(collectives not overlapped); loops multiplied by their trip counts; sampling = B/data x decode steps per "
            "group x one decode step; update = B/data x the update given the sampler's capture (capacity/timing.py)")


def write_json(path: str, rows: list[dict], args, planner, timing: dict | None = None) -> None:
    """{"setup": the run's options (train mode, LoRA rank / alpha / targets, parameter counts; "compiled_for": the GPU
    kind of --compile-for, absent for XLA:CPU's programs), "rows": one object
    per row (`Planner.plan`): train, mode, G, P, B, decode_steps, the
    "sampling" and "update" phases' components and "total" in bytes per device, "peak", "peak_phase", and "fits"
    (peak <= device_gb * 1e9)}; with --time also "time": {"hardware": the device kind's peaks and their source,
    "rows": `Planner.timing` per row (decode step figures, decode steps per group, per-phase costs and seconds)}."""
    setup = dict(config=args.config, mesh=args.mesh, dtype=args.dtype, response_len=args.response_len,
                 chunk=args.chunk_size, device_gb=args.device_gb, groups_per_step=args.groups_per_step,
                 params=planner.num_params, train=planner.train_mode, trainable_params=planner.num_trainable,
                 lora=planner.lora, largest_layer_bytes=planner.layer_bytes, kernels=planner.kernels,
                 **({"compiled_for": planner.compile_for} if planner.compile_for else {}),
                 **({"kl_coef": planner.kl_coef} if planner.kl_coef > 0 else {}))
    with open(path, "w") as f:
        json.dump(dict(setup=setup, rows=rows, **({} if timing is None else dict(time=timing))), f, indent=1)
        f.write("\n")


