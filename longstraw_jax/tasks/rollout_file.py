"""Externally generated rollouts (e.g. sampled with vLLM or SGLang): one GRPO group per JSONL line.

    {"prompt": [ids...] | "prompt_text": "...",
     "responses": [[ids...], ...] | "responses_text": ["...", ...] | "turns": [[turn, ...], ...],
                                                      G >= 1 non-empty responses
     "rewards": [r_1, ..., r_G],                      finite numbers within float32 range (not true/false)
     "loss_mask": [[0 | 1, ...], ...],   optional, one per response token: 0 = read, not trained on (an agent's tool
                                     output, docs/architecture.md 11); every response keeps at least one 1
     "old_logprobs": [[...], ...],   optional, one per response token (log-probs <= 0 under the sampling policy;
                                     any number where loss_mask is 0)
     "ref_logprobs": [[...], ...]}   optional, likewise (for the k3 KL: required on every line when kl_coef > 0)

A multi-turn trajectory made by another agent harness comes as "turns": each response a list of {"role":
"assistant" | "tool", "tokens": [ids...] | "text": "..."}, concatenated in order; the assistant's tokens are
trained on (loss mask 1), the tool's only read (0). Or as "responses" with a "loss_mask".

Text fields need a `tokenizer.json` (Hugging Face `tokenizers`; encoded without added special tokens), given as the
file or as a directory holding it (a checkpoint's). Responses
are right-padded with `pad_token` (mask 0) to the longest response in the file, so every group of one prompt length
and group size compiles to the same step. Every line is checked when the file is read; a bad line raises a
ValueError naming the file, the line number and the field.
"""
from __future__ import annotations

import json
import os

import numpy as np

from longstraw_jax.grpo import GroupBatch
from longstraw_jax.tasks import reward_problem


