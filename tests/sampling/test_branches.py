"""Sampling from the captured prompt state (sampling/branches.py) on a small Qwen3.6 (one LLLF block, O(1) weights).

- every sampled token is the one a full recompute would sample: `forward(prompt + response)` gives the logits at
  each response position, and categorical sampling with the same per-step key must pick the same token. Branches
  share one state (each overwrites the previous branch's tail), so this also shows no branch sees another's tokens;
- the recorded log-probs equal the full-graph oracle's (naive.response_logprobs, what grpo_grads scores) at
  temperature 1, and the sampling log-probs reflect temperature / top-p;
- stop token: kept with mask 1, then padding with mask 0, and the tokens before it are unchanged; several stop ids
  (stop_tokens): a branch ends at the first it samples;
- top-p keeps exactly the nucleus; bad inputs raise on the host;
- branches decode together (`decode_batch`, default all G): one branch at a time gives the same tokens, masks and
  log-probs (stop token, top-p; both families);
- AOT memory: temporaries do not grow with G (the prompt state is never copied per branch), and one batched decode
  step of N branches reads the prompt cache once (XLA's bytes accessed grow by far less than N - 1 caches);
- keep_capture: the sampler hands back its capture of prompt[:-1] (the state, chunk boundaries) equal to the
  engine's capture, and the same rollout; a state's positions at or beyond its length are never read by `extend`
  or `branch_grads` (both families).
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longstraw_jax import models
from longstraw_jax.engine.capture import capture_chunks
from longstraw_jax.engine.naive import response_logprobs
from longstraw_jax.models.qwen36.config import FULL, LINEAR
from longstraw_jax.sampling import branches as rollout
from longstraw_jax.sampling.branches import SamplingConfig, first_argmax, next_token, sample_group, sampling_logits
from tests.helpers import hlo_result_shapes, o1_params, rel_err

P, G, R, CHUNK = 21, 3, 6, 8


@pytest.fixture(scope="module")
def setup():
    config = models.Qwen36Config.tiny(num_hidden_layers=4, layer_types=(LINEAR, LINEAR, LINEAR, FULL),
                                      vocab_size=64, gdn_chunk_size=16)
    model = models.build(config)
    params = o1_params(model.init(jax.random.key(0)), jax.random.key(1))
    prompt = np.random.default_rng(0).integers(0, 64, P).astype(np.int32)
    return model, params, prompt


def full_logits(model, params, prompt, responses):
    """[G, R, V] logits of each response position from one full forward per branch."""
    tokens = jnp.concatenate([jnp.broadcast_to(prompt, (responses.shape[0], P)), responses], axis=1)
    return jax.vmap(lambda t: model._forward(params, t))(tokens)[:, P - 1 : P - 1 + responses.shape[1]]


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_tokens_and_logprobs_match_a_full_recompute(setup, temperature, top_p):
    model, params, prompt = setup
    key = jax.random.key(42)
    sampling = SamplingConfig(response_len=R, temperature=temperature, top_p=top_p)
    out = sample_group(model, params, prompt, G, sampling, key, chunk_size=CHUNK)
    responses = np.asarray(out.responses)
    assert responses.shape == (G, R) and np.all(np.asarray(out.mask) == 1)
    assert len({tuple(r) for r in responses}) == G  # branches differ (different keys)

    logits = full_logits(model, params, prompt, jnp.asarray(responses))
    branch_keys = jax.random.split(key, G)
    for g in range(G):
        for t in range(R):
            shaped = sampling_logits(logits[g, t], temperature, top_p)
            assert int(jax.random.categorical(jax.random.fold_in(branch_keys[g], t), shaped)) == responses[g, t]
            np.testing.assert_allclose(out.sample_logprobs[g, t], jax.nn.log_softmax(shaped)[responses[g, t]],
                                       rtol=1e-4, atol=1e-4)

    oracle, _ = response_logprobs(model, params, jnp.asarray(prompt), jnp.asarray(responses))
    np.testing.assert_allclose(out.logprobs, oracle, rtol=1e-4, atol=1e-4)
    if temperature == 1.0 and top_p == 1.0:
        np.testing.assert_array_equal(out.sample_logprobs, out.logprobs)
    else:  # the sampling distribution is not the policy's: old_logprobs must be `logprobs`, not these
        assert np.max(np.abs(np.asarray(out.sample_logprobs) - np.asarray(out.logprobs))) > 0.1

def test_greedy_is_the_argmax_of_a_full_recompute(setup):
    """temperature 0: every token is the argmax of the full recompute's logits at its position, every branch is
    the same whatever the key, sample_logprobs are 0 (a point mass) and logprobs are the policy's."""
    model, params, prompt = setup
    greedy = SamplingConfig(response_len=R, temperature=0.0)
    out = sample_group(model, params, prompt, 2, greedy, jax.random.key(1), chunk_size=CHUNK)
    other = sample_group(model, params, prompt, 2, greedy, jax.random.key(2), chunk_size=CHUNK)
    responses = np.asarray(out.responses)
    assert np.array_equal(responses[0], responses[1]) and np.array_equal(responses, np.asarray(other.responses))
    logits = full_logits(model, params, prompt, jnp.asarray(responses))
    np.testing.assert_array_equal(responses, np.argmax(np.asarray(logits), axis=-1))
    assert len(set(responses[0].tolist())) > 1  # not a degenerate constant sequence
    np.testing.assert_array_equal(out.sample_logprobs, 0.0)
    oracle, _ = response_logprobs(model, params, jnp.asarray(prompt), jnp.asarray(responses))
    np.testing.assert_allclose(out.logprobs, oracle, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(out.first_logprobs, jax.nn.log_softmax(logits[0, 0]), rtol=1e-4, atol=1e-4)



def test_glm_samples_through_the_same_protocol():
    """GLM-5.2 (MLA + DSA indexer, top-k 16 < P: sparse selection active) through the same sampler: tokens and
    log-probs agree with a full recompute."""
    model = models.build(models.Glm52Config.tiny(vocab_size=64, query_block_size=8, index_key_block_size=8))
    params = o1_params(model.init(jax.random.key(0)), jax.random.key(2))
    prompt = np.random.default_rng(1).integers(0, 64, P).astype(np.int32)
    key = jax.random.key(3)
    out = sample_group(model, params, prompt, 2, SamplingConfig(response_len=4), key, chunk_size=CHUNK)
    logits = full_logits(model, params, prompt, out.responses)
    for g, branch_key in enumerate(jax.random.split(key, 2)):
        for t in range(4):
            assert int(jax.random.categorical(jax.random.fold_in(branch_key, t), logits[g, t])) == out.responses[g, t]
    oracle = jnp.take_along_axis(jax.nn.log_softmax(logits), out.responses[..., None], axis=-1)[..., 0]
    np.testing.assert_allclose(out.logprobs, oracle, rtol=1e-4, atol=1e-4)


def test_stop_token_masks_and_pads(setup):
    model, params, prompt = setup
    key = jax.random.key(7)
    free = sample_group(model, params, prompt, G, SamplingConfig(response_len=R), key, chunk_size=CHUNK)
    stop = int(free.responses[1, 2])  # branch 1 stops at t = 2 (or earlier, if the token appeared before)
    pad = 63 if stop != 63 else 62
    out = sample_group(model, params, prompt, G, SamplingConfig(response_len=R, stop_token=stop, pad_token=pad),
                       key, chunk_size=CHUNK)
    for g in range(G):
        row = np.asarray(free.responses[g])
        hits = np.flatnonzero(row == stop)
        length = hits[0] + 1 if hits.size else R
        np.testing.assert_array_equal(out.mask[g], np.arange(R) < length)
        np.testing.assert_array_equal(out.responses[g, :length], row[:length])
        assert np.all(np.asarray(out.responses[g, length:]) == pad)
        assert np.all(np.asarray(out.logprobs[g, length:]) == 0)
        np.testing.assert_allclose(out.logprobs[g, :length], free.logprobs[g, :length], rtol=1e-6, atol=1e-6)
    assert out.mask[1].sum() <= 3


def test_several_stop_tokens_end_a_branch_at_the_first_of_them(setup):
    """SamplingConfig.stop_tokens (a chat model's end-of-turn and EOS ids): each branch ends at whichever stop id it
    samples first, exactly as with that id alone; `stops` is stop_token then stop_tokens, without repeats."""
    model, params, prompt = setup
    key = jax.random.key(7)
    free = sample_group(model, params, prompt, G, SamplingConfig(response_len=R), key, chunk_size=CHUNK)
    first, second = int(free.responses[0, 3]), int(free.responses[2, 1])
    sampling = SamplingConfig(response_len=R, stop_token=first, stop_tokens=[second, np.int64(first)], pad_token=63)
    assert sampling.stop_tokens == (second, first) and sampling.stops == tuple(dict.fromkeys((first, second)))
    assert hash(sampling) == hash(dataclasses.replace(sampling, stop_tokens=(second, first)))
    out = sample_group(model, params, prompt, G, sampling, key, chunk_size=CHUNK)
    for g in range(G):
        row = np.asarray(free.responses[g])
        hits = np.flatnonzero((row == first) | (row == second))
        length = hits[0] + 1 if hits.size else R
        np.testing.assert_array_equal(out.mask[g], np.arange(R) < length)
        np.testing.assert_array_equal(out.responses[g, :length], row[:length])
        assert np.all(np.asarray(out.responses[g, length:]) == 63)
    assert out.mask[0].sum() <= 4 and out.mask[2].sum() <= 2
    only = SamplingConfig(response_len=R, stop_tokens=(second,), pad_token=63)  # no stop_token, one stop id
    np.testing.assert_array_equal(sample_group(model, params, prompt, G, only, key, chunk_size=CHUNK).mask[2],
                                  np.arange(R) < np.flatnonzero(np.asarray(free.responses[2]) == second)[0] + 1)
    with pytest.raises(ValueError, match=r"stop_tokens=\(-1,\) must be a tuple of non-negative int token ids"):
        SamplingConfig(stop_tokens=(-1,))
    with pytest.raises(ValueError, match=r"stop_tokens holds 64, out of range"):
        sample_group(model, params, prompt, 2, SamplingConfig(response_len=2, stop_tokens=(64,)), key)


@pytest.mark.slow  # three sampler compiles per family
@pytest.mark.parametrize("family", ["qwen36", "glm52"])
def test_one_branch_at_a_time_samples_what_all_together_do(setup, family):
    """decode_batch=1 (G batches of one branch, one after another) == all G branches decoding together, with a stop
    token that ends one branch early (the others keep going) and top-p; decode_batch must divide G."""
    model, params, prompt = setup if family == "qwen36" else _glm_setup()
    g, key = 4, jax.random.key(8)
    free = sample_group(model, params, prompt, g, SamplingConfig(response_len=R, top_p=0.9), key, chunk_size=CHUNK)
    sampling = SamplingConfig(response_len=R, top_p=0.9, stop_token=int(free.responses[2, 1]), pad_token=63)
    together = sample_group(model, params, prompt, g, sampling, key, chunk_size=CHUNK)
    apart = sample_group(model, params, prompt, g, dataclasses.replace(sampling, decode_batch=1), key,
                         chunk_size=CHUNK)
    assert together.mask[2].sum() <= 2 and together.mask.sum() < g * R  # a branch stopped while others went on
    np.testing.assert_array_equal(apart.responses, together.responses)
    np.testing.assert_array_equal(apart.mask, together.mask)
    for name in ("logprobs", "sample_logprobs"):
        np.testing.assert_allclose(getattr(apart, name), getattr(together, name), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="decode_batch=3 must divide the group size G=4"):
        sample_group(model, params, prompt, g, dataclasses.replace(sampling, decode_batch=3), key, chunk_size=CHUNK)


@pytest.mark.parametrize("family", ["qwen36", "glm52"])
def test_a_batched_decode_step_reads_the_prompt_cache_once(family):
    """One decode step of N = 8 branches (`jax.vmap` of `model.decode` over tails and tokens) after a prompt whose
    cache dominates: XLA's bytes accessed exceed one branch's by far less than the 7 extra prompt caches that
    decoding the branches one after another would read. Key blocks as long as the prompt (XLA counts a loop's body
    once, so the cache is visited in one block) and heads few and wide, so that the per-branch score rows ([N, H,
    S]: not reads of the cache) stay small next to the cache."""
    length = 8192
    if family == "qwen36":
        config = models.Qwen36Config.tiny(vocab_size=64, attention_block_size=length, head_dim=128,
                                          num_attention_heads=2, num_key_value_heads=2)
    else:
        config = models.Glm52Config.tiny(vocab_size=64, index_key_block_size=length, index_n_heads=1,
                                         index_head_dim=64, kv_lora_rank=128)
    model = models.build(config)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0)))
    state = jax.eval_shape(lambda: model.init_state(length))
    tail = jax.eval_shape(lambda: model.init_tail(params, state, 4))
    cache_bytes = state.nbytes() - sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(model.carried(state)))
    accessed = {}
    for n in (1, 8):
        tails = jax.tree.map(lambda a: jax.ShapeDtypeStruct((n,) + a.shape, a.dtype), tail)
        step = jax.vmap(model.decode, in_axes=(None, None, 0, 0, None))
        compiled = jax.jit(step).lower(params, state, tails, jax.ShapeDtypeStruct((n,), jnp.int32),
                                       jax.ShapeDtypeStruct((), jnp.int32)).compile()
        accessed[n] = compiled.cost_analysis()["bytes accessed"]
    print(f"{family}: bytes accessed N=1 {accessed[1]:.3e}, N=8 {accessed[8]:.3e}; one prompt cache {cache_bytes:.3e}")
    assert accessed[1] > cache_bytes  # the step does read the prompt cache
    assert accessed[8] - accessed[1] < 0.5 * cache_bytes


