"""`budget_service/ledger.py`: the reads every role shares (a category's typed state, what
the ledger holds of each sample, what waits for the writer, the stored config) and the
values that cross into Lua (caps, prompt digests, conversation events)."""

from __future__ import annotations

import msgspec
import pytest

from budget_service.budget import Budget
from budget_service.keys import WRITER_GROUP, Keys
from budget_service.ledger import (
    TurnEvent,
    cache_by_engine,
    cap_arg,
    cap_text,
    cap_value,
    parse_cap,
    prompt_digest,
    turn_event,
)
from foundation.config import UNCAPPED
from foundation.wire import DeadLetter, Outcome
from tests.helpers import LEASE_MS, ck, feed, make_cfg, result, turn_result


def test_the_status_document_is_the_typed_state_the_producer_steers_on(budget) -> None:
    assert feed(budget, "s:1") == 1
    states = budget.states(["code"])
    assert states["code"].pending == 1 and states["code"].state == "open"
    doc = budget.telemetry.status(["code"])["categories"]
    assert doc == {k: msgspec.structs.asdict(st) for k, st in states.items()}


def test_a_cap_is_tokens_or_none_in_redis_and_for_people() -> None:
    assert (cap_arg(None), cap_arg(0), cap_arg(1200)) == (UNCAPPED, 0, 1200)
    assert (cap_value(b"none"), cap_value(b"1200"), cap_value("7"), cap_value(None)) == (
        None, 1200, 7, 0)
    assert (cap_text(None), cap_text(0)) == ("uncapped", "0")
    assert (parse_cap(" None "), parse_cap("300"), parse_cap("0")) == (None, 300, 0)
    for bad in ("-1", "lots", ""):
        with pytest.raises(ValueError):
            parse_cap(bad)


def test_a_prompt_digest_tells_prompts_apart_by_their_ids_and_their_order() -> None:
    assert prompt_digest([1, 2, 3]) == prompt_digest((1, 2, 3))
    digests = {prompt_digest(p) for p in ([1, 2, 3], [3, 2, 1], [1, 2], [1, 2, 3, 0], [])}
    assert len(digests) == 5
    assert all(len(d) == 24 for d in digests)


def test_the_cache_counters_read_by_engine_with_the_missing_ones_zero() -> None:
    raw = {b"http://b:1 samples": b"2", b"http://b:1 cached": b"64",
           b"http://a prompt": b"300"}
    assert cache_by_engine(raw) == {
        "http://a": {"samples": 0, "prompt_tokens": 300, "cached_tokens": 0,
                     "reusable_tokens": 0},
        "http://b:1": {"samples": 2, "prompt_tokens": 0, "cached_tokens": 64,
                       "reusable_tokens": 0}}
    assert list(cache_by_engine(raw)) == ["http://a", "http://b:1"]


def test_a_turn_hands_its_output_on_unless_it_is_the_last_or_kept_out() -> None:
    first = turn_result("c", 1, 3, [5, 6])
    ev = turn_event(first)
    assert ev == TurnEvent("c#t1", [5, 6], "c#t2", 7)
    assert ev.args() == ["next", "c#t1", b"[5,6]", "c#t2", 7, ""]
    # the turn on disk may differ from the one in the stream: its output is handed on
    assert turn_event(first, [9]) == TurnEvent("c#t1", [9], "c#t2", 7)
    # a turn the reply gate kept out ends its conversation, as the last turn does
    gated = msgspec.structs.replace(turn_result("c", 2, 3, [1]), gate="loop")
    assert turn_event(gated) == TurnEvent("c#t2", drop=("c#t1",))
    last = turn_event(turn_result("c", 3, 3, [1]))
    assert last is not None and last.args() == ["end", 2, "c#t1", "c#t2"]
    # a sample of no conversation, and a turn held back by a closed category: no event
    assert turn_event(result("a", 3)) is None
    cut = DeadLetter("c#t2", "code", Outcome.CUT, "cap", conversation_id="c", turn=2)
    assert turn_event(cut) is None
    stopped = msgspec.structs.replace(cut, outcome=Outcome.STOPPED)
    assert turn_event(stopped) == TurnEvent("c#t2", drop=("c#t1",))


def test_the_entries_say_what_the_ledger_holds_of_each_sample(budget: Budget) -> None:
    feed(budget, "a")
    feed(budget, "b")
    assert budget.samples.admit("code", "a", 10, LEASE_MS)[0] == "ok"
    a, b, unknown = budget.entries("code", ["a", "b", "zz"])
    assert a.pending is not None and a.pending.sample_id == "a"
    assert (a.seq, a.in_flight) == (0, True)
    assert b.pending is not None and (b.seq, b.in_flight) == (0, False)
    assert unknown == (None, 0, False)
    assert budget.entries("code", []) == []
    budget.samples.commit(result("a", 5), 0, 0.0)
    assert budget.entries("code", ["a"]) == [(None, 0, False)]  # final: forgotten


def test_unwritten_counts_what_waits_in_the_streams_of_the_categories_asked(redis) -> None:
    budget = Budget(redis, Keys("tokencap", "t"))
    budget.feeding.init_run(make_cfg(cats=("code", "math")))
    feed(budget, "a")
    budget.samples.commit(result("a", 5), 0, 0.0)
    budget.samples.fail(DeadLetter("x", "math", Outcome.REJECTED, "invalid_json"))
    assert budget.unwritten(["code", "math"]) == 2
    assert budget.unwritten(["math"]) == 1
    [(_, entries)] = redis.xreadgroup(WRITER_GROUP, "w", {ck(budget).results: ">"})
    budget.writing.acknowledge("code", False, [e for e, _ in entries], {"a": 5})
    assert budget.unwritten(["code", "math"]) == 1


def test_the_run_s_config_is_read_back_as_it_was_stored(redis) -> None:
    cfg = make_cfg(cap=500, cats=("code", "math"))
    budget = Budget(redis, Keys("tokencap", "t"))
    other = Budget(redis, Keys("tokencap", "nope"))
    assert not budget.has_run() and budget.load_config() is None
    budget.feeding.init_run(cfg)
    assert budget.has_run() and not other.has_run()
    assert budget.load_config() == cfg
