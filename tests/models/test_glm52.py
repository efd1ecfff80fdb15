"""GLM-5.x model: sparsity active across the capture boundary, the ops against dense references (values and
gradients), the real config and state size, config errors; and the engine on GLM: exact == naive (no gradient into
the indexer), detached == stop_gradient autograd (as tests/engine/test_local.py), block by block == autodiff. The checks
every family passes (capture/extend/advance == forward, capture memory, parameter count, token errors) are in
tests/models/test_families.py."""
import dataclasses
import json
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from longstraw_jax import GroupBatch, GRPOConfig, engine, grpo_grads, models, naive_grpo_grads
from longstraw_jax.engine.capture import capture_chunks
from longstraw_jax.models.base import CausalLM
from longstraw_jax.models.glm52 import Glm52, Glm52Config
from longstraw_jax.ops.mla import sparse_latent_attention
from longstraw_jax.ops.moe import route
from tests.helpers import (
    CASES,
    ROOT,
    TINY_T,
    assert_metrics_equal,
    detached_reference,
    glm_o1_params,
    make_batch,
    prompt_only_tokens,
    rel_err,
    tiny_model,
)

CONFIGS = os.path.join(ROOT, "configs")


@pytest.fixture(scope="module")
def tiny():
    """(model, params, tokens [TINY_T]): `tiny_model("glm52")`, index_topk = 16 < TINY_T (the indexer selects)."""
    return tiny_model("glm52")


def test_branch_selection_crosses_the_capture_boundary(tiny):
    """After a capture of 40 tokens, the branch tokens' selections mix prompt and branch positions and leave most
    visible positions out (sparsity is active across the boundary); extend == forward: tests/models/test_families.py."""
    model, params, tokens = tiny
    selection = np.asarray(model.index_selection(params, tokens))  # [F, T, k]
    assert selection.shape == (model.config.num_full_layers, TINY_T, 16)
    branch = selection[:, 40:]
    assert (branch >= 0).all()  # every branch query sees > 16 positions: all 16 slots used
    assert ((branch < 40).any(-1) & (branch >= 40).any(-1)).any()
    assert (branch < 40).mean() > 0.3
    early = selection[:, 5]  # query 5 sees 6 positions: all selected, the rest of the slots unused
    assert all(sorted(row[row >= 0]) == list(range(6)) for row in early)


# ----- the ops against dense references, values and gradients ---------------------------------------------------


def test_sparse_latent_attention_matches_masked_dense_attention_and_its_gradients():
    """ops/mla.py (gather per query block + custom VJP) == softmax over a dense [T, S + T] mask built from the
    selection, differentiated by autodiff: values, dq, d cache (at its layer) and d new rows."""
    key = jax.random.split(jax.random.key(7), 6)
    layers, cached, t, heads, dk, dv, k = 3, 21, 13, 4, 24, 16, 9
    q = jax.random.normal(key[0], (t, heads, dk))
    cache = jax.random.normal(key[1], (layers, cached + 5, dk))  # rows >= cached are never written nor read
    new = jax.random.normal(key[2], (t, dk))
    positions = cached + jnp.arange(t)
    scores = jax.random.uniform(key[3], (t, cached + t))
    visible = jnp.arange(cached + t)[None, :] <= positions[:, None]
    order = jnp.argsort(jnp.where(visible, -scores, jnp.inf), axis=-1)[:, :k]
    selected = jnp.where(jnp.take_along_axis(visible, order, -1), order, -1).astype(jnp.int32)
    selected = selected.at[0, 3:].set(-1)  # a row with unused slots
    layer, scale = 1, dk**-0.5
    weights = jax.random.normal(key[4], (t, heads, dv))

    def ours(q, cache, new):
        out = sparse_latent_attention(q, cache, layer, new, selected, cached, scale=scale, value_dim=dv, block_size=4)
        return jnp.sum(out * weights), out

    def dense(q, cache, new):
        rows = jnp.concatenate([cache[layer, :cached], new])  # [S + T, dk]
        chosen = jnp.zeros((t, cached + t), bool).at[jnp.arange(t)[:, None], jnp.maximum(selected, 0)].max(
            selected >= 0)
        s = jnp.where(chosen[:, None, :], jnp.einsum("thd,sd->ths", q, rows) * scale, -jnp.inf)
        out = jnp.einsum("ths,sd->thd", jax.nn.softmax(s, axis=-1), rows[:, :dv])
        return jnp.sum(out * weights), out

    # jitted whole: one compile each, not one per primitive (eager op-by-op dispatch)
    (_, got), got_grads = jax.jit(jax.value_and_grad(ours, argnums=(0, 1, 2), has_aux=True))(q, cache, new)
    (_, want), want_grads = jax.jit(jax.value_and_grad(dense, argnums=(0, 1, 2), has_aux=True))(q, cache, new)
    np.testing.assert_allclose(got, want, atol=1e-5)
    chex.assert_trees_all_close(got_grads, want_grads, rtol=1e-7, atol=1e-5)  # rtol: numpy's default
    assert np.abs(np.asarray(got_grads[1])[layer, :cached]).max() > 0.01