@pytest.mark.parametrize("family", ["qwen36", "glm52"])
def test_a_decode_step_copies_no_stack_of_weights(family):
    """One decode step of N = 4 branches on one device reads each layer's weights from the parameter stacks, never
    a copy of a whole block's stack (Qwen3.6: [per_block, out, in]) or of a MoE layer's experts (GLM-5.x: [E, I, D]):
    XLA:CPU materialises a dynamic slice that feeds a matmul, so a block-level slice was a second pass over every
    weight per token, and the experts' scan a copy of all E experts per layer and token (`gathered_swiglu` reads
    the chosen ones). Nor does it copy Qwen3.6's prompt cache head-major ([Hkv, hd, S] keys, [Hkv, S, hd] values:
    `ops/attention._per_head`). Widths chosen so that no other array of the step shares those shapes."""
    if family == "qwen36":
        config = models.Qwen36Config.tiny(vocab_size=64, hidden_size=40, intermediate_size=72)
        stacks = lambda params: [a for a in jax.tree.leaves(params["blocks"]) if a.ndim == 4]  # [nb, per_block, ..]
        copies = lambda a: {a.shape[1:]}
        cache = {(config.num_key_value_heads, config.head_dim, 48), (config.num_key_value_heads, 48, config.head_dim)}
    else:
        config = models.Glm52Config.tiny(vocab_size=64, hidden_size=40, moe_intermediate_size=24)
        stacks = lambda params: [a for path, a in jax.tree_util.tree_leaves_with_path(params)
                                 if str(getattr(path[-1], "key", "")).startswith("experts_")]
        copies = lambda a: {a.shape[-3:], a.shape[-4:]}  # one layer's experts, one repeat's
        cache = set()
    model = models.build(config)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0)))
    state = jax.eval_shape(lambda: model.init_state(48))
    tails = jax.tree.map(lambda a: jax.ShapeDtypeStruct((4,) + a.shape, a.dtype),
                         jax.eval_shape(lambda: model.init_tail(params, state, 8)))
    step = jax.vmap(model.decode, in_axes=(None, None, 0, 0, None))
    hlo = jax.jit(step).lower(params, state, tails, jax.ShapeDtypeStruct((4,), jnp.int32),
                              jax.ShapeDtypeStruct((), jnp.int32)).compile().as_text()
    forbidden = set().union(cache, *(copies(a) for a in stacks(params)))
    assert forbidden and not forbidden & hlo_result_shapes(hlo), sorted(forbidden & hlo_result_shapes(hlo))


