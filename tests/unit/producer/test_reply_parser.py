"""How a generated turn becomes the next prompt's assistant message (`producer/reply_parser.py`:
`ReplyParser`): the parsers the template picks, reasoning and tool calls split out, call ids
the same every time, and a reply that does not parse refused naming its turn."""

from __future__ import annotations

import hashlib

import pytest

from producer.render import Renderer
from producer.reply_parser import ReplyParser, Unparsed
from tests.conftest import QWEN

QWEN3 = QWEN.parent / "qwen3"


@pytest.fixture(scope="module")
def qwen3() -> Renderer:
    return Renderer(QWEN3)


@pytest.fixture(scope="module")
def qwen() -> Renderer:
    return Renderer(QWEN)


def test_reply_parser_follows_the_template(qwen: Renderer, qwen3: Renderer) -> None:
    q3 = ReplyParser(qwen3.tokenizer, qwen3.template)
    q25 = ReplyParser(qwen.tokenizer, qwen.template)
    assert (q3.reasoning_choice.name, q3.tool_choice.name) == ("qwen3", "qwen25")
    # no reasoning_content in 2.5's template: its text is all content
    assert (q25.reasoning_choice.name, q25.tool_choice.name) == ("none", "qwen25")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    out = qwen3.encode('<think>\nhmm\n</think>\n\n<tool_call>\n{"name": "f", "arguments": '
                       '{"x": "y"}}\n</tool_call>') + [qwen3.eos_token_id]
    msg = q3.message(out, tools, call_key="c#t1")
    call_id = "call_" + hashlib.sha256(b"c#t1#0").hexdigest()[:24]
    # reasoning as generated (SGLang 0.5.23 trims nothing), the call's id the same every time
    assert msg == {"role": "assistant", "reasoning_content": "\nhmm\n", "content": "",
                   "tool_calls": [{"id": call_id, "type": "function",
                                   "function": {"name": "f", "arguments": {"x": "y"}}}]}
    assert q3.message(out, tools, call_key="c#t1") == msg
    # without tools in the conversation, tool-call text is content, as a chat server does
    assert q3.message(out)["content"].startswith("\n\n<tool_call>")
    plain = qwen.encode("Hello there") + [qwen.eos_token_id]
    assert q25.message(plain) == {"role": "assistant", "content": "Hello there"}
    assert ReplyParser(qwen3.tokenizer, qwen3.template, "none", "none").message(out)[
        "content"].startswith("<think>")


def test_a_reply_that_does_not_parse_is_refused_naming_its_turn(qwen3: Renderer) -> None:
    q3 = ReplyParser(qwen3.tokenizer, qwen3.template)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    good = qwen3.encode("fine") + [qwen3.eos_token_id]
    cut = qwen3.encode('<think>\nok\n</think>\n\n<tool_call>\n{"name": "f", "argu')
    with pytest.raises(Unparsed, match="turn 2: call 1 is not terminated"):
        q3.messages([good, cut], tools, "c")
