"""The conversations export (`tokencap/export/conversations.py`): a row per result (its prompt's
messages re-read from the source, the decoded answer, the raw texts); the prompt messages found
only while the source still holds the row's record; and, for conversations regenerated turn by
turn, one row per conversation that ended, with why it stopped (its last turn written, a cap,
a dead turn, a reply the gate kept out, the export's own cut) and none for one still going."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from foundation.config import RunConfig, load_config
from foundation.outputs import FAILED_FILE, REJECTED_FILE, STOPPED_FILE
from foundation.wire import DeadLetter, Outcome, Result, encode, turn_id
from producer.render import Renderer
from producer.source import CategorySource
from tests.conftest import DATASETS, QWEN
from tokencap.export.conversations import ConversationSink, SourceMessages, conversation_row
from tokencap.export.sinks import CategoryStats

GSM8K = DATASETS / "question_answer" / "gsm8k_test_first200.jsonl"


class Decoder:
    """Ids 1..9 are words, 0 is a special token."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return " ".join("<s>" if i == 0 else f"w{i}" for i in ids
                        if not (skip_special_tokens and i == 0))


def result(sid: str, output: list[int], prompt: list[int] | None = None, cat: str = "math",
           **extra: object) -> Result:
    prompt = [5, 6] if prompt is None else prompt
    return Result(id=sid, category=cat, prompt_ids=prompt, output_ids=output,
                  prompt_tokens=len(prompt), completion_tokens=len(output),
                  finish_reason="stop", text="", sampling={}, counted_tokens=len(output),
                  **extra)


def test_a_row_holds_the_prompt_messages_the_answer_and_both_raw_texts() -> None:
    asked = [{"role": "user", "content": "Sum?"}]
    row = conversation_row(result("s1", [3, 4, 0]), "math/s1", Decoder(), lambda r: asked)
    assert row == {"id": "math/s1", "category": "math", "finish_reason": "stop",
                   "conversations": [*asked, {"role": "assistant", "content": "w3 w4"}],
                   "prompt_text": "w5 w6", "completion_text": "w3 w4 <s>"}
    alone = conversation_row(result("s1", [3]), "s1", Decoder(), lambda r: None)
    assert alone["conversations"] == [{"role": "assistant", "content": "w3"}]


def load_config_text(tmp: Path, body: str):
    (tmp / "run.toml").write_text(body)
    return load_config(tmp / "run.toml")


def math_config(tmp: Path, source: Path = GSM8K) -> RunConfig:
    """A run `t` of one category, `math`, over question/answer records at `source`."""
    return load_config_text(tmp, f"""
run = "t"
output_dir = "{tmp / 'out'}"
tokenizer = "{QWEN}"
[[category]]
name = "math"
source = "{source}"
format = "question_answer"
sampling = {{ max_new_tokens = 64 }}
""")


@pytest.fixture
def source_config(tmp_path):
    return math_config(tmp_path)


def test_the_prompt_messages_are_re_read_only_while_the_source_holds_the_rows_record(
        source_config) -> None:
    with CategorySource.open(source_config, source_config.category[0]) as src:
        first, third = src.read(0), src.read(2)
    messages = SourceMessages(source_config)
    try:
        row = result(first.sample_id, [1], ordinal=0)
        assert messages(row) == list(first.prompt) and first.prompt[0]["role"] == "user"
        assert messages.unmatched == 0
        # the record at that position is another one now (the source changed): no messages
        assert messages(result(third.sample_id, [1], ordinal=0)) is None
        assert messages(result(first.sample_id, [1], ordinal=10_000)) is None  # past its end
        assert messages(result(first.sample_id, [1], cat="gone", ordinal=0)) is None
        assert messages.unmatched == 3
        assert messages.category("gone") is None and messages.category("math") is not None
    finally:
        messages.close()


