"""`producer/parsers/base.py`: what every reply parser shares. The `<think>`-tag reasoning
split (a turn that opens no block is all content, one cut before its end all reasoning, a
tool call ends the reasoning, nothing trimmed), the tool-call interface, and the helpers the
families build on: a JSON object or `Unparsed`, the calls of one section, a
`{name, arguments}` object, the parameter types of the tools offered."""

from __future__ import annotations

import json

import pytest

from foundation.errors import TokencapError
from producer.parsers.base import (
    Call,
    ReasoningParser,
    ToolCallParser,
    Unparsed,
    json_object,
    name_and_arguments,
    schema_types,
    section_calls,
)


class Interrupted(ReasoningParser):
    name = "interrupted"
    interrupt = "<call>"


def test_a_turn_that_opens_no_reasoning_block_is_all_content() -> None:
    plain = ReasoningParser()
    assert plain.split("Just an answer.") == (None, "Just an answer.")
    assert plain.split("<think>\nhmm\n</think>\n\nYes.") == ("\nhmm\n", "\n\nYes.")
    # a repeated start tag is one start; no whitespace is trimmed on either side
    assert plain.split("<think><think> a </think> b ") == (" a ", " b ")


def test_an_opened_block_is_reasoning_from_the_first_token_and_a_cut_turn_all_reasoning(
        ) -> None:
    plain = ReasoningParser()
    assert plain.split("step 1</think>Done.", opened=True) == ("step 1", "Done.")
    assert plain.split("step 1, step 2", opened=True) == ("step 1, step 2", "")
    assert plain.split("<think>cut before its end") == ("cut before its end", "")

    class Forced(ReasoningParser):  # reasoning is assumed even without its start tag
        forced = True

    assert Forced().split("thought</think>said") == ("thought", "said")


def test_a_tool_call_before_the_end_of_reasoning_ends_it_and_stays_in_the_rest() -> None:
    parser = Interrupted()
    assert parser.split("<think>plan<call>{}</call>") == ("plan", "<call>{}</call>")
    # the end tag, where there is one, wins
    assert parser.split("<think>a</think>b<call>") == ("a", "b<call>")
    assert ReasoningParser().split("<think>plan<call>") == ("plan<call>", "")


def test_a_tool_call_parser_knows_a_call_by_its_markers() -> None:
    class Marked(ToolCallParser):
        markers = ("<call>", "<calls>")

    assert Marked().has_call("text <calls> more") and not Marked().has_call("text only")
    assert not ToolCallParser().has_call("<call>")  # no markers, no call
    with pytest.raises(NotImplementedError):
        ToolCallParser().split("x", None)


def test_unparsed_names_its_parser_and_is_a_tokencap_error() -> None:
    err = Unparsed("qwen25", "call 1: invalid JSON")
    assert (err.parser, err.reason, str(err)) == ("qwen25", "call 1: invalid JSON",
                                                  "qwen25: call 1: invalid JSON")
    assert isinstance(err, TokencapError) and isinstance(err, ValueError)


def test_json_object_parses_an_object_or_says_why_not() -> None:
    assert json_object('{"a": [1, 2]}', "p", "call 1") == {"a": [1, 2]}
    with pytest.raises(Unparsed, match=r"^p: call 1: invalid JSON \(Expecting"):
        json_object('{"a": ', "p", "call 1")
    with pytest.raises(Unparsed, match="call 2: expected a JSON object, got list"):
        json_object("[1]", "p", "call 2")


def _call(body: str, k: int) -> Call:
    name, _, args = body.partition("|")
    return Call(name, json_object(args, "p", f"call {k}"))


SECTION = ("<s>", "</s>", "<c>", "</c>")


def test_section_calls_reads_each_call_of_the_section_and_the_text_before_it() -> None:
    text = 'Let me check. <s><c>f|{"x": 1}</c><c>g|{}</c></s> dropped after the section'
    content, calls = section_calls(text, "p", *SECTION, _call)
    assert content == "Let me check. "
    assert calls == [Call("f", {"x": 1}), Call("g", {})]
    # a section cut before its end runs to the end of the text
    assert section_calls('<s><c>f|{"x": 1}</c>', "p", *SECTION, _call) == (
        "", [Call("f", {"x": 1})])


@pytest.mark.parametrize(("text", "why"), [
    ('<c>f|{}</c>', "<c> outside a <s> section"),
    ('<s><c>f|{}</c><c>g|{}</s>', "call 2 is not terminated (</c>)"),
    ("<s>no call here</s>", "a tool-call section without a call"),
    ('<s><c>f|{"x": </c></s>', "call 1: invalid JSON"),
])  # fmt: skip
def test_section_calls_refuses_a_section_that_does_not_parse(text: str, why: str) -> None:
    with pytest.raises(Unparsed, match=r"^p: " + why.replace("(", r"\(").replace(")", r"\)")):
        section_calls(text, "p", *SECTION, _call)


def test_name_and_arguments_takes_either_key_and_arguments_as_json_text() -> None:
    assert name_and_arguments({"name": "f", "parameters": {"x": "é"}}, "p", "call 1") == Call(
        "f", {"x": "é"}, json.dumps({"x": "é"}, ensure_ascii=False))
    assert name_and_arguments({"name": "f", "arguments": '{"y": 2}'}, "p", "call 1") == Call(
        "f", {"y": 2}, '{"y": 2}')
    assert name_and_arguments({"name": "f", "arguments": " "}, "p", "c").arguments == {}
    assert name_and_arguments({"name": "f"}, "p", "c") == Call("f", {}, "{}")
    with pytest.raises(Unparsed, match="call 3: no function name"):
        name_and_arguments({"arguments": {}}, "p", "call 3")
    with pytest.raises(Unparsed, match="call 1: arguments are not an object"):
        name_and_arguments({"name": "f", "arguments": [1]}, "p", "call 1")
    with pytest.raises(Unparsed, match="call 1 arguments: invalid JSON"):
        name_and_arguments({"name": "f", "arguments": "{oops"}, "p", "call 1")


def test_schema_types_maps_each_function_offered_to_its_parameter_types() -> None:
    tools = [
        {"type": "function", "function": {"name": "weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"},
                                             "days": {"type": "integer"},
                                             "unit": {"enum": ["C", "F"]},
                                             "at": {"type": ["string", "null"]}}}}},
        {"name": "bare", "parameters": {"properties": {"q": {"type": "string"}}}},
        {"name": "no_parameters"},
        {"function": {"description": "no name"}},
        "not a tool",
    ]
    assert schema_types(tools) == {  # type: ignore[arg-type]
        "weather": {"city": "string", "days": "integer", "unit": "",
                    "at": "['string', 'null']"},
        "bare": {"q": "string"}, "no_parameters": {}}
    assert schema_types(None) == {}
