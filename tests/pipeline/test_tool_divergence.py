"""Tool-call divergence, case by case (`Conversation.divergence`, `args_match`): a regenerated
turn's calls against the calls the source's next tool results answer. Another function, fewer
calls, no call, more calls: the conversation stops there (never a result handed to a call it
does not answer); the same function with other arguments goes on, marked. Then end to end on
the simulator in Qwen's and Kimi's grammar: no prompt holds a result whose name differs from
the call it answers, and every stopped conversation says why."""

from __future__ import annotations

import json

import pytest

from producer.formats.turns import to_conversation
from producer.render import Renderer
from producer.reply_parser import reply_parser
from sglang_sim.config import LengthDist
from sglang_sim.testing import SimServer
from testing.harness import started
from tests.conftest import FIXTURES, write_config
from tests.family_tokenizers import folder

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
EMAIL = {"type": "function", "function": {
    "name": "send_email", "description": "send an email",
    "parameters": {"type": "object", "properties": {"to": {"type": "string"}},
                   "required": ["to"]}}}


def call(name: str, cid: str, **args: str) -> dict:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


def result(cid: str, name: str, text: str) -> dict:
    return {"role": "tool", "tool_call_id": cid, "name": name, "content": text}


def asked(*calls: dict, content: str = "") -> dict:
    return {"role": "assistant", "content": content, "tool_calls": list(calls)}


USER = {"role": "user", "content": "Weather in Paris?"}
# case -> (tools offered, the source's messages)
CASES: dict[str, tuple[list[dict], list[dict]]] = {
    # the model can only call send_email: the source's result answers get_weather
    "other_name": ([EMAIL], [USER, asked(call("get_weather", "c1", city="Paris")),
                             result("c1", "get_weather", "12C"),
                             {"role": "assistant", "content": "12C in Paris."}]),
    "fewer_calls": ([WEATHER], [USER, asked(call("get_weather", "c1", city="Paris"),
                                            call("get_weather", "c2", city="Lyon")),
                                result("c1", "get_weather", "12C"),
                                result("c2", "get_weather", "14C"),
                                {"role": "assistant", "content": "12C and 14C."}]),
    # turn 2 follows a tool result: the model answers in words where the source called
    "no_call": ([WEATHER], [USER, asked(call("get_weather", "c1", city="Paris")),
                            result("c1", "get_weather", "12C"),
                            asked(call("get_weather", "c2", city="Lyon")),
                            result("c2", "get_weather", "14C"),
                            {"role": "assistant", "content": "12C and 14C."}]),
    # the source answered in words, then the user went on: the model calls
    "more_calls": ([WEATHER], [USER, {"role": "assistant", "content": "Which Paris?"},
                               {"role": "user", "content": "France."},
                               {"role": "assistant", "content": "Sunny."}]),
    "other_args": ([WEATHER], [USER, asked(call("get_weather", "c1", city="Paris")),
                               result("c1", "get_weather", "12C"),
                               {"role": "assistant", "content": "12C in Paris."}]),
}


def conversation(case: str):
    tools, messages = CASES[case]
    conv = to_conversation({"messages": messages, "tools": tools}, "messages", "all")
    assert not isinstance(conv, list)
    return conv


@pytest.mark.parametrize("case", ["other_name", "fewer_calls", "more_calls"])
def test_a_first_turn_that_departs_from_the_source_stops_the_conversation(case) -> None:
    conv = conversation(case)
    model = {"other_name": [call("send_email", "m1", to="bob")],
             "fewer_calls": [call("get_weather", "m1", city="Paris")],
             "more_calls": [call("get_weather", "m1", city="Paris")]}[case]
    div = conv.divergence([asked(*model)])
    assert div is not None and div.kind == case and div.turn == 1
    assert "the model made" in div.message


def test_the_names_of_both_sides_are_in_the_message() -> None:
    div = conversation("other_name").divergence([asked(call("send_email", "m", to="bob"))])
    assert div is not None
    assert div.message == ('turn 1: the model made send_email({"to": "bob"}); the source\'s '
                           'tool results after it answer get_weather({"city": "Paris"})')


def test_no_call_where_the_source_called_stops_it() -> None:
    conv = conversation("no_call")
    first = asked(call("get_weather", "m1", city="Paris"))
    assert conv.divergence([first]) is None
    div = conv.divergence([first, {"role": "assistant", "content": "Lyon too?"}])
    assert div is not None and (div.kind, div.turn) == ("no_call", 2)