def test_a_source_that_cannot_be_indexed_gives_no_messages(tmp_path) -> None:
    src = tmp_path / "moved.jsonl"
    src.write_text('{"question": "q", "answer": "a"}\n')
    cfg = math_config(tmp_path, src)
    src.unlink()  # gone since the run
    messages = SourceMessages(cfg)
    assert messages(result("x", [1], ordinal=0)) is None and messages.unmatched == 1
    messages.close()


# -- conversations regenerated turn by turn ---------------------------------------------------

@pytest.fixture(scope="module")
def qwen() -> Renderer:
    return Renderer(QWEN)


def turn(qwen: Renderer, conv: str, n: int, total: int, text: str, **extra: object) -> Result:
    tok = qwen.tokenizer
    out = tok.encode(text, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    return result(turn_id(conv, n), out, conversation_id=conv, turn=n, turns_total=total,
                  **extra)


def letter(conv: str, n: int, outcome: Outcome, reason: str) -> bytes:
    return encode(DeadLetter(id=turn_id(conv, n), category="math", outcome=outcome,
                             reason=reason, conversation_id=conv, turn=n, turns_total=3))


def test_each_ended_conversation_is_one_row_saying_why_it_stopped(tmp_path, qwen) -> None:
    cat_dir = tmp_path / "out" / "math"
    cat_dir.mkdir(parents=True)
    # Given the turns written and the category's dead letters and kept-out replies
    turns = [
        turn(qwen, "done", 1, 2, "Hi."), turn(qwen, "done", 2, 2, "Bye."),
        turn(qwen, "capped", 1, 3, "One."),
        turn(qwen, "died", 1, 3, "One."),
        turn(qwen, "gated", 1, 2, "One."),
        turn(qwen, "going", 1, 2, "One."),
        turn(qwen, "cut", 1, 2, "One."), turn(qwen, "cut", 2, 2, "Two."),
        turn(qwen, "odd", 1, 2, "One."), turn(qwen, "odd", 2, 2, "Two.", prefix_consistent=False),
    ]
    (cat_dir / STOPPED_FILE).write_bytes(letter("capped", 2, Outcome.CUT, "cap") + b"\n")
    (cat_dir / FAILED_FILE).write_bytes(letter("died", 2, Outcome.DEAD, "server_error") + b"\n")
    gated = turn(qwen, "gated", 2, 2, "loop loop", gate="loop")
    (cat_dir / REJECTED_FILE).write_bytes(encode(gated) + b"\n")
    path = tmp_path / "d" / "conversations.jsonl"
    sink = ConversationSink(path, qwen.tokenizer, None)
    for t in reversed(turns):  # the turns come in any order
        sink.add_turn(t)
    sink.truncated_at = {"cut": 2}  # the export dropped turn 2 (finish_reason length)
    sink.consistent_only = True
    stats = CategoryStats()
    # When the category's conversations are flushed
    sink.flush_conversations(cat_dir, "math/", stats)
    sink.finish()
    sink.publish()
    rows = {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}
    # Then each one that ended is a row, none still going on, none inconsistent
    assert sorted(rows) == ["math/capped", "math/cut", "math/died", "math/done", "math/gated"]
    assert {k: (r["complete"], r["stopped"], r["turns"]) for k, r in rows.items()} == {
        "math/done": (True, None, 2), "math/capped": (False, "cap", 1),
        "math/died": (False, "dead:server_error", 1),
        "math/gated": (False, "rejected_reply:loop", 1), "math/cut": (False, "truncated", 1)}
    # without the source, the conversation is the model's turns, each parsed back
    assert rows["math/done"]["conversations"] == [{"role": "assistant", "content": "Hi."},
                                                  {"role": "assistant", "content": "Bye."}]
    assert rows["math/done"]["finish_reasons"] == ["stop", "stop"]
    assert rows["math/done"]["turns_total"] == 2 and rows["math/done"]["category"] == "math"
    assert (stats.conversations, stats.conversations_complete,
            stats.conversations_in_progress) == (5, 1, 1)
    # the turns are forgotten once flushed: the next category starts empty
    sink.flush_conversations(cat_dir, "math/", stats)
    assert stats.conversations == 5
