"""A dataset of prompts (`--data`) as a task: rows of text prompts or chat messages, tokenized with the checkpoint's
own tokenizer and chat template, served in a shuffled order that is a pure function of the data position.

    rows = read_dataset("trajectories.jsonl")        # JSONL, Parquet, or a directory from datasets' save_to_disk
    train, held_out = split_rows(len(rows), 0.05)    # or held-out rows from their own file (--eval-data)
    task = DatasetTask(rows, "trajectories.jsonl", train, tokenizer, PromptFormat(messages_field="messages"), seed=0)
    task.prompt(i)                                   # Prompt(tokens int32 [P_i], info = the row's other columns, text)

Rows are read with Hugging Face `datasets` (Arrow, memory-mapped: a row is read when it is drawn, so many
multi-megabyte rows never sit in memory together; JSONL and Parquet are converted once into datasets' cache,
`HF_DATASETS_CACHE`). A row gives the prompt as text (`prompt_field`) or as chat messages (`messages_field`: a list of
{role, content}, rendered with the tokenizer's chat template, `add_generation_prompt=True` plus
`chat_template_kwargs`); text is encoded without added special tokens (the template holds them). Every other column
goes to the reward functions (`Prompt.info`; tasks/rewards.py).

Order: training prompt number `index` (the trainer's data position * B + b) is row `rows[perm_e[index % N]]` of
epoch e = index // N, perm_e a permutation drawn from (seed, e): every epoch visits each training row once, and a
resumed run draws exactly the rows an uninterrupted one would. The held-out split of `split_rows` is drawn with a
fixed seed (`SPLIT_SEED`), so runs with different --seed hold out the same rows.

Lengths: prompts keep their real length (`max_prompt_len` with `truncate` = "left" drops the oldest tokens and keeps
the question at the end, "right" keeps the start, "error" refuses). Bad rows are ValueErrors naming the file, the row
(numbered from 0, as datasets counts) and the field; the checks that need only the table (a missing column, a row
without the prompt) run when the task is built, the others when a row is drawn.
"""
from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from longstraw_jax.tasks.base import Prompt

SPLIT_SEED = 0x5EED  # the held-out rows of --eval-fraction: the same whatever --seed
TRUNCATE = ("left", "right", "error")
RESERVED = ("prompts", "completions")  # the reward functions' own arguments: not column names


def read_dataset(path: str, option: str = "--data"):
    """The rows of `path` as a `datasets.Dataset`: a .jsonl / .json file, a .parquet file, or a directory written by
    `Dataset.save_to_disk` (a DatasetDict's "train" split, or its only one). ValueError naming `option` and `path`
    when it does not exist, cannot be read, or has no rows."""
    import datasets

    datasets.disable_progress_bars()
    log = datasets.utils.logging
    previous = log.get_verbosity()
    log.set_verbosity(log.CRITICAL)  # its own "failed to load" lines: the ValueError below says it in one line
    try:
        return _read(datasets, path, option)
    finally:
        log.set_verbosity(previous)


def _read(datasets, path: str, option: str):
    if not os.path.exists(path):
        raise ValueError(f"{option} {path}: no such file or directory")
    builders = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
    builder = builders.get(os.path.splitext(path)[1].lower())
    if not os.path.isdir(path) and builder is None:
        raise ValueError(f"{option} {path}: unknown format; give a .jsonl, .json or .parquet file or a directory "
                         "written by datasets' save_to_disk")
    try:
        if os.path.isdir(path):
            rows = datasets.load_from_disk(path)
            if isinstance(rows, datasets.DatasetDict):
                splits = list(rows)
                if "train" not in rows and len(splits) != 1:
                    raise ValueError(f"a DatasetDict with splits {splits} (need a 'train' split or a single one)")
                rows = rows["train" if "train" in rows else splits[0]]
        elif os.path.getsize(path) == 0:
            raise ValueError("the file is empty")
        else:
            rows = datasets.load_dataset(builder, data_files=path, split="train",
                                         cache_dir=os.environ.get("HF_DATASETS_CACHE"))
    except Exception as e:  # datasets / pyarrow raise many kinds; the cause says what is wrong with the file
        cause = e.__cause__ or e
        text = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        raise ValueError(f"{option} {path}: cannot read it: {text}") from None
    if len(rows) == 0:
        raise ValueError(f"{option} {path}: no rows (the data is empty)")
    return rows


