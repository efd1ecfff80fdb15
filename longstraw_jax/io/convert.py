"""Hugging Face safetensors <-> Orbax, streamed at real size: `python -m longstraw_jax.convert`.

    hf2orbax --hf DIR --out DIR [--dtype bfloat16] [--mesh AxB] [--force] [--dry-run]
    orbax2hf --ckpt DIR --config DIR --out DIR [--dtype D] [--shard-size 5GB] [--force] [--dry-run]

hf2orbax writes an *init directory*: `OUT/config.json` (the HF config.json, verbatim, plus the other small non-weight
files such as the tokenizer) and `OUT/params/`, an Orbax checkpoint of the params pytree of `model.init` (same nested
dicts), restorable with `orbax.checkpoint.StandardCheckpointer().restore(OUT/params, abstract_params)`. orbax2hf
writes sharded safetensors + `model.safetensors.index.json` under the original names (`model.language_model.*` for
Qwen3.6 multimodal checkpoints, per-expert tensors for GLM), copying the tensors the model does not use (`mtp.*`,
`model.visual.*`) and the non-weight files from the `--config` directory when it has them.

Streaming. Each HF tensor is one slice `flat[path][index]` of a stacked leaf (models/hf.py `Slot`), read from disk and
written in row blocks of about `block_bytes` (64 MiB), so host memory stays at a few blocks whatever the model size.
The Orbax side is the directory layout of `StandardCheckpointHandler(use_ocdbt=False)` (orbax-checkpoint 0.12.8):
`params/_METADATA` (the tree) + one zarr v2 array per leaf, `params/<path with dots>/` (zstd level 1, as Orbax writes
them). All arrays are created up front with chunks of one slice's rows, CHUNK_BYTES (16 MiB) each; a block is whole
chunks, so no write reads anything back and a block's chunks compress in parallel. Plain zarr rather than OCDBT: each
chunk is a file, so tens of thousands of slice writes (GLM's per-expert tensors) need no database commit each. No
`_sharding` file is written: restore with shardings in `abstract_params` (else numpy arrays come back); the checkpoint
restores onto any mesh. `--mesh AxB` only aligns the chunks with the FSDP shards of A*B devices
(`sharding.rules.param_specs`: each leaf split along one own dimension), so that each device of that mesh reads whole
chunks of its own shard and no chunk is decoded by two devices. All arrays have one dtype (`--dtype`); orbax2hf
restores each tensor's original dtype. Reading accepts both Orbax layouts (OCDBT or not, zarr v2 or v3), i.e. also
what the trainer's StandardCheckpointer saves; a chunk cache of one chunk keeps whole-leaf chunks from being decoded
once per slice.

Safety: nothing is unpickled (`*.bin`/`*.pt` are refused); every name and shape is checked before data is read;
output is assembled in `OUT.tmp-convert-PID` and renamed to OUT only when complete (removed on any error), and an
existing non-empty OUT is replaced only with `--force`.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import os
import re
import resource
import shutil
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import tensorstore as ts
from flax import traverse_util

from longstraw_jax import models
from longstraw_jax.io.replace_dir import staged
from longstraw_jax.models import hf
from longstraw_jax.models.base import read_json
from longstraw_jax.sharding import rules
from longstraw_jax.sharding.mesh import parse_mesh_spec

BLOCK_BYTES = 64 << 20  # one read/write unit
CHUNK_BYTES = 16 << 20  # zarr chunk: a block is several chunks, compressed in parallel
SHARD_BYTES = 5 * 10**9  # HF's default max_shard_size="5GB"
IN_FLIGHT = 1  # blocks being compressed/written while the next one is read
STANDARD_HANDLER = "orbax.checkpoint._src.handlers.standard_checkpoint_handler.StandardCheckpointHandler"
CONVERT_RECORD = "convert.json"  # what hf2orbax read: source, dtype, which HF prefix spelling (for orbax2hf)
_WEIGHT_FILES = re.compile(r".*(\.safetensors|\.safetensors\.index\.json|\.index\.json|"
                           + "|".join(re.escape(s) for s in hf.PICKLE_SUFFIXES) + ")$")


@dataclasses.dataclass
class Summary:
    """What a conversion wrote (or, with dry_run, would write): HF tensors, their bytes, seconds, peak RSS."""

    direction: str
    tensors: int
    nbytes: int
    seconds: float = 0.0
    peak_rss: int = 0
    dry_run: bool = False

    def __str__(self) -> str:
        if self.dry_run:
            return f"{self.direction} (dry run): {self.tensors} tensors, {_gb(self.nbytes)} would be written"
        rate = self.nbytes / max(self.seconds, 1e-9) / 1e6
        return (f"{self.direction}: {self.tensors} tensors, {_gb(self.nbytes)} in {self.seconds:.1f} s "
                f"({rate:.0f} MB/s), peak RSS {_gb(self.peak_rss)}")


def _gb(nbytes: int) -> str:
    return f"{nbytes / 1e9:.3f} GB ({nbytes:,} bytes)"


def peak_rss_bytes() -> int:
    """This process's peak resident set size (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Progress:
    """One line per tensor on a terminal (overwritten in place); elsewhere a line every `every` seconds."""

    def __init__(self, total_tensors: int, total_bytes: int, stream=None, every: float = 10.0):
        self.total_tensors, self.total_bytes, self.every = total_tensors, total_bytes, every
        self.stream = stream or sys.stderr
        self.tensors = self.nbytes = 0
        self.start = self.last = time.perf_counter()

    def update(self, name: str, nbytes: int) -> None:
        self.tensors += 1
        self.nbytes += nbytes
        now = time.perf_counter()
        tty = self.stream.isatty()
        if tty or now - self.last >= self.every or self.tensors == self.total_tensors:
            self.last = now
            rate = self.nbytes / max(now - self.start, 1e-9) / 1e6
            line = (f"[{self.tensors:>{len(str(self.total_tensors))}}/{self.total_tensors}] "
                    f"{self.nbytes / 1e9:.2f}/{self.total_bytes / 1e9:.2f} GB {rate:.0f} MB/s {name}")
            self.stream.write(f"\r{line[:160]:<160}" if tty else line + "\n")
            if tty and self.tensors == self.total_tensors:
                self.stream.write("\n")
            self.stream.flush()


