"""Agent branches over text (agents/text.py) with a tiny word-level tokenizer whose chat template knows tools:

- a tool reply's observation ids are exactly what the whole conversation renders after the assistant's end-of-turn
  token (one and two tool messages), framed so that a cut shortens the content and never the wrapper;
- the start check passes for that template and refuses one that renders history differently than turn by turn
  (the bug class of verl #6501, TRL #5144, slime #2263), and `supports_tools` tells a template that ignores tools;
- `--tools`: the policy's <tool_call> blocks are run; an unknown tool, a malformed call or a raising tool returns
  its error text (counted); a turn without a call ends the episode;
- through the trainer: a --data run with a text --env and with --tools writes transcripts whose tool turns are the
  template's rendering; --tools with a template that ignores tools, or a template that fails the check, is refused
  with one line and nothing written.
"""
import json
import os

import numpy as np
import pytest

from longstraw_jax.agents import text
from longstraw_jax.agents.environment import Reply, check_step_result
from longstraw_jax.trainer import cli as run
from tests.tasks.test_dataset import tiny_tokenizer

WORDS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "user", "assistant", "system", "tool", "tools:", "colour",
         "<tool_response>", "</tool_response>", "<tool_call>", "</tool_call>", '{"name":', '"colour",', '"nope",',
         '"arguments":', '{"thing":', '"sky"}}', "the", "sky", "is", "blue", "what", "?", "I", "will", "look", "it",
         "up", ".", "It", "question", "of", "ok", "Error:"]
TEMPLATE = (
    "{% if tools %}<|im_start|> system tools: {% for t in tools %}{{ t['function']['name'] }} {% endfor %}"
    "<|im_end|> {% endif %}"
    "{% for m in messages %}{% if m['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|> user {% endif %}"
    "<tool_response> {{ m['content'] }} </tool_response> "
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|> {% endif %}"
    "{% else %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")
# like the Qwen3 templates with reasoning: earlier assistant turns (before a later assistant turn) are rendered
# shortened in the whole conversation
FORGETFUL = TEMPLATE.replace("{% else %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endif %}",
                             "{% elif m['role'] == 'assistant' and loop.index0 < messages | length - 2 %}"
                             "<|im_start|> assistant ok "
                             "<|im_end|> {% else %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> "
                             "{% endif %}")
NO_TOOLS = TEMPLATE.replace("{% if tools %}", "{% if false %}")


def tokenizer_dir(directory, template=TEMPLATE):
    return tiny_tokenizer(directory, WORDS, template=template)


def load(directory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)


def colour(thing: str) -> str:
    """The colour of a thing.

    Args:
        thing: what to look at
    """
    if thing == "grass":
        raise KeyError("no grass here")
    return "blue"


TOOLS = [colour]


def test_framed_observations_are_what_the_whole_conversation_renders(tmp_path):
    tokenizer = load(tokenizer_dir(tmp_path))
    stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
    chat = text.ChatTurns(tokenizer, stop, text.tool_schemas(TOOLS))
    chat.check()
    assert chat.supports_tools()
    head = [{"role": "user", "content": "what colour is the sky ?"}, {"role": "assistant", "content": "look it up"}]
    for replies in (["blue"], ["blue", "it is blue"]):
        whole = tokenizer.encode(text.render(tokenizer, head + [{"role": "tool", "content": r} for r in replies], True,
                                             chat.tools), add_special_tokens=False)
        before = tokenizer.encode(text.render(tokenizer, head, False, chat.tools), add_special_tokens=False)
        # the assistant turn as the policy wrote it ends at its stop token; the observation is the rest
        at = len(before) - 1 if before[-1] != stop else len(before)
        assert before[at - 1] == stop
        framed = chat.framed(replies)
        assert framed.ids == whole[at:]
        assert tokenizer.decode(framed.prefix).split() == ["<|im_start|>", "user", "<tool_response>"]
        assert tokenizer.decode(framed.suffix).split() == ["</tool_response>", "<|im_end|>", "<|im_start|>",
                                                           "assistant"]
    reply = check_step_result((chat.framed(["the sky is blue"]), None, False), len(WORDS) + 1)
    kept = reply.fit(len(reply.observation) - 2)  # the content loses its last 2 tokens, the wrapper stays
    assert tokenizer.decode(kept).split() == ["<|im_start|>", "user", "<tool_response>", "the", "sky",
                                              "</tool_response>", "<|im_end|>", "<|im_start|>", "assistant"]
    assert len(Reply(np.arange(5), frame=(2, 1)).fit(2)) == 2  # not even the wrapper fits: cut at the end


