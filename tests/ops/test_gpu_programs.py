"""The programs a GPU run compiles, lowered for CUDA on this CPU host: the day a GPU is lent, `--kernels auto` must
compile, not fail at its first step.

With the backend reported as "gpu" (`jax.default_backend`, which every backend choice of the library reads:
`ops.kernels.resolve`, the Pallas kernels' interpret mode, the decode step's attention products, the experts'
grouped matmul, the Gated DeltaNet's chunk), the trainer's programs (the update in exact and detached mode, the
sampler with its capture; on one device and on a data x seq mesh; tiny and full-size configs) are traced and lowered
with `lowering_platforms=("cuda",)`. Lowering runs Pallas's Triton lowering of every kernel inside the scans, vmaps,
custom VJPs and shard_maps where the models call it, so it catches what the kernels' own tests cannot: a kernel
called at a shape or from a context that only a whole program produces. Nothing is compiled or run. JAX's caches
are cleared before and after each test, so no trace made for one backend is reused for the other.
"""
import dataclasses
import os
import warnings

import jax
import jax.numpy as jnp
import pytest

from longstraw_jax import models, sharding, train
from longstraw_jax.adapters import lora, trainable
from longstraw_jax.grpo import GroupBatch, GRPOConfig
from longstraw_jax.sampling import groups, turns
from longstraw_jax.sampling.branches import SamplingConfig
from longstraw_jax.trainer import pretrain, warmup
from tests.helpers import reported_backend, triton_calls

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs")
S = jax.ShapeDtypeStruct

QWEN_FORWARD = {"flash_attention_forward", "gated_delta_chunk_local", "gated_delta_state_pass", "gated_delta_output"}
QWEN_BACKWARD = {"flash_attention_dq", "flash_attention_dkv", "gated_delta_chunk_local_backward",
                 "gated_delta_state_backward", "gated_delta_output_backward"}
GLM_FORWARD = {"sparse_latent_attention_forward"}
GLM_BACKWARD = {"sparse_latent_attention_backward"}
# decoding alone (a decoded token takes the Gated DeltaNet's recurrent step, no chunk kernel)
DECODING = {"qwen36": {"flash_attention_forward"}, "glm52": GLM_FORWARD}


@pytest.fixture
def on_gpu():
    """The backend reported as "gpu" for the test's traces (`tests.helpers.reported_backend`). Fails if Pallas's
    lowering warned (it does, with numpy's RuntimeWarning, where a kernel gets a zero-sized block: a shape Triton
    does not take)."""
    with reported_backend("gpu"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    pallas = [w for w in caught if issubclass(w.category, RuntimeWarning) and "pallas" in w.filename]
    assert not pallas, f"Pallas's lowering warned: {pallas[0].message} ({pallas[0].filename}:{pallas[0].lineno})"


def check(lowered, family: str, kernels: set[str]):
    """The lowered program calls exactly `kernels` (by name) as compiled Triton kernels (interpreted kernels leave
    none), each kernel's Triton module valid; GLM-5.x's experts run as the grouped matmul (`ragged_dot`; a CPU
    gathers each token's expert weights)."""
    calls = triton_calls(lowered)  # each kernel's module verified
    assert calls, "no Triton custom call: the kernels were interpreted or not called"
    assert {call.name for call in calls} == kernels
    if family == "glm52":
        assert "ragged_dot" in lowered.as_text()


def abstract(model, dtype=jnp.float32):
    """The model's parameters as shapes (never allocated)."""
    return jax.eval_shape(lambda: jax.tree.map(lambda a: a.astype(dtype), model.init(jax.random.key(0))))


def update(model, params, mode: str, prompt_len: int, group_size: int, response_len: int, chunk: int, mesh=None,
           groups_per_step: int | None = None, frozen=None):
    """The trainer's update program (`train.jitted_train_step`) lowered for CUDA from shapes alone; params: the
    trainable part when `frozen` holds the rest (`trainable.split`)."""
    lead = () if groups_per_step is None else (groups_per_step,)
    batch = GroupBatch(prompt=S(lead + (prompt_len,), jnp.int32),
                       responses=S(lead + (group_size, response_len), jnp.int32),
                       mask=S(lead + (group_size, response_len), jnp.float32),
                       rewards=S(lead + (group_size,), jnp.float32),
                       old_logprobs=S(lead + (group_size, response_len), jnp.float32))
    optimizer = train.make_optimizer(1e-4)
    opt_state = jax.eval_shape(optimizer.init, params)
    return train.jitted_train_step.trace(model, params, opt_state, batch, optimizer, GRPOConfig(), mode, chunk,
                                         mesh, None, frozen).lower(lowering_platforms=("cuda",))


def sampler(model, params, prompt_len: int, group_size: int, response_len: int, chunk: int, mesh=None,
            num_groups: int = 1):
    """The trainer's sampler (`sampling.groups.sample_groups`' program: capture, then the branches decoded together,
    the capture kept for the update) lowered for CUDA from shapes alone."""
    prompts = S((num_groups, prompt_len), jnp.int32)
    keys = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), num_groups))
    sampling = SamplingConfig(response_len=response_len, temperature=0.7)
    if mesh is None:
        return groups._one_device.trace(model, params, prompts, keys, group_size, sampling, chunk, True).lower(
            lowering_platforms=("cuda",))
    layout = groups.round_layout(model, prompt_len - 1, mesh.shape["seq"], chunk)
    return groups._on_mesh.trace(model, params, prompts, keys, group_size, sampling, mesh, layout, True).lower(
        lowering_platforms=("cuda",))


