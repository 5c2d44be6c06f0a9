"""`producer/formats/conversation.py`: `Conversation.prompt`, the prompt of each turn with the
model's earlier turns in place of the source's and the source's tool results re-keyed to the
model's calls, and `replay_notes`, what those results do not match. Divergence case by case
(`Conversation.divergence`, `args_match`): tests/pipeline/test_tool_divergence.py, beside the
run that stops on it. How a generated turn becomes that assistant message:
tests/unit/producer/test_replay.py and test_reply_parser.py."""

from __future__ import annotations

import pytest

from producer.formats.conversation import Conversation
from producer.formats.turns import to_conversation
from tests.helpers import conversation_records


def test_a_turns_prompt_holds_the_models_earlier_turns() -> None:
    rec = conversation_records()["chat-3-turns"]
    conv = to_conversation(rec, "auto", "all")
    assert not isinstance(conv, list)
    mine = [{"role": "assistant", "content": f"mine {k}"} for k in (1, 2)]
    # turn 3: the source's system and user turns, the model's own turns 1 and 2
    assert conv.prompt(mine) == [rec["messages"][0], rec["messages"][1], mine[0],
                                 rec["messages"][3], mine[1], rec["messages"][5]]
    assert conv.prompt() == rec["messages"][:2]
    with pytest.raises(ValueError):
        conv.prompt(mine * 2)


def test_tool_results_are_rekeyed_to_the_regenerated_calls() -> None:
    conv = to_conversation(conversation_records()["agent-weather"], "auto", "all")
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


def test_a_result_no_regenerated_call_asked_for_gets_an_id_in_the_models_format() -> None:
    # Given a source whose call and result carry no id (ShareGPT's function_call and
    # observation), and whose second result answers a call that has one
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "P"}}}
    conv = Conversation([
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [call, {**call, "id": "c2"}]},
        {"role": "tool", "content": "12C"},
        {"role": "tool", "content": "14C", "tool_call_id": "c2"},
        {"role": "assistant", "content": "12C and 14C."},
    ], None, (1, 4))
    answer = {"role": "assistant", "content": "I cannot tell."}  # the model made no call
    # When turn 2's history is made with the model's turn 1
    asked: list[tuple[str, int, int]] = []

    def call_id(name: str, index: int, turn: int) -> str:
        asked.append((name, index, turn))
        return f"{name}-{index}-t{turn}"

    prompt = conv.prompt([answer], call_id)
    # Then the result without an id gets the one the source's call would have had in the
    # model's format; the one with an id keeps it
    assert prompt[1] == answer
    assert prompt[2] == {"role": "tool", "content": "12C", "tool_call_id": "get_weather-0-t1"}
    assert prompt[3]["tool_call_id"] == "c2" and asked == [("get_weather", 0, 1)]
    # without `call_id` the results stay as the source wrote them
    assert conv.prompt([answer])[2:4] == conv.messages[2:4]
    assert conv.replay_notes([answer]) == [
        "turn 1: 2 tool result(s) of the source answer no call (the model made 0)"]
