"""A malformed input line is reported with file and line while the run goes on."""

from __future__ import annotations

import json
import os

from sglang_sim.testing import SimServer
from testing.harness import started
from tests.conftest import QWEN, write_config

GOOD = 30


def test_malformed_lines_are_dead_lettered_and_the_run_goes_on(tmp_path, redis_url) -> None:
    # Given a source with broken lines in between good ones
    src = tmp_path / "qa.jsonl"
    lines = [json.dumps({"question": f"What is {i} + {i}?", "answer": str(2 * i)})
             for i in range(GOOD)]
    lines.insert(3, '{"question": "unterminated')            # line 4: invalid JSON
    lines.insert(10, json.dumps(["not", "an", "object"]))      # line 11: not an object
    lines.insert(20, json.dumps({"question": "   "}))          # line 21: empty turn
    src.write_bytes("\n".join(lines).encode() + b"\n" + b'{"question": "\xff\xfe"}\n')
    cfg = write_config(tmp_path, f"""
run = "bad"
output_dir = "{tmp_path / 'out'}"
tokenizer = "{QWEN}"
cap_tokens = 1000000
[[category]]
name = "qa"
source = "{src}"
format = "question_answer"
sampling = {{ max_new_tokens = 64 }}
""")
    with SimServer(time_scale=1000.0) as sim:
        with started(cfg, redis_url, [sim.url], 2) as pipe:
            status = pipe.run()
    # Then every good line was generated, and each bad one is recorded with file:line
    pipe.check_invariants(status)
    st = status["categories"]["qa"]
    assert st["state"] == "exhausted"
    assert st["samples"] == GOOD and st["rejected"] == 4
    # (where: the source's path relative to the output folder)
    at = os.path.relpath(src, cfg.output_dir)
    dead = {d["where"]: d for d in pipe.dead_letters("qa")}
    assert dead[f"{at}:4"]["reason"] == "invalid_json"
    assert dead[f"{at}:11"]["reason"] == "not_an_object"
    assert dead[f"{at}:21"]["reason"] == "empty_turn"
    assert dead[f"{at}:34"]["reason"] == "invalid_utf8"
    assert all(d["outcome"] == "rejected" for d in dead.values())
    assert st["reasons"] == {"empty_turn": 1, "invalid_json": 1, "invalid_utf8": 1,
                             "not_an_object": 1}


def test_every_kind_of_malformed_record_and_duplicates_are_counted_in_status(
        tmp_path, redis_url) -> None:
    src = tmp_path / "chat.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"Question {i}?"}]} for i in range(12)]
    rows += [
        {"messages": [{"role": "user", "content": "Question 3?"}]},       # duplicate prompt
        {"messages": [{"role": "user"}]},                                   # missing field
        {"messages": [{"role": "wizard", "content": "hi"}]},               # unknown role
        {"messages": [{"role": "user", "content": ""}]},                   # empty turn
        {"messages": []},                                                   # empty conversation
        {"messages": [{"role": "assistant", "content": "only me"}]},       # no user turn
        {"messages": "not a list"},                                         # wrong type
        {"instr": "no known keys"},                                         # unknown format
    ]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = write_config(tmp_path, f"""
run = "kinds"
output_dir = "{tmp_path / 'out'}"
tokenizer = "{QWEN}"
[[category]]
name = "chat"
source = "{src}"
sampling = {{ max_new_tokens = 32 }}
""")
    with SimServer(time_scale=1000.0) as sim:
        with started(cfg, redis_url, [sim.url], 2) as pipe:
            status = pipe.run()
    pipe.check_invariants(status)
    st = status["categories"]["chat"]
    assert st["samples"] == 12 and st["duplicate_prompts"] == 1
    assert st["reasons"] == {
        "duplicate_prompt": 1, "empty_conversation": 1, "empty_turn": 1, "missing_field": 1,
        "no_user_turn": 1, "unknown_format": 1, "unknown_role": 1, "wrong_type": 1,
    }
    assert st["rejected"] == sum(st["reasons"].values())


def test_prompt_longer_than_the_context_is_rejected_with_reason(tmp_path, redis_url) -> None:
    src = tmp_path / "ids.jsonl"
    src.write_text(json.dumps({"input_ids": list(range(1, 200))}) + "\n"
                   + json.dumps({"input_ids": [1, 2, 3]}) + "\n")
    cfg = write_config(tmp_path, f"""
run = "long"
output_dir = "{tmp_path / 'out'}"
context_length = 256
sampling_defaults = "engine"
[[category]]
name = "ids"
source = "{src}"
format = "input_ids"
sampling = {{ max_new_tokens = 100 }}
""")
    with SimServer(time_scale=1000.0) as sim:
        with started(cfg, redis_url, [sim.url], 1) as pipe:
            status = pipe.run()
    pipe.check_invariants(status)
    assert status["categories"]["ids"]["samples"] == 1
    (dead,) = pipe.dead_letters("ids")
    assert dead["reason"] == "prompt_too_long" and "256" in dead["message"]
