"""Hugging Face checkpoints <-> our parameter pytrees (safetensors only; never unpickle).

Model-agnostic: each model class provides `hf_layout()` (HF name -> Slot), `hf_skipped_prefixes` (on-disk tensors
it ignores, e.g. MTP and vision towers) and `hf_prefix_aliases` (alternative spellings of its names, e.g. Qwen3.6's
multimodal `model.language_model.*`); its config class provides `from_hf` and `to_hf`, and models/registry.py maps
config.json's `model_type` to the family. Saving writes the canonical layout with the config class's `to_hf()`
config.json.

Safetensors are read and written here at the format level (`read_rows`, `write_sharded_safetensors`), tensor by
tensor in row blocks: the library's `safe_open` maps whole shards (their pages count towards resident memory) and
`save_file` needs a shard's tensors in memory, which io/convert.py cannot afford at real size.
"""
from __future__ import annotations

import glob
import json
import logging
import math
import os
import struct
from typing import Callable, Iterable, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import traverse_util

from longstraw_jax.models import registry
from longstraw_jax.models.base import Slot, read_json


def config_from_hf(directory: str | os.PathLike):
    """The config object for `directory/config.json`, or for a config file path with any name (dispatch on its
    `model_type`: models/registry.py)."""
    path = os.fspath(directory)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file or directory")
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(f"{path}: no config.json in this directory")
        path = os.path.join(path, "config.json")
    return registry.read_config(read_json(path, "config file"), path)


def checkpoint_layout(model) -> dict[str, Slot]:
    """HF tensor name -> Slot, from abstract shapes only (the model's `hf_layout()`)."""
    return model.hf_layout()


def _canonical_name(model, name: str) -> str | None:
    """The stored name in the layout's spelling, or None for tensors the model skips (e.g. MTP, vision)."""
    if name.startswith(model.hf_skipped_prefixes):
        return None
    for old, new in model.hf_prefix_aliases:
        if name.startswith(old):
            return new + name[len(old):]
    return name


# Pickle-based checkpoint files: never opened (unpickling runs arbitrary code).
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def _safetensor_files(directory: str) -> list[str]:
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        weight_map = read_json(index, "safetensors index").get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise ValueError(f"{index}: safetensors index needs a \"weight_map\" object (tensor name -> file name)")
        files = [os.path.join(directory, f) for f in sorted(set(weight_map.values()))]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise FileNotFoundError(f"{index}: lists {len(missing)} missing shard(s): {', '.join(missing[:3])}"
                                    f"{' ...' if len(missing) > 3 else ''}")
        return files
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        pickled = sorted(f for f in os.listdir(directory) if f.endswith(PICKLE_SUFFIXES))
        if pickled:
            raise ValueError(f"{directory}: refusing {', '.join(pickled)}: pickle-based checkpoints are never loaded "
                             "(unpickling runs code); convert them to safetensors with the tool that wrote them")
        raise FileNotFoundError(f"no *.safetensors in {directory} (only safetensors checkpoints are loaded)")
    return files


# ----- safetensors, streamed: an 8-byte little-endian header length, a JSON header {name: {dtype, shape,
# data_offsets}}, then the tensors' bytes back to back (C order). Read and written in row blocks, never mmapped
# whole, so host memory stays at one block.

SAFETENSORS_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
                      "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2, "I64": np.int64,
                      "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
_DTYPE_NAMES = {np.dtype(v): k for k, v in SAFETENSORS_DTYPES.items()}


