"""Sampling on a ("data", "seq") mesh (sampling/mesh.py) == the one-device sampler (sampling/branches.py), on 8
simulated
CPU devices, tiny models at O(1) scale.

- same key -> the same tokens, masks and log-probs (rtol 1e-5): Qwen3.6 on 2x4 with a stop token and top-p, GLM-5.x
  on 1x8 greedy (index_topk 16 < the prompt: the sharded top-k over prompt + tail + token must select what one
  device selects) with its prompt left-padded (PAD random tokens, `left_pad` PAD: the pads fill the first round
  and shards; the one-device oracle samples the unpadded prompt); the mesh decodes all G branches together, the
  one-device oracle one at a time (decode_batch=1); prompts captured in rounds, P - 1 divisible by no layout;
- keep_capture: the (sstate, capture_aux) handed back equals the family's sharded capture of prompt[:-1]
  (`engine.capture.jitted_capture_on_mesh`, what engine/mesh.py computes);
- no weights move per decoded token: the compiled decode step (all branches, 1x8) all-gathers no matrix that the
  layers apply through `linear` (each device multiplies by its own FSDP shard, `sharding/tensor.py`); GLM's
  kv_b_proj, still gathered, shows the check sees a gathered weight;
- kernels="pallas" (interpreted): the same tokens as the XLA attention, the branches folded into one kernel call;
- memory: per-device bytes (arguments + temporaries, AOT `memory_analysis()`) on 1x8 are well under a third of the
  one-device sampler's at a prompt whose cache dominates: nothing of size P is replicated.
"""
import dataclasses
from importlib import import_module

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longstraw_jax import models, sharding
from longstraw_jax.engine.capture import jitted_capture_on_mesh, round_layout
from longstraw_jax.sampling import branches as rollout, mesh as sample
from longstraw_jax.sampling.branches import SamplingConfig
from longstraw_jax.sharding import rules
from tests.helpers import hlo_result_shapes, o1_params

pytestmark = pytest.mark.slow  # mesh and one-device samplers per family; AOT compiles at P = 65536

P, R, G, ROUND = 30, 5, 3, 8  # prompt[:-1] = 29 positions: a full round (whole segments) and a padded last round
PAD = 11  # GLM's left pads: its padded prompt[:-1] has 40 positions


def _setup(family: str):
    if family == "qwen36":
        model = models.build(models.Qwen36Config.tiny(vocab_size=64, gdn_chunk_size=16))
    else:
        model = models.build(models.Glm52Config.tiny(vocab_size=64, query_block_size=8, index_key_block_size=8))
    params = o1_params(model.init(jax.random.key(0)), jax.random.key(1))
    prompt = np.random.default_rng(0).integers(0, 64, P).astype(np.int32)
    return model, params, prompt


def _placed(params, mesh):
    return jax.device_put(params, rules.named(rules.param_specs(params, mesh), mesh))


