"""`budget_service/writing.py`, the writer's role: its Lua scripts called directly against a
real Redis through its methods (`ensure_groups`: `init_category`; `acknowledge`,
`mark_written`: `acknowledge`); the tests of a script are named `test_<script>_...`
(`test_scripts.py::test_every_script_has_a_direct_test`)."""

from __future__ import annotations

import msgspec

from budget_service.budget import Budget
from budget_service.keys import WRITER_GROUP
from budget_service.ledger import turn_event
from foundation.wire import DeadLetter, encode
from testing.harness import ledger_state
from tests.helpers import ck, feed, pending, result, turn_result


def test_init_category_creates_the_writer_group_on_both_streams(budget: Budget) -> None:
    for stream in (ck(budget).results, ck(budget).dead):
        groups = budget.redis.xinfo_groups(stream)
        assert [g["name"] for g in groups] == [WRITER_GROUP.encode()]
    budget.redis.delete(ck(budget).results)
    # again after Redis lost it; BUSYGROUP on the other ignored
    budget.writing.ensure_groups("code")
    assert budget.redis.xinfo_groups(ck(budget).results)[0]["name"] == WRITER_GROUP.encode()
    assert ledger_state(budget, "code")["cap"] == 1000


def test_acknowledge_marks_written_deletes_entries_and_corrects_used(budget: Budget) -> None:
    feed(budget, "a")
    budget.samples.commit(result("a", 30), 0, 0.0)
    stream = ck(budget).results
    [(_, entries)] = budget.redis.xreadgroup(WRITER_GROUP, "w", {stream: ">"})
    ids = [eid for eid, _ in entries]
    assert budget.writing.written("code", ["a", "b"]) == [None, None]
    assert budget.writing.acknowledge("code", False, ids, {"a": 30}, correction=-5) == 1
    assert budget.redis.xlen(stream) == 0 and ledger_state(budget, "code")["used"] == 25
    assert budget.redis.xpending(stream, WRITER_GROUP)["pending"] == 0
    assert budget.writing.written("code", ["a", "b"]) == ["30", None]
    # marks alone: found on disk at a writer's start
    budget.writing.mark_written("code", {"b": "d"})
    assert budget.writing.written("code", ["a", "b"]) == ["30", "d"]
    assert budget.writing.acknowledge("code", True, [], {}, 0) == 0


def test_acknowledge_hands_a_written_turn_to_the_next_and_ends_conversations(
        budget: Budget) -> None:

    ev = turn_event(msgspec.structs.replace(turn_result("c", 1, 3, [5, 6]), engine="http://e"))
    assert ev is not None and ev.next_id == "c#t2"
    budget.writing.acknowledge("code", False, [], {"c#t1": 2}, 0, [ev])
    assert budget.redis.zrange(ck(budget).follow, 0, -1, withscores=True) == [(b"c#t2", 7.0)]
    [f] = budget.feeding.followups("code", 10)
    # the next turn prefers the engine that served this one (its prefix cache)
    assert (f.sample_id, f.ordinal, f.outputs, f.engine) == ("c#t2", 7, [[5, 6]], "http://e")
    # a turn that ends forgets its preference
    budget.redis.hset(ck(budget).pending, "c#t2", encode(pending("c#t2")))
    budget.samples.commit(msgspec.structs.replace(result("c#t2", 3), id="c#t2"), 0, 0.0)
    assert budget.redis.hlen(ck(budget).engine_of) == 0
    budget.redis.hdel(ck(budget).final, "c#t2")
    # a next turn already pending or final is not put in `follow` again
    budget.redis.delete(ck(budget).follow)
    budget.redis.hset(ck(budget).pending, "c#t2", "{}")
    budget.writing.acknowledge("code", False, [], {}, 0, [ev])
    assert budget.redis.zcard(ck(budget).follow) == 0
    budget.redis.hset(ck(budget).history, "c#t2", "[7]")
    # the last turn ends the conversation: its history goes
    end = turn_event(turn_result("c", 3, 3, [9]))
    assert end is not None and end.drop == ("c#t1", "c#t2")
    budget.writing.acknowledge("code", False, [], {}, 0, [end])
    assert budget.redis.hlen(ck(budget).history) == 0
    # so does a rejected or dead turn; a cut record does not
    dead = DeadLetter(id="d#t2", category="code", outcome="dead", reason="lost",
                      conversation_id="d", turn=2, turns_total=4)
    assert turn_event(dead).drop == ("d#t1",)  # type: ignore[union-attr]
    assert turn_event(msgspec.structs.replace(dead, outcome="cut")) is None
