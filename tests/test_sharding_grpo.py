"""Sharded `grpo_grads(..., mesh=...)` == one device (float32, tiny Qwen3.6, 8 CPU devices; 4x8 runs in the
32-device subprocess of test_sharding_sequence.py).

P - 1 = 45 prompt positions divide evenly over neither 2x4 (8 segments of 6) nor 1x8 (16 segments of 3); the batch
has ragged masks, KL on and old log-probs given, so every term of the loss reaches the sharded backward.
"""
import jax
import numpy as np
import pytest

from longstraw_jax import GroupBatch, grpo_grads, models, sharding
from longstraw_jax.models.base import CausalLM
from tests.helpers import SHARDED_CFG, assert_sharded_grads_match, o1_params

P, R = 46, 7


@pytest.fixture(scope="module")
def setup():
    model = models.build(models.Qwen36Config.tiny())
    params = o1_params(model.init(jax.random.key(0)), jax.random.key(1))
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    mask = (np.arange(R)[None, :] < np.array([[7], [4], [6]])).astype(np.float32)
    batch = GroupBatch(prompt=rng.integers(0, vocab, P).astype(np.int32),
                       responses=rng.integers(0, vocab, (3, R)).astype(np.int32), mask=mask,
                       rewards=np.array([1.0, 0.0, 0.5], np.float32),
                       old_logprobs=np.where(mask == 1, rng.normal(-6, 0.3, mask.shape), np.nan).astype(np.float32),
                       ref_logprobs=rng.normal(-6, 0.3, mask.shape).astype(np.float32))
    return model, params, batch


@pytest.mark.parametrize("spec,mode", [pytest.param("2x4", "exact", marks=pytest.mark.slow), ("1x8", "detached")])
def test_sharded_grpo_grads_equal_one_device(setup, spec, mode):
    # chunk_size 16: rounds on 2x4 (one full round of 24 positions + 21; the exact backward walks both), one on 1x8
    got_grads, specs = assert_sharded_grads_match(*setup, spec, mode)
    mesh = sharding.make_mesh(spec)
    # the gradient comes back FSDP-sharded like the parameters: each device holds 1/8 of a split leaf
    embed = got_grads["embed"]
    assert specs["embed"] != jax.sharding.PartitionSpec()
    assert embed.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, specs["embed"]), embed.ndim)
    assert {s.data.size for s in embed.addressable_shards} == {embed.size // 8}


def test_unsupported_model_is_refused_by_name():
    class Other(CausalLM):  # a family without a `sequence_parallel` adapter
        config = models.Qwen36Config.tiny()

    batch = GroupBatch(prompt=np.zeros(8, np.int32), responses=np.zeros((1, 2), np.int32),
                       mask=np.ones((1, 2), np.float32), rewards=np.zeros(1, np.float32))
    with pytest.raises(NotImplementedError, match="Other has no sequence-parallel path"):
        grpo_grads(Other(), None, batch, SHARDED_CFG, "exact", mesh=sharding.make_mesh("1x8"))
