"""tools/gpu_compile.py's host-side parts (its compiles need jax's CUDA plugin, the `gpu-compile` extra, which CI does
not install; its target descriptions: tests/capacity/test_gpu_target.py): the kernel launches read from XLA's dumped
thunk sequence, the kernel names read from a compiled program's text, the tables, and the programs it compiles,
traced from shapes."""
import bench_device
import gpu_compile  # tools/ is on the tests' path (pyproject's pythonpath)
import jax
import pytest

from longstraw_jax.adapters import trainable

THUNKS = """\
001: kCustomKernel [source       | next=005 (4)] loop_multiply_fusion grid: [1, 1, 1] threads: [2, 1, 1]  shared_memory: 0 bytes
005: kCustomKernel [prev=001 (4) | next=006 (1)] sparse_latent_attention_forward grid: [4096, 1, 1] threads: [256, 1, 1]  shared_memory: 143552 bytes
009: kCustomKernel [prev=008 (1) | next=010 (1)] flash_attention_dq grid: [128, 24, 1] threads: [256, 1, 1]  shared_memory: 196608 bytes
"""  # noqa: E501 - XLA's lines, as dumped


def test_kernel_launches_are_read_from_the_thunk_sequence(tmp_path):
    (tmp_path / "module_0001.jit_loss.thunk_sequence.txt").write_text(THUNKS)
    launches = gpu_compile.kernel_resources(str(tmp_path), {"sparse_latent_attention_forward", "flash_attention_dq"})
    assert [(k["kernel"], k["grid"], k["threads"], k["shared"]) for k in launches] == [
        ("sparse_latent_attention_forward", [4096, 1, 1], 256, 143552),
        ("flash_attention_dq", [128, 24, 1], 256, 196608)]
    # no PTX dumped: no registers, so no occupancy either
    assert all(k["registers"] is None and k["programs_per_sm"] is None for k in launches)
    table = gpu_compile.format_kernels([dict(case="c", ok=True, resources=launches),
                                        dict(case="d", ok=False, error="RESOURCE_EXHAUSTED: Shared memory size limit")])
    assert "| c | flash_attention_dq | 128x24x1 | 256 | 192 |" in table
    assert "| d | failed: RESOURCE_EXHAUSTED: Shared memory size limit |" in table


class _Compiled:
    def __init__(self, text):
        self.text = text

    def as_text(self):
        return self.text


def test_kernel_names_come_from_the_triton_custom_calls():
    text = "\n".join([
        '  %pallas_call.7 = (f32[8]) custom-call(%a), custom_call_target="__gpu$xla.gpu.triton", backend_config='
        '{ir = "\\00...", name = "flash_attention_forward", num_stages = 2 : i32, num_warps = 8 : i32}',
        '  %fusion = f32[8] fusion(%a), kind=kCustom, calls=%gemm, backend_config={"name":"not_a_kernel"}',
        '  %pallas_call.9 = f32[8] custom-call(%b), custom_call_target="__gpu$xla.gpu.triton", backend_config='
        '{name = "flash_attention_dq", num_stages = 2 : i32, num_warps = 8 : i32}'])
    assert gpu_compile.triton_kernels_in(_Compiled(text)) == ["flash_attention_forward", "flash_attention_dq"]


@pytest.mark.parametrize("train", ["full", "lora"])
def test_the_programs_trace_from_shapes(train):
    """`model_programs` (what `--measure programs` compiles): the captures and the updates of the tiny preset trace
    from shapes alone (eval_shape: no device), the update's params and its AdamW state the trainable part only with
    LoRA (the base frozen), and what they return has the update's structure."""
    cfg = bench_device.bench_config("configs/qwen3.6-tiny.json", 1, "xla")
    opts = dict(dtype="float32", chunk_size=32, lens=[64], step_len=64, group_size=2, response_len=8,
                modes=["detached", "exact"], train=train)
    programs = list(gpu_compile.model_programs(cfg, opts))
    assert [(name, p) for name, p, *_ in programs] == [("capture", 65), ("detached", 64), ("exact", 64)]
    for name, _, fn, args, statics, donated in programs:
        dynamic = [i for i in range(len(args)) if i not in statics]

        def call(*values):
            merged = list(args)
            for i, value in zip(dynamic, values, strict=True):
                merged[i] = value
            return fn(*merged)

        out = jax.eval_shape(call, *[args[i] for i in dynamic])
        if name == "capture":
            continue
        params, frozen = args[1], args[10]
        trained = sum(x.size for x in jax.tree.leaves(params))
        assert (frozen is None) == (train == "full") and donated == (1, 2)
        if train == "lora":  # the adapters (a, b of every matrix) trained, the base frozen
            paths = [trainable.path_str(path) for path, _ in jax.tree_util.tree_leaves_with_path(params)]
            assert trained > 0 and paths and all(trainable.adapter_leaf(p) for p in paths), paths[:4]
            assert sum(x.size for x in jax.tree.leaves(frozen)) > 0
        assert jax.tree.structure(out[0]) == jax.tree.structure(params) and "loss" in out[2]
