"""Checkpoint conversion (longstraw_jax/io/convert.py): HF -> Orbax -> HF round trips, the Orbax layout against
StandardCheckpointer's own, errors, streaming memory and dry runs on the real configs.

Model types are parametrised over what exists: every layout in ROUND_TRIPS / DRY_RUNS whose model_type is in
`models.MODEL_TYPES` (GLM-5.2 joins when models/glm52/model.py registers "glm_moe_dsa" and tests/hf_reference.py
has `make_glm_checkpoint`).
"""
import importlib.util
import json
import math
import os
import pickle
import subprocess
import sys
import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest

from longstraw_jax import models
from longstraw_jax.io import convert
from longstraw_jax.models import hf
from longstraw_jax.models.qwen36.config import FULL, LINEAR, Qwen36Config
from tests import hf_reference
from tests.helpers import ROOT

TOKENS = np.random.default_rng(0).integers(0, 256, size=40).astype(np.int32)


def _text_checkpoint(directory):
    return hf_reference.make_qwen_checkpoint(directory, seed=3)


def _multimodal_checkpoint(directory):
    model = hf_reference.make_qwen_checkpoint(directory / "text", seed=3)
    hf_reference.to_multimodal_layout(directory / "text", directory / "mm")
    return model


# layout -> (model_type, builder(directory) -> the transformers model, directory of the checkpoint it wrote)
ROUND_TRIPS = {
    "qwen3.6_text": ("qwen3_5_text", _text_checkpoint, ""),
    "qwen3.6_multimodal": ("qwen3_5", _multimodal_checkpoint, "mm"),
}
if importlib.util.find_spec("tests.glm_reference"):
    from tests import glm_reference

    ROUND_TRIPS["glm5.2"] = ("glm_moe_dsa", glm_reference.make_glm_checkpoint, "")
ROUND_TRIPS = {k: v for k, v in ROUND_TRIPS.items() if v[0] in models.MODEL_TYPES}


@pytest.fixture(scope="module", params=sorted(ROUND_TRIPS))
def checkpoint(request, tmp_path_factory):
    """(HF directory, the transformers class that wrote it)."""
    _, build, sub = ROUND_TRIPS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    return root / sub, type(build(root))


def _tensors(directory) -> dict:
    """Every tensor of a safetensors directory: name -> (dtype, shape, raw bytes)."""
    return {name: (t.dtype, t.shape, hf.read_rows(t).tobytes()) for name, t in hf.stored_tensors(directory).items()}


def _assert_same_params(got, expected):
    flat_got, flat_expected = (jax.tree_util.tree_flatten_with_path(t)[0] for t in (got, expected))
    assert [p for p, _ in flat_got] == [p for p, _ in flat_expected]
    for (path, a), (_, b) in zip(flat_got, flat_expected):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), path


def test_round_trip_is_bit_identical(checkpoint, tmp_path):
    """HF -> Orbax -> HF: the same tensors (names, dtypes, bytes; unused mtp/vision tensors copied), the same
    config.json; StandardCheckpointer restores exactly what load_hf reads; transformers gives identical logits."""
    directory, model_class = checkpoint
    init, out = tmp_path / "init", tmp_path / "hf"
    convert.hf2orbax(directory, init, "float32")
    model, params = models.load_hf(directory)
    restored = ocp.StandardCheckpointer().restore(init / "params", jax.eval_shape(lambda: params))
    _assert_same_params(restored, params)
    assert (init / "config.json").read_bytes() == (directory / "config.json").read_bytes()

    convert.orbax2hf(init, directory, out, shard_bytes=400_000)  # several shards + index
    assert _tensors(out) == _tensors(directory)
    assert (out / "config.json").read_bytes() == (directory / "config.json").read_bytes()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(hf.stored_tensors(directory)) and len(set(index["weight_map"].values())) > 1

    logits = [hf_reference.hf_logits(model_class.from_pretrained(d).float().eval(), TOKENS) for d in (directory, out)]
    np.testing.assert_array_equal(logits[1], logits[0])

    # the init directory alone (no safetensors next to its config) still gives the original names
    text_only = tmp_path / "hf_from_init"
    convert.orbax2hf(init, init, text_only)
    expected = {k: v for k, v in _tensors(directory).items() if not k.startswith(model.hf_skipped_prefixes)}
    assert _tensors(text_only) == expected


