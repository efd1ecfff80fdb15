"""An fp64 oracle: the engine against `naive_grpo_grads`, against itself, and on a mesh, in float64.

On random O(1)-scale models float32 round-off alone puts exact vs naive near 1e-4 (two exact chunk layouts on one
device differ by about as much), so the float32 tests cannot tell a small bug from round-off. Here the parameters
are float64 and everything runs under `jax_enable_x64` (accumulators float64 too: ops/dtypes.py), where round-off is
~1e-14 and a 1e-10 bound leaves four orders of magnitude for the floor while catching any real discrepancy:

    1. exact grpo_grads == naive_grpo_grads (chunk_size 7: P - 1 = 29 = 4 chunks of 7 + a remainder of 1),
    2. two exact chunk layouts agree (7 vs 32: the whole prompt in one chunk),
    3. exact on a 2x4 mesh == one device: Qwen3.6 in rounds (chunk_size 8 -> a full round of 24 positions and a
       last one of 5), GLM-5.2 in one round (its rounds cost another ~15 s of compile; float32 covers them in
       engine/test_mesh.py),
    4. the G branches replayed together (`GRPOConfig.replay_batch`, one device and the mesh) == one at a time,
    5. left padding changes nothing (docs/architecture.md 4.6): the batch with PAD = 19 random tokens before its
       prompt and `left_pad` 19 gives the unpadded batch's exact and detached gradients (the pads fill two capture
       chunks of 7 and part of the third); exact vs naive (1.) is on the padded batch,

for the tiny Qwen3.6 and GLM-5.2 (index_topk 16 < P: DSA selection is sparse). The batch has ragged masks with
holes (an agent branch's observation tokens: read by the replay, mask 0), old log-probs (NaN at mask 0) and KL on,
so every term of the loss reaches the backward.

x64 is switched on only inside `compute` (the `jax.enable_x64` context manager, thread-local) around the whole
computation, whose results leave it as numpy arrays: other test modules in this pytest worker keep float32.
`compute(family, x64=False)` runs the same comparisons in float32 (for the contrast; not a test).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from longstraw_jax import GroupBatch, GRPOConfig, grpo_grads, models, naive_grpo_grads, sharding
from longstraw_jax.models.glm52 import Glm52Config
from longstraw_jax.sharding import rules
from tests.helpers import o1_params, prompt_only_tokens, rel_err

pytestmark = pytest.mark.slow  # float64 compiles of naive, exact and mesh grpo_grads for both families

P, R, PAD = 30, 6, 19
LAYOUTS = (7, 32)  # P - 1 = 29 prompt positions: 4 x 7 + 1, one chunk
MESH, ROUND = "2x4", {"qwen36": 8, "glm52": 64}  # chunk_size on the mesh: several rounds, one round
CFG = GRPOConfig(kl_coef=0.1)
TOGETHER = GRPOConfig(kl_coef=0.1, replay_batch=3)  # the G = 3 branches replayed at once
TOL = 1e-10
PAIRS = {"exact vs naive": ("exact7_padded", "naive_padded"), "layouts": ("exact32", "exact7"),
         "mesh vs one device": ("mesh", "exact7"), "padded vs unpadded exact": ("exact7_padded", "exact7"),
         "padded vs unpadded detached": ("detached7_padded", "detached7"),
         "branches together vs naive": ("together7_padded", "naive_padded"),
         "branches together on the mesh vs one device": ("mesh_together", "exact7")}


def build(family: str, dtype):
    """(model, O(1) random params in `dtype`)."""
    if family == "qwen36":
        model = models.build(models.Qwen36Config.tiny(gdn_chunk_size=16))
    else:  # small blocks: several query blocks and indexer key blocks in every call
        model = models.build(Glm52Config.tiny(query_block_size=8, index_key_block_size=8))
    params = o1_params(model.init(jax.random.key(0), dtype=dtype), jax.random.key(1))
    if family == "glm52":  # GLM norms multiply by a plain w: 1 + N(0, 0.3^2) (tests/helpers.py glm_o1_params)
        flat = traverse_util.flatten_dict(params, sep="/")
        params = traverse_util.unflatten_dict(
            {k: 1.0 + v if k.endswith("norm") and not k.endswith("bias") else v for k, v in flat.items()}, sep="/")
    return model, params


def make_batch(vocab: int) -> GroupBatch:
    rng = np.random.default_rng(0)
    # agent branches' masks: observation tokens (0) between policy turns, and padding at the end
    mask = np.array([[1, 1, 0, 0, 1, 1], [1, 1, 1, 0, 0, 0], [1, 0, 0, 1, 1, 0]], np.float32)
    return GroupBatch(prompt=rng.integers(0, vocab, P).astype(np.int32),
                      responses=rng.integers(0, vocab, (3, R)).astype(np.int32), mask=mask,
                      rewards=np.array([1.0, 0.0, 0.5], np.float32),
                      old_logprobs=np.where(mask == 1, rng.normal(-6, 0.3, mask.shape), np.nan).astype(np.float32),
                      ref_logprobs=rng.normal(-6, 0.3, mask.shape).astype(np.float32))


def left_padded(batch: GroupBatch, vocab: int) -> GroupBatch:
    """batch with PAD random tokens before its prompt and left_pad = PAD."""
    noise = np.random.default_rng(7).integers(0, vocab, PAD).astype(np.int32)
    return batch.replace(prompt=np.concatenate([noise, batch.prompt]), left_pad=np.int32(PAD))


def compute(family: str, x64: bool = True) -> tuple[GroupBatch, dict]:
    """(batch, {name: (loss, grads, metrics)} as numpy) for exact at each of LAYOUTS (one device), exact on the mesh,
    and exact, detached and naive at chunk_size 7 on the batch and / or its left-padded twin; float64 params under
    x64, else float32."""
    host = lambda out: jax.tree.map(np.asarray, out)
    with jax.enable_x64(x64):
        model, params = build(family, jnp.float64 if x64 else jnp.float32)
        assert {x.dtype for x in jax.tree.leaves(params)} == {np.dtype(np.float64 if x64 else np.float32)}
        batch = make_batch(model.config.vocab_size)
        padded = left_padded(batch, model.config.vocab_size)
        out = {"naive_padded": host(jax.jit(naive_grpo_grads, static_argnums=(0, 3))(model, params, padded, CFG))}
        for chunk in LAYOUTS:
            out[f"exact{chunk}"] = host(grpo_grads(model, params, batch, CFG, "exact", chunk_size=chunk))
        out["exact7_padded"] = host(grpo_grads(model, params, padded, CFG, "exact", chunk_size=7))
        out["detached7"] = host(grpo_grads(model, params, batch, CFG, "detached", chunk_size=7))
        out["detached7_padded"] = host(grpo_grads(model, params, padded, CFG, "detached", chunk_size=7))
        out["together7_padded"] = host(grpo_grads(model, params, padded, TOGETHER, "exact", chunk_size=7))
        mesh = sharding.make_mesh(MESH)
        placed = jax.device_put(params, rules.named(rules.param_specs(params, mesh), mesh))
        out["mesh"] = host(grpo_grads(model, placed, batch, CFG, "exact", chunk_size=ROUND[family], mesh=mesh))
        out["mesh_together"] = host(grpo_grads(model, placed, batch, TOGETHER, "exact", chunk_size=ROUND[family],
                                               mesh=mesh))
    return batch, out


def errors(out: dict) -> dict:
    """{comparison: (relative gradient error, absolute loss difference)} for each of PAIRS."""
    return {name: (rel_err(out[a][1], out[b][1]), abs(float(out[a][0]) - float(out[b][0])))
            for name, (a, b) in PAIRS.items()}


@pytest.fixture(scope="module", params=["qwen36", "glm52"])
def results(request):
    batch, out = compute(request.param)
    assert not jax.config.jax_enable_x64 and jnp.zeros(()).dtype == jnp.float32  # nothing leaked
    return request.param, batch, out


def test_float64_throughout(results):
    _, batch, out = results
    for name, (loss, grads, metrics) in out.items():
        assert loss.dtype == np.float64, name
        assert {g.dtype for g in jax.tree.leaves(grads)} == {np.dtype(np.float64)}, name
        assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads)), name
    metrics = out["naive_padded"][2]
    assert float(metrics["kl"]) > 0 and float(metrics["clip_frac"]) < 1  # KL on; the surrogate has gradient
    # the embedding rows of tokens only in prompt[:-1] are reached only through the prompt's backward
    prompt_only = prompt_only_tokens(batch)
    assert prompt_only.size and np.abs(out["exact7"][1]["embed"][prompt_only]).min() > 0


@pytest.mark.parametrize("comparison", list(PAIRS))
def test_agree_to_float64_round_off(results, comparison):
    family, _, out = results
    grad_err, loss_err = errors(out)[comparison]
    print(f"{family} {comparison}: grad rel err {grad_err:.2e}, loss diff {loss_err:.2e}")
    assert grad_err <= TOL
    assert loss_err <= 1e-12
    a, b = PAIRS[comparison]
    for key, want in out[b][2].items():
        np.testing.assert_allclose(out[a][2][key], want, rtol=1e-12, atol=1e-12, err_msg=key)
