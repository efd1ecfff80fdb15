"""Compile-only GPU devices on any host: the planner's programs (and tools/gpu_compile.py's) compiled by XLA's own GPU
compiler for a device kind it is only described, with no GPU present.

jax's CUDA plugin (the `gpu-compile` extra: jax-cuda12-plugin and jax-cuda12-pjrt, no CUDA libraries) builds devices
from a target description, XLA's GpuTargetConfigProto in text form (`target_config`); a program lowered onto them
goes through XLA's whole GPU pipeline (fusions, Triton GEMMs, the Pallas kernels' Triton), and its
`memory_analysis()` and HLO are the device's. JAX_PLATFORMS must name only the host's platform ("cpu"): the plugin
then does not look for a GPU, and registers the topology all the same.
"""
from __future__ import annotations

from longstraw_jax.capacity.hardware import HARDWARE

# What the compiler is told beyond capacity.hardware (HBM bandwidth and capacity): the SM count, L2 and clock
# (vendors' datasheets); shared memory, registers and threads are compute capability 9.0's (all three are sm_90).
TARGETS = {
    "h100": dict(core_count=132, l2_cache_size=50 * 2**20, clock_rate_ghz=1.98, name="NVIDIA H100 80GB HBM3"),
    "h200": dict(core_count=132, l2_cache_size=50 * 2**20, clock_rate_ghz=1.98, name="NVIDIA H200"),
    "h20": dict(core_count=78, l2_cache_size=60 * 2**20, clock_rate_ghz=1.98, name="NVIDIA H20"),
}
SM90 = dict(shared_memory_per_block=48 * 2**10, shared_memory_per_core=228 * 2**10,
            shared_memory_per_block_optin=227 * 2**10, registers_per_core_limit=65536, registers_per_block_limit=65536,
            threads_per_block_limit=1024, threads_per_warp=32, threads_per_core_limit=2048, fpus_per_core=128,
            block_dim_limit_x=2**31 - 1, block_dim_limit_y=65535, block_dim_limit_z=65535)
INSTALL = "pip install -e '.[gpu-compile]' (jax's CUDA plugin; in a venv of its own), and JAX_PLATFORMS=cpu"


def target_config(kind: str) -> str:
    """XLA's GpuTargetConfigProto (text) for `kind`, a key of TARGETS: what the compile-only devices are."""
    if kind not in TARGETS:
        raise ValueError(f"--compile-for {kind!r}: expected one of {', '.join(sorted(TARGETS))}")
    t, hw = TARGETS[kind], HARDWARE[kind]
    info = dict(SM90, core_count=t["core_count"], l2_cache_size=t["l2_cache_size"],
                clock_rate_ghz=t["clock_rate_ghz"], memory_bandwidth=int(hw.hbm_per_s),
                device_memory_size=int(hw.hbm_bytes))
    lines = [f"  {key}: {value}" for key, value in info.items()]
    return ("gpu_device_info {\n" + "\n".join(lines) + "\n  cuda_compute_capability { major: 9 minor: 0 }\n}\n"
            f'platform_name: "CUDA"\ndnn_version_info {{ major: 9 minor: 8 }}\ndevice_description_str: "{t["name"]}"\n')


def compile_only_devices(kind: str, count: int) -> list:
    """`count` compile-only CUDA devices of `kind` on one host (nothing can run on them). RuntimeError naming the
    extra when jax's CUDA plugin is missing."""
    config = target_config(kind)
    from jax.experimental import topologies

    try:
        topology = topologies.get_topology_desc("", "cuda", target_config=config, topology=f"1x1x{count}")
    except NotImplementedError as e:  # no CUDA plugin registered a topology
        raise RuntimeError(f"compiling for a {kind} needs jax's CUDA plugin: {INSTALL} ({e})") from None
    return list(topology.devices)
