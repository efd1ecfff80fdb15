"""Device mesh for sharded execution: axes ("data", "seq") (docs/architecture.md 5).

`seq` shards prompt positions and the captured prompt state (context parallelism); parameters and optimizer state
are sharded over the whole mesh (FSDP), and `data` also runs independent groups side by side.
"""
from __future__ import annotations

import re

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

AXES = ("data", "seq")
_SPEC = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*$")


def parse_mesh_spec(spec: str) -> tuple[int, int]:
    """"AxB" -> (A, B): A devices along `data`, B along `seq`; both positive."""
    match = _SPEC.match(spec) if isinstance(spec, str) else None
    if match is None:
        raise ValueError(f"mesh spec {spec!r} is not of the form 'AxB' (data x seq, e.g. '1x8' or '4x8')")
    data, seq = int(match.group(1)), int(match.group(2))
    if data < 1 or seq < 1:
        raise ValueError(f"mesh spec {spec!r}: data={data} and seq={seq} must both be >= 1")
    return data, seq


def make_mesh(spec: str, devices=None) -> Mesh:
    """A `Mesh` of shape (A, B) with axes ("data", "seq") over `devices` (default: all of `jax.devices()`).

    The device count must equal A * B exactly (no silent subset). Axes are `Auto`, so jitted code outside
    `shard_map` may let the compiler place intermediate values. On CPU, more devices come from
    `jax.config.update("jax_num_cpu_devices", N)` before JAX first touches a backend.
    """
    data, seq = parse_mesh_spec(spec)
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) != data * seq:
        raise ValueError(f"mesh {spec!r} needs data*seq = {data}*{seq} = {data * seq} devices, but "
                         f"{len(devices)} are available (on CPU set jax_num_cpu_devices={data * seq} "
                         "before JAX starts)")
    return Mesh(np.asarray(devices, dtype=object).reshape(data, seq), AXES, axis_types=(AxisType.Auto,) * 2)
