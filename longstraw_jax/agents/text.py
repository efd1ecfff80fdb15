"""Agent branches over text: an environment that reads and writes text, its replies rendered with the checkpoint's
chat template as tool messages, and `--tools` (plain Python functions called from the policy's tool calls).
docs/architecture.md 11.

The sampler speaks token ids (agents/environment.py). `TextEpisode` adapts a text environment to it:

    env.reset(prompt_text, info, branch)                        the prompt as text (decoded)
    content, reward, done = env.step(turn_text)                 the policy's turn, decoded (its stop token dropped)

`content` is a string (one tool message) or a list of strings (several, e.g. one per tool call). Its ids are the
rendered suffix `ChatTurns.framed` gives: what the chat template writes after the policy's end-of-turn token up to
the next assistant turn's content (the tool message(s) with the template's wrapper, the boundary tokens, the next
assistant header), as an `environment.Framed` observation whose content the sampler cuts (never the wrapper) when
it does not fit.

Training on tokens the model never saw (verl #6501, TRL #5144, slime #2263) happens when turn-by-turn rendering and
whole-conversation rendering disagree. `ChatTurns.check` renders a scripted 3-turn tool conversation both ways and
raises unless the token ids agree (the run refuses to start).

`ToolEnvironment` (`--tools MODULE:LIST`): a list of functions with type hints and docstrings; their JSON schemas
(`transformers.utils.get_json_schema`, as TRL) go to the chat template (`tools=`). A policy turn's calls are parsed
as Hermes / Qwen3 `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks; each result (or the error text
of a call that raises, names an unknown tool or is malformed, counted in `failures`) becomes one tool message. A turn
without a call ends the episode (the rewards score the transcript).
"""
from __future__ import annotations

import json
import re
import threading
from typing import Callable

from longstraw_jax.agents.environment import Framed, first_line

PLACE = "\x00PLACEHOLDER{}\x00"
TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


class TemplateError(ValueError):
    """The chat template cannot frame tool turns as the sampler appends them (a one-line reason)."""


def render(tokenizer, messages: list[dict], generation: bool, tools=None, kwargs=None) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation,
                                         tools=tools, **(kwargs or {}))


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


class ChatTurns:
    """How the tokenizer's chat template frames tool messages between assistant turns.

    stop_id: the policy's end-of-turn token (it ends a turn, mask 1). tools: JSON schemas passed to the template.
    `framed(contents)` -> `Framed(prefix, content, suffix)` ids: after the policy's stop token, the template's text up
    to each content, the content, and after the last content the rest up to the next assistant turn (its generation
    prompt included). Contents are encoded on their own, so a cut in one never touches the wrapper.
    """

    def __init__(self, tokenizer, stop_id: int, tools=None, kwargs=None):
        self.tokenizer, self.stop_id, self.tools, self.kwargs = tokenizer, int(stop_id), tools, kwargs or {}
        self.stop_text = tokenizer.decode([self.stop_id])
        self._pieces: dict[int, list[str]] = {}

    def pieces(self, count: int) -> list[str]:
        """The template's text around `count` tool messages: count + 1 pieces (before the first content, between
        contents, after the last up to the next assistant's content). TemplateError when the template does not put
        the assistant's end-of-turn token right after its content."""
        if count not in self._pieces:
            head = [{"role": "user", "content": "question"}, {"role": "assistant", "content": PLACE.format("A")}]
            tools = [{"role": "tool", "content": PLACE.format(i)} for i in range(count)]
            text = render(self.tokenizer, head + tools, True, self.tools, self.kwargs)
            at = text.find(PLACE.format("A"))
            if at < 0:
                raise TemplateError("the chat template does not write the assistant's content as given")
            after = text[at + len(PLACE.format("A")):]
            gap = after.find(self.stop_text)
            if gap < 0 or encode(self.tokenizer, after[:gap]):  # only what encodes to nothing may come between
                raise TemplateError(f"the chat template does not end an assistant turn with its stop token "
                                    f"{self.stop_text!r} right after the content (it writes {after[:30]!r})")
            rest, out = after[gap + len(self.stop_text):], []
            for i in range(count):
                before, found, rest = rest.partition(PLACE.format(i))
                if not found:
                    raise TemplateError("the chat template drops tool messages (no 'tool' role?)")
                out.append(before)
            self._pieces[count] = out + [rest]
        return self._pieces[count]

    def framed(self, contents: list[str]) -> Framed:
        """Tool messages -> their observation ids, Framed: prefix (the wrapper before the first content), content
        (the contents with the wrappers between them), suffix (the wrapper after the last, the next assistant
        header)."""
        pieces = self.pieces(len(contents))
        middle = []
        for i, content in enumerate(contents):
            if i:
                middle += encode(self.tokenizer, pieces[i])
            middle += encode(self.tokenizer, content)
        return Framed(encode(self.tokenizer, pieces[0]), middle, encode(self.tokenizer, pieces[-1]))

    def check(self) -> None:
        """Render a scripted 3-turn tool conversation turn by turn (prompt, each assistant turn's ids + stop token,
        each tool reply's `framed` ids) and whole; TemplateError naming the first differing position unless the
        turn-by-turn ids are a prefix of the whole's."""
        user = [{"role": "user", "content": "What is the colour of the sky ?"}]
        said = ["I will look it up .", "It is blue ."]
        replies = ["blue"]
        turnwise = encode(self.tokenizer, render(self.tokenizer, user, True, self.tools, self.kwargs))
        messages = list(user)
        for k, text in enumerate(said):
            turnwise += encode(self.tokenizer, text) + [self.stop_id]
            messages.append({"role": "assistant", "content": text})
            if k < len(replies):
                turnwise += self.framed([replies[k]]).ids
                messages.append({"role": "tool", "content": replies[k]})
        whole = encode(self.tokenizer, render(self.tokenizer, messages, False, self.tools, self.kwargs))
        if whole[:len(turnwise)] != turnwise:
            at = next((i for i, (a, b) in enumerate(zip(turnwise, whole)) if a != b), min(len(turnwise), len(whole)))
            raise TemplateError(
                f"the chat template renders a tool conversation differently turn by turn than whole (first at token "
                f"{at}: {self.tokenizer.decode(turnwise[at:at + 8])!r} vs {self.tokenizer.decode(whole[at:at + 8])!r}"
                "): the policy would be trained on tokens it never saw")

    def supports_tools(self) -> bool:
        """Whether the template writes the tools' schemas (it renders differently with and without them)."""
        user = [{"role": "user", "content": "question"}]
        return render(self.tokenizer, user, True, self.tools, self.kwargs) != render(
            self.tokenizer, user, True, None, self.kwargs)