def tiny(family: str):
    config = (models.Qwen36Config.tiny(kernels="pallas") if family == "qwen36"
              else models.Glm52Config.tiny(kernels="pallas"))
    return models.build(config)


def expected(family: str, backward: bool) -> set[str]:
    forward, back = (QWEN_FORWARD, QWEN_BACKWARD) if family == "qwen36" else (GLM_FORWARD, GLM_BACKWARD)
    return forward | back if backward else forward


@pytest.mark.parametrize("family", ["qwen36", "glm52"])
def test_one_device_programs_lower_for_cuda_with_compiled_kernels(on_gpu, family):
    """One device, tiny models: the exact and detached updates call every kernel and its backward, the sampler the
    forward kernels only."""
    model = tiny(family)
    params = abstract(model)
    for mode in ("exact", "detached"):
        lowered = update(model, params, mode, prompt_len=64, group_size=4, response_len=8, chunk=32)
        check(lowered, family, expected(family, backward=True))
    lowered = sampler(model, params, prompt_len=64, group_size=4, response_len=8, chunk=32)
    check(lowered, family, expected(family, backward=False))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen36", "glm52"])
def test_mesh_programs_lower_for_cuda_with_compiled_kernels(on_gpu, family):
    """On a 2 x 4 (data x seq) mesh of this host's devices, two groups: the exact update (ring attention over the
    sharded prompt, FSDP parameters) and the mesh sampler lower with the kernels inside their shard_maps."""
    model = tiny(family)
    params = abstract(model)
    mesh = sharding.make_mesh("2x4")
    lowered = update(model, params, "exact", prompt_len=64, group_size=4, response_len=8, chunk=16, mesh=mesh,
                     groups_per_step=2)
    check(lowered, family, expected(family, backward=True))
    lowered = sampler(model, params, prompt_len=64, group_size=4, response_len=8, chunk=16, mesh=mesh, num_groups=2)
    check(lowered, family, expected(family, backward=False))


@pytest.mark.slow
@pytest.mark.parametrize("name, family", [("qwen3.6-27b.json", "qwen36"), ("glm-5.2.json", "glm52")])
@pytest.mark.parametrize("mesh_spec, prompt_len", [(None, 4096), ("1x8", 16384)])
def test_full_size_programs_lower_for_cuda(on_gpu, name, family, mesh_spec, prompt_len):
    """Qwen3.6-27B and GLM-5.2 at their own sizes (bfloat16 weights from shapes alone, never allocated; head dims,
    GQA ratios, MLA ranks and expert counts as configured), G 8, R 64, on one device (a 4K prompt) and sequence-
    parallel over 8 devices (a 16K prompt; GLM's experts exchanged by `ragged_all_to_all`): the exact update and the
    sampler lower, calling every kernel at the model's real shapes."""
    model = models.build(dataclasses.replace(models.config_from_hf(os.path.join(CONFIGS, name)), kernels="pallas"))
    params = abstract(model, jnp.bfloat16)
    mesh = None if mesh_spec is None else sharding.make_mesh(mesh_spec)
    chunk = 1024 if mesh is None else 2048
    lowered = update(model, params, "exact", prompt_len=prompt_len, group_size=8, response_len=64, chunk=chunk,
                     mesh=mesh, groups_per_step=None if mesh is None else 1)
    check(lowered, family, expected(family, backward=True))
    if mesh is not None and family == "glm52":
        assert "ragged_all_to_all" in lowered.as_text()
    lowered = sampler(model, params, prompt_len=prompt_len, group_size=8, response_len=64, chunk=chunk, mesh=mesh)
    check(lowered, family, expected(family, backward=False))