def test_the_start_check_refuses_a_template_that_renders_history_differently(tmp_path):
    tokenizer = load(tokenizer_dir(tmp_path / "forgetful", FORGETFUL))
    chat = text.ChatTurns(tokenizer, tokenizer.convert_tokens_to_ids("<|im_end|>"))
    with pytest.raises(text.TemplateError, match="differently turn by turn than whole"):
        chat.check()
    plain = load(tokenizer_dir(tmp_path / "plain", NO_TOOLS))
    assert not text.ChatTurns(plain, plain.convert_tokens_to_ids("<|im_end|>"), text.tool_schemas(TOOLS)) \
        .supports_tools()


def test_tool_calls_run_and_errors_are_observations():
    counts = text.ToolCounts()
    env = text.ToolEnvironment(TOOLS, counts)
    call = '<tool_call> {"name": "colour", "arguments": {"thing": "sky"}} </tool_call>'
    assert env.step(f"I will look {call}") == (["blue"], None, False)
    out, _, done = env.step('<tool_call> {"name": "nope"} </tool_call> <tool_call> not json </tool_call> '
                            '<tool_call> {"name": "colour", "arguments": {"thing": "grass"}} </tool_call>')
    assert not done and out[0].startswith("Error: ValueError: unknown tool 'nope'; tools: colour")
    assert out[1].startswith("Error: JSONDecodeError") and out[2] == "Error: KeyError: 'no grass here'"
    assert counts.take() == (4, 3) and counts.take() == (0, 0)
    assert env.step("It is blue .") == ("", None, True)
    with pytest.raises(ValueError, match="no usable schema"):
        text.tool_schemas([lambda x: x])


def echo_factory(vocab_size, seed):
    return EchoText()


class EchoText:
    """A text environment: answers 'ok' to each turn; the episode ends after 2 turns with reward 1."""

    def reset(self, prompt_text, info, branch):
        assert prompt_text.split()[:2] == ["<|im_start|>", "user"]
        self.turns = 0

    def step(self, turn_text):
        self.turns += 1
        return "ok", 1.0 if self.turns == 2 else None, self.turns == 2


def write_data(path, rows=4):
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": "what colour is the sky ?"}],
                                        "answer": "blue"}) + "\n" for _ in range(rows)))
    return str(path)


TEXT_RUN = ["--vocab-size", "48", "--group-size", "2", "--response-len", "16", "--turn-len", "4", "--max-turns", "3",
            "--chunk-size", "8", "--eval-every", "0", "--sft-steps", "0", "--steps", "1", "--reward", "contains",
            "--log-samples-every", "1"]


def test_text_episodes_through_the_trainer(tmp_path, capsys):
    tokenizer = tokenizer_dir(tmp_path / "tok")
    data = write_data(tmp_path / "d.jsonl")
    out = str(tmp_path / "echo")
    held_out = ["--eval-every", "1", "--eval-fraction", "0.5", "--eval-prompts", "2"]
    assert run.main(TEXT_RUN + ["--data", data, "--tokenizer", tokenizer, "--out", out,
                                "--env", "tests.agents.test_text:echo_factory"] + held_out) == 0
    evals = [r for r in map(json.loads, open(os.path.join(out, "metrics.jsonl"))) if r.get("kind") == "eval"]
    # held-out episodes scored as training scores them: the environment's reward (1 after 2 turns) + the text
    # reward on the transcript
    assert evals and all(e["eval_reward"] >= 1.0 and "eval_reward/contains" in e for e in evals)
    rows = [json.loads(line) for line in open(os.path.join(out, "samples.jsonl"))]
    tools = [t for c in rows[0]["completions"] for t in c["turns"] if t["role"] == "tool" and t["tokens"]]
    wrapped = ["user", "<tool_response>", "ok", "</tool_response>", "assistant"]  # (special tokens skipped)
    assert tools and all(t["text"].split() == wrapped for t in tools)
    out = str(tmp_path / "tools")
    assert run.main(TEXT_RUN + ["--data", data, "--tokenizer", tokenizer, "--out", out,
                                "--tools", "tests.agents.test_text:TOOLS"]) == 0
    record = json.loads(open(os.path.join(out, "metrics.jsonl")).readline())
    assert record["tools/calls"] >= 0 and record["tools/failures"] <= record["tools/calls"]
    for template, tools_or_env, message in (
            (NO_TOOLS, ["--tools", "tests.agents.test_text:TOOLS"], "ignores tools"),
            (FORGETFUL, ["--env", "tests.agents.test_text:echo_factory"], "differently turn by turn than whole")):
        out = str(tmp_path / "refused")
        capsys.readouterr()
        assert run.main(TEXT_RUN + ["--data", data, "--tokenizer", tokenizer_dir(tmp_path / "bad", template),
                                    "--out", out] + tools_or_env) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0] and not os.path.exists(out)