def test_bfloat16_conversion_matches_load_hf(checkpoint, tmp_path):
    """Default dtype: bfloat16 arrays equal to load_hf(dtype=bfloat16) bit for bit; --dtype on the way back."""
    directory, _ = checkpoint
    summary = convert.hf2orbax(directory, tmp_path / "init")
    model, params = models.load_hf(directory, dtype=jnp.bfloat16)
    restored = ocp.StandardCheckpointer().restore(tmp_path / "init" / "params", jax.eval_shape(lambda: params))
    _assert_same_params(restored, params)
    layout = hf.checkpoint_layout(model)
    assert summary.tensors == len(layout) and summary.nbytes == sum(2 * math.prod(s.hf_shape) for s in layout.values())
    convert.orbax2hf(tmp_path / "init", directory, tmp_path / "hf", "bfloat16")
    written = hf.stored_tensors(tmp_path / "hf")
    assert {t.dtype for name, t in written.items() if not name.startswith(model.hf_skipped_prefixes)} == {
        np.dtype(ml_dtypes.bfloat16)}


def test_orbax_layout_is_standard_checkpointers(tmp_path):
    """Our params/ is what StandardCheckpointHandler(use_ocdbt=False) writes (same _METADATA, same zarr arrays up to
    chunking), and orbax2hf reads the params of a training state saved the default way (OCDBT) exactly."""
    hf_dir = tmp_path / "hf"
    hf_reference.make_qwen_checkpoint(hf_dir, seed=5, num_hidden_layers=4, tie_word_embeddings=True)
    _, params = models.load_hf(hf_dir)
    convert.hf2orbax(hf_dir, tmp_path / "ours", "float32")
    theirs = tmp_path / "theirs"
    ocp.Checkpointer(ocp.StandardCheckpointHandler(use_ocdbt=False)).save(theirs, args=ocp.args.StandardSave(params))
    ours = tmp_path / "ours" / "params"
    assert json.loads((ours / "_METADATA").read_text()) == json.loads((theirs / "_METADATA").read_text())
    arrays = sorted(p.name for p in ours.iterdir() if p.is_dir())
    assert arrays == sorted(p.name for p in theirs.iterdir() if p.is_dir() and p.name != "array_metadatas")
    for name in arrays:
        a, b = (json.loads((d / name / ".zarray").read_text()) for d in (ours, theirs))
        assert {**a, "chunks": None} == {**b, "chunks": None}, name

    # a training checkpoint step: item "state" = {"params", "opt_state", "rng"}, OCDBT, whole-leaf chunks
    step = tmp_path / "checkpoints" / "100"
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(step / "state", {"params": params, "opt_state": {"mu": params}, "rng": jnp.zeros(2, jnp.uint32)})
    checkpointer.wait_until_finished()
    convert.orbax2hf(step, hf_dir, tmp_path / "back")
    assert _tensors(tmp_path / "back") == _tensors(hf_dir)


# ---------------------------------------------------------------------------------------------------------------
# Errors


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_hf")
    model = models.build(Qwen36Config.tiny())
    models.save_hf(model, model.init(jax.random.key(0)), directory)
    return directory