def split_rows(count: int, fraction: float, path: str = "--data") -> tuple[np.ndarray, np.ndarray]:
    """(training rows, held-out rows), int64 sorted: round(count * fraction) rows drawn with `SPLIT_SEED` are held
    out. ValueError when that leaves no held-out row or no training row."""
    held = int(round(count * fraction))
    if not 1 <= held <= count - 1:
        raise ValueError(f"--eval-fraction={fraction} of the {count} rows of {path} holds out {held}; need at least "
                         "one held-out row and one training row")
    order = np.random.default_rng(SPLIT_SEED).permutation(count)
    return np.sort(order[held:]), np.sort(order[:held])


@dataclasses.dataclass(frozen=True)
class PromptFormat:
    """How a row becomes prompt tokens: exactly one of prompt_field (text) and messages_field (chat messages);
    chat_template_kwargs: extra keyword arguments of the chat template (JSON values, e.g. enable_thinking);
    max_prompt_len: None or the most tokens a prompt may have, with truncate in TRUNCATE."""

    prompt_field: str | None = None
    messages_field: str | None = None
    chat_template_kwargs: tuple[tuple[str, object], ...] = ()
    max_prompt_len: int | None = None
    truncate: str = "error"

    def __post_init__(self):
        if (self.prompt_field is None) == (self.messages_field is None):
            raise ValueError("give exactly one of --prompt-field and --messages-field")
        if self.truncate not in TRUNCATE:
            raise ValueError(f"--truncate={self.truncate!r} must be one of {', '.join(TRUNCATE)}")
        if self.max_prompt_len is not None and self.max_prompt_len < 2:
            raise ValueError(f"--max-prompt-len={self.max_prompt_len} must be >= 2")

    @property
    def field(self) -> str:
        return self.messages_field if self.messages_field is not None else self.prompt_field


def choose_format(columns, prompt_field: str | None, messages_field: str | None, **options) -> PromptFormat:
    """The PromptFormat of a dataset with `columns`: the field given, else the column 'prompt' (text) if there is
    one, else 'messages'. ValueError when the chosen column is missing."""
    if prompt_field is None and messages_field is None:
        if "prompt" in columns:
            prompt_field = "prompt"
        elif "messages" in columns:
            messages_field = "messages"
        else:
            raise ValueError(f"no 'prompt' or 'messages' column (columns: {sorted(columns)}); name the prompt's "
                             "column with --prompt-field (text) or --messages-field (chat messages)")
    fmt = PromptFormat(prompt_field=prompt_field, messages_field=messages_field, **options)
    if fmt.field not in columns:
        option = "--messages-field" if fmt.messages_field is not None else "--prompt-field"
        raise ValueError(f"{option} {fmt.field}: no such column (columns: {sorted(columns)})")
    return fmt


def first_null_row(rows, field: str, among=None) -> int | None:
    """The first row (of `among`, int [N] row numbers, default every row) whose `field` is null (missing in a JSON
    line), read from the Arrow column's validity bitmap without decoding any value; None when there is none (or the
    dataset has an index mapping: then rows are checked when drawn)."""
    if getattr(rows, "_indices", None) is not None:
        return None
    column = rows.data.column(field)
    if column.null_count == 0:
        return None
    import pyarrow.compute as pc

    null = np.asarray(pc.is_null(column))
    if among is not None:
        kept = np.zeros_like(null)
        kept[np.asarray(among, np.int64)] = True
        null &= kept
    found = np.flatnonzero(null)
    return int(found[0]) if found.size else None


def check_messages(value) -> list[dict]:
    """Chat messages of a row -> the messages for the chat template: each a dict with a string 'role' and a string
    'content' (null content only with tool_calls); other keys kept unless null (a column of Arrow structs gives
    every message every key). ValueError saying which message is wrong."""
    if not isinstance(value, list) or not value:
        raise ValueError(f"must be a non-empty list of {{role, content}} messages, not {shown(value)}")
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise ValueError(f"message {i} must be an object {{role, content}}, not {shown(message)}")
        if not isinstance(message.get("role"), str):
            raise ValueError(f"message {i} needs a string 'role' (has {shown(message.get('role'))})")
        content = message.get("content")
        if not isinstance(content, str) and not (content is None and message.get("tool_calls")):
            raise ValueError(f"message {i} needs a string 'content' (has {shown(content)})")
        messages.append({k: v for k, v in message.items() if v is not None or k == "content"})
    return messages


def shown(value) -> str:
    """A value as error messages show it: its repr (cut to 40 characters) and its type."""
    text = repr(value)
    return (text if len(text) <= 40 else text[:37] + "...") + f" ({type(value).__name__})"