# ---------------------------------------------------------------------------------------------------------------
# Geometry: which rows of an HF tensor go to which rows of its slice


def _chunk_rows(row_bytes: int) -> int:
    return max(1, CHUNK_BYTES // max(row_bytes, 1))


def _row_ranges(rows: int, row_bytes: int, block_bytes: int, chunk_rows: int | None = None) -> list[tuple[int, int]]:
    """[(r0, r1)] covering `rows`: whole chunks of `chunk_rows` rows (default `_chunk_rows`), about `block_bytes` at a
    time."""
    chunk_rows = chunk_rows or _chunk_rows(row_bytes)
    step = chunk_rows * max(1, block_bytes // max(chunk_rows * row_bytes, 1))
    return [(r, min(r + step, rows)) for r in range(0, rows, step)]


def _slice_blocks(slot: hf.Slot, leaf_shape: tuple[int, ...], itemsize: int, block_bytes: int,
                  chunk_rows: int | None = None):
    """Row ranges [(r0, r1)] of the slice `leaf[slot.index]` ([S0, ...]) that are HF rows [r0, r1) too, in blocks of
    `block_bytes` at `itemsize` (whole chunks of `chunk_rows`); [None] (the whole tensor at once) when the two
    layouts differ on the first axis."""
    shape = leaf_shape[len(slot.index):]
    if shape and slot.hf_shape and shape[0] == slot.hf_shape[0]:
        return _row_ranges(shape[0], math.prod(shape[1:]) * itemsize, block_bytes, chunk_rows)
    return [None]


def _chunk_shape(shape: tuple[int, ...], depth: int, itemsize: int, split_dim: int | None = None,
                 devices: int = 1) -> tuple[int, ...]:
    """Zarr chunks: one slice (`depth` leading indices) split into row chunks of <= CHUNK_BYTES that `_row_ranges`
    blocks align to. With `split_dim` (the leaf's FSDP dimension over `devices`, `sharding.rules.fsdp_dim`), each
    device's shard is a union of whole chunks, so a sharded restore reads no chunk twice."""
    rest = list(shape[depth:])
    if not rest:
        return (1,) * depth
    chunk = list(rest)
    if split_dim is not None and split_dim > depth:
        chunk[split_dim - depth] //= devices
    rows = min(_chunk_rows(math.prod(chunk[1:]) * itemsize), rest[0])
    if split_dim == depth:
        shard = rest[0] // devices
        rows = max(r for r in range(1, min(rows, shard) + 1) if shard % r == 0)
    return (1,) * depth + (rows,) + tuple(chunk[1:])


def _chunk_shapes(shapes: dict[str, tuple[int, ...]], depths: dict[str, int], itemsize: int,
                  devices: int = 1) -> dict[str, tuple[int, ...]]:
    """Leaf path -> zarr chunk shape; `devices` > 1 aligns chunks with the FSDP shards of that many devices."""
    def split(path, shape):
        stacked = 2 if path.split("/")[0] in rules.STACKED_ROOTS else 0
        return rules.fsdp_dim(shape, stacked, devices)

    return {path: _chunk_shape(shape, depths.get(path, 0), itemsize, split(path, shape), devices)
            for path, shape in shapes.items()}


def _slot_depths(layout: dict[str, hf.Slot]) -> dict[str, int]:
    """Leaf path -> number of stacked (indexed) leading axes; the layout must index each leaf uniformly."""
    depths: dict[str, set] = collections.defaultdict(set)
    for slot in layout.values():
        depths[slot.path].add(len(slot.index))
    bad = sorted(path for path, d in depths.items() if len(d) > 1)
    if bad:
        raise ValueError(f"model layout indexes these leaves with different depths: {', '.join(bad)}")
    return {path: d.pop() for path, d in depths.items()}


# ---------------------------------------------------------------------------------------------------------------
# Orbax directories


def orbax_name(path: str) -> str:
    """Orbax's array name for a params path: keys joined by '.' ("blocks/full/q_proj" -> "blocks.full.q_proj")."""
    return path.replace("/", ".")


class OrbaxWriter:
    """Creates every zarr array of a params checkpoint in `directory`, then takes slice/row-block writes."""

    def __init__(self, directory: str, shapes: dict[str, tuple[int, ...]], dtype, chunks: dict[str, tuple[int, ...]]):
        self.directory, self.shapes, self.dtype, self.chunks = directory, shapes, jnp.dtype(dtype), chunks
        self.pending: collections.deque = collections.deque()
        self.arrays = {}
        for path, shape in shapes.items():
            metadata = {"shape": list(shape), "chunks": list(chunks[path]), "compressor": {"id": "zstd", "level": 1}}
            spec = {"driver": "zarr", "kvstore": {"driver": "file", "path": os.path.join(directory, orbax_name(path))},
                    "metadata": metadata, "dtype": self.dtype.name, "create": True}
            self.arrays[path] = ts.open(spec).result()

    def chunk_rows(self, path: str) -> int | None:
        """Rows per chunk of one slice of leaf `path` (None for a scalar slice)."""
        depth = len(self.chunks[path]) - 1
        return self.chunks[path][depth] if depth < len(self.shapes[path]) else None

    def write(self, path: str, index: tuple[int, ...], rows: tuple[int, int] | None, block: np.ndarray) -> None:
        """Write `block` (already in the checkpoint dtype) to `leaf[index]` or `leaf[index][r0:r1]`."""
        target = self.arrays[path][index if rows is None else index + (slice(*rows),)]
        self.pending.append(target.write(block.reshape(target.shape)))
        while len(self.pending) > IN_FLIGHT:
            self.pending.popleft().result()

    def finish(self, custom_metadata: dict, started_ns: int) -> None:
        """Wait for all writes, then write `_METADATA` and `_CHECKPOINT_METADATA` as StandardCheckpointer does."""
        while self.pending:
            self.pending.popleft().result()
        tree = {}
        for path in sorted(self.shapes, key=lambda p: tuple(p.split("/"))):
            keys = path.split("/")
            tree[str(tuple(keys))] = {
                "key_metadata": [{"key": k, "key_type": 2} for k in keys],  # 2: dict key
                "value_metadata": {"value_type": "jax.Array", "skip_deserialize": False,
                                   "write_shape": list(self.shapes[path])}}
        with open(os.path.join(self.directory, "_METADATA"), "w") as f:
            json.dump({"tree_metadata": tree, "use_ocdbt": False, "use_zarr3": False,
                       "store_array_data_equal_to_fill_value": True, "custom_metadata": None}, f)
        with open(os.path.join(self.directory, "_CHECKPOINT_METADATA"), "w") as f:
            json.dump({"item_handlers": STANDARD_HANDLER, "metrics": {}, "performance_metrics": {},
                       "init_timestamp_nsecs": started_ns, "commit_timestamp_nsecs": time.time_ns(),
                       "custom_metadata": custom_metadata}, f)


class OrbaxReader:
    """The params arrays of an Orbax checkpoint; OCDBT or plain, zarr v2 or v3. `ckpt` is the item directory
    (holding `_METADATA`), an init directory (`ckpt/params`) or a training checkpoint step (`ckpt/state`, whose tree
    is {"params": ..., "opt_state": ..., ...}: only the params subtree is read). `read` returns one slice or row block;
    a cache of the largest chunk makes a checkpoint saved with whole-leaf chunks decode each chunk once when its
    slices are read in order."""

    def __init__(self, ckpt: str | os.PathLike):
        ckpt = os.path.abspath(os.fspath(ckpt))
        candidates = [ckpt, os.path.join(ckpt, "params"), os.path.join(ckpt, "state")]
        found = [d for d in candidates if os.path.exists(os.path.join(d, "_METADATA"))]
        if not found:
            raise FileNotFoundError(f"--ckpt {ckpt}: no Orbax checkpoint (no _METADATA in {', '.join(candidates)})")
        self.directory = found[0]
        meta_path = os.path.join(self.directory, "_METADATA")
        meta = read_json(meta_path, "Orbax metadata")
        try:
            stored = ["/".join(str(k["key"]) for k in entry["key_metadata"])
                      for entry in meta["tree_metadata"].values()]
        except (KeyError, TypeError, AttributeError):
            raise ValueError(f"{meta_path}: Orbax metadata without a tree_metadata of key_metadata entries") from None
        if any(path.startswith("params/") for path in stored):  # a training state: its params subtree
            stored = [path for path in stored if path.startswith("params/")]
            names = {path[len("params/"):]: orbax_name(path) for path in stored}
        else:
            names = {path: orbax_name(path) for path in stored}
        specs = {path: self._spec(name, meta.get("use_ocdbt", True), meta.get("use_zarr3", False))
                 for path, name in names.items()}
        probe = {path: ts.open(spec, read=True).result() for path, spec in specs.items()}
        self.shapes = {path: tuple(a.shape) for path, a in probe.items()}
        self.dtypes = {path: np.dtype(a.dtype.numpy_dtype) for path, a in probe.items()}
        largest = max((math.prod(a.chunk_layout.read_chunk.shape) * a.dtype.numpy_dtype.itemsize
                       for a in probe.values()), default=0)
        context = ts.Context({"cache_pool": {"total_bytes_limit": int(largest)}})
        self.arrays = {path: ts.open(spec, read=True, context=context).result() for path, spec in specs.items()}

    def _spec(self, name: str, use_ocdbt: bool, use_zarr3: bool) -> dict:
        kvstore = ({"driver": "ocdbt", "base": f"file://{self.directory}", "path": name} if use_ocdbt
                   else {"driver": "file", "path": os.path.join(self.directory, name)})
        return {"driver": "zarr3" if use_zarr3 else "zarr", "kvstore": kvstore,
                "recheck_cached_data": False, "recheck_cached_metadata": False}

    def read(self, path: str, index: tuple[int, ...], rows: tuple[int, int] | None = None) -> np.ndarray:
        source = self.arrays[path][index if rows is None else index + (slice(*rows),)]
        return source.read().result()


# ---------------------------------------------------------------------------------------------------------------
# Output directories: staged, renamed when complete


def _check_output(out: str, force: bool, sources: tuple[str, ...]) -> str:
    out = os.path.abspath(out)
    for source in sources:
        if os.path.commonpath([out, os.path.abspath(source)]) == out:
            raise ValueError(f"--out {out} contains the input {source}; choose another output directory")
    if os.path.lexists(out):
        if not os.path.isdir(out):
            raise FileExistsError(f"--out {out} exists and is not a directory")
        if os.listdir(out) and not force:
            raise FileExistsError(f"--out {out} exists and is not empty; pass --force to replace it")
    return out


def _warn_if_refused(out: str | None, force: bool) -> None:
    """--dry-run: say on stderr when the real run would refuse --out (non-empty without --force)."""
    if out and not force and os.path.isdir(out) and os.listdir(out):
        print(f"warning: --out {os.path.abspath(out)} exists and is not empty; a real run needs --force to replace it",
              file=sys.stderr)


def _copy_side_files(source_dir: str, dest_dir: str) -> list[str]:
    """Copy config.json, tokenizer and other small regular files (not weights, not our record) -> their names."""
    names = [n for n in sorted(os.listdir(source_dir)) if os.path.isfile(os.path.join(source_dir, n))
             and not _WEIGHT_FILES.match(n) and n != CONVERT_RECORD]
    for name in names:
        shutil.copy2(os.path.join(source_dir, name), os.path.join(dest_dir, name))
    return names


def _config_dir(source: str, option: str) -> tuple[str, str]:
    """(directory, config path) for a checkpoint directory or a config .json file given as `option` (named in the
    error when it is neither)."""
    source = os.path.abspath(os.fspath(source))
    if os.path.isfile(source):
        return os.path.dirname(source), source
    if not os.path.exists(source):
        raise FileNotFoundError(f"{option} {source}: no such file or directory")
    if not os.path.isfile(os.path.join(source, "config.json")):
        raise FileNotFoundError(f"{option} {source}: no config.json in this directory")
    return source, os.path.join(source, "config.json")


def _has_weights(directory: str) -> bool:
    return any(n.endswith((".safetensors",) + hf.PICKLE_SUFFIXES) for n in os.listdir(directory))


def _float_dtype(name: str) -> np.dtype:
    allowed = ("bfloat16", "float16", "float32")
    if name not in allowed:
        raise ValueError(f"--dtype {name!r}: expected one of {', '.join(allowed)}")
    return jnp.dtype(name)


def _param_shapes(model) -> dict[str, tuple[int, ...]]:
    """Flattened params path ("blocks/full/q_proj") -> shape, from abstract evaluation of `model.init`."""
    abstract = jax.eval_shape(model.init, jax.random.key(0))
    return {path: tuple(s.shape) for path, s in traverse_util.flatten_dict(abstract, sep="/").items()}


# ---------------------------------------------------------------------------------------------------------------
# hf2orbax


def hf2orbax(hf_dir: str, out: str | None, dtype: str = "bfloat16", *, mesh: str | None = None, force: bool = False,
             dry_run: bool = False, block_bytes: int = BLOCK_BYTES, log=None) -> Summary:
    """HF safetensors directory (or, for a dry run, just a config.json) -> init directory `out`."""
    log = log or sys.stdout
    try:
        devices = math.prod(parse_mesh_spec(mesh)) if mesh is not None else 1
    except ValueError as e:
        raise ValueError(f"--mesh {mesh!r}: {e}") from None
    dtype = _float_dtype(dtype)
    source_dir, config_path = _config_dir(hf_dir, "--hf")
    model = models.build(models.config_from_hf(config_path))
    layout = hf.checkpoint_layout(model)
    depths = _slot_depths(layout)
    shapes = _param_shapes(model)
    chunks = _chunk_shapes(shapes, depths, dtype.itemsize, devices)
    abstract = dry_run and (os.path.isfile(os.fspath(hf_dir)) or not _has_weights(source_dir))
    found, skipped = ({}, []) if abstract else hf.match_checkpoint(model, source_dir)
    tensor_bytes = {name: math.prod(slot.hf_shape) * dtype.itemsize for name, slot in layout.items()}
    total = sum(tensor_bytes.values())
    unused = sorted({p + "*" for p in model.hf_skipped_prefixes for t in skipped if t.name.startswith(p)})
    print(f"hf2orbax: {config_path} -> {type(model.config).__name__}; "
          + (f"{len(layout)} tensors expected (abstract: config only)" if abstract else
             f"{len(found)} tensors matched in {source_dir}, {len(skipped)} not used {' '.join(unused)}"), file=log)
    print(f"  params: {len(shapes)} Orbax arrays, {len(layout)} HF tensors, {_gb(total)} at {dtype.name}", file=log)
    if mesh is not None:
        split = sum(c < n for path in shapes for c, n in zip(chunks[path], shapes[path]))
        print(f"  --mesh {mesh}: zarr chunks aligned with the FSDP shards of {devices} devices "
              f"(sharding.rules.param_specs); {split} chunked dimensions", file=log)
    if dry_run:
        for path in sorted(shapes):
            nbytes = math.prod(shapes[path]) * dtype.itemsize
            print(f"    {orbax_name(path):<48} {str(list(shapes[path])):<28} {dtype.name} {nbytes / 1e9:9.3f} GB",
                  file=log)
        summary = Summary("hf2orbax", len(layout), total, dry_run=True)
        print(summary, file=log)
        _warn_if_refused(out, force)
        return summary
    out = _check_output(out, force, (source_dir,))

    start, started_ns = time.perf_counter(), time.time_ns()
    order = sorted(layout, key=lambda name: (found[name].file, found[name].offset))  # sequential reads
    progress = Progress(len(order), total)
    with staged(out, "convert") as staging:
        params_dir = os.path.join(staging, "params")
        os.makedirs(params_dir)
        writer = OrbaxWriter(params_dir, shapes, dtype, chunks)
        written = collections.defaultdict(set)
        for name in order:
            slot, stored = layout[name], found[name]
            for rows in _slice_blocks(slot, shapes[slot.path], dtype.itemsize, block_bytes,
                                      writer.chunk_rows(slot.path)):
                block = hf.read_rows(stored) if rows is None else hf.read_rows(stored, *rows)
                writer.write(slot.path, slot.index, rows, block.astype(dtype, copy=False))
            written[slot.path].add(slot.index)
            progress.update(name, tensor_bytes[name])
        zero_filled = _zero_fill(writer, shapes, depths, written, dtype, block_bytes)
        if zero_filled:
            print(f"  zero-filled {len(zero_filled)} slices no HF tensor maps to (as load_hf): "
                  f"{', '.join(zero_filled[:8])}{' ...' if len(zero_filled) > 8 else ''}", file=log)
        record = {"source": source_dir, "dtype": dtype.name, "tensors": len(order), "bytes": total, "mesh": mesh,
                  "hf_prefix_aliases_used": sorted({(old, new) for old, new in model.hf_prefix_aliases
                                                    for t in found.values() if t.name.startswith(old)})}
        writer.finish(record, started_ns)
        _copy_side_files(source_dir, staging)
        with open(os.path.join(staging, CONVERT_RECORD), "w") as f:
            json.dump(record, f, indent=2)
    summary = Summary("hf2orbax", len(order), total, time.perf_counter() - start, peak_rss_bytes())
    print(f"{summary} -> {out}", file=log)
    return summary


def _zero_fill(writer: OrbaxWriter, shapes, depths, written, dtype, block_bytes) -> list[str]:
    """Write zeros to every slice no HF tensor covered (Orbax refuses to read missing chunks) -> their names."""
    filled = []
    for path, shape in shapes.items():
        depth = depths.get(path, 0)
        for index in np.ndindex(*shape[:depth]):
            if index in written[path]:
                continue
            rest = shape[depth:]
            slot = hf.Slot(path, index, rest)
            for rows in _slice_blocks(slot, shape, dtype.itemsize, block_bytes, writer.chunk_rows(path)):
                block_shape = rest if rows is None else (rows[1] - rows[0], *rest[1:])
                writer.write(path, index, rows, np.zeros(block_shape, dtype))
            filled.append(f"{orbax_name(path)}{list(index) if index else ''}")
    return filled


# ---------------------------------------------------------------------------------------------------------------
# orbax2hf


def orbax2hf(ckpt: str, config: str, out: str | None, dtype: str | None = None, *, shard_bytes: int = SHARD_BYTES,
             force: bool = False, dry_run: bool = False, block_bytes: int = BLOCK_BYTES, log=None) -> Summary:
    """Orbax params checkpoint + the HF config (directory) it came from -> sharded safetensors directory `out`.

    dtype: one dtype for every tensor; default: each tensor's dtype in the `--config` directory's safetensors when
    it has them (the original checkpoint), else the Orbax array's dtype.
    """
    log = log or sys.stdout
    config_dir, config_path = _config_dir(config, "--config")
    model = models.build(models.config_from_hf(config_path))
    layout = hf.checkpoint_layout(model)
    reader = OrbaxReader(ckpt)
    problems = hf.mismatches({orbax_name(p): shape for p, shape in _param_shapes(model).items()},
                             {orbax_name(p): shape for p, shape in reader.shapes.items()}, "arrays")
    if problems:
        raise ValueError(f"Orbax checkpoint {reader.directory} does not match {config_path} "
                         f"({type(model.config).__name__}): {problems}")

    if _has_weights(config_dir):  # the original checkpoint: its names, dtypes and unused tensors
        found, extras = hf.match_checkpoint(model, config_dir)
        names = {name: found[name].name for name in layout}
        dtypes = {name: found[name].dtype for name in layout}
    else:
        aliases = []  # the spelling hf2orbax found, when config_dir is one of its init directories
        if os.path.exists(record_path := os.path.join(config_dir, CONVERT_RECORD)):
            aliases = read_json(record_path, "conversion record").get("hf_prefix_aliases_used", [])
        names = {name: next((old + name[len(new):] for old, new in aliases if name.startswith(new)), name)
                 for name in layout}
        dtypes, extras = {name: reader.dtypes[layout[name].path] for name in layout}, []
        if model.hf_skipped_prefixes:
            print(f"  note: {config_dir} has no safetensors, so tensors the model does not use "
                  f"({', '.join(model.hf_skipped_prefixes)}*) are not written", file=log)
    if dtype is not None:
        dtypes = dict.fromkeys(layout, _float_dtype(dtype))
    order = sorted(layout, key=lambda name: (layout[name].path, layout[name].index))  # leaf by leaf: chunk cache hits
    source = {names[name]: name for name in order}
    extra_by_name = {t.name: t for t in extras}
    entries = [(names[n], np.dtype(dtypes[n]), layout[n].hf_shape) for n in order]
    entries += [(t.name, t.dtype, t.shape) for t in extras]
    total = sum(math.prod(shape) * d.itemsize for _, d, shape in entries)
    shards = max(1, math.ceil(total / shard_bytes))
    print(f"orbax2hf: {reader.directory} + {config_path} -> {len(entries)} tensors ({len(layout)} from Orbax, "
          f"{len(extras)} copied), {_gb(total)}, about {shards} shard(s)", file=log)
    if dry_run:
        summary = Summary("orbax2hf", len(entries), total, dry_run=True)
        print(summary, file=log)
        _warn_if_refused(out, force)
        return summary
    out = _check_output(out, force, (reader.directory, config_dir))

    start = time.perf_counter()
    progress = Progress(len(entries), total)

    def blocks(name: str):
        if name in extra_by_name:
            stored = extra_by_name[name]
            row_bytes = math.prod(stored.shape[1:]) * stored.dtype.itemsize
            ranges = _row_ranges(stored.shape[0], row_bytes, block_bytes) if stored.shape else [None]
            for rows in ranges:
                yield hf.read_rows(stored) if rows is None else hf.read_rows(stored, *rows)
            progress.update(name, stored.nbytes)
            return
        canonical = source[name]
        slot, out_dtype = layout[canonical], np.dtype(dtypes[canonical])
        leaf_dtype = reader.dtypes[slot.path]
        for rows in _slice_blocks(slot, reader.shapes[slot.path], leaf_dtype.itemsize, block_bytes):
            block = reader.read(slot.path, slot.index, rows).astype(out_dtype, copy=False)
            yield block.reshape(slot.hf_shape if rows is None else (rows[1] - rows[0], *slot.hf_shape[1:]))
        progress.update(name, math.prod(slot.hf_shape) * out_dtype.itemsize)

    with staged(out, "convert") as staging:
        files = hf.write_sharded_safetensors(staging, entries, blocks, shard_bytes)
        _copy_side_files(config_dir, staging)
    summary = Summary("orbax2hf", len(entries), total, time.perf_counter() - start, peak_rss_bytes())
    print(f"{summary} -> {out} ({len(files)} file(s))", file=log)
    return summary


# ---------------------------------------------------------------------------------------------------------------
# Command line


def _size(text: str) -> int:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?", text.strip(), re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a size such as 5GB, 500MB or 2GiB")
    unit = (match[2] or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30}[unit]
    return int(float(match[1]) * scale)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m longstraw_jax.convert", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    a = sub.add_parser("hf2orbax", help="HF safetensors directory -> init directory (config.json + Orbax params/)")
    a.add_argument("--hf", required=True, help="HF checkpoint directory (or, with --dry-run, a config.json file)")
    a.add_argument("--out", help="init directory to write (required unless --dry-run)")
    a.add_argument("--dtype", default="bfloat16", help="dtype of the Orbax arrays (default bfloat16)")
    a.add_argument("--mesh", help="AxB device mesh (data x seq) the checkpoint will be restored onto: zarr chunks are "
                   "cut along each leaf's FSDP dimension so every device reads only whole chunks of its own shard")
    b = sub.add_parser("orbax2hf", help="Orbax params checkpoint -> HF sharded safetensors directory")
    b.add_argument("--ckpt", required=True, help="Orbax checkpoint: an init directory, its params/, or a training "
                   "checkpoint step (<out>/checkpoints/<step>, params read from its state item)")
    b.add_argument("--config", required=True, help="the original HF directory (names, dtypes, unused tensors, "
                   "tokenizer are taken from it) or any directory/file with its config.json")
    b.add_argument("--out", help="HF directory to write (required unless --dry-run)")
    b.add_argument("--dtype", help="dtype of every tensor (default: the original's, else the Orbax arrays')")
    b.add_argument("--shard-size", type=_size, default=SHARD_BYTES, help="max bytes per safetensors file (5GB)")
    for p in (a, b):
        p.add_argument("--force", action="store_true", help="replace a non-empty --out")
        p.add_argument("--dry-run", action="store_true", help="check names and shapes, print what would be written")
        p.add_argument("--block-size", type=_size, default=BLOCK_BYTES,
                       help="read/write unit (64MiB; zarr chunks are 16MiB)")
    args = parser.parse_args(argv)
    if not args.dry_run and not args.out:
        parser.error("--out is required (unless --dry-run)")
    try:
        if args.command == "hf2orbax":
            hf2orbax(args.hf, args.out, args.dtype, mesh=args.mesh, force=args.force, dry_run=args.dry_run,
                     block_bytes=args.block_size)
        else:
            orbax2hf(args.ckpt, args.config, args.out, args.dtype, shard_bytes=args.shard_size, force=args.force,
                     dry_run=args.dry_run, block_bytes=args.block_size)
    except (ValueError, OSError, NotImplementedError) as e:  # OSError: FileNotFoundError, FileExistsError, ...
        print(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
