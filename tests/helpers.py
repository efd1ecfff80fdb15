"""What several test modules share (no test module imports another): O(1)-scale random parameters, the tiny model
of each family (tests/models/test_families.py, models/test_qwen36.py, models/test_glm52.py), the pytree relative error,
the engine's test cases and oracles (tests/engine/test_local.py, reused on GLM by tests/models/test_glm52.py), the
sharded-vs-one-device gradient check, the 32-device subprocess runner, an all-gather emulation of
`jax.lax.ragged_all_to_all` (XLA:CPU has none; checked in tests/sharding/test_experts.py), `reported_backend`
(the library's backend choices made as on a GPU: `ops.triton_ir`), `triton_calls` (a CUDA lowering's Triton
kernels, verified).

The transformers oracles live apart, in tests/hf_reference.py and tests/glm_reference.py: they import torch.
"""
import functools
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from longstraw_jax import GroupBatch, GRPOConfig, grpo_grads, models, sharding
from longstraw_jax.grpo import grpo_loss
from longstraw_jax.ops import triton_ir
from longstraw_jax.sharding import rules

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def triton_calls(lowered) -> list[triton_ir.TritonKernel]:
    """The Triton kernels a program lowered for CUDA calls, in order (name, grid, warps, stages, module), every
    kernel's module verified as XLA's GPU compiler would (`ops.triton_ir`: InvalidTritonModule names the first that
    fails). Also checks that the program's text names each kernel in a Triton custom call, as parsed."""
    calls = triton_ir.triton_kernels(lowered)
    assert lowered.as_text().count(triton_ir.CALL_TARGET) == len(calls)
    return calls


reported_backend = triton_ir.reported_backend  # (where the tests have always found it)


def o1_params(params, key):
    """Random parameters at O(1) scale (the models' default init, small matrices and identity norms, hides bugs):
    every leaf re-drawn, matrices ~ N(0, 1/fan_in), vectors (norms, biases, decays) ~ N(0, 0.3^2)."""
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(key, len(leaves))
    # drawn in float32 (float64 for float64 params: the fp64 oracle of engine/test_float64.py)
    out = [jax.random.normal(k, x.shape, jnp.promote_types(x.dtype, jnp.float32))
           * (x.shape[-1] ** -0.5 if x.ndim >= 2 and x.shape[-1] > 4 else 0.3)
           for k, x in zip(keys, leaves)]
    return jax.tree.unflatten(tree, out)


def glm_o1_params(model, key):
    """O(1) random parameters; GLM norms multiply by a plain w, so their weights are 1 + N(0, 0.3^2)."""
    flat = traverse_util.flatten_dict(o1_params(model.init(jax.random.key(0)), key), sep="/")
    is_norm = lambda path: path.endswith("norm") and not path.endswith("bias")
    return traverse_util.unflatten_dict({k: 1.0 + v if is_norm(k) else v for k, v in flat.items()}, sep="/")


TINY_T = 75  # tokens of `tiny_model`: > GLM's index_topk = 16, so the indexer really selects


@functools.cache
def tiny_model(family: str):
    """The tiny model of `family` ("qwen36" or "glm52") at O(1) scale -> (model, params, tokens int32 [TINY_T]).
    GLM with small blocks (query and indexer key blocks of 8): several query blocks, several indexer key blocks and a
    tail block in every call. Built once per process (arrays are immutable; the test modules that use it share it,
    and conftest.py's per-module cache clearing drops compiled programs, not these arrays)."""
    if family == "qwen36":
        model = models.build(models.Qwen36Config.tiny())
        params = o1_params(model.init(jax.random.key(0)), jax.random.key(1))
    elif family == "glm52":
        model = models.build(models.Glm52Config.tiny(query_block_size=8, index_key_block_size=8))
        params = glm_o1_params(model, jax.random.key(1))
    else:
        raise ValueError(f"unknown family {family!r}")
    tokens = jax.random.randint(jax.random.key(2), (TINY_T,), 0, model.config.vocab_size, dtype=jnp.int32)
    return model, params, tokens


@functools.cache
def tiny_forward(family: str):
    """`tiny_model(family)` and its forward logits [TINY_T, vocab] -> (model, params, tokens, logits), once per
    process."""
    model, params, tokens = tiny_model(family)
    return model, params, tokens, model.forward(params, tokens)


def rel_err(got, want):
    """sqrt(sum (got - want)^2) / sqrt(sum want^2) over a whole pytree, in float64."""
    pairs = list(zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True))
    num = sum(np.sum((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2) for a, b in pairs)
    den = sum(np.sum(np.asarray(b, np.float64) ** 2) for _, b in pairs)
    return float(np.sqrt(num / den))


def assert_metrics_equal(got, want):
    assert sorted(got) == sorted(want)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6, err_msg=key)


# ----- the engine's cases (tests/engine/test_local.py's docstring has the table)

P, R = 25, 8  # prompt and response length of every case

