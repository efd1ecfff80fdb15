"""Left-padded prompts change nothing (docs/architecture.md 4.6): a prompt of N real tokens left-padded with PAD
random tokens and `left_pad = PAD` gives the unpadded prompt's logits, loss, metrics, gradients and sampled tokens.

Every check compares the padded run against the unpadded one on the tiny Qwen3.6 and GLM-5.2 at O(1) scale (GLM's
index_topk 16 < the real prompt: DSA selection is sparse, and 16 > the real keys of early queries, so top-k must
leave slots empty rather than take a pad). The pads are random ids (not a pad id) and span whole capture chunks, a
chunk that mixes pads and real tokens, GDN chunks (Qwen gdn_chunk_size 8) and, on a mesh, the first shards and round
boundaries. Each comparison first checks that the same padded prompt *without* left_pad differs: the masks are what
makes them equal. Here: capture, extend, forward and sampling, on one device and on a mesh, in float32 (tolerances
of float round-off: the pads move chunk, GDN-chunk and attention-block boundaries, exact only in exact arithmetic).
The gradients: on one device in float64 (tests/engine/test_float64.py, 1e-10, both families and modes), on a mesh and
for groups stacked with different pads in float32 (tests/engine/test_mesh.py).
"""
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longstraw_jax import GroupBatch, GRPOConfig, grpo_grads, models, sharding
from longstraw_jax.engine.capture import capture_on_mesh, extend_on_mesh
from longstraw_jax.grpo import validate_batch
from longstraw_jax.models.glm52 import Glm52Config
from longstraw_jax.sampling import branches, groups as sampling_groups, mesh as mesh_sampling
from longstraw_jax.sampling.branches import SamplingConfig
from longstraw_jax.sampling.padding import bucket_length, bucket_lengths, pad_batch, pad_left
from longstraw_jax.sharding import rules
from tests.helpers import glm_o1_params, o1_params, rel_err

N, R, PAD = 21, 5, 11  # real prompt tokens, response tokens, pads: the padded prompt has 32 tokens
N2 = 14  # a second group's real prompt tokens
CHUNK = 6  # capture chunks: padded prompt[:-1] = 31 positions -> chunks 0 (all pads), 1 (pads and real), ...
slow = pytest.mark.slow  # compiles of several engines or samplers each (> ~20 s)


def build(family: str):
    """(model, O(1) float32 params): Qwen3.6 with GDN chunks of 8, GLM-5.2 with query / indexer key blocks of 8."""
    if family == "qwen36":
        model = models.build(models.Qwen36Config.tiny(gdn_chunk_size=8))
        return model, o1_params(model.init(jax.random.key(0)), jax.random.key(1))
    model = models.build(Glm52Config.tiny(query_block_size=8, index_key_block_size=8))
    return model, glm_o1_params(model, jax.random.key(1))


def group(vocab: int, n: int, seed: int) -> GroupBatch:
    """One unpadded group: a prompt of n tokens, 3 branches of R tokens (ragged masks), KL on."""
    rng = np.random.default_rng(seed)
    mask = (np.arange(R)[None, :] < np.array([[5], [2], [4]])).astype(np.float32)
    return GroupBatch(prompt=rng.integers(0, vocab, n).astype(np.int32),
                      responses=rng.integers(0, vocab, (3, R)).astype(np.int32), mask=mask,
                      rewards=np.array([1.0, 0.0, 0.5], np.float32),
                      old_logprobs=np.where(mask == 1, rng.normal(-6, 0.3, mask.shape), np.nan).astype(np.float32),
                      ref_logprobs=rng.normal(-6, 0.3, mask.shape).astype(np.float32))


def padded(batch: GroupBatch, pad: int, seed: int = 7) -> GroupBatch:
    """batch with `pad` random tokens before its prompt and left_pad = pad."""
    noise = np.random.default_rng(seed).integers(0, 512, pad).astype(np.int32)
    return batch.replace(prompt=np.concatenate([noise, batch.prompt]), left_pad=np.int32(pad))