def test_wrong_tensors_are_listed_by_name(tiny_hf, tmp_path):
    from safetensors.numpy import load_file, save_file

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_bytes((tiny_hf / "config.json").read_bytes())
    tensors = load_file(tiny_hf / "model.safetensors")
    del tensors["model.layers.3.self_attn.k_norm.weight"]
    tensors["model.layers.0.linear_attn.bogus.weight"] = np.zeros(3, np.float32)
    tensors["model.layers.5.mlp.up_proj.weight"] = np.zeros((7, 64), np.float32)
    save_file(tensors, bad / "model.safetensors")
    for dry_run in (True, False):
        with pytest.raises(ValueError) as info:
            convert.hf2orbax(bad, tmp_path / "out", dry_run=dry_run)
        message = str(info.value)
        assert "missing keys (1): model.layers.3.self_attn.k_norm.weight" in message
        assert "unexpected keys (1): model.layers.0.linear_attn.bogus.weight" in message
        assert "model.layers.5.mlp.up_proj.weight: (7, 64) (expected (128, 64))" in message
    assert not (tmp_path / "out").exists()

    # an Orbax checkpoint from another config: arrays listed by name
    convert.hf2orbax(tiny_hf, tmp_path / "init")
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps(Qwen36Config.tiny(hidden_size=48).to_hf()))
    with pytest.raises(ValueError, match=r"mis-shaped arrays \(\d+\): blocks.full.input_norm: \(2, 1, 64\) "
                                         r"\(expected \(2, 1, 48\)\)"):
        convert.orbax2hf(tmp_path / "init", other, tmp_path / "out2")


