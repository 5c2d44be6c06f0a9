"""`producer/formats/turns.py`: a record's turns kept by the turn policy (`first`, `last`,
`all`: its generation points), read through a `field_map` or mapped by a `role_map`; an
unknown role rejects a record only where the policy keeps its turn. The checks of each field:
test_records.py; a turn's prompt with the model's earlier turns: test_conversation.py."""

from __future__ import annotations

import json

import pytest

from producer.formats.records import Rejected
from producer.formats.turns import to_conversation
from producer.readers.index import SourceIndex, read_sample
from tests.conftest import DATASETS
from tests.helpers import conversation_records, to_prompt

TAU = DATASETS / "agent" / "tau_bench_gpt4o_airline_traj.jsonl"
ROLE_MAP = {"customer": "user", "agent": "assistant"}


# -- turns = "all": generation points ---------------------------------------------------------

def test_every_assistant_turn_of_a_chat_is_a_generation_point() -> None:
    rec = conversation_records()["chat-3-turns"]
    conv = to_conversation(rec, "auto", "all")
    assert not isinstance(conv, list)
    assert conv.points == (2, 4, 6) and conv.turns == 3 and conv.tools is None
    # first and last keep one point, at the end of their prompt
    first = to_conversation(rec, "auto", "first")
    assert not isinstance(first, list) and first.points == (2,)


def test_a_trailing_user_turn_adds_a_point() -> None:
    conv = to_conversation(conversation_records()["chat-trailing-user"], "auto", "all")
    assert not isinstance(conv, list)
    assert conv.points == (1, 3) and len(conv.messages) == 3


# -- turns = "first" and "last" ---------------------------------------------------------------

def test_sharegpt_system_turn_in_conversations_is_kept() -> None:
    path = DATASETS / "sharegpt/torchtune_chat_tiny.json"
    with SourceIndex.build([path]) as index:
        first = read_sample(index, 0, "auto", "first", None).prompt
        last = read_sample(index, 0, "auto", "last", None).prompt
        replaced = read_sample(index, 0, "auto", "first", "Be brief.").prompt
    assert first == [
        {"role": "system", "content": "You are an AI assistant."},
        {"role": "user", "content": "What is the meaning of life?"},
    ]
    assert [m["role"] for m in last] == ["system", "user", "assistant", "user"]
    assert last[-1]["content"] == "That's ridiculous."
    assert replaced[0] == {"role": "system", "content": "Be brief."}
    assert len(replaced) == 2


def test_turns_first_and_last_on_multi_turn_messages() -> None:
    path = DATASETS / "messages/xtuner_mllm_sft_text_example_data.jsonl"
    with SourceIndex.build([path]) as index:
        i = next(i for i in range(len(index)) if len(index.read(i)["messages"]) >= 6)
        record = index.read(i)
        first = read_sample(index, i, "messages", "first", None).prompt
        last = read_sample(index, i, "messages", "last", None).prompt
    original = record["messages"]
    assert first == original[:1]
    last_user = max(k for k, m in enumerate(original) if m["role"] == "user")
    assert last == original[: last_user + 1]
    assert len(last) > len(first)
    assert last[-1]["role"] == "user"


# -- field_map --------------------------------------------------------------------------------

def test_field_map_shapes() -> None:
    record = {"prompt": "p", "chat": [{"speaker": "human", "text": "t"}], "sys": "s"}
    assert to_prompt(record, "auto", field_map={"prompt": "prompt"}) == [
        {"role": "user", "content": "p"}
    ]
    mapped = to_prompt(
        record,
        "auto",
        field_map={"messages": "chat", "role": "speaker", "content": "text", "system": "sys"},
    )
    assert mapped == [{"role": "system", "content": "s"}, {"role": "user", "content": "t"}]
    with pytest.raises(Rejected) as info:
        to_prompt({"prompt": 3}, "auto", field_map={"prompt": "prompt"})
    assert (info.value.reason, info.value.field) == ("wrong_type", "prompt")
    with pytest.raises(ValueError):
        to_prompt(record, "auto", turns="middle")


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
    rec = conversation_records()["unknown-role-late"]
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
    conv = to_conversation(conversation_records()["mapped-roles"], "auto", "all",
                           role_map=ROLE_MAP)
    assert not isinstance(conv, list)
    assert [m["role"] for m in conv.messages] == ["user", "assistant", "user", "assistant"]
    with pytest.raises(Rejected) as info:
        to_conversation(conversation_records()["mapped-roles"], "auto", "all")
    assert info.value.reason == "unknown_role"


def test_an_instruction_takes_its_passage_after_it_as_alpaca_does() -> None:
    """databricks-dolly's layout (instruction, context, response): the passage is part of
    the prompt, after the instruction; Alpaca's `input` the same; a field_map names one."""
    from producer.formats.turns import to_conversation

    dolly = {"instruction": "When did Virgin Australia start operating?",
             "context": "Virgin Australia commenced services on 31 August 2000.",
             "response": "31 August 2000.", "category": "closed_qa"}
    [user] = to_conversation(dolly, "auto", "first", None).prompt()
    assert user["content"] == dolly["instruction"] + "\n\n" + dolly["context"]
    no_passage = {**dolly, "context": ""}
    assert to_conversation(no_passage, "auto", "first", None).prompt()[0]["content"] == \
        dolly["instruction"]
    mapped = {"q": "Summarise it.", "passage": "A long text."}
    [user] = to_conversation(mapped, "auto", "first", None,
                             {"prompt": "q", "context": "passage"}).prompt()
    assert user["content"] == "Summarise it.\n\nA long text."
