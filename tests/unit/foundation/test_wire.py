"""`foundation/wire.py`: what crosses Redis and lands in the files comes back as it went
(every struct through `encode` and msgspec's decoder), a line of an older or newer version
still reads, token ids are checked, and a turn's sample id is made and read back."""

from __future__ import annotations

import msgspec
import pytest

from foundation.wire import (
    DeadLetter,
    ErrorKind,
    JobRef,
    Outcome,
    Pending,
    Result,
    encode,
    split_turn_id,
    turn_id,
)

PENDING = Pending(sample_id="c#t2", ordinal=4, prompt_ids=[1, 2, 3],
                  sampling={"max_new_tokens": 64, "stop": ["\n"]}, where="a.jsonl:5",
                  source_id="rec-5", failures=1, conversation_id="c", turn=2, turns_total=3,
                  prefix_consistent=True, history_notes=["tool result replayed"],
                  reusable_tokens=2, tool_args_match=False, prefer_engine="http://e",
                  affinity="00ff", fed_at_ms=1_700_000_000_000, row_id="r1")
RESULT = Result(id="c#t2", category="code", prompt_ids=[1, 2, 3], output_ids=[4, 2**31 - 1],
                prompt_tokens=3, completion_tokens=2, finish_reason="length", text="hi",
                sampling={"max_new_tokens": 2}, counted_tokens=2, ordinal=4,
                finish={"type": "length", "length": 2}, engine="http://e", latency_s=0.25,
                conversation_id="c", turn=2, turns_total=3, model="m", engine_version="0.5.23",
                cached_tokens=1, out_of_vocab=1, gate="length", made_by="r@abc",
                hidden_states={"file": "code/states/x.safetensors", "tokens": 5})
LETTER = DeadLetter(id="c#t3", category="code", outcome=Outcome.STOPPED,
                    reason="tool_divergence", message="the model called f(x=2)", where="a:5",
                    attempts=2, conversation_id="c", turn=3, turns_total=3)


@pytest.mark.parametrize("item", [JobRef("r", "code", "s:1", seq=2, prompt_tokens=40),
                                  PENDING, RESULT, LETTER])
def test_every_struct_comes_back_as_it_went(item: msgspec.Struct) -> None:
    assert msgspec.json.decode(encode(item), type=type(item)) == item


def test_a_line_written_before_a_field_was_added_still_reads() -> None:
    old = (b'{"id":"a","category":"code","prompt_ids":[1],"output_ids":[2],"prompt_tokens":1,'
           b'"completion_tokens":1,"finish_reason":"stop","text":"x","sampling":{},'
           b'"counted_tokens":1}')
    r = msgspec.json.decode(old, type=Result)
    assert (r.gate, r.history_notes, r.cached_tokens, r.hidden_states) == ("", [], None, None)
    assert msgspec.json.decode(b'{"run":"r","category":"c","sample_id":"s"}',
                               type=JobRef) == JobRef("r", "c", "s")


def test_a_line_of_a_newer_version_reads_without_what_it_added() -> None:
    newer = encode(LETTER)[:-1] + b',"added_later":{"x":1}}'
    assert msgspec.json.decode(newer, type=DeadLetter) == LETTER


@pytest.mark.parametrize("bad", [2**31, -1])
def test_a_token_id_a_row_cannot_store_is_refused(bad: int) -> None:
    line = encode(msgspec.structs.replace(RESULT, output_ids=[1, bad]))
    with pytest.raises(msgspec.ValidationError, match="output_ids"):
        msgspec.json.decode(line, type=Result)


def test_the_structs_are_frozen_and_the_statuses_strings() -> None:
    with pytest.raises(AttributeError):
        RESULT.text = "changed"  # type: ignore[misc]
    assert encode(Outcome.CUT) == b'"cut"' and Outcome("dead") is Outcome.DEAD
    assert ErrorKind.BAD_STATES == "bad_hidden_states"
    assert msgspec.json.decode(encode(LETTER), type=DeadLetter).outcome is Outcome.STOPPED
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(encode(LETTER).replace(b'"stopped"', b'"lost"'), type=DeadLetter)


def test_a_turn_s_sample_id_is_made_and_read_back() -> None:
    assert turn_id("conv-7", 3) == "conv-7#t3"
    assert split_turn_id(turn_id("conv-7", 3)) == ("conv-7", 3)
    assert split_turn_id("a#tb#t12") == ("a#tb", 12)  # the last mark is the turn's
    for plain in ("s:1", "c#t0", "c#t", "c#tx", "c#t-1", "c#2"):
        assert split_turn_id(plain) is None, plain