class _Trap:
    """Unpickling this creates a marker file: the test fails if anything unpickles a checkpoint."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickle_checkpoints_are_refused_unopened(tiny_hf, tmp_path, capsys):
    directory = tmp_path / "pt"
    directory.mkdir()
    (directory / "config.json").write_bytes((tiny_hf / "config.json").read_bytes())
    marker = tmp_path / "unpickled"
    (directory / "pytorch_model.bin").write_bytes(pickle.dumps(_Trap(str(marker))))
    assert convert.main(["hf2orbax", "--hf", str(directory), "--out", str(tmp_path / "out")]) == 2
    assert "refusing pytorch_model.bin: pickle-based checkpoints are never loaded" in capsys.readouterr().err
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_existing_output_needs_force(tiny_hf, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    assert convert.main(["hf2orbax", "--hf", str(tiny_hf), "--out", str(out)]) == 2
    assert "exists and is not empty; pass --force" in capsys.readouterr().err
    assert (out / "keep.txt").exists()
    assert convert.main(["hf2orbax", "--hf", str(tiny_hf), "--out", str(out), "--force"]) == 0
    assert not (out / "keep.txt").exists() and (out / "params" / "_METADATA").exists()
    with pytest.raises(ValueError, match="contains the input"):
        convert.hf2orbax(tiny_hf, tiny_hf.parent, force=True)


def _bad_checkpoints(tiny_hf, root):
    """(name, directory or path given as --hf, expected one-line message) for broken inputs."""
    good = (tiny_hf / "model.safetensors").read_bytes()
    cases = []

    def checkpoint(name, weights=None, config=None):
        directory = root / name
        directory.mkdir()
        (directory / "config.json").write_bytes((tiny_hf / "config.json").read_bytes() if config is None else config)
        if weights is not None:
            (directory / "model.safetensors").write_bytes(weights)
        return directory

    for n in (0, 3, 7):
        d = checkpoint(f"short{n}", good[:n])
        cases.append((f"{n} bytes", d, f"{d / 'model.safetensors'}: {n} bytes: too short for a safetensors file "
                                       "(it starts with an 8-byte header length)"))
    d = checkpoint("cut_header", good[:50])
    length = int.from_bytes(good[:8], "little")
    cases.append(("truncated header", d, f"{d / 'model.safetensors'}: truncated: its header needs {length} bytes "
                                         "after the 8-byte length, the file has 42"))
    d = checkpoint("bad_header", (5).to_bytes(8, "little") + b"{bad}")
    cases.append(("header not JSON", d, f"{d / 'model.safetensors'}: the safetensors header is not valid JSON: "
                                        "Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"))
    d = checkpoint("cut_data", good[:-100])
    last = max(hf.read_safetensors_header(str(tiny_hf / "model.safetensors")), key=lambda t: t.offset)
    cases.append(("truncated data", d, f"{d / 'model.safetensors'}: truncated: {last.name} ends at byte {len(good)}, "
                                       f"the file has {len(good) - 100} bytes"))
    d = checkpoint("bad_config", good, b'{"model_type": "qwen3_5_text",')
    cases.append(("config not JSON", d, f"{d / 'config.json'}: config file is not valid JSON: Expecting property "
                                        "name enclosed in double quotes: line 1 column 31 (char 30)"))
    d = checkpoint("list_config", good, b"[1, 2]")
    cases.append(("config not an object", d, f"{d / 'config.json'}: config file must be a JSON object, got list"))
    cases.append(("no such directory", root / "nope", f"--hf {root / 'nope'}: no such file or directory"))
    cases.append(("no such config file", root / "nope" / "config.json",
                  f"--hf {root / 'nope' / 'config.json'}: no such file or directory"))
    (root / "empty").mkdir()
    cases.append(("no config.json", root / "empty", f"--hf {root / 'empty'}: no config.json in this directory"))
    return cases


def test_bad_files_are_one_line_errors_naming_the_file(tiny_hf, tmp_path, capsys):
    """Each broken input: exit status 2, one `error: ...` line naming the file, nothing written; --dry-run too (a
    truncated safetensors file used to pass it)."""
    out = tmp_path / "out"
    for name, source, message in _bad_checkpoints(tiny_hf, tmp_path):
        for extra in ([], ["--dry-run"]):
            assert convert.main(["hf2orbax", "--hf", str(source), "--out", str(out)] + extra) == 2, (name, extra)
            err = capsys.readouterr().err
            assert err == f"error: {message}\n", (name, extra, err)
            assert not out.exists() and not list(tmp_path.glob("out.tmp-convert-*")), name
    # orbax2hf names its own option
    assert convert.main(["orbax2hf", "--ckpt", str(tmp_path), "--config", str(tmp_path / "nope"), "--dry-run"]) == 2
    assert capsys.readouterr().err == f"error: --config {tmp_path / 'nope'}: no such file or directory\n"


def test_interrupted_conversion_leaves_nothing_complete_looking(tiny_hf, tmp_path, monkeypatch):
    calls = []
    write = convert.OrbaxWriter.write

    def failing_write(self, *args):
        calls.append(1)
        if len(calls) == 20:
            raise RuntimeError("disk full (injected)")
        return write(self, *args)

    monkeypatch.setattr(convert.OrbaxWriter, "write", failing_write)
    with pytest.raises(RuntimeError, match="injected"):
        convert.hf2orbax(tiny_hf, tmp_path / "init")
    assert os.listdir(tmp_path) == []  # neither the output nor its staging directory
    monkeypatch.undo()

    convert.hf2orbax(tiny_hf, tmp_path / "init")
    read = convert.OrbaxReader.read

    def interrupted_read(self, path, *args):
        if "mlp" in path:
            raise KeyboardInterrupt
        return read(self, path, *args)

    monkeypatch.setattr(convert.OrbaxReader, "read", interrupted_read)
    with pytest.raises(KeyboardInterrupt):
        convert.orbax2hf(tmp_path / "init", tiny_hf, tmp_path / "hf")
    assert sorted(os.listdir(tmp_path)) == ["init"]


def test_mesh_aligns_chunks_with_fsdp_shards(tiny_hf, tmp_path, monkeypatch):
    """--mesh 2x4: every leaf's zarr chunks tile each of the 8 devices' FSDP shards (parallel.rules.fsdp_dim) exactly,
    with small chunks (shards of one chunk and of several occur), and the values restore unchanged."""
    from longstraw_jax.sharding import rules

    monkeypatch.setattr(convert, "CHUNK_BYTES", 2048)
    convert.hf2orbax(tiny_hf, tmp_path / "init", "float32", mesh="2x4", block_bytes=8192)
    model, params = models.load_hf(tiny_hf)
    restored = ocp.StandardCheckpointer().restore(tmp_path / "init" / "params", jax.eval_shape(lambda: params))
    _assert_same_params(restored, params)
    split_kinds = set()
    for path, shape in convert._param_shapes(model).items():
        chunks = json.loads((tmp_path / "init" / "params" / convert.orbax_name(path) / ".zarray").read_text())["chunks"]
        assert math.prod(chunks) * 4 <= 2048 or chunks[-1] == shape[-1], (path, chunks)
        dim = rules.fsdp_dim(shape, 2 if path.startswith("blocks/") else 0, 8)
        if dim is not None:
            assert (shape[dim] // 8) % chunks[dim] == 0, (path, shape, chunks)
            split_kinds.add("finer than a shard" if chunks[dim] < shape[dim] // 8 else "one shard")
    assert split_kinds == {"finer than a shard", "one shard"}
    assert json.loads((tmp_path / "init" / convert.CONVERT_RECORD).read_text())["mesh"] == "2x4"


def test_bad_flags_are_named(tiny_hf, tmp_path):
    with pytest.raises(ValueError, match="--mesh '2by4': .*not of the form 'AxB'"):
        convert.hf2orbax(tiny_hf, tmp_path / "out", mesh="2by4")
    with pytest.raises(ValueError, match="--dtype 'int8': expected one of bfloat16, float16, float32"):
        convert.hf2orbax(tiny_hf, tmp_path / "out", "int8")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------------------------
# Dry runs on the real configs: tensor count and bytes against transformers' own meta-device model


def _qwen_meta_tensors(path) -> dict[str, int]:
    """name -> element count of transformers' Qwen3_5ForCausalLM built on the meta device (no memory)."""
    import torch
    from transformers import Qwen3_5Config, Qwen3_5ForCausalLM

    with torch.device("meta"):
        model = Qwen3_5ForCausalLM(Qwen3_5Config.from_json_file(path).text_config)
    return {name: v.numel() for name, v in model.state_dict().items()}


