"""Build the stdlib question-answering example: a long-context dataset from the Python standard library's own sources
and a byte-level BPE tokenizer trained on them (a transformers tokenizer directory with a ChatML chat template).

    python examples/stdlib_qa/build.py --out data/stdlib_qa      # then: python -m longstraw_jax.run --config
                                                                  #       configs/stdlib_qa.toml

Each row is one prompt: several stdlib modules concatenated (each under a `# file: <path>` line) followed by one
question (`--question`):

- `default`: "What is the default value of the parameter `p` of `f`?", whose answer is the default exactly as the
  source writes it (`None`, `0`, `'strict'`, ...). `f` is defined (`def f(`) in exactly one file of the prompt. The
  answer is drawn uniformly from the default values both splits offer (`None` is the most common default in the
  sources; drawn that way it would reward a policy that reads nothing). Rows are {"messages": [system, user],
  "answer", "file", "function", "parameter", "files", "prompt_tokens"}.
- `next_name`: "Which name comes next in the line `<prefix>`?", where `<prefix>` is the start of a source line (its
  indentation dropped) that occurs exactly once in the prompt's files, and the answer is the identifier that follows
  it there (4+ characters; not a keyword, a builtin or a name found in over 10 % of the modules, such as `self`).
  Finding the line and copying what follows it is in-context copying, which a model pre-trained on code picks up
  given enough training (`python -m longstraw_jax.pretrain` on `corpus/`; docs/benchmarks.md 6d: minutes on a
  2-core CPU are not enough). Rows are {"messages", "answer", "file", "prefix", "files",
  "prompt_tokens"}.
- `complete`: the same cut as a code completion, without a chat: the prompt is the files followed by the asked line
  again, as indented in its file, up to the name (its trailing whitespace left to the completion, so the name's
  token is the one the files hold, ` load` rather than `load` after `import`); the prefix without that whitespace
  occurs exactly once in the files. The completion's first name is the answer (reward.py `first_name`): a base
  that copies from its context answers it with no chat format to learn. Rows are {"prompt", "answer", "file",
  "prefix", "files", "prompt_tokens"}.

The modules are split into training and held-out modules (`--held-out-fraction`), so held-out questions ask about
functions no training prompt contains. Everything is a pure function of the options and the Python installation's
standard library (the same Python version gives the same files): rebuilding gives identical bytes.

Writes into --out: tokenizer/ (tokenizer.json, tokenizer_config.json with the chat template), train.jsonl,
held_out.jsonl, held_out_no_read.jsonl (the held-out rows without their files: the question alone, for the no-read
baseline `python -m longstraw_jax.evaluate --eval-data`), manifest.json (the options, the Python version, row counts
and prompt lengths in tokens) and corpus/ (a pre-training corpus: every stdlib source of up to CORPUS_MAX_CHARS
characters that no held-out prompt holds, one file each, under its `# file:` header).
"""
from __future__ import annotations

import argparse
import ast
import builtins
import dataclasses
import io
import json
import keyword
import os
import re
import sys
import sysconfig
import tokenize

import numpy as np

