"""`producer/formats/records.py`: which format a record is in (`detect_format`, and the
`field_map` an unknown one would need), and the checks of its fields as a kept turn is made a
chat message: single-turn formats, a top-level system text, text parts, tool schemas, OpenAI
tool calls and their results, ShareGPT's function_call and observation; a bad field is a
`Rejected` naming its reason and path. The turn policies, `field_map` and `role_map`:
test_turns.py."""

from __future__ import annotations

import json
import re
import tomllib

import pytest

from producer.formats.records import FORMATS, Rejected, detect_format
from producer.formats.turns import to_conversation
from producer.readers.index import SourceIndex, read_sample
from tests.conftest import DATASETS
from tests.helpers import conversation_records, to_prompt

GLAIVE = DATASETS / "agent" / "glaive_toolcall_en_demo.json"


# -- formats --------------------------------------------------------------------------------

def test_single_turn_formats() -> None:
    assert detect_format({"instruction": "Do", "input": "", "output": "x"}) == "alpaca"
    alpaca = to_prompt({"instruction": "Sort", "input": "3 1 2", "output": "1 2 3"}, "auto")
    assert alpaca == [{"role": "user", "content": "Sort\n\n3 1 2"}]
    assert to_prompt({"instruction": "Sort", "input": " "}, "alpaca")[0]["content"] == "Sort"
    assert to_prompt({"instruction": "I", "response": "R"}, "auto") == [
        {"role": "user", "content": "I"}
    ]
    assert to_prompt({"input": "code", "output": "x", "id": "1"}, "auto")[0]["content"] == "code"
    assert to_prompt({"problem": "p", "solution": "s"}, "auto")[0]["content"] == "p"
    assert to_prompt({"input_ids": [1, 2]}, "auto") == [1, 2]
    assert set(FORMATS) >= {"auto", "input_ids"}


@pytest.mark.parametrize("key", ["prompt", "query", "text"])
def test_a_single_field_prompt_is_read_by_auto(key) -> None:
    assert to_prompt({key: "Say hi.", "id": 3}, "auto") == [
        {"role": "user", "content": "Say hi."}]
    assert to_prompt({key: "Say hi."}, key) == [{"role": "user", "content": "Say hi."}]


@pytest.mark.parametrize("record", [
    {"dialog": [{"speaker": "user", "message": "Hello?"}], "n": 1},
    {"instr": "Write a haiku.", "n": 2},
])
def test_an_unknown_format_names_the_field_map_that_reads_it(record) -> None:
    with pytest.raises(Rejected) as err:
        to_prompt(record, "auto")
    assert err.value.reason == "unknown_format"
    hint = re.search(r"field_map = (\{.*?\})", str(err.value))
    assert hint, str(err.value)
    field_map = tomllib.loads(f"field_map = {hint[1]}")["field_map"]  # as a config holds it
    messages = to_prompt(record, "auto", field_map=field_map)
    assert messages[-1]["role"] == "user" and messages[-1]["content"] in (
        "Hello?", "Write a haiku.")


# -- a record's fields ------------------------------------------------------------------------

def test_openthoughts_top_level_system_and_system_prompt() -> None:
    record = {
        "system": "Think step by step.",
        "conversations": [
            {"from": "user", "value": "q1"},
            {"from": "assistant", "value": "a1"},
            {"from": "user", "value": "q2"},
            {"from": "assistant", "value": "a2"},
        ],
    }
    assert to_prompt(record, "auto", "last") == [
        {"role": "system", "content": "Think step by step."},
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"},
    ]
    assert to_prompt(record, "auto", "first", system_prompt="S")[0] == {
        "role": "system",
        "content": "S",
    }