def _glm_meta_tensors(path) -> dict[str, int]:
    """Same for GlmMoeDsaForCausalLM, its fused in-memory experts split into the per-expert tensors
    save_pretrained writes (gate_up_proj [E, 2I, D] -> E gate_proj + E up_proj [I, D]; down_proj [E, D, I])."""
    import torch
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    with torch.device("meta"):
        model = GlmMoeDsaForCausalLM(GlmMoeDsaConfig.from_json_file(path))
    tensors = {}
    for name, v in model.state_dict().items():
        prefix = name.rsplit(".", 1)[0]
        if name.endswith("experts.gate_up_proj"):
            half = v[0].numel() // 2
            tensors.update({f"{prefix}.{e}.{p}.weight": half for e in range(v.shape[0])
                            for p in ("gate_proj", "up_proj")})
        elif name.endswith("experts.down_proj"):
            tensors.update({f"{prefix}.{e}.down_proj.weight": v[0].numel() for e in range(v.shape[0])})
        else:
            tensors[name] = v.numel()
    return tensors


# config -> (model_type, transformers oracle, tensor count, approximate bf16 bytes)
DRY_RUNS = {"configs/qwen3.6-27b.json": ("qwen3_5", _qwen_meta_tensors, 851, 53.79e9),
            "configs/glm-5.2.json": ("glm_moe_dsa", _glm_meta_tensors, 58794, 1.4868e12)}
DRY_RUNS = {k: v for k, v in DRY_RUNS.items() if v[0] in models.MODEL_TYPES and os.path.exists(os.path.join(ROOT, k))}