SYSTEM = "Read the Python source files and answer the question with the value only."
QUESTION = "What is the default value of the parameter `{parameter}` of `{function}`?"
NEXT_SYSTEM = "Read the Python source files and answer the question with the name only."
NEXT_QUESTION = "Which name comes next in the line `{prefix}`?"
QUESTION_KINDS = ("default", "next_name", "complete")
CORPUS_MAX_CHARS = 100_000  # the largest source file written to corpus/
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
HEADER = "# file: {path}\n"
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # pad, turn start, end of turn (the stop token)
CHAT_TEMPLATE = ("{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
                 "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                 "{%- endif %}")
SKIPPED_DIRS = {"test", "tests", "idlelib", "site-packages", "ensurepip", "lib2to3", "turtledemo", "__pycache__",
                "tkinter", "pydoc_data", "encodings"}


@dataclasses.dataclass(frozen=True)
class BuildConfig:
    """rows / held_out_rows: prompts of each split; min_tokens <= every prompt's length in tokens <= max_tokens (the
    rendered chat, generation prompt included); vocab_size: the tokenizer's vocabulary (special tokens included);
    min_chars / max_chars: the sizes of the modules used; max_answer_chars: the longest default asked about;
    held_out_fraction: the share of modules only held-out prompts use; seed: every random choice; question: the kind
    of question (QUESTION_KINDS: the module's docstring)."""

    rows: int = 512
    held_out_rows: int = 64
    min_tokens: int = 4096
    max_tokens: int = 5120
    vocab_size: int = 2048
    min_chars: int = 300
    max_chars: int = 10000
    max_answer_chars: int = 12
    held_out_fraction: float = 0.2
    seed: int = 0
    question: str = "default"

    def __post_init__(self):
        errors = [f"--{name.replace('_', '-')}={getattr(self, name)} must be >= {low}"
                  for name, low in (("rows", 1), ("held_out_rows", 1), ("min_tokens", 16), ("vocab_size", 300),
                                    ("min_chars", 1), ("max_answer_chars", 1), ("seed", 0))
                  if getattr(self, name) < low]
        if self.max_tokens < self.min_tokens:
            errors.append(f"--max-tokens={self.max_tokens} must be >= --min-tokens={self.min_tokens}")
        if self.max_chars < self.min_chars:
            errors.append(f"--max-chars={self.max_chars} must be >= --min-chars={self.min_chars}")
        if self.question not in QUESTION_KINDS:
            errors.append(f"--question={self.question} must be one of {', '.join(QUESTION_KINDS)}")
        if not 0 < self.held_out_fraction < 1:
            errors.append(f"--held-out-fraction={self.held_out_fraction} must be in (0, 1)")
        if errors:
            raise ValueError("; ".join(errors))


@dataclasses.dataclass(frozen=True)
class Default:
    """One question a module can answer: `def function(` with parameter `parameter` whose default is `answer` (its
    source text)."""

    function: str
    parameter: str
    answer: str


@dataclasses.dataclass(frozen=True)
class Module:
    """A stdlib source file: path relative to the stdlib directory ('json/decoder.py'), its text, its questions."""

    path: str
    text: str
    defaults: tuple[Default, ...]

    @property
    def segment(self) -> str:
        """The module as it appears in a prompt: the header line, the source, a blank line."""
        return HEADER.format(path=self.path) + self.text.rstrip("\n") + "\n\n"


def stdlib_dir() -> str:
    """This Python's standard library directory (its .py sources)."""
    return sysconfig.get_paths()["stdlib"]


def literal_defaults(text: str, max_answer_chars: int) -> tuple[Default, ...]:
    """The (function, parameter, default) triples of every `def` in `text` whose default is a literal (a constant,
    or a negated number) of at most max_answer_chars characters and on one line; () if the text does not parse."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return ()
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        args = node.args
        positional = args.posonlyargs + args.args
        pairs = list(zip(positional[len(positional) - len(args.defaults):], args.defaults))
        pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
        for arg, default in pairs:
            literal = isinstance(default, ast.Constant) or (
                isinstance(default, ast.UnaryOp) and isinstance(default.op, ast.USub)
                and isinstance(default.operand, ast.Constant))
            source = ast.get_source_segment(text, default)
            if literal and source and "\n" not in source and len(source) <= max_answer_chars:
                found.append(Default(node.name, arg.arg, source))
    return tuple(found)


def stdlib_sources(root: str, min_chars: int, max_chars: int):
    """(path relative to root, text) of the .py files under root outside SKIPPED_DIRS (and not test*) with
    min_chars..max_chars bytes of ASCII text, in sorted order; newlines normalised."""
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in SKIPPED_DIRS and not d.startswith("test"))
        for name in sorted(files):
            path = os.path.join(directory, name)
            if (not name.endswith(".py") or name.startswith("test")
                    or not min_chars <= os.path.getsize(path) <= max_chars):
                continue
            with open(path, "rb") as f:
                raw = f.read()
            if raw.isascii():
                yield os.path.relpath(path, root).replace(os.sep, "/"), raw.decode("ascii").replace("\r\n", "\n")


def parses(text: str) -> bool:
    try:
        ast.parse(text)
    except (SyntaxError, ValueError):
        return False
    return True


def read_modules(config: BuildConfig, root: str | None = None) -> list[Module]:
    """The stdlib modules the example uses, sorted by path: .py files outside SKIPPED_DIRS with min_chars..max_chars
    characters of ASCII text that parse and (for `default` questions) have at least one literal default."""
    modules = []
    for path, text in stdlib_sources(root or stdlib_dir(), config.min_chars, config.max_chars):
        defaults = literal_defaults(text, config.max_answer_chars)
        if defaults or (config.question != "default" and parses(text)):
            modules.append(Module(path, text, defaults))
    return sorted(modules, key=lambda m: m.path)


def train_tokenizer(modules: list[Module], vocab_size: int, extra: tuple[str, ...] = ()):
    """A byte-level BPE (`tokenizers`) trained on the modules' prompt segments (and the `extra` texts), wrapped as a
    transformers fast tokenizer with the ChatML template: pad <|endoftext|>, EOS <|im_end|> (the end of the
    assistant's turn)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = [m.segment for m in modules] + [SYSTEM, QUESTION, *extra]
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=SPECIAL[2], pad_token=SPECIAL[0],
                                   chat_template=CHAT_TEMPLATE, clean_up_tokenization_spaces=False)


def defined_in(function: str, modules: list[Module]) -> list[str]:
    """The paths of the modules whose text has `def function(` (async included)."""
    pattern = re.compile(rf"\bdef {re.escape(function)}\(")
    return [m.path for m in modules if pattern.search(m.text)]


def messages(modules: list[Module], question: Default) -> list[dict]:
    """The chat of one prompt: the system line, then the modules' segments and the question as the user turn."""
    user = "".join(m.segment for m in modules) + QUESTION.format(parameter=question.parameter,
                                                                function=question.function)
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def questions(module: Module) -> dict[str, list[Default]]:
    """{answer: the module's questions with that answer}: (function, parameter) pairs whose default is the same
    wherever the module defines them (a name defined twice, e.g. in two classes, with different defaults is left
    out)."""
    answers: dict[tuple[str, str], set[str]] = {}
    for d in module.defaults:
        answers.setdefault((d.function, d.parameter), set()).add(d.answer)
    out: dict[str, list[Default]] = {}
    for (function, parameter), values in sorted(answers.items()):
        if len(values) == 1:
            value = next(iter(values))
            out.setdefault(value, []).append(Default(function, parameter, value))
    return out


def common_answers(modules: list[Module], min_modules: int) -> list[str]:
    """The answers (default values) at least `min_modules` of the modules can be asked about, sorted."""
    counts: dict[str, int] = {}
    for m in modules:
        for value in questions(m):
            counts[value] = counts.get(value, 0) + 1
    return sorted(v for v, n in counts.items() if n >= min_modules)


def prompt_length(tokenizer, chat: list[dict]) -> int:
    """Tokens of the rendered chat with the generation prompt (what the trainer captures)."""
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def fill_around(module: Module, pool: list[Module], sizes: dict[str, int], config: BuildConfig,
                rng: np.random.Generator, excluded) -> list[Module] | None:
    """`module` and other modules of the pool (sizes: each one's segment length in tokens), in random order, until
    the prompt holds about min_tokens; a module that would pass max_tokens or for which excluded(module) is true is
    skipped. `module` sits at a random place among them. None when the pool cannot fill min_tokens."""
    others, total = [], 64 + sizes[module.path]  # 64: the system line, the question and the template, roughly
    for i in rng.permutation(len(pool)):
        if total >= config.min_tokens:
            break
        other = pool[i]
        if other.path != module.path and total + sizes[other.path] <= config.max_tokens - 64 and not excluded(other):
            others.append(other)
            total += sizes[other.path]
    if total < config.min_tokens - 64:
        return None  # short even if the estimate of the template's tokens is off by 64
    place = int(rng.integers(len(others) + 1))
    return others[:place] + [module] + others[place:]


def build_row(pool: list[Module], answers: list[str], sizes: dict[str, int], tokenizer, config: BuildConfig,
              rng: np.random.Generator, attempts: int = 100) -> dict:
    """One row: an answer drawn uniformly from `answers` (so that no answer dominates: always answering `None` scores
    about 1 / len(answers)), a module of `pool` with a question of that answer, then other modules of the pool (sizes:
    each one's segment length in tokens) until the prompt holds at least min_tokens; a module that would pass
    max_tokens or that also defines the asked function is skipped. The asked module sits at a random place among
    them. Drawn again when the rendered prompt's length is outside min_tokens..max_tokens, at most `attempts`
    times."""
    for _ in range(attempts):
        answer = answers[rng.integers(len(answers))]
        holders = [m for m in pool if answer in questions(m)]
        if not holders:
            continue
        module = holders[rng.integers(len(holders))]
        offered = questions(module)[answer]
        question = offered[rng.integers(len(offered))]
        chosen = fill_around(module, pool, sizes, config, rng, lambda other: defined_in(question.function, [other]))
        if chosen is None:
            continue
        chat = messages(chosen, question)
        length = prompt_length(tokenizer, chat)
        if config.min_tokens <= length <= config.max_tokens:
            break
    else:
        raise ValueError(f"cannot fill a prompt of {config.min_tokens}..{config.max_tokens} tokens with a question "
                         f"from {len(pool)} modules: lower --min-tokens or raise --max-tokens / --max-chars")
    return {"messages": chat, "answer": question.answer, "file": module.path, "function": question.function,
            "parameter": question.parameter, "files": [m.path for m in chosen], "prompt_tokens": length}


def in_long_strings(text: str) -> set[int]:
    """The 1-based numbers of the lines that hold part of a string spanning several lines (docstrings: prose, not
    code)."""
    rows = set()
    try:
        for token in tokenize.generate_tokens(io.StringIO(text).readline):
            if token.type == tokenize.STRING and token.end[0] > token.start[0]:
                rows.update(range(token.start[0], token.end[0] + 1))
    except (tokenize.TokenError, SyntaxError):
        pass
    return rows


def next_name_cuts(text: str, common: frozenset[str]) -> list[tuple[str, str]]:
    """Every (prefix, name) of the module's code a `next_name` question can ask: `name` a whole identifier of 4+
    characters, not a keyword, a builtin or in `common`, and not an attribute (no `.` before it); `prefix` the line
    before it with its indentation dropped, 12+ characters, outside a string literal (an even number of each quote),
    without a comment or backticks. Lines of docstrings and other multi-line strings are skipped."""
    prose = in_long_strings(text)
    cuts = []
    for number, line in enumerate(text.splitlines(), 1):
        body = line.lstrip()
        if not body or number in prose or "#" in body or "`" in body:
            continue
        for match in NAME.finditer(body):
            name, prefix = match.group(), body[: match.start()]
            if (len(prefix) >= 12 and len(name) >= 4 and not keyword.iskeyword(name) and not hasattr(builtins, name)
                    and name not in common and not prefix[-1].isdigit() and prefix[-1] != "."
                    and prefix.count("'") % 2 == 0 and prefix.count('"') % 2 == 0):
                cuts.append((prefix, name))
    return cuts


def common_names(modules: list[Module], share: float = 0.1) -> frozenset[str]:
    """The identifiers found in more than `share` of the modules (`self`, `name`, ...): answers a policy could give
    without reading."""
    counts: dict[str, int] = {}
    for m in modules:
        for name in set(NAME.findall(m.text)):
            counts[name] = counts.get(name, 0) + 1
    return frozenset(name for name, n in counts.items() if n > share * len(modules))


def build_next_name_row(pool: list[Module], sizes: dict[str, int], common: frozenset[str], tokenizer,
                        config: BuildConfig, rng: np.random.Generator, attempts: int = 100) -> dict:
    """One `next_name` or `complete` row: a module of the pool, filled around with others (fill_around), then a
    (prefix, name) cut of that module drawn uniformly among those whose prefix (for `complete`: without its trailing
    whitespace) occurs exactly once in the prompt's files. Drawn again when no cut is unique or the prompt's length
    is outside min_tokens..max_tokens, at most `attempts` times."""
    complete = config.question == "complete"
    for _ in range(attempts):
        module = pool[rng.integers(len(pool))]
        chosen = fill_around(module, pool, sizes, config, rng, lambda other: False)
        if chosen is None:
            continue
        files = "".join(m.segment for m in chosen)
        cuts = [(prefix.rstrip() if complete else prefix, name) for prefix, name in next_name_cuts(module.text, common)]
        cuts = [c for c in cuts if files.count(c[0]) == 1]
        if not cuts:
            continue
        prefix, name = cuts[rng.integers(len(cuts))]
        if complete:  # the files, then the asked line again, indented as in its file, up to the name
            at = files.index(prefix)
            prompt = files + files[files.rindex("\n", 0, at) + 1: at] + prefix
            row = {"prompt": prompt}
            length = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        else:
            row = {"messages": [{"role": "system", "content": NEXT_SYSTEM},
                                {"role": "user", "content": files + NEXT_QUESTION.format(prefix=prefix)}]}
            length = prompt_length(tokenizer, row["messages"])
        if config.min_tokens <= length <= config.max_tokens:
            return {**row, "answer": name, "file": module.path, "prefix": prefix, "files": [m.path for m in chosen],
                    "prompt_tokens": length}
    raise ValueError(f"cannot fill a prompt of {config.min_tokens}..{config.max_tokens} tokens with a "
                     f"{config.question} question from {len(pool)} modules: lower --min-tokens or raise --max-tokens / "
                     "--max-chars")


def build(config: BuildConfig, root: str | None = None):
    """-> (tokenizer, training rows, held-out rows): modules split into training and held-out modules, the tokenizer
    trained on all of them, rows built from each split's modules."""
    modules = read_modules(config, root)
    if len(modules) < 10:
        raise ValueError(f"only {len(modules)} stdlib modules of {config.min_chars}..{config.max_chars} characters "
                         f"under {root or stdlib_dir()}: widen --min-chars / --max-chars")
    # next_name and complete share a tokenizer (one pre-trained base serves both)
    extra = (NEXT_SYSTEM, NEXT_QUESTION) if config.question != "default" else ()
    tokenizer = train_tokenizer(modules, config.vocab_size, extra)
    rng = np.random.default_rng(config.seed)
    order = rng.permutation(len(modules))
    held = max(1, int(round(len(modules) * config.held_out_fraction)))
    held_out_pool = sorted((modules[i] for i in order[:held]), key=lambda m: m.path)
    train_pool = sorted((modules[i] for i in order[held:]), key=lambda m: m.path)
    sizes = {m.path: len(tokenizer(m.segment, add_special_tokens=False)["input_ids"]) for m in modules}
    if config.question in ("next_name", "complete"):
        common = common_names(modules)
        train, held_out = ([build_next_name_row(pool, sizes, common, tokenizer, config, rng) for _ in range(count)]
                           for pool, count in ((train_pool, config.rows), (held_out_pool, config.held_out_rows)))
        return tokenizer, train, held_out
    # answers both splits can ask about, each offered by at least two modules of each (held-out rows ask about
    # values training rows ask about too, from modules training never sees)
    answers = sorted(set(common_answers(train_pool, 2)) & set(common_answers(held_out_pool, 2)))
    if not answers:
        raise ValueError("no default value is offered by two modules of both splits: raise --max-chars")
    train = [build_row(train_pool, answers, sizes, tokenizer, config, rng) for _ in range(config.rows)]
    held_out = [build_row(held_out_pool, answers, sizes, tokenizer, config, rng) for _ in range(config.held_out_rows)]
    return tokenizer, train, held_out


def majority_share(answers: list[str]) -> float:
    """The share of the most common answer: the reward of always giving it (a baseline that reads nothing)."""
    return max(answers.count(a) for a in set(answers)) / len(answers)


def without_files(row: dict) -> dict:
    """The row asked without its files: the question alone (for `complete`: the asked line alone, as indented in its
    file). The no-read baseline: what a policy answers from the question's own words, e.g. a prefix ending in `**` ->
    `kwargs`."""
    if "prompt" in row:
        return {**row, "prompt": row["prompt"][row["prompt"].rindex("\n") + 1:], "files": [], "prompt_tokens": None}
    system, user = row["messages"]
    question = (NEXT_QUESTION.format(prefix=row["prefix"]) if "prefix" in row
                else QUESTION.format(parameter=row["parameter"], function=row["function"]))
    assert user["content"].endswith(question), "the user turn ends with the question"
    return {**row, "messages": [system, {"role": "user", "content": question}], "files": [],
            "prompt_tokens": None}


def write(out: str, config: BuildConfig, root: str | None = None) -> dict:
    """Build and write everything into `out` (created; existing files replaced) -> the manifest."""
    tokenizer, train, held_out = build(config, root)
    os.makedirs(os.path.join(out, "corpus"), exist_ok=True)
    tokenizer.save_pretrained(os.path.join(out, "tokenizer"))
    held_out_paths = {path for row in held_out for path in row["files"]}
    for path, text in stdlib_sources(root or stdlib_dir(), 1, CORPUS_MAX_CHARS):
        if path not in held_out_paths:  # the pre-training corpus: every source no held-out prompt holds
            with open(os.path.join(out, "corpus", path.replace("/", "__")), "w") as f:
                f.write(HEADER.format(path=path) + text)
    no_read = [without_files(row) for row in held_out]
    for name, rows in (("train.jsonl", train), ("held_out.jsonl", held_out), ("held_out_no_read.jsonl", no_read)):
        with open(os.path.join(out, name), "w") as f:
            f.writelines(json.dumps(row, sort_keys=True) + "\n" for row in rows)
    lengths = [row["prompt_tokens"] for row in train + held_out]
    manifest = {"config": dataclasses.asdict(config), "python": sys.version.split()[0], "vocab": len(tokenizer),
                "train_rows": len(train), "held_out_rows": len(held_out),
                "prompt_tokens": {"min": min(lengths), "max": max(lengths), "mean": float(np.mean(lengths))},
                "answers": sorted({row["answer"] for row in train + held_out}),
                "held_out_majority": majority_share([row["answer"] for row in held_out])}
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
    return manifest


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="data/stdlib_qa", help="output directory (default: %(default)s)")
    for field in dataclasses.fields(BuildConfig):
        parser.add_argument("--" + field.name.replace("_", "-"), type=type(field.default), default=field.default,
                            help="default: %(default)s")
    args = vars(parser.parse_args(argv))
    out = args.pop("out")
    try:
        manifest = write(out, BuildConfig(**args))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{out}: {manifest['train_rows']} training + {manifest['held_out_rows']} held-out prompts of "
          f"{manifest['prompt_tokens']['min']}..{manifest['prompt_tokens']['max']} tokens, a {manifest['vocab']}-token "
          f"tokenizer, {len(manifest['answers'])} distinct answers (the most common one is "
          f"{manifest['held_out_majority']:.3f} of the held-out rows), Python {manifest['python']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