@pytest.mark.parametrize("grouped", ["_grouped_scan", "_grouped_ragged", "gathered"])
def test_grouped_experts_and_router_match_a_per_expert_loop(grouped, monkeypatch):
    """ops/moe.py: sorted grouped compute == every expert on every token, then the chosen ones (values, gradients
    with respect to x, the expert weights and the router weight, also under vmap); group-limited routing keeps
    top-k in the best groups; the correction bias changes the choice but not the weights' formula. Both grouped
    matmuls: the CPU one (a scan over experts) and the GPU one (`ragged_dot`); and decoding's `gathered_swiglu`
    (each row gathers its expert's weights)."""
    from longstraw_jax.ops import moe

    swiglu = moe.gathered_swiglu if grouped == "gathered" else moe.grouped_swiglu
    if grouped != "gathered":
        monkeypatch.setattr(moe, "_grouped", getattr(moe, grouped))
    key = jax.random.split(jax.random.key(3), 6)
    n, d, i, e, topk = 11, 8, 6, 8, 3
    x = jax.random.normal(key[0], (n, d))
    gate, up = jax.random.normal(key[1], (e, i, d)) / 3, jax.random.normal(key[2], (e, i, d)) / 3
    down, router = jax.random.normal(key[3], (e, d, i)) / 3, jax.random.normal(key[4], (e, d))
    bias = 0.3 * jax.random.normal(key[5], (e,))
    kw = dict(top_k=topk, n_group=2, topk_group=1, norm_topk_prob=True, scaling=2.5)

    def ours(x, gate, up, down, router):
        experts, w = route(x, router, bias, **kw)
        return swiglu(x, experts, w, gate, up, down)

    experts = np.asarray(route(x, router, bias, **kw)[0])

    def loop(x, gate, up, down, router):  # every expert on every token, then pick the chosen ones
        s = jax.nn.sigmoid(x @ router.T)
        w = jnp.take_along_axis(s, experts, -1)
        w = 2.5 * w / jnp.sum(w, -1, keepdims=True)
        hidden = jax.nn.silu(jnp.einsum("nd,eid->nei", x, gate)) * jnp.einsum("nd,eid->nei", x, up)
        every = jnp.einsum("nei,edi->ned", hidden, down)  # [N, E, D]
        return jnp.sum(w[..., None] * jnp.take_along_axis(every, experts[..., None], 1), axis=1)

    s = np.asarray(jax.nn.sigmoid(x @ router.T) + bias)
    for row, chosen in zip(s, experts):  # chosen experts lie in one group (topk_group=1) and are its top-3
        group = chosen[0] // 4
        assert (chosen // 4 == group).all()
        assert set(chosen) == set(np.argsort(-row[group * 4 : group * 4 + 4])[:topk] + group * 4)
    # each computation jitted whole (one compile, not one per primitive as eager op-by-op dispatch does)
    ours, loop = jax.jit(ours), jax.jit(loop)
    args = (x, gate, up, down, router)
    np.testing.assert_allclose(ours(*args), loop(*args), atol=1e-5)
    probe = jax.random.normal(key[0], (n, d))
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(ours(*a) * probe), argnums=range(5)))(*args)
    want = jax.jit(jax.grad(lambda *a: jnp.sum(loop(*a) * probe), argnums=range(5)))(*args)
    chex.assert_trees_all_close(grads, want, rtol=1e-7, atol=1e-5)  # rtol: numpy's default
    batched = jnp.stack([x, probe])  # vmap over tokens' batches with shared (unbatched) weights
    np.testing.assert_allclose(jax.jit(jax.vmap(ours, in_axes=(0, None, None, None, None)))(batched, *args[1:]),
                               jnp.stack([ours(x, *args[1:]), ours(probe, *args[1:])]), atol=1e-5)


