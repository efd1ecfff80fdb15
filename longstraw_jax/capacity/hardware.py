"""Device kinds for the planner's time model (and tools/bench_device.py's MFU), and the roofline that turns an
`hlo.Cost` into seconds.

Each number is the vendor's peak for one device, with its source next to it. Conventions:

* `flops_per_s`: dense bf16 tensor-core FLOP/s (no 2:4 sparsity: NVIDIA's headline "with sparsity" figures are
  twice these).
* `hbm_per_s`: HBM bytes/s (1 TB/s = 1e12 B/s).
* `link_per_s`: NVLink bytes/s **per device per direction**. NVIDIA quotes 900 GB/s for fourth-generation NVLink
  (18 links x 50 GB/s), the total of both directions: 450 GB/s each way (vendors' tables write "450 GB/s
  unidirectional, 900 GB/s bidirectional"); likewise 1.8 TB/s for fifth-generation NVLink (900 GB/s each way) and
  600 GB/s for the H100 PCIe card's NVLink bridge (300 GB/s each way). `hlo.Cost.collective_bytes` counts what
  one device sends (= what it receives, in the patterns counted there), so it is divided by the per-direction rate.
* `hbm_bytes`: HBM capacity in bytes (1 GB = 1e9 B).

Peaks are not achieved: a real kernel reaches some fraction of each (matmuls ~60-80 % of the FLOP/s, streaming
~80-90 % of HBM, NCCL ~70-85 % of NVLink bus bandwidth); the roofline below is an optimistic floor on compute and
memory time, made pessimistic again by assuming no overlap of collectives (next).
"""
from __future__ import annotations

import dataclasses

from longstraw_jax.capacity.hlo import Cost


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One device kind's peaks (module docstring for the conventions); `source`: where they come from."""

    name: str
    flops_per_s: float   # dense bf16
    hbm_per_s: float     # bytes/s
    link_per_s: float    # NVLink bytes/s per direction
    hbm_bytes: float     # capacity
    source: str


_NVLINK4_PER_DIRECTION = 900e9 / 2  # 900 GB/s total bidirectional (NVLink 4: 18 links x 25 GB/s each way)
_NVLINK5_PER_DIRECTION = 1.8e12 / 2  # 1.8 TB/s total bidirectional (NVLink 5: 18 links x 50 GB/s each way)

HARDWARE = {
    "a100": Hardware(
        "a100", flops_per_s=312e12, hbm_per_s=2.039e12, link_per_s=600e9 / 2, hbm_bytes=80e9,
        source="NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM column: BF16 Tensor Core 312 TFLOPS (624 with "
               "sparsity), GPU memory 80 GB HBM2e, 2,039 GB/s, NVLink 600 GB/s (third generation)"),
    "h100-pcie": Hardware(
        "h100-pcie", flops_per_s=756e12, hbm_per_s=2.0e12, link_per_s=600e9 / 2, hbm_bytes=80e9,
        source="NVIDIA H100 Tensor Core GPU datasheet (2022), H100 PCIe column: BF16 Tensor Core 1,513 TFLOPS with "
               "sparsity (756 dense), GPU memory 80 GB HBM2e, 2 TB/s, NVLink bridge 600 GB/s"),
    "h100": Hardware(
        "h100", flops_per_s=989e12, hbm_per_s=3.35e12, link_per_s=_NVLINK4_PER_DIRECTION, hbm_bytes=80e9,
        source="NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column: BF16 Tensor Core 1,979 TFLOPS with sparsity "
               "(989 dense), GPU memory 80 GB, 3.35 TB/s, NVLink 900 GB/s"),
    "h200": Hardware(
        "h200", flops_per_s=989e12, hbm_per_s=4.8e12, link_per_s=_NVLINK4_PER_DIRECTION, hbm_bytes=141e9,
        source="NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column: BF16 Tensor Core 1,979 TFLOPS with sparsity "
               "(989 dense), GPU memory 141 GB HBM3e, 4.8 TB/s, NVLink 900 GB/s"),
    "h20": Hardware(
        "h20", flops_per_s=148e12, hbm_per_s=4.0e12, link_per_s=_NVLINK4_PER_DIRECTION, hbm_bytes=96e9,
        source="NVIDIA HGX H20 specifications as published by NVIDIA partners (no public NVIDIA datasheet): "
               "FP16/BF16 Tensor Core 148 TFLOPS dense (INT8 / FP8 296), 96 GB HBM3, 4.0 TB/s, NVLink 900 GB/s"),
    "b200": Hardware(
        "b200", flops_per_s=2.25e15, hbm_per_s=8e12, link_per_s=_NVLINK5_PER_DIRECTION, hbm_bytes=180e9,
        source="NVIDIA HGX B200 specifications (8 GPUs): FP16/BF16 Tensor Core 36 PFLOPS with sparsity (2.25 PFLOPS "
               "dense per GPU), 1.4 TB HBM3e (180 GB per GPU: DGX B200's 1,440 GB total), 64 TB/s aggregate (8 TB/s "
               "per GPU), NVLink 5 1.8 TB/s per GPU"),
    "gb200": Hardware(
        "gb200", flops_per_s=2.5e15, hbm_per_s=8e12, link_per_s=_NVLINK5_PER_DIRECTION, hbm_bytes=186e9,
        source="NVIDIA GB200 NVL72 specifications (72 GPUs): FP16/BF16 Tensor Core 360 PFLOPS with sparsity "
               "(2.5 PFLOPS dense per GPU), up to 13.4 TB HBM3e (186 GB per GPU), 576 TB/s (8 TB/s per GPU), NVLink "
               "130 TB/s (1.8 TB/s per GPU)"),
    "cpu": Hardware(
        "cpu", flops_per_s=100e9, hbm_per_s=20e9, link_per_s=10e9, hbm_bytes=16e9,
        source="ROUGH round numbers, not a datasheet: a few x86 cores with AVX2 FMA (~100 GFLOP/s float32 together), "
               "~20 GB/s DRAM, ~10 GB/s memcpy between simulated devices; for smoke runs of tools/bench_device.py "
               "on XLA:CPU, where the ratio measured / estimated says how far XLA:CPU is from these numbers"),
}

