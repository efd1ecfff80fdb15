"""Next-token pre-training on a text corpus (`python -m longstraw_jax.pretrain`): a base model for a GRPO run on real
text, saved as a Hugging Face checkpoint (`models.save_hf` + the tokenizer), which `python -m longstraw_jax.run --hf
DIR` loads like any other.

    python -m longstraw_jax.pretrain --text corpus_dir --glob "*.py" --tokenizer tok_dir --seq-len 512 \\
        --batch 8 --steps 600 --learning-rate 3e-3 --out base_dir

The corpus: every file named by `--text` (files, or directories searched recursively with `--glob`), read as UTF-8,
each tokenized with the tokenizer (no special tokens) and followed by its EOS id when it has one, then all of them
concatenated into one token stream. `--held-out F` keeps the last fraction F of the files (sorted by path) out of
training: their loss is the run's held-out loss. Training windows: `seq_len + 1` tokens at offsets drawn uniformly
from the training stream with `numpy.random.default_rng([seed, step])` (a pure function of seed and step); with
`--repeat F` a share F of them also hold one of their spans twice (`windows`). The loss
is the mean over the window's `seq_len` positions of -log p(next token) (`model.forward`, the whole graph; the batch
vmapped); AdamW (`train.make_optimizer`, with `--lr-warmup-steps`). The model: `tiny` (`Qwen36Config.tiny` at the
tokenizer's size, `--vocab-size` to round it up) or a config.json (random init).

Written to `--out`: config.json + model.safetensors (`save_hf`), the tokenizer's files, and pretrain.jsonl (a line
per logged step: step, and the mean loss and tokens_per_s of the steps since the previous logged one, the first
window's including the compile; and the held-out loss before training and after the last step).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import glob
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from longstraw_jax import models
from longstraw_jax.train import make_optimizer


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Token streams int32 [N] (train) and [M] (held-out; may be empty) and the files they came from."""
    train: np.ndarray
    held_out: np.ndarray
    train_files: tuple[str, ...]
    held_out_files: tuple[str, ...]


def corpus_files(paths, pattern: str = "*") -> list[str]:
    """The files named by `paths` (a file itself; a directory: its files matching `pattern`, recursively), sorted and
    deduplicated. ValueError naming the path when one does not exist or a directory has no matching file."""
    files = set()
    for path in paths:
        if os.path.isfile(path):
            files.add(os.path.abspath(path))
        elif os.path.isdir(path):
            found = [f for f in glob.glob(os.path.join(path, "**", pattern), recursive=True) if os.path.isfile(f)]
            if not found:
                raise ValueError(f"--text {path}: no file matching {pattern!r} in that directory")
            files.update(os.path.abspath(f) for f in found)
        else:
            raise ValueError(f"--text {path}: no such file or directory")
    return sorted(files)