def test_glm_decoding_on_a_gpu_reads_each_chosen_expert_once():
    """GLM-5.x's one-device decode step picks its experts' matmul by backend: gathered weights on a CPU, the grouped
    matmul elsewhere (`ragged_dot`; under the branches' vmap their rows merge into one call, `ops/moe.py`), so no
    [N, k, I, D] copy of gathered expert weights. With the backend reported as "gpu" (the grouped matmul then runs
    through XLA:CPU's ragged_dot expansion) a group samples the CPU path's tokens and log-probs."""
    from tests.helpers import o1_params, reported_backend

    config = models.Glm52Config.tiny(vocab_size=64, hidden_size=40, moe_intermediate_size=24)
    model = models.build(config)
    params = o1_params(model.init(jax.random.key(0)), jax.random.key(1))
    prompt = np.random.default_rng(2).integers(0, 64, 20).astype(np.int32)
    sampling = SamplingConfig(response_len=4, temperature=0.7)
    want = rollout.sample_group(model, params, prompt, 3, sampling, jax.random.key(3), chunk_size=8)
    state = jax.eval_shape(lambda: model.init_state(48))
    tails = jax.tree.map(lambda a: jax.ShapeDtypeStruct((3,) + a.shape, a.dtype),
                         jax.eval_shape(lambda: model.init_tail(params, state, 8)))
    step = lambda: str(jax.make_jaxpr(jax.vmap(model.decode, in_axes=(None, None, 0, 0, None)))(
        params, state, tails, jax.ShapeDtypeStruct((3,), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32)))
    # one projection's gathered copies: [3 branches, k, I, D]
    gathered = f"f32[3,{config.num_experts_per_tok},{config.moe_intermediate_size},{config.hidden_size}]"
    text = step()
    assert gathered in text and "ragged_dot" not in text
    with reported_backend("gpu"):
        text = step()
        assert "ragged_dot" in text and gathered not in text
        got = rollout.sample_group(model, params, prompt, 3, sampling, jax.random.key(3), chunk_size=8)
    np.testing.assert_array_equal(got.responses, want.responses)
    np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=1e-5, atol=1e-5)