def _assert_same_rollout(got, want):
    np.testing.assert_array_equal(got.responses, want.responses)
    np.testing.assert_array_equal(got.mask, want.mask)
    for name in ("logprobs", "sample_logprobs"):
        np.testing.assert_allclose(getattr(got, name), getattr(want, name), rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("family, spec, left_pad", [("qwen36", "2x4", None), ("glm52", "1x8", PAD)])
def test_mesh_sampler_equals_one_device_and_keeps_the_sharded_capture(family, spec, left_pad):
    model, params, prompt = _setup(family)
    key = jax.random.key(4)
    sampling = SamplingConfig(response_len=R, temperature=0.8, top_p=0.9, decode_batch=1)
    if family == "qwen36":  # a stop token that ends branch 1 early (mask and padding must follow)
        free = rollout.sample_group(model, params, prompt, G, sampling, key, chunk_size=8)
        sampling = dataclasses.replace(sampling, stop_token=int(free.responses[1, 1]), pad_token=63)
    else:
        sampling = SamplingConfig(response_len=R, temperature=0.0, decode_batch=1)
    want = rollout.sample_group(model, params, prompt, G, sampling, key, chunk_size=8)
    if family == "qwen36":
        assert want.mask[1].sum() <= 2 and want.mask.sum() < G * R
    mesh = sharding.make_mesh(spec)
    placed = _placed(params, mesh)
    together = dataclasses.replace(sampling, decode_batch=None)
    if left_pad:  # the mesh samples the padded prompt; the one-device oracle above, the unpadded one
        prompt = np.concatenate([np.random.default_rng(7).integers(0, 64, left_pad).astype(np.int32), prompt])
    got, captured = sample.sample_group(model, placed, prompt, G, together, key, mesh, chunk_size=ROUND,
                                        keep_capture=True, left_pad=left_pad)
    _assert_same_rollout(got, want)

    positions = prompt.shape[0] - 1
    layout = round_layout(model, positions, mesh.shape["seq"], ROUND)
    assert captured.sstate.layout == layout and layout.full >= 1 and captured.sstate.length == positions
    stored = layout.to_stored(jnp.asarray(prompt[:-1]))
    sstate, aux = jitted_capture_on_mesh(model, placed, stored, mesh, layout, "ring", left_pad)
    for got_leaf, want_leaf in zip(jax.tree.leaves((captured.sstate, captured.capture_aux)),
                                   jax.tree.leaves((sstate, aux)), strict=True):
        assert got_leaf.sharding.is_equivalent_to(want_leaf.sharding, got_leaf.ndim)
        np.testing.assert_allclose(got_leaf, want_leaf, rtol=1e-5, atol=1e-5)
    natural = captured.sstate.natural()  # and it is the one-device capture of prompt[:-1]
    fresh = model.capture(params, prompt[:-1], chunk_size=8, left_pad=left_pad)
    for name in ("keys", "values", "kv", "index_keys"):
        if hasattr(fresh, name):
            np.testing.assert_allclose(getattr(natural, name), getattr(fresh, name), rtol=1e-4, atol=1e-4,
                                       err_msg=name)


def test_mesh_sampler_with_pallas_attention_draws_the_xla_tokens():
    """kernels="pallas" (the flash kernels, interpreted here): the mesh decoder's G branches over the sharded prompt
    cache fold into one forward call per step (`ops/flash_attention._forward_folding`, inside the mesh's shard_map)
    and draw the tokens, masks and log-probs of the XLA attention."""
    model, params, prompt = _setup("qwen36")
    mesh = sharding.make_mesh("2x4")
    placed = _placed(params, mesh)
    sampling = SamplingConfig(response_len=R, temperature=0.8, top_p=0.9)
    run = lambda model: sample.sample_group(model, placed, prompt, G, sampling, jax.random.key(4), mesh,
                                            chunk_size=ROUND)
    pallas = models.build(dataclasses.replace(model.config, kernels="pallas"))
    _assert_same_rollout(run(pallas), run(model))


def test_nothing_of_prompt_size_is_replicated():
    """AOT-compiled samplers at a prompt whose cache dominates (tiny Qwen3.6, P = 65536, chunks / rounds of 256):
    per-device arguments + temporaries on 1x8 < 0.35 x one device's (the cache is split 8 ways, only R positions
    are replicated; what remains is P-independent: one round's capture activations, parameters' shards)."""
    model, params, _ = _setup("qwen36")
    length, chunk, sampling = 65536, 256, SamplingConfig(response_len=8)
    prompt = jax.ShapeDtypeStruct((length,), jnp.int32)
    key = jax.eval_shape(lambda: jax.random.key(0))
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
    one = rollout._sample_group.lower(model, abstract, prompt, key, 2, sampling, chunk).compile().memory_analysis()
    mesh = sharding.make_mesh("1x8")
    placed = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract,
                          rules.named(rules.param_specs(abstract, mesh), mesh))
    layout = round_layout(model, length - 1, 8, chunk)
    many = sample._sample_group.lower(model, placed, prompt, key, 2, sampling, mesh, layout, "ring",
                                      False).compile().memory_analysis()
    per_device = lambda m: m.argument_size_in_bytes + m.temp_size_in_bytes
    cache = model.init_state(length + 7).nbytes()
    print(f"sampler bytes per device: one device {per_device(one)}, 1x8 {per_device(many)}; cache {cache}")
    assert per_device(one) > cache  # the prompt dominates the one-device sampler
    assert per_device(many) < 0.35 * per_device(one)


@pytest.mark.parametrize("family", ["qwen36", "glm52"])
def test_a_decode_step_gathers_no_linear_weight(family):
    """One decode step of G = 4 branches on 1x8 (AOT-compiled from shapes): no all-gather's result has the shape of
    a matrix in the family's LINEAR_LEAVES (a gathered layer would: `rules.gather_layer` returns whole [out, in]
    matrices), while GLM's kv_b_proj (applied per head, not through linear) is gathered and is seen."""
    model, _, _ = _setup(family)
    if family == "glm52":  # indexer sizes whose matrices share no shape with a gathered one (weights_proj [Hi, D],
        # kv_b_proj [H (nope + v), kv_lora], router [E, D])
        model = models.build(dataclasses.replace(model.config, index_n_heads=4))
    adapter = import_module(f"longstraw_jax.models.{family}.mesh_forward")
    mesh = sharding.make_mesh("1x8")
    abstract = jax.eval_shape(lambda: model.init(jax.random.key(0)))
    params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract,
                          rules.named(rules.param_specs(abstract, mesh), mesh))
    family_sp = model.mesh_adapter()
    layout = round_layout(model, P - 1, 8, ROUND)
    sstate = jax.eval_shape(lambda p, t: family_sp.capture(p, t, mesh, layout, "ring")[0], params,
                            jax.ShapeDtypeStruct((layout.padded,), jnp.int32))
    state_shardings = rules.named(rules.prompt_state_specs(sstate.state), mesh)
    sstate = sstate.replace(state=jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                               sstate.state, state_shardings))
    tails = jax.eval_shape(lambda p, s: jax.tree.map(lambda a: jnp.broadcast_to(a, (4,) + a.shape),
                                                     family_sp.init_tail(p, s, R)), params, sstate)
    step = jax.vmap(lambda params, sstate, tail, token: family_sp.decode(params, sstate, tail, token, P, mesh),
                    in_axes=(None, None, 0, 0))
    hlo = jax.jit(step).lower(params, sstate, tails, jax.ShapeDtypeStruct((4,), jnp.int32)).compile().as_text()
    gathered = hlo_result_shapes(hlo, ("all-gather", "all-gather-start"))
    matrices = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(abstract):
        name = getattr(path[-1], "key", None)
        if rules.stacked_dims(path) and leaf.ndim == 4:  # [stacked, stacked, out, in]: one layer's matrix
            matrices.setdefault(name, set()).add(tuple(leaf.shape[2:]))
    linear = {shape for name in adapter.LINEAR_LEAVES for shape in matrices.get(name, ())}
    assert linear and not linear & gathered, sorted(linear & gathered)
    if family == "glm52":
        assert matrices["kv_b_proj"] & gathered