@pytest.fixture(scope="module", params=["qwen36", pytest.param("glm52", marks=pytest.mark.slow)])
def family(request):
    return request.param


@pytest.fixture(scope="module")
def setup(family):
    model, params = build(family)
    return family, model, params, group(model.config.vocab_size, N, seed=0)


# ----- the bucketing helpers ---------------------------------------------------------------------------------------


def test_bucket_lengths_are_geometric_and_bounded():
    assert bucket_lengths(1000, 64) == (64, 128, 256, 512, 1024)
    assert bucket_lengths(1024, 64) == (64, 128, 256, 512, 1024)
    assert bucket_lengths(1000, 64, max_buckets=2) == (512, 1024)
    assert bucket_lengths(10, 64) == (64,)
    assert [bucket_length(n, 64, 1000) for n in (2, 64, 65, 200, 1000)] == [64, 64, 128, 256, 1024]
    assert bucket_length(5, 64, 1000, max_buckets=2) == 512  # short prompts pad up to the smallest kept bucket
    # a run over lengths 2..max_length compiles at most this many programs per phase
    lengths = {bucket_length(n, 64, 5000, max_buckets=3) for n in range(2, 5001)}
    assert len(lengths) == 3 and max(lengths) >= 5000
    with pytest.raises(ValueError, match="longer than max_length=100"):
        bucket_length(101, 8, 100)
    with pytest.raises(ValueError, match="multiple must be a positive int"):
        bucket_lengths(100, 0)


def test_pad_left_and_pad_batch():
    tokens = np.array([5, 6, 7], np.int32)
    out, left_pad = pad_left(tokens, 6, pad_id=1)
    np.testing.assert_array_equal(out, [1, 1, 1, 5, 6, 7])
    assert left_pad == 3 and left_pad.dtype == np.int32 and out.dtype == np.int32
    prompts, pads = pad_batch([np.arange(2, 12), np.arange(2, 5)], multiple=8, max_length=100)
    assert prompts.shape == (2, 16) and pads.tolist() == [6, 13]
    np.testing.assert_array_equal(prompts[1, 13:], [2, 3, 4])
    with pytest.raises(ValueError, match="cannot left-pad 3 tokens to length 2"):
        pad_left(tokens, 2)
    with pytest.raises(ValueError, match="rank-1 integer"):
        pad_left(np.zeros((2, 2), np.int32), 6)


# ----- validation --------------------------------------------------------------------------------------------------


def test_bad_left_pad_is_refused_by_name():
    batch = group(512, N, seed=0)
    validate_batch(batch.replace(left_pad=np.int32(N - 2)), 512)  # the last allowed: 2 real prompt tokens
    with pytest.raises(ValueError, match=r"GroupBatch.left_pad = 20 is out of range: need 0 <= GroupBatch.left_pad "
                                         r"<= 19"):
        validate_batch(batch.replace(left_pad=np.int32(N - 1)), 512)
    with pytest.raises(ValueError, match="GroupBatch.left_pad = -1 is out of range"):
        validate_batch(batch.replace(left_pad=np.int32(-1)), 512)
    with pytest.raises(TypeError, match="GroupBatch.left_pad must be an integer"):
        validate_batch(batch.replace(left_pad=np.float32(2)), 512)
    stacked = jax.tree.map(lambda a: np.stack([a, a]), batch)
    with pytest.raises(ValueError, match=r"GroupBatch.left_pad must have shape \[2\] \(one per group\)"):
        validate_batch(stacked.replace(left_pad=np.int32(3)), 512)
    validate_batch(stacked.replace(left_pad=np.array([0, 3], np.int32)), 512)
    model, params = build("qwen36")
    with pytest.raises(ValueError, match="left_pad = 20 is out of range"):
        branches.sample_group(model, params, batch.prompt, 2, SamplingConfig(response_len=2), jax.random.key(0),
                              left_pad=N - 1)
    with pytest.raises(ValueError, match="left_pad = 21 is out of range"):
        model.capture(params, batch.prompt, 8, left_pad=N)