class DatasetTask:
    """Prompts from the rows `rows` (indices into `dataset`) of a dataset; see the module docstring.

    dataset: a `datasets.Dataset`; path: its file (for messages); rows: int [N] the rows this task draws from;
    tokenizer: a transformers tokenizer; fmt: PromptFormat; seed: the order's seed; shuffle: False serves
    rows[index % N] in order (held-out prompts). prompt(index) -> Prompt(tokens int32 [P] (2 <= P, at most
    max_prompt_len), info = every other column of the row, text = the prompt's text)."""

    def __init__(self, dataset, path: str, rows, tokenizer, fmt: PromptFormat, seed: int = 0, shuffle: bool = True,
                 name: str | None = None):
        self.dataset, self.path, self.tokenizer, self.format = dataset, path, tokenizer, fmt
        self.rows = np.asarray(rows, np.int64)
        self.seed, self.shuffle = int(seed), shuffle
        self.name = name or f"data {path}"
        self.columns = [c for c in dataset.column_names if c != fmt.field]
        if len(self.rows) == 0:
            raise ValueError(f"{path}: no rows to draw from")
        reserved = sorted(set(self.columns) & set(RESERVED))
        if reserved:
            raise ValueError(f"{path}: columns {reserved} clash with the reward functions' own arguments "
                             "(prompts, completions): rename them")
        null = first_null_row(dataset, fmt.field)
        if null is not None:
            raise ValueError(f"{path}: row {null}: '{fmt.field}' is missing")
        self._orders: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.rows)

    def order(self, epoch: int) -> np.ndarray:
        """The permutation of epoch `epoch` (int64 [N]), drawn from (seed, epoch); the latest two are kept."""
        if epoch not in self._orders:
            if len(self._orders) >= 2:
                self._orders.pop(min(self._orders))
            self._orders[epoch] = np.random.default_rng([self.seed, epoch]).permutation(len(self.rows))
        return self._orders[epoch]

    def row_of(self, index: int) -> int:
        """The dataset row of prompt number `index` (>= 0)."""
        epoch, within = divmod(int(index), len(self.rows))
        return int(self.rows[self.order(epoch)[within] if self.shuffle else within])

    def prompt(self, index: int) -> Prompt:
        return self.render(self.row_of(index))

    def render(self, row: int) -> Prompt:
        """Row `row` of the dataset -> its Prompt (info: the other columns, plus nothing else)."""
        record = self.dataset[row]
        field = self.format.field
        where = f"{self.path}: row {row}: '{field}'"
        value = record.get(field)
        try:
            if self.format.messages_field is not None:
                text = self._chat(check_messages(value))
            elif not isinstance(value, str) or not value:
                raise ValueError(f"must be a non-empty string, not {shown(value)}")
            else:
                text = value
            tokens = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            tokens, text = self._fit(np.asarray(tokens, np.int32), text)
        except ValueError as e:
            raise ValueError(f"{where} {e}") from None
        return Prompt(tokens, {c: record[c] for c in self.columns}, text)

    def _chat(self, messages: list[dict]) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                      **dict(self.format.chat_template_kwargs))
        except Exception as e:  # a template raising on these messages (jinja's own errors included)
            text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(f"the tokenizer's chat template fails on these messages: {text}") from None

    def _fit(self, tokens: np.ndarray, text: str) -> tuple[np.ndarray, str]:
        """--max-prompt-len / --truncate: (tokens, text) as they are, or the kept part (text decoded from it)."""
        limit = self.format.max_prompt_len
        if limit is not None and len(tokens) > limit:
            if self.format.truncate == "error":
                raise ValueError(f"has {len(tokens)} tokens, more than --max-prompt-len={limit} (--truncate left "
                                 "keeps the last tokens, right the first)")
            tokens = tokens[-limit:] if self.format.truncate == "left" else tokens[:limit]
            text = self.tokenizer.decode(tokens.tolist(), skip_special_tokens=False)
        if len(tokens) < 2:
            raise ValueError(f"has {len(tokens)} token(s); a prompt needs at least 2")
        return tokens, text


def template_kwargs(text: str | None) -> tuple[tuple[str, object], ...]:
    """--chat-template-kwargs JSON object -> sorted (key, value) pairs (hashable); ValueError when it is not one."""
    if text is None:
        return ()
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ValueError(f"--chat-template-kwargs={text!r} is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"--chat-template-kwargs={text!r} must be a JSON object, e.g. '{{\"enable_thinking\": "
                         "false}'")
    return tuple(sorted(value.items()))
