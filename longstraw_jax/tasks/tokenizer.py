"""A checkpoint's tokenizer: loaded from its directory with transformers' `AutoTokenizer` (no torch needed), checked
against the model's vocabulary, and the ids that end a response (the checkpoint's end-of-turn / EOS ids).

    tokenizer = load_tokenizer("ckpt_dir", vocab_size=model.config.vocab_size)
    stops = stop_ids(tokenizer, "ckpt_dir")          # generation_config.json's eos_token_id(s) + the tokenizer's EOS

transformers is imported here, inside the functions: `import longstraw_jax` stays light.
"""
from __future__ import annotations

import json
import os

# any of these marks a directory that holds a tokenizer (fast: tokenizer.json; slow: a vocabulary / model file)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def load_tokenizer(path: str, vocab_size: int | None = None, option: str = "--tokenizer"):
    """The transformers tokenizer in directory `path` (local files only: never the network). ValueError naming
    `option` and `path` when the directory does not exist, holds no tokenizer files, cannot be loaded, or (with
    `vocab_size`) has more tokens than the model's vocabulary (len(tokenizer) counts the added tokens)."""
    if not os.path.isdir(path):
        raise ValueError(f"{option} {path}: no such directory (a tokenizer directory: tokenizer.json / "
                         "tokenizer_config.json)")
    if not any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES):
        raise ValueError(f"{option} {path}: no tokenizer files there (need one of {', '.join(TOKENIZER_FILES)})")
    from transformers import AutoTokenizer
    from transformers.utils import logging

    logging.set_verbosity_error()  # e.g. "no model type": the tokenizer alone is what we load
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # transformers raises OSError, ValueError, KeyError, ... for broken files
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{option} {path}: cannot load the tokenizer: {text}") from None
    if vocab_size is not None and len(tokenizer) > vocab_size:
        raise ValueError(f"{option} {path}: the tokenizer has {len(tokenizer)} tokens, more than the model's "
                         f"vocab_size={vocab_size}: it does not belong to this model")
    return tokenizer


def generation_eos_ids(directory: str | None) -> tuple[int, ...]:
    """eos_token_id of `directory`/generation_config.json (an int or a list of ints), or () when there is none."""
    path = os.path.join(directory, "generation_config.json") if directory else None
    if path is None or not os.path.isfile(path):
        return ()
    try:
        with open(path) as f:
            value = json.load(f).get("eos_token_id")
    except (OSError, ValueError, AttributeError) as e:
        raise ValueError(f"{path}: not a readable JSON object ({e})") from None
    values = value if isinstance(value, list) else [] if value is None else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ValueError(f"{path}: eos_token_id={value!r} must be a token id or a list of them")
    return tuple(values)


def stop_ids(tokenizer, *directories: str | None) -> tuple[int, ...]:
    """The ids that end a response: each directory's generation_config.json eos_token_id(s) (the tokenizer's
    directory first, then the checkpoint's), then the tokenizer's own EOS token; in that order, without repeats."""
    ids = [i for d in dict.fromkeys(d for d in directories if d) for i in generation_eos_ids(d)]
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(int(tokenizer.eos_token_id))
    return tuple(dict.fromkeys(ids))