@pytest.mark.parametrize("config", sorted(DRY_RUNS))
def test_dry_run_on_real_config(config):
    """Through `python -m longstraw_jax.convert` in a child process; abstract shapes only, nothing written."""
    _, meta_tensors, count, approximate = DRY_RUNS[config]
    tensors = meta_tensors(os.path.join(ROOT, config))
    nbytes = 2 * sum(tensors.values())  # bfloat16
    assert len(tensors) == count and abs(nbytes / approximate - 1) < 1e-3, (len(tensors), nbytes)
    result = subprocess.run([sys.executable, "-m", "longstraw_jax.convert", "hf2orbax", "--hf",
                             os.path.join(ROOT, config), "--dry-run"], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"})
    assert result.returncode == 0, result.stderr
    assert f"{count} tensors expected (abstract: config only)" in result.stdout
    assert f"{count} HF tensors, {nbytes / 1e9:.3f} GB ({nbytes:,} bytes) at bfloat16" in result.stdout
    assert f"hf2orbax (dry run): {count} tensors" in result.stdout


# ---------------------------------------------------------------------------------------------------------------
# Streaming: peak memory of a >= 1 GB many-layer checkpoint, in child processes


def _write_synthetic_checkpoint(directory, layers=24) -> tuple[int, int]:
    """Qwen3.6 with 1024-wide layers, a 65536 x 1024 vocabulary, random finite bf16, written tensor by tensor.
    Returns (total bytes, largest tensor bytes)."""
    cfg = Qwen36Config.tiny(vocab_size=65536, hidden_size=1024, intermediate_size=4096, num_hidden_layers=layers,
                            layer_types=(LINEAR, LINEAR, LINEAR, FULL) * (layers // 4), num_attention_heads=8,
                            num_key_value_heads=2, head_dim=128, linear_num_key_heads=4, linear_num_value_heads=8,
                            linear_key_head_dim=128, linear_value_head_dim=128)
    layout = hf.checkpoint_layout(models.build(cfg))
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(cfg.to_hf()))
    pool = (np.random.default_rng(0).integers(0, 1 << 16, 1 << 26, dtype=np.uint16) & 0xBFFF).view(ml_dtypes.bfloat16)
    sizes = [math.prod(slot.hf_shape) for slot in layout.values()]
    assert max(sizes) <= pool.size

    def blocks(name):
        shape = layout[name].hf_shape
        start = zlib.crc32(name.encode()) % (pool.size - math.prod(shape) + 1)
        yield pool[start:start + math.prod(shape)].reshape(shape)

    entries = [(name, pool.dtype, slot.hf_shape) for name, slot in layout.items()]
    hf.write_sharded_safetensors(str(directory), entries, blocks, 300 * 10**6)
    return 2 * sum(sizes), 2 * max(sizes)


_MEASURE = """
import json, sys
from longstraw_jax.io import convert
before = convert.peak_rss_bytes()
getattr(convert, sys.argv[1])(*sys.argv[2:])
print(json.dumps({"before": before, "peak": convert.peak_rss_bytes()}))
"""


@pytest.mark.slow  # a 1 GB synthetic checkpoint converted both ways, in subprocesses
def test_streaming_peak_memory(tmp_path):
    """Peak RSS growth during a conversion <= 2 x largest tensor + 256 MiB (the model is >= 1 GB), both ways."""
    total, largest = _write_synthetic_checkpoint(tmp_path / "hf")
    assert total >= 10**9 and largest == 65536 * 1024 * 2
    bound = 2 * largest + (256 << 20)
    assert bound < 0.55 * total  # about half the model: holding it whole cannot pass
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
    runs = {"hf2orbax": [str(tmp_path / "hf"), str(tmp_path / "init")],
            "orbax2hf": [str(tmp_path / "init"), str(tmp_path / "hf"), str(tmp_path / "back")]}
    for direction, args in runs.items():
        result = subprocess.run([sys.executable, "-c", _MEASURE, direction, *args], capture_output=True, text=True,
                                timeout=300, env=env)
        assert result.returncode == 0, result.stderr
        rss = json.loads(result.stdout.strip().splitlines()[-1])
        growth = rss["peak"] - rss["before"]
        assert growth <= bound, f"{direction}: peak RSS grew {growth / 2**20:.0f} MiB > bound {bound / 2**20:.0f} MiB"
    original, back = hf.stored_tensors(tmp_path / "hf"), hf.stored_tensors(tmp_path / "back")
    assert set(back) == set(original)
    for name, t in original.items():
        assert hf.read_rows(back[name]).tobytes() == hf.read_rows(t).tobytes(), name
