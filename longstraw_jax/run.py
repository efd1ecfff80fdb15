"""`python -m longstraw_jax.run`: the embedded default.

Until the trainer lands this is a real capture -> extend demo on the tiny Qwen3.6 model: it captures a synthetic
long prompt chunk by chunk, continues a short response from the captured state, checks the continuation against a
full forward pass, and reports timings and the state size.
"""
import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from longstraw_jax import models


def _timed(fn, *args):
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return out, time.perf_counter() - start


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-len", type=int, default=4096)
    parser.add_argument("--response-len", type=int, default=32)
    parser.add_argument("--chunk-size", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    cfg = models.Qwen36Config.tiny()
    model = models.build(cfg)
    params = model.init(jax.random.key(args.seed))
    rng = np.random.default_rng(args.seed)
    prompt = rng.integers(0, cfg.vocab_size, args.prompt_len, dtype=np.int32)
    response = rng.integers(0, cfg.vocab_size, args.response_len, dtype=np.int32)
    print(f"model: tiny Qwen3.6 ({cfg.num_hidden_layers} layers {''.join(t[0].upper() for t in cfg.block_pattern)}"
          f" x {cfg.num_blocks}, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}); devices: {jax.devices()[0].platform}")

    _, compile_and_run = _timed(model.capture, params, prompt, args.chunk_size)
    state, capture_s = _timed(model.capture, params, prompt, args.chunk_size)
    print(f"capture: {args.prompt_len} prompt tokens in chunks of {args.chunk_size}: {capture_s * 1e3:.1f} ms "
          f"({args.prompt_len / capture_s:,.0f} tok/s; first call incl. compile {compile_and_run:.1f} s)")
    print(f"state: {state.nbytes() / 2**20:.2f} MiB = KV {2 * state.keys.nbytes / 2**20:.2f} MiB "
          f"({2 * state.keys.nbytes // args.prompt_len} B/token over {cfg.layer_types.count('full_attention')} "
          f"attention layers) + GDN conv/recurrent {(state.conv.nbytes + state.recurrent.nbytes) / 2**20:.2f} MiB (fixed)")

    model.extend(params, state, response)
    logits, extend_s = _timed(model.extend, params, state, response)
    print(f"extend: {args.response_len} response tokens from the captured state: {extend_s * 1e3:.1f} ms")

    full = model.forward(params, np.concatenate([prompt, response]))
    err = float(jnp.max(jnp.abs(logits - full[args.prompt_len:])))
    print(f"check: extend(capture(prompt), response) vs forward(prompt + response): max |logit diff| = {err:.2e}")
    if err > 1e-3:
        raise SystemExit("capture/extend disagrees with the full forward pass")


if __name__ == "__main__":
    main()