def test_gathered_experts_equal_grouped_ones_with_per_expert_adapters():
    """`gathered_swiglu` (decoding) == `grouped_swiglu` when the expert stacks are LoRA nodes (per-expert adapters,
    `ops/lora.grouped`), also under vmap over branches with the weights shared, as a decode step runs it."""
    from longstraw_jax.ops import moe
    from longstraw_jax.ops.lora import LoRA

    key = jax.random.split(jax.random.key(5), 8)
    t, d, i, e, rank = 3, 8, 6, 5, 2
    node = lambda k, out, inn: LoRA(jax.random.normal(k[0], (e, out, inn)) / 3, jax.random.normal(k[1], (e, rank, inn)),
                                    jax.random.normal(k[2], (e, out, rank)), 0.5)
    gate, up = node(jax.random.split(key[0], 3), i, d), node(jax.random.split(key[1], 3), i, d)
    down = node(jax.random.split(key[2], 3), d, i)
    x = jax.random.normal(key[3], (4, t, d))  # 4 branches of t tokens
    experts = jax.random.randint(key[4], (4, t, 2), 0, e)
    weights = jax.random.uniform(key[5], (4, t, 2))
    run = lambda f: jax.jit(jax.vmap(lambda x, ex, w: f(x, ex, w, gate, up, down)))(x, experts, weights)
    want = run(moe.grouped_swiglu)
    assert float(jnp.std(want)) > 0.1
    np.testing.assert_allclose(run(moe.gathered_swiglu), want, rtol=1e-5, atol=1e-5)


# ----- real size ------------------------------------------------------------------------------------------------


def test_real_config_and_state_size():
    """The fields of configs/glm-5.2.json and the state per token (its parameter count:
    tests/models/test_families.py)."""
    cfg = Glm52Config.from_hf(os.path.join(CONFIGS, "glm-5.2.json"), strict=True)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size, cfg.rope_theta) == (78, 6144, 154880, 8e6)
    pattern = "".join("F" if t == "full" else "S" for t in cfg.indexer_types)
    assert pattern == "FFF" + "SSSF" * 18 + "SSS" and cfg.num_full_layers == 21
    assert cfg.mlp_layer_types == ("dense",) * 3 + ("sparse",) * 75
    assert [(len(s.pattern), s.repeats) for s in cfg.segments] == [(1, 3), (4, 18), (1, 3)]
    model = models.build(cfg)
    assert model.hf_skipped_prefixes == ("model.layers.78.",)
    per_token = jax.eval_shape(lambda: model.init_state(1, jnp.bfloat16)).nbytes()
    assert per_token == (78 * 576 + 21 * 128) * 2  # docs/architecture.md 6: ~95 KB per token in bf16
    # derived like transformers when indexer_types / mlp_layer_types are absent
    with open(os.path.join(CONFIGS, "glm-5.2.json")) as f:
        raw = json.load(f)
    derived = {k: v for k, v in raw.items() if k not in ("indexer_types", "mlp_layer_types")}
    assert Glm52Config.from_hf(derived) == cfg
    assert Glm52Config.from_hf({**derived, "index_topk_freq": 1}).num_full_layers == 78  # GLM-5 / 5.1


# ----- bad input (the errors every family gives: tests/models/test_families.py)


def test_config_errors():
    good = Glm52Config.tiny().to_hf()
    with pytest.raises(ValueError, match=r"indexer_types\[0\] must be 'full'"):
        Glm52Config.from_hf({**good, "indexer_types": ["shared"] + good["indexer_types"][1:]})
    with pytest.raises(ValueError, match="indexer_types has 3 entries but num_hidden_layers=4"):
        Glm52Config.from_hf({**good, "indexer_types": good["indexer_types"][:3]})
    with pytest.raises(ValueError, match="index_topk_pattern has characters"):
        Glm52Config.from_hf({k: v for k, v in good.items() if k != "indexer_types"} | {"index_topk_pattern": "FFX"})
    with pytest.raises(ValueError, match="n_routed_experts=8 is not a multiple of n_group=3"):
        Glm52Config.from_hf({**good, "n_group": 3})
    with pytest.raises(ValueError, match="rope_type='yarn'"):
        Glm52Config.from_hf({**good, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}})
    assert Glm52Config.from_hf({**good, "head_dim": 192}) == Glm52Config.tiny()  # overwritten, as transformers


# ----- the engine on GLM (the cases and oracles of tests/engine/test_local.py, in tests/helpers.py)