# `device.device_kind` substrings -> entry, first match wins: a longer name before its prefix (GB200 before B200,
# H200 before H20, H100 PCIe before H100); the A100 entry is the 80 GB SXM card's only (the 40 GB card and the PCIe
# cards have other HBM rates: no entry)
_DEVICE_KINDS = (("GB200", "gb200"), ("B200", "b200"), ("H200", "h200"), ("H100 PCIe", "h100-pcie"), ("H100", "h100"),
                 ("H20", "h20"), ("A100-SXM4-80GB", "a100"))


def hardware(name: str) -> Hardware:
    """The Hardware of a device kind (a key of HARDWARE: h100, h200, b200, ..., or the rough cpu; case-insensitive)."""
    try:
        return HARDWARE[name.lower()]
    except KeyError:
        raise ValueError(f"--hardware {name!r}: expected one of {', '.join(sorted(HARDWARE))}") from None


def for_device_kind(device_kind: str) -> Hardware | None:
    """The datasheet entry of an accelerator by its `device.device_kind` (e.g. "NVIDIA H100 80GB HBM3" -> h100), None
    for a kind without one (a PCIe card whose SXM sibling is listed too: its peaks are lower). Never the rough cpu
    entry: tools/bench_device.py's MFU divides by this entry's FLOP/s."""
    kind = device_kind.lower()
    key = next((key for name, key in _DEVICE_KINDS if name.lower() in kind), None)
    if key is None or ("pcie" in kind and not key.endswith("pcie")):
        return None
    return HARDWARE[key]


def for_device(device_kind: str, platform: str) -> Hardware | None:
    """The entry of a JAX device (`device.device_kind`, `device.platform`): the rough `cpu` entry on XLA:CPU, else
    `for_device_kind` (None for a device without an entry)."""
    return HARDWARE["cpu"] if platform == "cpu" else for_device_kind(device_kind)


def roofline(cost: Cost, hw: Hardware) -> float:
    """Seconds of one execution of `cost` (per device) on `hw`:

        max(flops / flops_per_s, hbm_bytes / hbm_per_s) + collective_bytes / link_per_s

    compute and HBM traffic overlap perfectly (a roofline), collectives overlap with nothing (they are added: an
    upper bound where XLA's scheduler hides them behind compute, which it does for FSDP's layer all-gathers when it
    can prefetch the next layer)."""
    return max(cost.flops / hw.flops_per_s, cost.hbm_bytes / hw.hbm_per_s) + cost.collective_total / hw.link_per_s


def breakdown(cost: Cost, hw: Hardware) -> dict[str, float]:
    """The roofline's terms in seconds: {"compute", "memory", "collectives", "total"} (total = `roofline`)."""
    return dict(compute=cost.flops / hw.flops_per_s, memory=cost.hbm_bytes / hw.hbm_per_s,
                collectives=cost.collective_total / hw.link_per_s, total=roofline(cost, hw))


__all__ = ["HARDWARE", "Hardware", "breakdown", "for_device", "for_device_kind", "hardware", "roofline"]