class StoredTensor(NamedTuple):
    """One tensor of a safetensors file: `dtype` `shape` in C order at byte `offset` of `file`."""

    file: str
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def read_safetensors_header(path: str) -> list[StoredTensor]:
    """The tensors of one safetensors file (reads only its header). ValueError naming the file for anything that is
    not a well-formed safetensors file: too short, a truncated or malformed header, tensors past the end of it."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{path}: {len(prefix)} bytes: too short for a safetensors file (it starts with an "
                             "8-byte header length)")
        (length,) = struct.unpack("<Q", prefix)
        if length > 1 << 30:
            raise ValueError(f"{path}: safetensors header of {length} bytes: not a safetensors file")
        if 8 + length > size:
            raise ValueError(f"{path}: truncated: its header needs {length} bytes after the 8-byte length, the file "
                             f"has {size - 8}")
        try:
            header = json.loads(f.read(length))
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
            raise ValueError(f"{path}: the safetensors header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the safetensors header must be a JSON object, got {type(header).__name__}")
    tensors = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            ints = [*shape, start, end]
            if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ints) or start > end:
                raise ValueError
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}: {name}: malformed safetensors entry {entry!r:.200} (needs dtype, shape and "
                             "data_offsets [start, end])") from None
        if dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"{path}: {name} has dtype {dtype}; supported: {', '.join(SAFETENSORS_DTYPES)}")
        tensor = StoredTensor(path, name, np.dtype(SAFETENSORS_DTYPES[dtype]), tuple(shape), 8 + length + start)
        if end - start != tensor.nbytes:
            raise ValueError(f"{path}: {name} spans {end - start} bytes, shape {tensor.shape} needs {tensor.nbytes}")
        if 8 + length + end > size:
            raise ValueError(f"{path}: truncated: {name} ends at byte {8 + length + end}, the file has {size} bytes")
        tensors.append(tensor)
    return tensors


def stored_tensors(directory: str | os.PathLike) -> dict[str, StoredTensor]:
    """Stored name -> StoredTensor over every safetensors shard of `directory`."""
    return {t.name: t for path in _safetensor_files(os.fspath(directory)) for t in read_safetensors_header(path)}


def read_rows(tensor: StoredTensor, start: int = 0, stop: int | None = None) -> np.ndarray:
    """Rows [start, stop) of the first axis (default: all), read from disk (no mmap) -> [stop - start, ...]."""
    if not tensor.shape:
        start, stop, row_shape = 0, 1, ()
    else:
        stop, row_shape = tensor.shape[0] if stop is None else stop, tensor.shape[1:]
    row_bytes = math.prod(row_shape) * tensor.dtype.itemsize
    out = np.empty((stop - start, *row_shape) if tensor.shape else (), tensor.dtype)
    view = memoryview(out.reshape(-1).view(np.uint8))
    with open(tensor.file, "rb", buffering=0) as f:
        f.seek(tensor.offset + start * row_bytes)
        done = 0
        while done < len(view):  # a single read returns at most ~2 GiB on Linux
            n = f.readinto(view[done:])
            if not n:
                raise ValueError(f"{tensor.file}: truncated while reading {tensor.name}")
            done += n
    return out


def write_safetensors(path: str, tensors: list[tuple[str, np.dtype, tuple[int, ...]]],
                      blocks: Callable[[str], Iterable[np.ndarray]]) -> None:
    """Write `tensors` (name, dtype, shape) to one file; `blocks(name)` yields arrays whose bytes, concatenated in
    C order, are that tensor (e.g. row blocks). The header is written first, so nothing is held whole."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, dtype, shape in tensors:
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        header[name] = {"dtype": _DTYPE_NAMES[np.dtype(dtype)], "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)) + encoded)
        for name, dtype, shape in tensors:
            written = 0
            for block in blocks(name):
                if block.dtype != np.dtype(dtype):
                    raise ValueError(f"{path}: {name} block has dtype {block.dtype}, header says {np.dtype(dtype)}")
                f.write(np.ascontiguousarray(block).reshape(-1).view(np.uint8).data)
                written += block.nbytes
            expected = header[name]["data_offsets"][1] - header[name]["data_offsets"][0]
            if written != expected:
                raise ValueError(f"{path}: {name} got {written} bytes, expected {expected}")


def write_sharded_safetensors(directory: str, tensors: list[tuple[str, np.dtype, tuple[int, ...]]],
                              blocks: Callable[[str], Iterable[np.ndarray]], max_shard_bytes: int) -> list[str]:
    """`model.safetensors`, or `model-0000i-of-0000n.safetensors` of at most `max_shard_bytes` each (a larger tensor
    gets a shard of its own) plus `model.safetensors.index.json`, in `directory`; returns the file names."""
    shards, size = [[]], 0
    for entry in tensors:
        nbytes = math.prod(entry[2]) * np.dtype(entry[1]).itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    if len(shards) == 1:
        files = ["model.safetensors"]
    else:
        files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        total = sum(math.prod(shape) * np.dtype(dtype).itemsize for _, dtype, shape in tensors)
        weight_map = {name: file for file, shard in zip(files, shards) for name, _, _ in shard}
        with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    for file, shard in zip(files, shards):
        write_safetensors(os.path.join(directory, file), shard, blocks)
    return files


def match_checkpoint(model, directory: str | os.PathLike) -> tuple[dict[str, StoredTensor], list[StoredTensor]]:
    """Pair the layout's names with `directory`'s tensors -> (canonical name -> StoredTensor, skipped tensors).

    Raises ValueError listing every missing, unexpected or mis-shaped key (by stored name) before any data is read.
    """
    directory = os.fspath(directory)
    layout = checkpoint_layout(model)
    found, skipped = {}, []
    for stored in stored_tensors(directory).values():
        name = _canonical_name(model, stored.name)
        if name is None:
            skipped.append(stored)
        else:
            found[name] = stored
    problems = mismatches({name: layout[name].hf_shape for name in layout},
                          {name: t.shape for name, t in found.items()}, "keys", lambda name: found[name].name)
    if problems:
        raise ValueError(f"checkpoint {directory} does not match {model.config.__class__.__name__}: {problems}")
    return found, skipped


def mismatches(expected: dict[str, tuple], got: dict[str, tuple], noun: str, spell=lambda name: name) -> str:
    """'missing {noun} (n): a, b; unexpected {noun} (n): ...; mis-shaped {noun} (n): c: (got) (expected (want))' for
    two name -> shape maps ('' when they agree); `spell` gives the name to print for a name of `got`."""
    missing = sorted(set(expected) - set(got))
    unexpected = sorted(spell(name) for name in set(got) - set(expected))
    misshaped = [f"{spell(name)}: {got[name]} (expected {expected[name]})"
                 for name in sorted(set(expected) & set(got)) if tuple(got[name]) != tuple(expected[name])]
    return "; ".join(f"{label} {noun} ({len(items)}): {', '.join(items)}" for label, items in
                     (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped)) if items)