def test_every_reader_of_a_prompt_takes_left_pad():
    """The contract (models/base.py): each family's methods that read a prompt, its mesh adapter's and its layerwise
    stages' blocks accept `left_pad` (a method without it would silently read pads)."""
    for config in (models.Qwen36Config.tiny(), Glm52Config.tiny()):
        model = models.build(config)
        adapter = model.mesh_adapter()
        stages = model.block_stages() if hasattr(model, "block_stages") else (model,)
        methods = [getattr(model, name) for name in ("capture", "extend", "extend_hidden", "forward", "capture_chunk",
                                                     "chunk_entries", "advance", "decode", "branch_grads",
                                                     "chunk_grads")]
        methods += [getattr(adapter, name) for name in ("capture", "extend_hidden", "prompt_backward", "decode")]
        methods += [stage.block for stage in stages]
        for method in methods:
            assert "left_pad" in inspect.signature(method).parameters, f"{type(model).__name__}: {method.__name__}"


# ----- one device --------------------------------------------------------------------------------------------------


def test_padded_capture_and_extend_equal_unpadded(setup):
    family, model, params, batch = setup
    pad = padded(batch, PAD)
    want = model.extend(params, model.capture(params, batch.prompt, CHUNK), batch.responses[0])
    got = model.extend(params, model.capture(params, pad.prompt, CHUNK, left_pad=PAD), batch.responses[0],
                       left_pad=PAD)
    unmasked = model.extend(params, model.capture(params, pad.prompt, CHUNK), batch.responses[0])
    scale = float(jnp.max(jnp.abs(want)))
    assert float(jnp.max(jnp.abs(unmasked - want))) > 1e-2 * scale  # the pads do matter without left_pad
    assert float(jnp.max(jnp.abs(got - want))) <= 1e-5 * scale, family
    # the reference path too: forward over pads + prompt, the pads' rows dropped
    tokens = np.concatenate([pad.prompt, batch.responses[0]])
    np.testing.assert_allclose(model.forward(params, tokens, left_pad=PAD)[PAD:],
                               model.forward(params, tokens[PAD:]), atol=1e-5 * scale)


# ----- samplers ----------------------------------------------------------------------------------------------------


def sampling_for(family: str) -> SamplingConfig:
    if family == "qwen36":  # temperature 1 with top-p: a real draw per token
        return SamplingConfig(response_len=R, temperature=1.0, top_p=0.9)
    return SamplingConfig(response_len=R, temperature=0.0)


def assert_same_rollout(got, want, what: str):
    """Same tokens and masks; log-probs within float32 round-off of a differently chunked computation (padding
    shifts the capture's chunk boundaries). The first position's distribution over the vocabulary (values ~ -4 .. -9)
    also gets rtol 1e-5: one host measured it up to 1.1e-5 apart (1.8e-6 relative, ~24 ulp), others under 1e-5;
    float64 holds padded == unpadded to 1e-10 (engine/test_float64.py)."""
    np.testing.assert_array_equal(got.responses, want.responses, err_msg=what)
    np.testing.assert_array_equal(got.mask, want.mask, err_msg=what)
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5, err_msg=what)
    np.testing.assert_allclose(got.first_logprobs, want.first_logprobs, rtol=1e-5, atol=1e-5, err_msg=what)


@slow  # the fast tier checks padding in capture + extend (the sampler's capture and decode read the same masks)
def test_padded_sampling_equals_unpadded(setup):
    family, model, params, batch = setup
    key, sampling = jax.random.key(3), sampling_for(family)
    want = branches.sample_group(model, params, batch.prompt, 4, sampling, key, chunk_size=CHUNK)
    got = branches.sample_group(model, params, padded(batch, PAD).prompt, 4, sampling, key, chunk_size=CHUNK,
                                left_pad=PAD)
    assert_same_rollout(got, want, family)


