"""Conversations and agent traces as the producer reads them
(`formats.turns.to_conversation`), how a generated turn becomes the next prompt's assistant
message (`producer.replies`), and the config keys of issue 13 (turns = "all", role_map,
cap_tokens = "none")."""

from __future__ import annotations

import hashlib
import json

import pytest

from foundation.config import RunConfig
from foundation.errors import ConfigError
from foundation.wire import Result
from producer.formats import Rejected
from producer.formats.turns import to_conversation, to_prompt
from producer.readers import SourceIndex, read_sample
from producer.render import Renderer
from producer.replies import ReplyParser, Unparsed
from tests.conftest import DATASETS, QWEN, write_config

CONVERSATIONS = DATASETS / "conversations" / "tokencap_conversations.jsonl"
GLAIVE = DATASETS / "agent" / "glaive_toolcall_en_demo.json"
TAU = DATASETS / "agent" / "tau_bench_gpt4o_airline_traj.jsonl"
QWEN3 = QWEN.parent / "qwen3"
ROLE_MAP = {"customer": "user", "agent": "assistant"}


def records() -> dict[str, dict]:
    return {r["id"]: r for r in map(json.loads, CONVERSATIONS.read_text().splitlines())}


@pytest.fixture(scope="module")
def qwen3() -> Renderer:
    return Renderer(QWEN3)


@pytest.fixture(scope="module")
def qwen() -> Renderer:
    return Renderer(QWEN)


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


def test_developer_becomes_system_unless_the_template_knows_it(qwen: Renderer) -> None:
    messages = [{"role": "developer", "content": "Be terse."}, {"role": "user", "content": "hi"}]
    assert qwen.knows_role("developer") is False
    text = qwen.render_text(messages)
    assert text == qwen.render_text([{"role": "system", "content": "Be terse."}, messages[1]])
    qwen._developer = True  # a template that knows the role gets it as is
    try:
        assert qwen.prepare(messages) == messages
    finally:
        qwen._developer = None


# -- replies: output ids -> assistant message ---------------------------------------------------

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


# -- config ---------------------------------------------------------------------------------------

def test_config_keys_of_conversations(tmp_path) -> None:
    src = tmp_path / "s.jsonl"
    src.write_text('{"question": "q"}\n')

    def config(body: str) -> RunConfig:
        return write_config(tmp_path, f"""
run = "r"
output_dir = "out"
tokenizer = "{QWEN}"
cap_tokens = "none"
[[category]]
name = "c"
source = "{src}"
sampling = {{ max_new_tokens = 8 }}
{body}
""")

    cfg = config('turns = "all"\nrole_map = { bot = "assistant" }')
    cat = cfg.category[0]
    assert (cat.turns, cat.role_map, cfg.cap_for(cat)) == ("all", {"bot": "assistant"}, None)
    assert cfg.cap_for(config("cap_tokens = 500").category[0]) == 500
    with pytest.raises(ConfigError, match=r"role_map.*'robot'"):
        config('role_map = { bot = "robot" }')
    with pytest.raises(ConfigError, match="turns"):
        config('turns = "all"\nformat = "input_ids"')
    with pytest.raises(ConfigError, match="cap_tokens"):
        config('cap_tokens = "lots"')


# -- the writer carries conversations on from what is on disk -----------------------------------

def turn_row(turn: int, out: list[int]) -> Result:
    return Result(id=f"c#t{turn}", category="code", prompt_ids=[1, 2], output_ids=out,
                  prompt_tokens=2, completion_tokens=len(out), finish_reason="stop", text="x",
                  sampling={}, counted_tokens=len(out), ordinal=4, conversation_id="c",
                  turn=turn, turns_total=3)


def test_a_turn_generated_again_goes_on_from_the_row_on_disk(tmp_path, redis) -> None:
    """Redis lost turn 1's commit after the writer wrote it; turn 1 was generated again
    (other output) and committed: the file keeps the first, and the conversation goes on
    from the first, the one on disk."""
    from budget_service.budget import Budget
    from budget_service.keys import Keys
    from tests.test_lua import make_cfg
    from writer.writer import Writer

    keys = Keys("tokencap", "t")
    budget = Budget(redis, keys)
    budget.feeding.init_run(make_cfg())
    on_disk = turn_row(1, [11, 12, 13])
    writer = Writer(redis, keys, ["code"], tmp_path)
    budget.samples.commit(on_disk, 0, 0.0)
    assert writer.drain_once(block_ms=None) == 1
    assert budget.feeding.followups("code", 10)[0].outputs == [[11, 12, 13]]
    redis.flushdb()  # Redis restarted empty: the commit, the marks, the follow-up are gone
    budget.feeding.init_run(make_cfg())
    again = turn_row(1, [21, 22])
    budget.samples.commit(again, 0, 0.0)
    writer2 = Writer(redis, keys, ["code"], tmp_path)  # a writer starting on the files
    assert writer2.drain_once(block_ms=None) == 0  # not written twice
    [f] = budget.feeding.followups("code", 10)
    assert (f.sample_id, f.ordinal, f.outputs) == ("c#t2", 4, [[11, 12, 13]])
    assert budget.state("code")["used"] == 3  # corrected to what the file holds
    writer.close()
    writer2.close()