def load_rollouts(path: str | os.PathLike, vocab_size: int, tokenizer_path: str | None = None,
                  pad_token: int = 0, required: dict[str, str] | None = None) -> list[GroupBatch]:
    """Every line of `path` as a GroupBatch (numpy arrays), in file order. Blank lines are skipped.

    tokenizer_path: tokenizer.json, or a directory holding one (needed for text fields).
    required: optional field -> why it is needed (e.g. {"ref_logprobs": "--kl-coef=0.1 needs it"}); a line without
    it is an error naming the line and the reason.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        raise ValueError(f"rollout file {path} is a directory; --rollouts takes one JSONL file (one group per line)")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"rollout file {path} does not exist")
    tokenizer = None
    if tokenizer_path is not None:
        from tokenizers import Tokenizer  # only text fields need it: not imported for id-only files

        if os.path.isdir(tokenizer_path):  # a checkpoint's (or tokenizer's) directory: its tokenizer.json
            tokenizer_path = os.path.join(tokenizer_path, "tokenizer.json")
        if not os.path.isfile(tokenizer_path):
            raise FileNotFoundError(f"tokenizer file {tokenizer_path} does not exist")
        tokenizer = Tokenizer.from_file(tokenizer_path)
    groups = []
    with open(path) as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                try:
                    record = json.loads(line)
                    for field, why in (required or {}).items():
                        if isinstance(record, dict) and field not in record:
                            raise ValueError(f"'{field}' is missing; {why}")
                    groups.append(_parse_group(record, vocab_size, tokenizer))
                except (ValueError, TypeError, KeyError) as e:
                    raise ValueError(f"{path}:{number}: {e}") from None
    if not groups:
        raise ValueError(f"{path}: no rollout groups (the file is empty)")
    length = max(len(r) for g in groups for r in g["responses"])
    return [_pad(g, length, pad_token) for g in groups]


def _token_list(value, field: str, vocab_size: int) -> np.ndarray:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ValueError(f"'{field}' must be a list of integer token ids")
    try:
        ids = np.asarray(value, np.int64)
    except OverflowError:  # beyond int64: found in Python (only on this error path)
        where = next(i for i, t in enumerate(value) if not 0 <= t < vocab_size)
        raise ValueError(f"'{field}'[{where}] = {value[where]} is out of range: token ids must be in "
                         f"[0, vocab_size={vocab_size})") from None
    bad = np.flatnonzero((ids < 0) | (ids >= vocab_size))
    if bad.size:
        raise ValueError(f"'{field}'[{bad[0]}] = {ids[bad[0]]} is out of range: token ids must be in "
                         f"[0, vocab_size={vocab_size})")
    return ids.astype(np.int32)


def _encode(text, field: str, tokenizer) -> list[int]:
    if tokenizer is None:
        raise ValueError(f"'{field}' is text: pass a tokenizer.json (--tokenizer) to encode it")
    if not isinstance(text, str):
        raise ValueError(f"'{field}' must be a string")
    return tokenizer.encode(text, add_special_tokens=False).ids


def _parse_group(record, vocab_size: int, tokenizer) -> dict:
    if not isinstance(record, dict):
        raise ValueError("each line must be a JSON object")
    known = {"prompt", "prompt_text", "responses", "responses_text", "turns", "rewards", "loss_mask", "old_logprobs",
             "ref_logprobs"}
    unknown = sorted(set(record) - known)
    if unknown:
        raise ValueError(f"unknown field(s) {unknown}; allowed: {sorted(known)}")
    if ("prompt" in record) == ("prompt_text" in record):
        raise ValueError("give exactly one of 'prompt' (token ids) and 'prompt_text'")
    if sum(name in record for name in ("responses", "responses_text", "turns")) != 1:
        raise ValueError("give exactly one of 'responses' (token id lists), 'responses_text' and 'turns'")
    if "turns" in record and "loss_mask" in record:
        raise ValueError("'turns' gives the loss mask by role: drop 'loss_mask'")
    if "prompt" in record:
        prompt = _token_list(record["prompt"], "prompt", vocab_size)
    else:
        prompt = _token_list(_encode(record["prompt_text"], "prompt_text", tokenizer), "prompt_text", vocab_size)
    if len(prompt) < 2:
        raise ValueError(f"'prompt' has {len(prompt)} token(s); need at least 2")
    field = next(name for name in ("responses", "responses_text", "turns") if name in record)
    raw = record[field]
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"'{field}' must be a non-empty list (G >= 1 responses)")
    masks = None
    if field == "turns":
        raw, masks = zip(*(_turns(turns, g, vocab_size, tokenizer) for g, turns in enumerate(raw)))
    if field == "responses_text":
        raw = [_encode(text, f"responses_text[{g}]", tokenizer) for g, text in enumerate(raw)]
    responses = [_token_list(r, f"{field}[{g}]", vocab_size) for g, r in enumerate(raw)]
    for g, response in enumerate(responses):
        if len(response) == 0:
            raise ValueError(f"'{field}[{g}]' is empty: every response needs at least one token")
    if "loss_mask" in record:
        masks = _loss_masks(record["loss_mask"], responses)
    if masks is not None:
        for g, mask in enumerate(masks):
            if not np.any(mask):
                raise ValueError(f"response {g} has no token with loss mask 1: nothing of it would be trained on")
    rewards = record.get("rewards")
    if not isinstance(rewards, list) or len(rewards) != len(responses):
        raise ValueError(f"'rewards' must be a list of {len(responses)} numbers (one per response)")
    for g, r in enumerate(rewards):
        problem = reward_problem(r)
        if problem is not None:
            raise ValueError(f"'rewards'[{g}] = {problem[0]}; {problem[1]}")
    group = {"prompt": prompt, "responses": responses, "rewards": np.asarray(rewards, np.float32)}
    if masks is not None:
        group["loss_mask"] = [np.asarray(m, np.float32) for m in masks]
    for name in ("old_logprobs", "ref_logprobs"):
        if name in record:
            values = record[name]
            if not isinstance(values, list) or len(values) != len(responses):
                raise ValueError(f"'{name}' must be a list of {len(responses)} lists (one per response)")
            rows = []
            for g, (row, response) in enumerate(zip(values, responses)):
                if not isinstance(row, list) or len(row) != len(response):
                    raise ValueError(f"'{name}'[{g}] must have {len(response)} numbers (one per response token)")
                if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in row):
                    raise ValueError(f"'{name}'[{g}] must be a list of numbers")
                row = np.asarray(row, np.float64)
                trained = np.ones(len(row), bool) if masks is None else np.asarray(masks[g]) > 0
                row = np.where(trained, row, 0.0)  # read-only tokens' values are never used
                for bad, rule in ((~np.isfinite(row), "log-probs must be finite"), (row > 0, "log-probs must be <= 0")):
                    if bad.any():
                        t = int(np.flatnonzero(bad)[0])
                        raise ValueError(f"'{name}'[{g}][{t}] = {float(row[t])}; {rule}")
                rows.append(row.astype(np.float32))
            group[name] = rows
    return group


def _turns(turns, g: int, vocab_size: int, tokenizer) -> tuple[list[int], list[int]]:
    """Response g given as turns -> (its token ids, its loss mask: 1 on the assistant's tokens, 0 on the tool's)."""
    if not isinstance(turns, list) or not turns:
        raise ValueError(f"'turns'[{g}] must be a non-empty list of {{\"role\", \"tokens\" | \"text\"}} objects")
    ids, mask = [], []
    for k, turn in enumerate(turns):
        where = f"'turns'[{g}][{k}]"
        if not isinstance(turn, dict) or turn.get("role") not in ("assistant", "tool"):
            raise ValueError(f"{where} must be an object with role 'assistant' or 'tool'")
        if ("tokens" in turn) == ("text" in turn) or set(turn) - {"role", "tokens", "text"}:
            raise ValueError(f"{where} must have 'role' and exactly one of 'tokens' and 'text'")
        tokens = turn["tokens"] if "tokens" in turn else _encode(turn["text"], where, tokenizer)
        tokens = _token_list(tokens, where, vocab_size).tolist()
        ids += tokens
        mask += [int(turn["role"] == "assistant")] * len(tokens)
    return ids, mask


def _loss_masks(values, responses) -> list[np.ndarray]:
    if not isinstance(values, list) or len(values) != len(responses):
        raise ValueError(f"'loss_mask' must be a list of {len(responses)} lists (one per response)")
    masks = []
    for g, (row, response) in enumerate(zip(values, responses)):
        if not isinstance(row, list) or len(row) != len(response) or any(v not in (0, 1) or isinstance(v, float)
                                                                         for v in row):
            raise ValueError(f"'loss_mask'[{g}] must be {len(response)} values 0 or 1 (one per response token)")
        masks.append(np.asarray(row, np.float32))
    return masks


def _pad(group: dict, length: int, pad_token: int) -> GroupBatch:
    g = len(group["responses"])
    responses = np.full((g, length), pad_token, np.int32)
    mask = np.zeros((g, length), np.float32)
    for i, response in enumerate(group["responses"]):
        responses[i, : len(response)] = response
        mask[i, : len(response)] = group["loss_mask"][i] if "loss_mask" in group else 1.0

    def rows(name):
        if name not in group:
            return None
        out = np.zeros((g, length), np.float32)
        for i, row in enumerate(group[name]):
            out[i, : len(row)] = row
        return out

    return GroupBatch(prompt=group["prompt"], responses=responses, mask=mask, rewards=group["rewards"],
                      old_logprobs=rows("old_logprobs"), ref_logprobs=rows("ref_logprobs"))