class TextEpisode:
    """A text environment as the sampler's token-level one (see the module docstring)."""

    def __init__(self, inner, chat: ChatTurns):
        self.inner, self.chat = inner, chat

    def reset(self, prompt_tokens, info, branch):
        return self.inner.reset(self.chat.tokenizer.decode(list(prompt_tokens)), info, branch)

    def step(self, turn):
        ids = [int(t) for t in turn]
        if ids and ids[-1] == self.chat.stop_id:
            ids = ids[:-1]
        value = self.inner.step(self.chat.tokenizer.decode(ids))
        if not isinstance(value, tuple) or len(value) != 3:
            return value  # the sampler names what is wrong
        content, reward, done = value
        if done:
            return [], reward, True
        contents = [content] if isinstance(content, str) else content
        if not isinstance(contents, list) or not all(isinstance(c, str) for c in contents):
            raise TypeError(f"a text environment's observation must be a str or a list of str, got "
                            f"{type(content).__name__}")
        return self.chat.framed(contents), reward, False


def tool_schemas(functions: list[Callable]) -> list[dict]:
    """The JSON schemas of plain functions with type hints and a docstring (Google style Args:), as the chat
    template's `tools=` takes them. ValueError naming a function whose schema cannot be made."""
    from transformers.utils import get_json_schema

    schemas = []
    for fn in functions:
        try:
            schemas.append(get_json_schema(fn))
        except Exception as e:
            raise ValueError(f"--tools: {getattr(fn, '__name__', fn)!r} has no usable schema ({first_line(e)}): a "
                             "tool needs type hints on every argument and a docstring with Args:") from None
    return schemas


class ToolCounts:
    """Tool calls and failures (calls answered with an error text), shared by every branch's ToolEnvironment."""

    def __init__(self):
        self.calls, self.failures, self.lock = 0, 0, threading.Lock()

    def add(self, failed: bool) -> None:
        with self.lock:
            self.calls += 1
            self.failures += int(failed)

    def take(self) -> tuple[int, int]:
        """(calls, failures) since the last take."""
        with self.lock:
            out, self.calls, self.failures = (self.calls, self.failures), 0, 0
        return out


class ToolEnvironment:
    """A text environment that runs the policy's tool calls (see the module docstring); counts: a `ToolCounts`."""

    def __init__(self, functions: list[Callable], counts: ToolCounts | None = None):
        self.functions = {fn.__name__: fn for fn in functions}
        self.counts = counts if counts is not None else ToolCounts()

    def reset(self, prompt_text, info, branch):
        pass

    def step(self, turn_text: str):
        blocks = TOOL_CALL.findall(turn_text)
        if not blocks:
            return "", None, True  # an answer: the episode is over
        return [self.call(block) for block in blocks], None, False

    def call(self, block: str) -> str:
        """One `<tool_call>` block -> its result as text, or the error text."""
        try:
            call = json.loads(block)
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                raise ValueError("a tool call must be a JSON object with a 'name'")
            arguments = call.get("arguments", {})
            if isinstance(arguments, str):
                arguments = json.loads(arguments)
            if not isinstance(arguments, dict):
                raise ValueError("'arguments' must be a JSON object")
            if call["name"] not in self.functions:
                raise ValueError(f"unknown tool {call['name']!r}; tools: {', '.join(self.functions)}")
            result = self.functions[call["name"]](**arguments)
            result = result if isinstance(result, str) else json.dumps(result)
        except Exception as e:
            self.counts.add(failed=True)
            return f"Error: {type(e).__name__}: {first_line(e)}"
        self.counts.add(failed=False)
        return result