def assert_only_selection_has_no_gradient(grads):
    """The indexer and the router's correction bias only choose positions / experts: exactly zero gradient (the
    indexer runs under no_grad in transformers too); every other parameter gets one."""
    for path, g in traverse_util.flatten_dict(grads, sep="/").items():
        if "/indexer/" in path or path.endswith("router_bias"):
            assert not np.any(np.asarray(g)), path
        else:
            assert np.abs(np.asarray(g)).max() > 0, path


grads_fn = jax.jit(grpo_grads, static_argnums=(0, 3, 4, 5))
naive_fn = jax.jit(naive_grpo_grads, static_argnums=(0, 3))


@pytest.fixture(scope="module")
def engine_case(tiny):
    """Case A of test_engine (G = 3, ragged masks, chunk 7 over P - 1 = 24, KL on, old logprobs): prompt + response
    is 33 tokens > index_topk, so the selections during capture and replay are sparse."""
    model, params, _ = tiny
    case = CASES["A"]
    batch = make_batch(model, params, case["lengths"], case["rewards"], case["old"], case["ref"], seed=0)
    exact = grads_fn(model, params, batch, case["cfg"], "exact", case["chunk"])
    return batch, exact, naive_fn(model, params, batch, case["cfg"])


def test_exact_equals_naive(tiny, engine_case):
    _, params, _ = tiny
    batch, (loss, grads, metrics), (naive_loss, naive_grads, naive_metrics) = engine_case
    chex.assert_trees_all_equal_shapes_and_dtypes(grads, params)  # and the same tree structure
    prompt_only = prompt_only_tokens(batch)
    assert prompt_only.size and np.abs(np.asarray(grads["embed"])[prompt_only]).min() > 0
    for g in (naive_grads, grads):  # autograd of the full graph, and the engine
        assert_only_selection_has_no_gradient(g)
    err = rel_err(grads, naive_grads)
    print(f"GLM exact vs naive: loss {float(loss):.6f} vs {float(naive_loss):.6f}, grad rel err {err:.2e}")
    assert err <= 1e-4
    assert abs(float(loss) - float(naive_loss)) <= 1e-5
    assert_metrics_equal(metrics, naive_metrics)


@pytest.mark.slow  # three GLM gradient programs (detached, autograd, exact)
def test_detached_equals_stop_gradient_autograd_and_differs_from_exact(tiny, engine_case):
    model, params, _ = tiny
    case = CASES["A"]
    batch, (exact_loss, exact_grads, exact_metrics), _ = engine_case
    loss, grads, metrics = grads_fn(model, params, batch, case["cfg"], "detached", case["chunk"])
    ref_loss, ref_grads, ref_metrics = jax.jit(detached_reference, static_argnums=(0, 3, 4))(
        model, params, batch, case["cfg"], case["chunk"])
    err, gap = rel_err(grads, ref_grads), rel_err(grads, exact_grads)
    print(f"GLM detached vs stop_gradient autograd: rel err {err:.2e}; detached vs exact: rel diff {gap:.2e}")
    assert err <= 1e-4 and abs(float(loss) - float(ref_loss)) <= 1e-5
    assert_metrics_equal(metrics, ref_metrics)
    assert gap > 1e-2 and abs(float(loss) - float(exact_loss)) <= 1e-5
    assert_metrics_equal(metrics, exact_metrics)
    assert not np.any(np.asarray(grads["embed"])[prompt_only_tokens(batch)])



# ----- block by block (layerwise: one stage per segment) vs the autodiff fallback ----------------------------------


@dataclasses.dataclass(frozen=True)
class AutodiffGlm(Glm52):
    """GLM through `CausalLM`'s autodiff hooks with a full state cotangent (the engine's path before GLM went block
    by block): the reference for the block-by-block backward."""

    branch_grads = CausalLM.branch_grads
    chunk_grads = CausalLM.chunk_grads
    differentiable_state = CausalLM.differentiable_state


def segmented_config(**overrides) -> Glm52Config:
    """6 layers from a transformers config with first_k_dense_replace 1 and index_topk_pattern FSFSFS: segments
    [full_dense] x 1, [shared_sparse, full_sparse] x 2, [shared_sparse] x 1. Shared layers reuse a selection made in
    an earlier segment (layers 1 and 5) and in an earlier block (layer 3); the last segment has no indexer keys."""
    raw = {k: v for k, v in Glm52Config.tiny().to_hf().items() if k not in ("indexer_types", "mlp_layer_types")}
    raw |= {"num_hidden_layers": 6, "first_k_dense_replace": 1, "index_topk_pattern": "FSFSFS", "index_topk": 8}
    return Glm52Config.from_hf(raw, **{"query_block_size": 8, "index_key_block_size": 8} | overrides)