def test_top_p_keeps_the_nucleus():
    logits = jnp.log(jnp.array([0.1, 0.5, 0.15, 0.25]))
    kept = lambda p: np.isfinite(np.asarray(sampling_logits(logits, 1.0, p)))
    np.testing.assert_array_equal(kept(0.4), [False, True, False, False])
    np.testing.assert_array_equal(kept(0.6), [False, True, False, True])   # 0.5 < 0.6: the next token is needed
    np.testing.assert_array_equal(kept(0.75), [False, True, False, True])  # 0.5 + 0.25 reaches 0.75
    np.testing.assert_array_equal(kept(0.8), [False, True, True, True])
    np.testing.assert_array_equal(kept(1.0), [True] * 4)
    np.testing.assert_allclose(sampling_logits(logits, 2.0, 1.0), logits / 2.0)


def test_first_argmax_is_jnp_argmax_with_ties_and_nans():
    rows = np.array([[1.0, 3.0, 3.0, 2.0], [0.0, 0.0, 0.0, 0.0], [1.0, np.nan, 5.0, np.nan], [-np.inf] * 4,
                     [2.0, 1.0, np.inf, np.inf]], np.float32)
    np.testing.assert_array_equal(first_argmax(jnp.asarray(rows)), jnp.argmax(jnp.asarray(rows), axis=-1))
    noise = jax.random.randint(jax.random.key(0), (64, 37), 0, 5).astype(jnp.bfloat16)  # many ties
    np.testing.assert_array_equal(first_argmax(noise), jnp.argmax(noise, axis=-1))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.9), (0.0, 1.0)])