def tokenize_files(files, tokenizer, vocab_size: int) -> np.ndarray:
    """The files' tokens, each file followed by the tokenizer's EOS id (if it has one), concatenated: int32 [N].
    ValueError naming the file when it is not UTF-8 or yields an id >= vocab_size."""
    eos = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
    parts = []
    for path in files:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except UnicodeDecodeError as e:
            raise ValueError(f"--text {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        ids = np.asarray(list(tokenizer(text, add_special_tokens=False)["input_ids"]) + eos, np.int64)
        if ids.size and ids.max() >= vocab_size:
            raise ValueError(f"--text {path}: token id {int(ids.max())} >= the model's vocab_size={vocab_size}")
        parts.append(ids.astype(np.int32))
    return np.concatenate(parts) if parts else np.zeros((0,), np.int32)


def load_corpus(paths, tokenizer, vocab_size: int, pattern: str = "*", held_out: float = 0.0,
                seq_len: int = 1) -> Corpus:
    """The corpus of `paths` split by file: the last `held_out` fraction of the sorted files (at least one when
    held_out > 0) are held out. ValueError when the training stream is shorter than one window (seq_len + 1)."""
    files = corpus_files(paths, pattern)
    count = int(np.ceil(held_out * len(files))) if held_out > 0 else 0
    if count >= len(files):
        raise ValueError(f"--held-out {held_out}: {len(files)} file(s) leave none to train on")
    train_files, held_files = files[: len(files) - count], files[len(files) - count:]
    train = tokenize_files(train_files, tokenizer, vocab_size)
    if train.size < seq_len + 1:
        raise ValueError(f"--text: the training files hold {train.size} tokens, fewer than one window of --seq-len "
                         f"{seq_len} + 1")
    return Corpus(train, tokenize_files(held_files, tokenizer, vocab_size), tuple(train_files), tuple(held_files))


def windows(stream: np.ndarray, seq_len: int, batch: int, seed: int, step: int, repeat: float = 0.0) -> np.ndarray:
    """`batch` windows of seq_len + 1 tokens at offsets drawn from default_rng([seed, step]): int32 [batch, L + 1].

    With `repeat` > 0, the first round(repeat * batch) windows get a copy of one of their own spans: m = (L + 1) // 4
    tokens from a random start j written again at a random later start k >= j + m (over what was there). Past its
    first tokens the copy is predictable only by finding the span earlier in the window and reading on from there:
    the in-context copying that a question about a long prompt needs, and that plain code, which repeats itself too
    rarely, does not teach in a few minutes of training. The distance k - j is random, so a fixed-offset copy does not
    pay (a copy always half a window back teaches exactly that, and nothing that transfers)."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, stream.size - seq_len, size=batch)
    rows = np.stack([stream[s: s + seq_len + 1] for s in starts])
    m = (seq_len + 1) // 4
    for i in range(int(round(repeat * batch))):
        j = rng.integers(0, seq_len + 2 - 2 * m)
        k = rng.integers(j + m, seq_len + 2 - m)
        rows[i, k: k + m] = rows[i, j: j + m]
    return rows


def lm_loss(model, params, tokens):
    """tokens int32 [B, L + 1] -> mean over B x L of -log p(tokens[:, 1:] | tokens[:, :-1]) (float32)."""
    def one(row):
        logits = model.forward(params, row[:-1]).astype(jnp.float32)  # [L, V]
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, row[1:, None], axis=-1))

    return jnp.mean(jax.vmap(one)(tokens))


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(2, 3))
def train_step(model, optimizer, params, opt_state, tokens):
    """One AdamW step on the batch's next-token loss -> (params, opt_state, loss before the update)."""
    loss, grads = jax.value_and_grad(lambda p: lm_loss(model, p, tokens))(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


@functools.partial(jax.jit, static_argnums=0)
def _eval_loss(model, params, tokens):
    return lm_loss(model, params, tokens)


def held_out_loss(model, params, stream: np.ndarray, seq_len: int, batch: int) -> float | None:
    """The mean next-token loss over the held-out stream's consecutive windows (at most 8 batches of them; the
    stream's tail shorter than a window left out); None when the stream holds no window."""
    count = min((stream.size - 1) // seq_len, 8 * batch)
    if count < 1:
        return None
    rows = np.stack([stream[i * seq_len: i * seq_len + seq_len + 1] for i in range(count)])
    losses = [float(_eval_loss(model, params, rows[i: i + batch])) * len(rows[i: i + batch])
              for i in range(0, count, batch)]
    return sum(losses) / count


def build_model(spec: str, vocab_size: int):
    """'tiny' (Qwen36Config.tiny(vocab_size)) or a config.json path (vocab_size must not exceed its own)."""
    if spec == "tiny":
        return models.build(models.Qwen36Config.tiny(vocab_size=vocab_size))
    if not os.path.isfile(spec):
        raise ValueError(f"--model {spec}: no such config file (or use 'tiny')")
    config = models.config_from_hf(spec)
    if config.vocab_size < vocab_size:
        raise ValueError(f"--model {spec}: vocab_size={config.vocab_size} < the tokenizer's {vocab_size} tokens")
    return models.build(config)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m longstraw_jax.pretrain", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--text", action="append", required=True, metavar="PATH",
                   help="a text file or a directory of them (repeatable)")
    p.add_argument("--glob", default="*", help="file pattern inside --text directories (default: every file)")
    p.add_argument("--tokenizer", required=True, metavar="DIR", help="a tokenizer directory (tokenizer.json)")
    p.add_argument("--model", default="tiny", help="'tiny' or a config.json (random init)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="the tiny model's vocabulary (default: the tokenizer's length)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--learning-rate", type=float, default=3e-3)
    p.add_argument("--lr-warmup-steps", type=int, default=0)
    p.add_argument("--held-out", type=float, default=0.0, metavar="F",
                   help="the last fraction F of the files (sorted) is not trained on: its loss is reported")
    p.add_argument("--repeat", type=float, default=0.0, metavar="F",
                   help="the share of each batch's windows that get one of their spans copied again at a random "
                        "later place (teaches copying from the context: `windows`)")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, metavar="DIR", help="the HF checkpoint directory to write (must not exist)")
    args = p.parse_args(argv)
    errors = [f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1"
              for name in ("seq_len", "batch", "steps", "log_every") if getattr(args, name) < 1]
    if not 0 <= args.repeat <= 1:
        errors.append(f"--repeat={args.repeat} must be in [0, 1]")
    if not 0 <= args.held_out < 1:
        errors.append(f"--held-out={args.held_out} must be in [0, 1)")
    if args.lr_warmup_steps < 0:
        errors.append(f"--lr-warmup-steps={args.lr_warmup_steps} must be >= 0")
    if os.path.exists(args.out):
        errors.append(f"--out {args.out}: already exists (nothing is overwritten)")
    if errors:
        p.error("; ".join(errors))
    return args


def pretrain(args: argparse.Namespace, say=print) -> dict:
    """The run of parsed arguments -> its summary {"steps", "loss_first", "loss_last", "held_out_before",
    "held_out_after", "seconds"}; writes --out."""
    from longstraw_jax.tasks.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer, args.vocab_size)
    vocab = args.vocab_size or len(tokenizer)
    model = build_model(args.model, vocab)
    corpus = load_corpus(args.text, tokenizer, model.config.vocab_size, args.glob, args.held_out, args.seq_len)
    say(f"corpus: {len(corpus.train_files)} training files, {corpus.train.size:,} tokens; {len(corpus.held_out_files)} "
        f"held out, {corpus.held_out.size:,} tokens; model {models.describe(model.config)}", flush=True)
    params = model.init(jax.random.key(args.seed), jnp.float32)
    optimizer = make_optimizer(args.learning_rate, lr_warmup_steps=args.lr_warmup_steps)
    opt_state = optimizer.init(params)
    records = [{"held_out_loss": held_out_loss(model, params, corpus.held_out, args.seq_len, args.batch), "step": 0}]
    start, losses = time.perf_counter(), []
    window_start, window_steps = start, 0  # the logging window's clock (its first step includes the compile)
    for step in range(args.steps):
        params, opt_state, loss = train_step(model, optimizer, params, opt_state,
                                             windows(corpus.train, args.seq_len, args.batch, args.seed, step,
                                                     args.repeat))
        losses.append(float(loss))
        window_steps += 1
        if not np.isfinite(losses[-1]):
            raise ValueError(f"step {step + 1}: the loss is {losses[-1]}: lower --learning-rate")
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            seconds = (time.perf_counter() - window_start) / window_steps
            records.append({"step": step + 1, "loss": float(np.mean(losses[-window_steps:])),
                            "tokens_per_s": args.batch * args.seq_len / seconds})
            say(f"step {step + 1}/{args.steps}: loss {records[-1]['loss']:.3f}, {seconds:.2f} s/step (means of the "
                f"last {window_steps})", flush=True)
            window_start, window_steps = time.perf_counter(), 0
    after = held_out_loss(model, params, corpus.held_out, args.seq_len, args.batch)
    records.append({"step": args.steps, "held_out_loss": after})
    os.makedirs(args.out)
    models.save_hf(model, params, args.out)
    tokenizer.save_pretrained(args.out)
    with open(os.path.join(args.out, "pretrain.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    summary = {"steps": args.steps, "loss_first": losses[0], "loss_last": losses[-1],
               "held_out_before": records[0]["held_out_loss"], "held_out_after": after,
               "seconds": time.perf_counter() - start}
    say(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}"
        + (f"; held-out {summary['held_out_before']:.3f} -> {after:.3f}" if after is not None else "")
        + f"; wrote {args.out} (python -m longstraw_jax.run --hf {args.out} ...)", flush=True)
    return summary


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        pretrain(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