@pytest.mark.parametrize("family", ["qwen36", "glm52"])
@pytest.mark.parametrize("mesh_spec", [None, pytest.param("2x4", marks=pytest.mark.slow)])
def test_agent_turn_programs_lower_for_cuda_with_compiled_kernels(on_gpu, family, mesh_spec):
    """The agent sampler's three programs (`sampling/turns.py`: capture and the first token, a policy turn, appending
    an observation), two groups, on one device and on a 2 x 4 mesh: each lowers with the forward kernels compiled
    (decoding alone: the attention kernel only)."""
    model = tiny(family)
    params = abstract(model)
    num_groups, group_size, prompt_len = 2, 4, 64
    sampling = SamplingConfig(response_len=16, temperature=0.7, stop_token=1)
    if mesh_spec is None:
        place = turns.Place(chunk_size=32)
    else:
        mesh = sharding.make_mesh(mesh_spec)
        place = turns.Place(mesh=mesh, layout=groups.round_layout(model, prompt_len - 1, mesh.shape["seq"], 16))
    args = (S((num_groups, prompt_len), jnp.int32), S((num_groups,), jnp.int32),
            jax.eval_shape(lambda: jax.random.split(jax.random.key(0), num_groups)))
    cuda = ("cuda",)
    lowered = turns._start.trace(model, params, *args, group_size, sampling, place).lower(lowering_platforms=cuda)
    check(lowered, family, expected(family, backward=False))
    branches, captured, keys, _ = jax.eval_shape(turns._start, model, params, *args, group_size, sampling, place)
    common = (model, params, place, place.state(captured), args[1], branches)
    per_branch = lambda dtype, *shape: S((num_groups, group_size) + shape, dtype)
    lowered = turns._policy_turn.trace(*common, keys, per_branch(jnp.int32), per_branch(jnp.bool_), sampling, 4,
                                       prompt_len).lower(lowering_platforms=cuda)
    check(lowered, family, DECODING[family])
    lowered = turns._observe.trace(*common, per_branch(jnp.int32, 3), per_branch(jnp.int32), prompt_len).lower(
        lowering_platforms=cuda)
    check(lowered, family, DECODING[family])


@pytest.mark.parametrize("family", ["qwen36", "glm52"])
def test_lora_warm_up_and_pretraining_programs_lower_for_cuda(on_gpu, family):
    """The other programs a run compiles: the exact update of LoRA adapters on every matrix (`--train lora`; the
    base frozen), the supervised warm-up's step (rows together, and one row at a time for long prompts) and
    `longstraw_jax.pretrain`'s step: each calls every kernel and its backward, compiled."""
    model = tiny(family)
    params = abstract(model)
    paths = lora.resolve_targets(params, "all")
    adapted = jax.eval_shape(lambda p, key: lora.add_adapters(p, paths, 4, 8.0, key), params, jax.random.key(0))
    adapters, frozen = trainable.split(adapted, trainable.adapter_leaf)
    lowered = update(model, adapters, "exact", prompt_len=64, group_size=4, response_len=8, chunk=32, frozen=frozen)
    check(lowered, family, expected(family, backward=True))
    optimizer = train.make_optimizer(1e-4)
    opt_state = jax.eval_shape(optimizer.init, params)
    rows = (S((4, 32), jnp.int32), S((4, 4), jnp.int32), S((4, 4), jnp.float32))  # prompts, targets, mask
    for per_row in (False, True):
        step = jax.jit(lambda p, o, *r, per_row=per_row: warmup.sft_step(model, optimizer, p, o, *r, per_row=per_row))
        check(step.trace(params, opt_state, *rows).lower(lowering_platforms=("cuda",)), family,
              expected(family, backward=True))
    lowered = pretrain.train_step.trace(model, optimizer, params, opt_state, S((4, 64), jnp.int32)).lower(
        lowering_platforms=("cuda",))
    check(lowered, family, expected(family, backward=True))