CASES = {
    "A": dict(lengths=[8, 3, 6], rewards=[1.0, 0.0, 0.25], chunk=7, old=True, ref=True,
              cfg=GRPOConfig(kl_coef=0.1, loss_agg="token-mean")),
    "B": dict(lengths=[5, 8, 1, 7], rewards=[0.0, 1.0, 1.0, -0.5], chunk=32, old=False, ref=False,
              cfg=GRPOConfig(kl_coef=0.0, loss_agg="seq-mean-token-mean", adv_norm="none", logprob_chunk=3)),
    "C": dict(lengths=[6], rewards=[1.0], chunk=8, old=True, ref=True,
              cfg=GRPOConfig(kl_coef=0.5, loss_agg="seq-mean-token-sum-norm")),
    # GSPO: one ratio per branch, narrow clip (some branches clipped as a whole)
    # (the branches' mean log-ratios are -0.098, 0.070, -0.026: only branch 0, A < 0 and ratio 0.907, is clipped)
    "D": dict(lengths=[4, 8, 2], rewards=[-1.0, 1.0, 0.5], chunk=5, old=True, ref=False,
              cfg=GRPOConfig(ratio="sequence", loss_agg="seq-mean-token-mean", clip_eps_low=0.05,
                             clip_eps_high=0.1)),
}


def response_logprobs(model, params, prompt, responses):
    """Per-branch log-probs through the public `model.forward` (one compile for all cases: same P + R)."""
    out = []
    for response in responses:
        logits = model.forward(params, np.concatenate([prompt, response]))[P - 1 : P - 1 + R]
        out.append(np.take_along_axis(np.asarray(jax.nn.log_softmax(logits)), response[:, None], 1)[:, 0])
    return np.stack(out)


def prompt_only_tokens(batch):
    """Token ids that occur in prompt[:-1] but neither in prompt[-1] nor in any response (the replay's inputs and
    targets)."""
    replayed = set(np.asarray(batch.responses).ravel().tolist()) | {int(batch.prompt[-1])}
    return np.array(sorted(set(np.asarray(batch.prompt[:-1]).tolist()) - replayed), np.int64)


def make_batch(model, params, lengths, rewards, old, ref, seed):
    """A case's batch: random prompt (P) and responses (R), masks of the given lengths, old / ref log-probs near the
    model's own (some clipping, not all); old log-probs are NaN on padding (which must be ignored)."""
    rng = np.random.default_rng(seed)
    vocab, g = model.config.vocab_size, len(lengths)
    mask = (np.arange(R)[None, :] < np.array(lengths)[:, None]).astype(np.float32)
    prompt = rng.integers(0, vocab, P).astype(np.int32)
    responses = rng.integers(0, vocab, (g, R)).astype(np.int32)
    logp = response_logprobs(model, params, prompt, responses)
    noisy = lambda scale: (logp + rng.normal(0, scale, logp.shape)).astype(np.float32)
    old_logprobs = np.where(mask == 1, noisy(0.2), np.nan).astype(np.float32) if old else None
    return GroupBatch(prompt=prompt, responses=responses, mask=mask, rewards=np.array(rewards, np.float32),
                      old_logprobs=old_logprobs, ref_logprobs=noisy(0.3) if ref else None)


def detached_reference(model, params, batch, cfg, chunk_size):
    """The detached mode's oracle: autograd through `model._extend` (full log_softmax, no scan, no remat), vmapped
    over branches, from a captured state under stop_gradient."""
    prompt = jnp.asarray(batch.prompt, jnp.int32)
    responses = jnp.asarray(batch.responses, jnp.int32)
    inputs = jnp.concatenate([jnp.broadcast_to(prompt[-1], (responses.shape[0], 1)), responses[:, :-1]], axis=1)

    def loss_fn(params):
        state = jax.lax.stop_gradient(model._capture(params, prompt[:-1], chunk_size))
        logits = jax.vmap(lambda t: model._extend(params, state, t))(inputs)  # [G, R, V]
        logp_all = jax.nn.log_softmax(logits, axis=-1)
        logp = jnp.take_along_axis(logp_all, responses[..., None], axis=-1)[..., 0]
        entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
        return grpo_loss(logp, batch, cfg, entropy=jax.lax.stop_gradient(entropy))

    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    return loss, grads, metrics