def load_hf(directory: str | os.PathLike, dtype=jnp.float32):
    """Read config.json and safetensors from `directory` -> (model, params in `dtype`).

    Raises ValueError listing every missing, unexpected or mis-shaped key before building anything.
    """
    directory = os.fspath(directory)
    model = registry.build(config_from_hf(directory))
    found, skipped = match_checkpoint(model, directory)
    if skipped:
        prefixes = sorted({p for p in model.hf_skipped_prefixes for t in skipped if t.name.startswith(p)})
        logging.getLogger(__name__).info("load_hf(%s): skipped %d tensors under %s (not used by %s)", directory,
                                         len(skipped), ", ".join(prefixes), type(model).__name__)
    shapes = jax.eval_shape(model.init, jax.random.key(0))
    flat = {k: np.zeros(v.shape, np.float32) for k, v in traverse_util.flatten_dict(shapes, sep="/").items()}
    for name, slot in checkpoint_layout(model).items():
        target = flat[slot.path]
        target[slot.index] = read_rows(found[name]).astype(np.float32).reshape(target.shape[len(slot.index):])
    params = traverse_util.unflatten_dict({k: jnp.asarray(v, dtype) for k, v in flat.items()}, sep="/")
    return model, params


def save_hf(model, params: dict, directory: str | os.PathLike, dtype=None,
            max_shard_bytes: int = 4 << 30) -> None:
    """Write `directory/config.json` and safetensors (sharded with an index above `max_shard_bytes`)."""
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    flat = traverse_util.flatten_dict(params, sep="/")
    layout = checkpoint_layout(model)

    def blocks(name):
        slot = layout[name]
        value = flat[slot.path][slot.index]
        yield np.asarray(jnp.asarray(value, dtype or value.dtype).reshape(slot.hf_shape))

    tensors = [(name, np.dtype(dtype or flat[slot.path].dtype), slot.hf_shape) for name, slot in layout.items()]
    write_sharded_safetensors(directory, tensors, blocks, max_shard_bytes)
    config = model.config.to_hf()
    config["torch_dtype"] = str(jnp.dtype(dtype or params["embed"].dtype))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
