"""Conversations and agent traces as the producer reads them (`producer/formats/turns.py`:
`to_conversation`, its first prompt by tests/helpers.py's `to_prompt`;
`producer/formats/conversation.py`: `Conversation.prompt`, `replay_notes`): generation
points, roles and role maps, tool calls and their results.
How a generated turn becomes the next prompt's assistant message: test_reply_parser.py."""

from __future__ import annotations

import json

import pytest

from producer.formats.records import Rejected
from producer.formats.turns import to_conversation
from producer.readers.index import SourceIndex, read_sample
from tests.conftest import DATASETS
from tests.helpers import to_prompt

CONVERSATIONS = DATASETS / "conversations" / "tokencap_conversations.jsonl"
GLAIVE = DATASETS / "agent" / "glaive_toolcall_en_demo.json"
TAU = DATASETS / "agent" / "tau_bench_gpt4o_airline_traj.jsonl"
ROLE_MAP = {"customer": "user", "agent": "assistant"}


def records() -> dict[str, dict]:
    return {r["id"]: r for r in map(json.loads, CONVERSATIONS.read_text().splitlines())}


# -- turns = "all": generation points ---------------------------------------------------------

def test_every_assistant_turn_of_a_chat_is_a_generation_point() -> None:
    rec = records()["chat-3-turns"]
    conv = to_conversation(rec, "auto", "all")
    assert not isinstance(conv, list)
    assert conv.points == (2, 4, 6) and conv.turns == 3 and conv.tools is None
    mine = [{"role": "assistant", "content": f"mine {k}"} for k in (1, 2)]
    # turn 3: the source's system and user turns, the model's own turns 1 and 2
    assert conv.prompt(mine) == [rec["messages"][0], rec["messages"][1], mine[0],
                                 rec["messages"][3], mine[1], rec["messages"][5]]
    assert conv.prompt() == rec["messages"][:2]
    with pytest.raises(ValueError):
        conv.prompt(mine * 2)
    # first and last keep one point, at the end of their prompt
    first = to_conversation(rec, "auto", "first")
    assert not isinstance(first, list) and first.points == (2,)


def test_a_trailing_user_turn_adds_a_point() -> None:
    conv = to_conversation(records()["chat-trailing-user"], "auto", "all")
    assert not isinstance(conv, list)
    assert conv.points == (1, 3) and len(conv.messages) == 3


def test_an_openai_agent_trace_reads_tools_calls_and_results() -> None:
    rec = records()["agent-weather"]
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
    conv = to_conversation(records()["agent-flights-developer"], "auto", "all")
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


def test_tau_bench_trajectories_through_a_field_map() -> None:
    with SourceIndex.build([TAU]) as index:
        sample = read_sample(index, 0, "auto", "all", None, {"messages": "traj"})
        raw = index.read(0)["traj"]
    conv = sample.conversation
    assert conv is not None and sample.tools is None
    calls = [m for m in conv.messages if m.get("tool_calls")]
    assert calls and all(isinstance(c["tool_calls"][0]["function"]["arguments"], dict)
                         for c in calls)
    first = next(m for m in raw if m.get("tool_calls"))
    assert calls[0]["tool_calls"][0]["function"]["arguments"] == json.loads(
        first["tool_calls"][0]["function"]["arguments"])
    assert conv.turns == sum(1 for m in raw if m["role"] == "assistant") + (
        raw[-1]["role"] != "assistant")


# -- roles --------------------------------------------------------------------------------------

def test_an_unknown_role_rejects_only_when_the_policy_uses_its_turn() -> None:
    rec = records()["unknown-role-late"]
    assert to_prompt(rec, "auto", "first") == [rec["messages"][0]]
    for turns in ("last", "all"):
        with pytest.raises(Rejected) as info:
            to_conversation(rec, "auto", turns)
        assert (info.value.reason, info.value.field) == ("unknown_role", "messages[2].role")
        assert "'narrator'" in str(info.value) and "role_map" in str(info.value)
    # a role_map makes it a known role
    conv = to_conversation(rec, "auto", "all", role_map={"Narrator": "system"})
    assert not isinstance(conv, list) and conv.messages[2]["role"] == "system"


def test_role_map_maps_source_roles() -> None:
    conv = to_conversation(records()["mapped-roles"], "auto", "all", role_map=ROLE_MAP)
    assert not isinstance(conv, list)
    assert [m["role"] for m in conv.messages] == ["user", "assistant", "user", "assistant"]
    with pytest.raises(Rejected) as info:
        to_conversation(records()["mapped-roles"], "auto", "all")
    assert info.value.reason == "unknown_role"


def test_bad_tool_arguments_name_the_field() -> None:
    with pytest.raises(Rejected) as info:
        to_conversation(records()["bad-tool-arguments"], "auto", "all")
    assert info.value.reason == "invalid_json"
    assert info.value.field == "messages[1].tool_calls[0].function.arguments"
    with pytest.raises(Rejected) as info:
        to_conversation({"messages": [{"role": "user", "content": "x"}], "tools": "{"}, "auto")
    assert (info.value.reason, info.value.field) == ("invalid_json", "tools")


def test_tool_results_are_rekeyed_to_the_regenerated_calls() -> None:
    conv = to_conversation(records()["agent-weather"], "auto", "all")
    assert not isinstance(conv, list)
    mine = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "functions.get_weather:0", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    prompt = conv.prompt([mine])
    # the source's result now answers the model's call, by its id and name
    assert prompt[3]["tool_call_id"] == "functions.get_weather:0"
    assert prompt[3]["name"] == "get_weather" and prompt[3]["content"] == conv.messages[3][
        "content"]
    assert conv.replay_notes([mine]) == []
    none = {"role": "assistant", "content": "no call"}
    assert conv.replay_notes([none]) == [
        "turn 1: 1 tool result(s) of the source answer no call (the model made 0)"]
    two = {**mine, "tool_calls": mine["tool_calls"] * 2}
    assert conv.replay_notes([two]) == [
        "turn 1: 1 call(s) of the model have no recorded result (the source has 1)"]


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
    import re
    import tomllib

    with pytest.raises(Rejected) as err:
        to_prompt(record, "auto")
    assert err.value.reason == "unknown_format"
    hint = re.search(r"field_map = (\{.*?\})", str(err.value))
    assert hint, str(err.value)
    field_map = tomllib.loads(f"field_map = {hint[1]}")["field_map"]  # as a config holds it
    messages = to_prompt(record, "auto", field_map=field_map)
    assert messages[-1]["role"] == "user" and messages[-1]["content"] in (
        "Hello?", "Write a haiku.")