def test_next_token_draws_what_jax_random_categorical_draws(dtype, temperature, top_p):
    """The sampler's token for a key is jax.random.categorical's for that key (greedy: jnp.argmax), and its two
    log-probs are those of the policy and of the sampled distribution."""
    sampling = SamplingConfig(response_len=4, temperature=temperature, top_p=top_p)
    draw = jax.jit(jax.vmap(lambda key, row: next_token(key, 5, row, sampling)))
    keys = jax.random.split(jax.random.key(3), 256)
    logits = (3 * jax.random.normal(jax.random.key(4), (256, 97))).astype(dtype)
    token, policy, sample = draw(keys, logits)
    shaped = jax.vmap(lambda row: sampling_logits(row, temperature, top_p))(logits)
    if temperature == 0:
        expected = jnp.argmax(logits, axis=-1)
    else:
        expected = jax.vmap(lambda k, row: jax.random.categorical(jax.random.fold_in(k, 5), row))(keys, shaped)
    np.testing.assert_array_equal(token, expected)
    assert len(set(np.asarray(token).tolist())) > 20  # not one token for every key
    at = lambda x: np.take_along_axis(np.asarray(jax.nn.log_softmax(x.astype(jnp.float32))), np.asarray(token)[:, None],
                                      axis=-1)[:, 0]
    tol = 1e-2 if dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(policy, at(logits), rtol=tol, atol=tol)
    np.testing.assert_allclose(sample, np.zeros(256) if temperature == 0 else at(shaped), rtol=tol, atol=tol)


