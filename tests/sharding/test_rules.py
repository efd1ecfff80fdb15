"""Mesh construction and partition rules: parameters FSDP-sharded (per-device bytes ~ total / devices), optimizer
state following them, prompt state split along `seq`."""
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from longstraw_jax import make_optimizer, models
from longstraw_jax.models.qwen36 import Qwen36Config
from longstraw_jax.sharding import make_mesh, rules


def test_make_mesh_axes_and_errors():
    mesh = make_mesh("2x4")
    assert mesh.axis_names == ("data", "seq") and dict(mesh.shape) == {"data": 2, "seq": 4}
    assert dict(make_mesh(" 1X8 ").shape) == {"data": 1, "seq": 8}
    with pytest.raises(ValueError, match=r"needs data\*seq = 4\*8 = 32 devices, but 8 are available"):
        make_mesh("4x8")
    for bad in ("8", "2x", "ax4", "2x4x1", "", None):
        with pytest.raises(ValueError, match="is not of the form 'AxB'"):
            make_mesh(bad)
    with pytest.raises(ValueError, match="data=0 and seq=8 must both be >= 1"):
        make_mesh("0x8")


def _per_device_bytes(tree) -> dict:
    used = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            used[shard.device] = used.get(shard.device, 0) + shard.data.nbytes
    return used


@pytest.mark.parametrize("spec", ["2x4", "1x8"])
def test_parameters_and_optimizer_state_are_sharded_over_the_whole_mesh(spec):
    mesh = make_mesh(spec)
    model = models.build(Qwen36Config.tiny())
    params = model.init(jax.random.key(0))
    specs = rules.param_specs(params, mesh)
    # stacked layer axes stay whole (the layer scan slices them locally); one own dimension is split 8 ways
    assert specs["blocks"]["linear"]["in_proj_qkv"] == P(None, None, ("data", "seq"))
    assert specs["blocks"]["full"]["o_proj"][:2] == (None, None)
    placed = jax.device_put(params, rules.named(specs, mesh))
    total = sum(x.nbytes for x in jax.tree.leaves(params))
    used = _per_device_bytes(placed)
    assert len(used) == 8
    # only the per-head vectors with 6 entries (A_log, dt_bias: 2 * 2 * 3 * 6 floats each kind) stay replicated
    assert max(used.values()) <= total / 8 + 1024, (max(used.values()), total / 8)
    np.testing.assert_array_equal(jax.device_get(placed["embed"]), params["embed"])

    optimizer = make_optimizer(1e-3)
    opt_state = optimizer.init(params)
    opt_specs = rules.like_params_specs(opt_state, params, specs)
    placed_opt = jax.device_put(opt_state, rules.named(opt_specs, mesh))
    opt_total = sum(x.nbytes for x in jax.tree.leaves(opt_state))
    assert max(_per_device_bytes(placed_opt).values()) <= opt_total / 8 + 4096
    moments = [leaf for leaf in jax.tree.leaves(placed_opt) if leaf.shape == params["embed"].shape]  # embed, lm_head
    assert len(moments) == 4 and all(m.sharding.spec == specs["embed"] for m in moments)


def test_prompt_state_specs_split_positions_along_seq():
    model = models.build(Qwen36Config.tiny())
    specs = rules.prompt_state_specs(jax.eval_shape(lambda: model.init_state(16)))
    assert specs.keys == specs.values == P(None, None, "seq")
    assert specs.conv == specs.recurrent == P()