@pytest.mark.slow  # two GLM exact steps over three segments
def test_block_by_block_equals_the_autodiff_fallback():
    """branch_grads and chunk_grads (exact mode's two hooks), block by block vs autodiff of the whole layer stack, on
    dense first layers and several segments (index_topk 8 < every key count here: selection is sparse)."""
    cfg = segmented_config()
    assert [(seg.pattern, seg.repeats) for seg in cfg.segments] == [
        (("full_dense",), 1), (("shared_sparse", "full_sparse"), 2), (("shared_sparse",), 1)]
    model = models.build(cfg)
    params = glm_o1_params(model, jax.random.key(1))
    tokens = jax.random.randint(jax.random.key(2), (26,), 0, cfg.vocab_size, dtype=jnp.int32)
    state = capture_chunks(model, params, tokens[:21], 8, jnp.float32)
    head = lambda p, h: (jnp.sum(model.logits(p, h)[:, :7] ** 2) / 100.0, None)

    def run(m, params, state):
        zeros = lambda tree: jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), tree)
        loss, _, grads, acc = m.branch_grads(params, state, tokens[21:], head, zeros(params),
                                             zeros(m.differentiable_state(state)))
        chunk_grads, chunk_acc = m.chunk_grads(params, state, tokens[8:16], 8, zeros(params), acc)
        return loss, grads, acc, chunk_grads, chunk_acc

    got = jax.jit(run, static_argnums=0)(model, params, state)
    want = jax.jit(run, static_argnums=0)(AutodiffGlm(cfg), params, state)
    assert got[2].index_keys is None and got[4].index_keys is None  # no indexer-key cotangent at all
    assert not np.any(np.asarray(want[2].index_keys))  # the fallback's: zero by construction
    assert float(got[0]) == pytest.approx(float(want[0]), rel=1e-6)
    for name, g, w in [("grads", got[1], want[1]), ("state cot", got[2].kv, want[2].kv),
                       ("chunk grads", got[3], want[3]), ("chunk state cot", got[4].kv, want[4].kv)]:
        assert np.abs(np.asarray(jax.tree.leaves(w)[0])).max() > 0, name
        assert rel_err(g, w) <= 1e-5, (name, rel_err(g, w))
    assert_only_selection_has_no_gradient(got[1])


def _float32_shapes(jaxpr) -> set:
    """Shapes of the float32 values a jaxpr and its sub-jaxprs (scan / while / cond / custom_vjp bodies) compute."""
    shapes = set()
    for eqn in jaxpr.eqns:
        shapes |= {v.aval.shape for v in eqn.outvars if getattr(v.aval, "dtype", None) == jnp.float32}
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else (param,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    shapes |= {v.aval.shape for v in sub.invars if getattr(v.aval, "dtype", None) == jnp.float32}
                    shapes |= _float32_shapes(sub)
    return shapes


@pytest.mark.slow  # traces a whole GLM exact step
def test_state_cotangent_has_no_indexer_key_buffer():
    """Exact grpo_grads, traced (not compiled) for a bfloat16 model: the state cotangent accumulator has no
    index_keys leaf, and no float32 array of the indexer keys' shape [F, P - 1, Di] exists anywhere in the program.
    The autodiff fallback (a full float32 accumulator) has one, so the check would see it."""
    cfg = segmented_config()
    params = jax.eval_shape(lambda: models.build(cfg).init(jax.random.key(0), jnp.bfloat16))
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    batch = GroupBatch(prompt=jax.ShapeDtypeStruct((38,), jnp.int32), responses=jax.ShapeDtypeStruct((2, 5), jnp.int32),
                       mask=f32(2, 5), rewards=f32(2))
    state = jax.eval_shape(lambda: models.build(cfg).init_state(37, jnp.bfloat16))
    assert models.build(cfg).differentiable_state(state).index_keys is None
    index_keys = (cfg.num_full_layers, 37, cfg.index_head_dim)
    trace = lambda model: jax.make_jaxpr(engine.local.jitted_grpo_grads, static_argnums=(0, 3, 4, 5))(
        model, params, batch, GRPOConfig(), "exact", 16).jaxpr
    assert index_keys not in _float32_shapes(trace(models.build(cfg)))
    assert index_keys in _float32_shapes(trace(AutodiffGlm(cfg)))