@slow
def test_sample_groups_with_different_pads_equal_each_alone():
    model, params = build("qwen36")
    first, second = group(512, N, seed=0), group(512, N2, seed=1)
    prompts, left_pad = pad_batch([first.prompt, second.prompt], multiple=CHUNK, max_length=64)
    keys, sampling = jax.random.split(jax.random.key(5), 2), sampling_for("qwen36")
    rollouts, captured = sampling_groups.sample_groups(model, params, prompts, keys, 3, sampling, CHUNK,
                                                       left_pad=left_pad)
    for b, g in enumerate((first, second)):
        alone = branches.sample_group(model, params, g.prompt, 3, sampling, keys[b], chunk_size=CHUNK)
        assert_same_rollout(jax.tree.map(lambda x: x[b], rollouts), alone, f"group {b}")
    # the kept captures serve the update of the same padded batch
    batch = GroupBatch(prompt=prompts, responses=rollouts.responses, mask=rollouts.mask,
                       rewards=jnp.array([[1.0, 0.0, 0.5], [0.0, 1.0, 1.0]]), left_pad=left_pad)
    reused = grpo_grads(model, params, batch, GRPOConfig(), "exact", chunk_size=CHUNK, captured=captured)
    fresh = grpo_grads(model, params, batch, GRPOConfig(), "exact", chunk_size=CHUNK)
    # the same capture, compiled in two programs (the sampler's, the update's): XLA fuses each program its own way,
    # so float32 round-off (measured 0 to 6e-6 as the sampler's program changed); a wrong pad or state is O(1)
    assert abs(float(reused[0]) - float(fresh[0])) <= 1e-6 and rel_err(reused[1], fresh[1]) <= 2e-5


# ----- on a mesh (8 simulated CPU devices) -------------------------------------------------------------------------


def placed(params, mesh):
    return jax.device_put(params, rules.named(rules.param_specs(params, mesh), mesh))


@slow
def test_padded_capture_and_extend_on_mesh_equal_unpadded_one_device():
    """Qwen3.6 on 1x8 in rounds of 8: the 11 pads fill round 0 and part of round 1 (shards 0-2 and 7 of the zigzag
    layout); capture + extend == one device unpadded."""
    model, params = build("qwen36")
    batch = group(model.config.vocab_size, N, seed=0)
    want = model.extend(params, model.capture(params, batch.prompt, CHUNK), batch.responses[0])
    mesh = sharding.make_mesh("1x8")
    params = placed(params, mesh)
    sstate = capture_on_mesh(model, params, padded(batch, PAD).prompt, mesh, chunk_size=8, left_pad=PAD)
    got = extend_on_mesh(model, params, sstate, batch.responses[0], mesh, left_pad=PAD)
    assert float(jnp.max(jnp.abs(got - want))) <= 1e-5 * float(jnp.max(jnp.abs(want)))


@pytest.mark.slow
def test_padded_sampling_on_mesh_equals_unpadded_one_device():
    """Qwen3.6 on 2x4 (GLM-5.2 on 1x8: tests/sampling/test_mesh.py)."""
    family, spec = "qwen36", "2x4"
    model, params = build(family)
    batch = group(model.config.vocab_size, N, seed=0)
    key, sampling = jax.random.key(3), sampling_for(family)
    want = branches.sample_group(model, params, batch.prompt, 4, sampling, key, chunk_size=CHUNK)
    mesh = sharding.make_mesh(spec)
    got = mesh_sampling.sample_group(model, placed(params, mesh), padded(batch, PAD).prompt, 4, sampling, key, mesh,
                                     chunk_size=8, left_pad=PAD)
    assert_same_rollout(got, want, f"{family} {spec}")