def test_messages_with_text_parts_and_leading_assistant() -> None:
    record = {
        "messages": [
            {"role": "assistant", "content": "Hi, how can I help?"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {"role": "assistant", "content": None},
        ]
    }
    assert to_prompt(record, "messages", "last") == [{"role": "user", "content": "a\nb"}]
    record["messages"][1]["content"].append({"type": "image_url", "image_url": "x"})
    with pytest.raises(Rejected) as info:
        to_prompt(record, "messages")
    assert (info.value.reason, info.value.field) == ("wrong_type", "messages[1].content[2]")


# -- tools, tool calls and their results -------------------------------------------------------

def test_an_openai_agent_trace_reads_tools_calls_and_results() -> None:
    rec = conversation_records()["agent-weather"]
    conv = to_conversation(rec, "auto", "all")
    assert not isinstance(conv, list)
    assert conv.tools == rec["tools"]
    roles = [m["role"] for m in conv.messages]
    assert roles == ["system", "user", "assistant", "tool", "assistant", "user", "assistant",
                     "tool", "assistant"]
    # the tool call and the answer after the tool result are separate generations
    assert conv.points == (2, 4, 6, 8)
    call = conv.messages[2]
    assert call["content"] == ""  # None with tool calls, as SGLang hands it to the template
    assert call["tool_calls"] == [{"type": "function", "id": "call_1", "function": {
        "name": "get_weather", "arguments": {"city": "Lisbon", "unit": "C"}}}]
    assert conv.messages[6]["tool_calls"][0]["function"]["arguments"] == {"city": "Porto"}
    assert conv.messages[3] == {"role": "tool", "tool_call_id": "call_1",
                                "name": "get_weather", "content": rec["messages"][3]["content"]}


def test_tools_as_a_json_string_and_text_part_results() -> None:
    conv = to_conversation(conversation_records()["agent-flights-developer"], "auto", "all")
    assert not isinstance(conv, list)
    assert conv.tools is not None and conv.tools[0]["function"]["name"] == "search_flights"
    assert conv.messages[0]["role"] == "developer"
    assert conv.messages[3]["content"] == "HAT045 08:00-11:10\nHAT123 14:30-17:40"
    assert conv.points == (2, 4)  # the call, then a trailing tool result asks for an answer


def test_sharegpt_function_call_and_observation_with_a_tools_string() -> None:
    with SourceIndex.build([GLAIVE]) as index:
        sample = read_sample(index, 2, "auto", "all", None)
        raw = index.read(2)
    conv = sample.conversation
    assert conv is not None and sample.tools is not None
    # bare {name, description, parameters} schemas are wrapped as a chat server gets them
    assert sample.tools[0] == {"type": "function", "function": json.loads(raw["tools"])[0]}
    kinds = [(m["role"], "tool_calls" in m) for m in conv.messages]
    assert kinds[:4] == [("user", False), ("assistant", True), ("tool", False),
                         ("assistant", False)]
    assert conv.messages[1]["tool_calls"][0]["function"] == {
        "name": "calculate_area", "arguments": {"shape": "rectangle", "dimensions": [5, 3]}}
    assert conv.turns == 6  # three calls and three answers


def test_bad_tool_arguments_name_the_field() -> None:
    with pytest.raises(Rejected) as info:
        to_conversation(conversation_records()["bad-tool-arguments"], "auto", "all")
    assert info.value.reason == "invalid_json"
    assert info.value.field == "messages[1].tool_calls[0].function.arguments"
    with pytest.raises(Rejected) as info:
        to_conversation({"messages": [{"role": "user", "content": "x"}], "tools": "{"}, "auto")
    assert (info.value.reason, info.value.field) == ("invalid_json", "tools")


def test_keys_with_text_no_format_or_map_reads_are_named() -> None:
    from producer.formats.records import unread_keys

    dolly = {"instruction": "x", "context": "y", "response": "z", "category": "closed_qa",
             "id": "7"}
    assert unread_keys(dolly, "auto") == ["category"]  # the passage is read now; ids never
    assert unread_keys({"question": "q", "answer": "a", "hint": "h", "n": 3}, "auto") == ["hint"]
    assert unread_keys({"q": "x", "passage": "y", "notes": "z"}, "auto",
                       {"prompt": "q", "context": "passage"}) == ["notes"]
    assert unread_keys({"weird": "x"}, "auto") == []  # no format: refused elsewhere, not here