def random_groups(vocab: int, pads, prompt_len: int, response_len: int = 6, group_size: int = 3,
                  seed: int = 0) -> GroupBatch:
    """Random GRPO groups: B = len(pads) groups stacked (prompt [B, P], responses [B, G, R], ...) for a tuple, one
    unstacked group (prompt [P]) for an int; the first pads[b] prompt tokens are pads (`left_pad`, None when all
    are 0). Ragged masks (every branch at least one token), distinct rewards per group, old (NaN at pads) and
    reference log-probs: every term of the loss is live."""
    rng = np.random.default_rng(seed)
    lead = (len(pads),) if isinstance(pads, tuple) else ()
    mask = (np.arange(response_len) < rng.integers(1, response_len + 1, lead + (group_size,))[..., None])
    mask = mask.astype(np.float32)
    logp = lambda: rng.normal(-6, 0.3, mask.shape).astype(np.float32)
    return GroupBatch(prompt=rng.integers(0, vocab, lead + (prompt_len,)).astype(np.int32),
                      responses=rng.integers(0, vocab, lead + (group_size, response_len)).astype(np.int32),
                      mask=mask, rewards=rng.normal(0, 1, lead + (group_size,)).astype(np.float32),
                      old_logprobs=np.where(mask == 1, logp(), np.nan).astype(np.float32), ref_logprobs=logp(),
                      left_pad=np.array(pads, np.int32) if np.any(pads) else None)


# ----- sharded == one device ----------------------------------------------------------------------------------------

SHARDED_CFG = GRPOConfig(kl_coef=0.1)


def assert_sharded_grads_match(model, params, batch, spec: str, mode: str, chunk_size: int = 16):
    """grpo_grads (SHARDED_CFG) on the mesh == on one device (loss, relative gradient error <= 1e-4, metrics);
    returns (the sharded grads, the parameter specs)."""
    loss, grads, metrics = grpo_grads(model, params, batch, SHARDED_CFG, mode, chunk_size=chunk_size)
    mesh = sharding.make_mesh(spec)
    specs = rules.param_specs(params, mesh)
    placed = jax.device_put(params, rules.named(specs, mesh))
    got_loss, got_grads, got_metrics = grpo_grads(model, placed, batch, SHARDED_CFG, mode, chunk_size=chunk_size,
                                                  mesh=mesh)
    assert abs(float(got_loss) - float(loss)) <= 1e-5
    assert rel_err(got_grads, grads) <= 1e-4
    assert_metrics_equal(got_metrics, metrics)
    return got_grads, specs


def run_32_device_check(module: str) -> dict:
    """Run `python -m module` in a fresh process (32 simulated CPU devices need a fresh JAX; this session has 8):
    the module's `__main__` prints one JSON object, the last line of its stdout, which is returned parsed."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "-m", module], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.strip().splitlines()
    assert lines, f"{module} printed nothing; stderr: {run.stderr[-3000:]}"
    return json.loads(lines[-1])


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                               axis_name):
    """`jax.lax.ragged_all_to_all` built from `all_gather` (XLA:CPU has no ragged all-to-all), differentiable:
    device `me`'s slot i (of K = n * per) receives from device src = i // per that device's slot
    j = me * per + i % per, i.e. operand_src[input_offsets_src[j] :][: recv_sizes[i]] written at
    output_offsets_src[j] (a later slot wins where writes overlap); the other rows keep `output`. send_sizes is the
    senders' side of recv_sizes (the primitive requires them to agree) and is not read."""
    del send_sizes
    n, me = jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name)
    slots = input_offsets.shape[0]
    per = slots // n
    everyone = lambda a: jax.lax.all_gather(a, axis_name)  # [n, ...]
    operands, starts_in, starts_out = everyone(operand), everyone(input_offsets), everyone(output_offsets)
    src = jnp.arange(slots) // per
    theirs = me * per + jnp.arange(slots) % per
    first, start = starts_in[src, theirs], starts_out[src, theirs]  # [K]
    row = jnp.arange(output.shape[0])[:, None]
    inside = (row >= start) & (row < start + recv_sizes)  # [M, K]
    slot = slots - 1 - jnp.argmax(inside[:, ::-1], axis=1)  # the last slot writing the row
    source_row = jnp.clip(first[slot] + row[:, 0] - start[slot], 0, operand.shape[0] - 1)
    got = operands[src[slot], source_row]
    hit = inside.any(axis=1).reshape((-1,) + (1,) * (output.ndim - 1))
    return jnp.where(hit, got, output)


def hlo_result_shapes(hlo: str, opcodes: tuple[str, ...] | None = None) -> set:
    """The shapes of the arrays compiled HLO text materialises: the results (tuple results included) of its
    instructions outside fusions' bodies (whose values live in registers, not buffers), of the given opcodes only
    when given (e.g. ("all-gather", "all-gather-start"))."""
    fused = set(re.findall(r" fusion\(.*?calls=%?([\w.\-]+)", hlo))
    shapes, inside = set(), False
    for line in hlo.splitlines():
        if line and not line[0].isspace():  # a computation's header (or the module's)
            inside = line.split(" ", 1)[0].lstrip("%") in fused
            continue
        instruction = re.match(r"\s*(?:ROOT )?%?[\w.\-]+ = (.*?) ([a-z][\w\-]*)\(", line)
        if instruction and not inside and (opcodes is None or instruction.group(2) in opcodes):
            shapes |= {tuple(int(d) for d in dims.split(",") if d)
                       for dims in re.findall(r"[a-z0-9]+\[([0-9,]*)\]", instruction.group(1))}
    return shapes