def test_bad_input_raises(setup):
    model, params, prompt = setup
    key = jax.random.key(0)
    ok = SamplingConfig(response_len=2)
    with pytest.raises(ValueError, match=r"G\) = 0"):
        sample_group(model, params, prompt, 0, ok, key)
    bad_prompt = prompt.copy()
    bad_prompt[3] = 64
    with pytest.raises(ValueError, match=r"prompt\[3\] = 64 is out of range"):
        sample_group(model, params, bad_prompt, 2, ok, key)
    with pytest.raises(ValueError, match=r"stop_token=64 is out of range"):
        sample_group(model, params, prompt, 2, SamplingConfig(response_len=2, stop_token=64), key)
    with pytest.raises(ValueError, match="need at least 2"):
        sample_group(model, params, prompt[:1], 2, ok, key)
    for bad in (dict(response_len=0), dict(temperature=-0.5), dict(top_p=1.5), dict(stop_token=-1)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingConfig(**bad)


@pytest.mark.slow  # AOT compiles of the sampler at G = 1 and 16 over a 4K prompt
def test_memory_does_not_grow_with_group_size(setup):
    """Temporaries of the compiled sampler at G = 1 and G = 16 (all branches decoding together: 16 tails of R
    positions) differ by far less than one copy of the state."""
    model, params, _ = setup
    length, sampling = 4096, SamplingConfig(response_len=4)
    prompt = jax.ShapeDtypeStruct((length,), jnp.int32)
    key = jax.eval_shape(lambda: jax.random.key(0))
    temp = {}
    for g in (1, 16):
        compiled = rollout._sample_group.lower(model, params, prompt, key, g, sampling, 512).compile()
        temp[g] = compiled.memory_analysis().temp_size_in_bytes
    state_bytes = model.init_state(length + 3).nbytes()
    print(f"sampler temp bytes: G=1 {temp[1]}, G=16 {temp[16]}; one state {state_bytes}")
    assert temp[16] - temp[1] < 0.1 * state_bytes


def _glm_setup():
    model = models.build(models.Glm52Config.tiny(vocab_size=64, query_block_size=8, index_key_block_size=8))
    params = o1_params(model.init(jax.random.key(0)), jax.random.key(2))
    return model, params, np.random.default_rng(1).integers(0, 64, P).astype(np.int32)


def _with_garbage_beyond_length(state, seq_axes={"keys": 2, "values": 2, "kv": 1, "index_keys": 1}):
    """The state with every position >= state.length of its appended parts overwritten by large random values."""
    fields = {}
    for name, axis in seq_axes.items():
        if hasattr(state, name):
            x = getattr(state, name)
            beyond = jnp.arange(x.shape[axis]) >= state.length
            beyond = beyond.reshape([-1 if d == axis else 1 for d in range(x.ndim)])
            noise = 50.0 * jax.random.normal(jax.random.key(9), x.shape, x.dtype)
            fields[name] = jnp.where(beyond, noise, x)
    return state.replace(**fields)


@pytest.mark.parametrize("family", ["qwen36", pytest.param("glm52", marks=pytest.mark.slow)])
def test_keep_capture_returns_the_engines_capture(setup, family):
    """sample_group(keep_capture=True): the same rollout, and a Captured whose state equals a fresh capture of
    prompt[:-1] on positions < P-1 and on the carried part, whose boundaries are capture_chunks' (same chunks), and
    from which a replay gives the logits of a replay from the fresh capture."""
    model, params, prompt = setup if family == "qwen36" else _glm_setup()
    # GLM: the sampler test_glm_samples_through_the_same_protocol compiled (G 2, R 4), so only keep_capture compiles
    g, r = (G, R) if family == "qwen36" else (2, 4)
    key, sampling = jax.random.key(5), SamplingConfig(response_len=r)
    plain = sample_group(model, params, prompt, g, sampling, key, chunk_size=CHUNK)
    out, captured = sample_group(model, params, prompt, g, sampling, key, chunk_size=CHUNK, keep_capture=True)
    np.testing.assert_array_equal(out.responses, plain.responses)
    np.testing.assert_array_equal(out.mask, plain.mask)
    for name in ("logprobs", "sample_logprobs"):  # another compiled program: float round-off only
        np.testing.assert_allclose(getattr(out, name), getattr(plain, name), rtol=1e-5, atol=1e-6, err_msg=name)

    fresh = model.capture(params, prompt[:-1], chunk_size=CHUNK)
    state = captured.state
    assert state.length == P - 1 and type(state) is type(fresh)
    for name, axis in (("keys", 2), ("values", 2), ("kv", 1), ("index_keys", 1)):
        if hasattr(fresh, name):
            got = getattr(state, name)
            assert got.shape[axis] == P - 1, name  # the branches decode into their own tails, not here
            np.testing.assert_allclose(got, getattr(fresh, name), rtol=1e-5, atol=1e-5, err_msg=name)
    for got, want in zip(jax.tree.leaves(model.carried(state)), jax.tree.leaves(model.carried(fresh)), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    _, boundaries = capture_chunks(model, params, jnp.asarray(prompt[:-1]), CHUNK, jnp.float32, keep_boundaries=True)
    assert jax.tree.structure(captured.boundaries) == jax.tree.structure(boundaries)
    for got, want in zip(jax.tree.leaves(captured.boundaries), jax.tree.leaves(boundaries), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

    replay = np.concatenate([prompt[-1:], np.asarray(out.responses[0, :-1])])
    np.testing.assert_allclose(model.extend(params, state, replay), model.extend(params, fresh, replay),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.slow  # a sampler and a gradient compile per family
@pytest.mark.parametrize("family", ["qwen36", "glm52"])
def test_positions_beyond_a_states_length_are_never_read(setup, family):
    """A state with room beyond its length (garbage there) replays exactly as the state without room: `extend`
    reads positions < length only (GLM: its top-k never selects one; an index_topk larger than the prompt makes
    every visible key selected), and so does Qwen3.6's block-by-block `branch_grads` (loss, parameter gradient,
    state cotangent; GLM's is autodiff of the same `extend`)."""
    model, params, prompt = setup if family == "qwen36" else _glm_setup()
    if family == "glm52":
        model = models.build(dataclasses.replace(model.config, index_topk=64))
    tokens = jnp.asarray(prompt[:-1])
    exact = capture_chunks(model, params, tokens, CHUNK, jnp.float32)
    roomy = _with_garbage_beyond_length(capture_chunks(model, params, tokens, CHUNK, jnp.float32, capacity=P + 9))
    replay = jnp.asarray(np.random.default_rng(4).integers(0, 64, R).astype(np.int32))
    # garbage read anywhere would move logits by O(1); GLM's top-k width follows the capacity (round-off only)
    np.testing.assert_allclose(model.extend(params, roomy, replay), model.extend(params, exact, replay), rtol=1e-5,
                               atol=1e-5)
    if family == "glm52":
        return
    head = lambda p, h: (jnp.sum(model.logits(p, h)[:, :7] ** 2) / 100.0, None)
    zeros = lambda tree: jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), tree)
    run = jax.jit(lambda state: model.branch_grads(params, state, replay, head, zeros(params), zeros(state)))
    loss, _, grads, acc = run(exact)
    got_loss, _, got_grads, got_acc = run(roomy)
    assert float(got_loss) == pytest.approx(float(loss), rel=1e-6)
    assert rel_err(got_grads, grads) < 1e-6
    assert rel_err(model.carried(got_acc), model.carried(acc)) < 1e-6
    for name in ("keys", "values"):
        cot = getattr(got_acc, name)
        assert rel_err(cot[:, :, : P - 1], getattr(acc, name)) < 1e-6, name
        assert not np.any(np.asarray(cot[:, :, P - 1 :])), name


@pytest.mark.slow  # the vmapped sampler's compile (the fast tier's trainer runs sample through it)
def test_the_traced_sampler_vmaps_over_groups(setup):
    """sample_traced under jax.vmap over a leading group axis (prompt [N, P], key [N]) == one call per group."""
    model, params, prompt = setup
    prompts = np.stack([prompt, np.roll(prompt, 3)])
    keys = jax.random.split(jax.random.key(11), 2)
    sampling = SamplingConfig(response_len=3, stop_token=int(prompt[0]))
    batched = jax.jit(jax.vmap(lambda p, k: rollout.sample_traced(model, params, p, k, 2, sampling, CHUNK, True)))
    out, captured = batched(jnp.asarray(prompts), keys)
    assert captured.state.length == P - 1 and captured.state.keys.shape[:3] == (2, 1, 1)
    for n in range(2):
        want, want_captured = sample_group(model, params, prompts[n], 2, sampling, keys[n], chunk_size=CHUNK,
                                           keep_capture=True)
        np.testing.assert_array_equal(out.responses[n], want.responses)
        np.testing.assert_allclose(out.logprobs[n], want.logprobs, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(captured.state.keys[n, :, :, : P - 1], want_captured.state.keys[:, :, : P - 1],
                                   rtol=1e-4, atol=1e-4)