def test_the_same_function_with_other_arguments_goes_on_marked() -> None:
    conv = conversation("other_args")
    same = [asked(call("get_weather", "m1", city="Paris"))]
    other = [asked(call("get_weather", "m1", city="Berlin"))]
    assert conv.divergence(other) is None and conv.divergence(same) is None
    assert conv.args_match(other) is False and conv.args_match(same) is True
    assert conv.args_match([]) is None  # nothing replayed yet
    # the result is re-keyed to the model's call (same function)
    prompt = conv.prompt(other)
    assert prompt[2] == {**CASES["other_args"][1][2], "tool_call_id": "m1"}


def test_a_result_is_never_re_keyed_to_a_call_of_another_function() -> None:
    conv = conversation("other_name")
    prompt = conv.prompt([asked(call("send_email", "m1", to="bob"))])
    tool = prompt[2]
    assert (tool["name"], tool["tool_call_id"]) == ("get_weather", "c1")


# -- end to end ------------------------------------------------------------------------------

SHORT = LengthDist(mean_tokens=30.0, sigma=0.4)
FAMILIES = {"qwen": (FIXTURES / "tokenizers" / "qwen3", "qwen3", ""),
            "kimi": (None, "kimi_k2", "")}


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_on_the_simulator_no_prompt_pairs_a_result_with_another_function(
        tmp_path, redis_url, family) -> None:
    tok_dir, grammar, extra = FAMILIES[family]
    tokenizer = tok_dir or folder("kimi-k2.5", tmp_path / "tok")
    src = tmp_path / "cases.jsonl"
    src.write_text("".join(  # each its own first prompt (else a duplicate)
        json.dumps({"id": case, "messages": [{**m[0], "content": f"{m[0]['content']} ({case})"},
                                             *m[1:]], "tools": t}) + "\n"
        for case, (t, m) in CASES.items()))
    cfg = write_config(tmp_path, f"""
run = "div"
output_dir = "{tmp_path / 'out'}"
tokenizer = "{tokenizer}"
cap_tokens = "none"
{extra}
[[category]]
name = "agent"
source = "{src}"
turns = "all"
sampling = {{ max_new_tokens = 256, temperature = 0.6 }}
""")
    with SimServer(time_scale=500.0, tokenizer=str(tokenizer), family=grammar,
                   default_length=SHORT) as sim, started(cfg, redis_url, [sim.url], 2) as pipe:
        status = pipe.run()
        pipe.check_invariants(status)  # every stopped conversation has its reason
    rows = {r.id: r for r in pipe.committed("agent")}
    stopped = {d.conversation_id: d for d in pipe.dead("agent") if d.outcome == "stopped"}
    ids = {r.source_id: r.conversation_id for r in rows.values()}  # case -> conversation
    # each case as expected: where it stopped and why, or how it went on
    for case, turn in (("other_name", 2), ("fewer_calls", 2), ("no_call", 3),
                       ("more_calls", 2)):
        letter = stopped[ids[case]]
        assert (letter.reason, letter.turn) == ("tool_divergence", turn), letter
        assert letter.message.startswith(f"{case}: turn {turn - 1}: the model made ")
    other = rows[f"{ids['other_args']}#t2"]
    assert other.tool_args_match is False and ids["other_args"] not in stopped
    # no prompt holds a tool result whose name differs from the call it answers
    renderer = Renderer(str(tokenizer))
    replies = reply_parser(cfg, renderer)
    tools = {case: t for case, (t, _) in CASES.items()}
    for r in rows.values():
        if r.turn < 2:
            continue
        case = r.source_id or ""
        earlier = sorted((x for x in rows.values() if x.conversation_id == r.conversation_id
                          and x.turn < r.turn), key=lambda x: x.turn)
        made = replies.messages([x.output_ids for x in earlier], tools[case],
                                r.conversation_id or "")
        names = {c["id"]: c["function"]["name"] for m in made for c in m.get("tool_calls", [])}
        tools_of, messages = CASES[case]
        conv = to_conversation({"messages": [{**messages[0], "content": f"{USER['content']} "
                                              f"({case})"}, *messages[1:]],
                                "tools": tools_of}, "messages", "all")
        assert not isinstance(conv, list)
        for m in conv.prompt(made, replies.result_ids(r.conversation_id or "")):
            if m["role"] == "tool" and m.get("tool_call_id") in names:
                assert m["name"] == names[m["tool_call_id"]], (r.id, m)
