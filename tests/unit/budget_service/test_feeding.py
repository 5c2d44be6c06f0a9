"""`budget_service/feeding.py`, the producer's role: each of its Lua scripts called directly
against a real Redis through its method (`init_run`, `feed`, `requeue`, `lease`, `unpark`,
`exhausted`, `source_size`, `reconcile`, `restore`, `feed_follow`, `cut`); the tests of a
script are named `test_<script>_...` (`test_scripts.py::test_every_script_has_a_direct_test`)."""

from __future__ import annotations

import msgspec
import pytest
from redis.exceptions import ResponseError

from budget_service.budget import Budget
from budget_service.keys import WRITER_GROUP, Keys
from budget_service.ledger import now_ms, prompt_digest, turn_event
from foundation.config import Mode, RunConfig
from foundation.errors import RunMismatch
from foundation.wire import DeadLetter
from testing.harness import final_marks, ledger_entry, ledger_state
from tests.helpers import LEASE_MS, ck, feed, make_cfg, pending, result, turn_result

# -- init ------------------------------------------------------------------------------

def test_init_run_creates_once_and_keeps_live_caps(redis) -> None:
    b = Budget(redis, Keys("tokencap", "t"))
    assert b.feeding.init_run(make_cfg(cap=1000, cats=("code", "math"))) is True
    b.operating.set_cap("code", 5000)
    assert b.feeding.init_run(make_cfg(cap=1000, cats=("code", "math"))) is False
    assert ledger_state(b, "code")["cap"] == 5000 and ledger_state(b, "math")["cap"] == 1000
    with pytest.raises(RunMismatch):
        b.feeding.init_run(make_cfg(cats=("code",)))


def test_init_run_refuses_changed_modes_on_resume(redis) -> None:
    """A resumed run draws each conversation's mode as before: other modes or weights for an
    existing run are refused (a half-made conversation would change mode), the same pass."""
    def with_modes(*modes: tuple[str, float]) -> RunConfig:
        cfg = make_cfg(cats=("code",))
        cat = msgspec.structs.replace(cfg.category[0], modes=[
            Mode(name=n, weight=w) for n, w in modes])
        return msgspec.structs.replace(cfg, category=[cat])

    b = Budget(redis, Keys("tokencap", "m"))
    assert b.feeding.init_run(with_modes(("think", 0.7), ("fast", 0.3))) is True
    assert b.feeding.init_run(with_modes(("think", 0.7), ("fast", 0.3))) is False
    for changed in (with_modes(("think", 0.5), ("fast", 0.5)), with_modes(("think", 1.0)),
                    make_cfg(cats=("code",))):
        with pytest.raises(RunMismatch, match="draw every conversation's mode as before"):
            b.feeding.init_run(changed)


# -- feed ------------------------------------------------------------------------------

def test_feed_records_once(budget: Budget) -> None:
    assert feed(budget, "a") == 1
    assert feed(budget, "a") == 0
    budget.samples.commit(result("a", 5), 0, 0.0)
    assert feed(budget, "a") == 0  # final samples are never fed again
    assert budget.feeding.cursor("code") == 3


def test_feed_appends_the_near_duplicate_record_of_what_it_feeds(budget: Budget) -> None:
    # Given three samples, b an exact copy of a's prompt ids, each with its record
    samples = [pending("a", (1, 2)), pending("b", (1, 2)), pending("c", (3,))]
    records = [b"A" * 132, b"B" * 132, b""]
    ids = budget.feeding.feed("code", 0, 3, now_ms() + LEASE_MS, samples, [], (), records)
    # Then the records of those fed are appended, in order; b (duplicate_prompt) adds none
    assert ids == ["a", "c"]
    assert budget.feeding.near_records("code") == b"A" * 132
    # and a stale feed appends nothing
    stale = budget.feeding.feed("code", 0, 4, now_ms() + LEASE_MS, [pending("d", (4,))], [], (),
                                [b"D" * 132])
    assert stale is None and budget.feeding.near_records("code") == b"A" * 132


def test_feed_with_a_stale_cursor_writes_nothing(budget: Budget) -> None:
    assert feed(budget, "a") == 1
    # a producer that believes the cursor is 5 (Redis lost feeds it made)
    assert budget.feeding.feed("code", 5, 6, now_ms() + LEASE_MS, [pending("b", (9,))], []) is None
    assert budget.feeding.cursor("code") == 1
    assert budget.redis.hget(ck(budget).pending, "b") is None


def test_a_prompt_another_category_fed_is_rejected_as_duplicate(redis) -> None:
    budget = Budget(redis, Keys("tokencap", "x"))
    budget.feeding.init_run(make_cfg(cats=("code", "chat")))
    deadline = now_ms() + LEASE_MS
    assert budget.feeding.feed("code", 0, 1, deadline, [pending("a", (7, 8))], [],
                               others=["chat"]) == ["a"]
    # chat feeds the same ids later: the first category keeps them; another prompt passes
    ids = budget.feeding.feed("chat", 0, 2, deadline,
                              [pending("b", (7, 8)), pending("c", (9,))], [], others=["code"])
    assert ids == ["c"]
    st = budget.telemetry.status()["categories"]["chat"]
    assert (st["duplicate_prompts"], st["reasons"]) == (1, {"duplicate_prompt": 1})
    entry = budget.redis.xrange(budget.keys.cat("chat").dead)[0][1][b"r"]
    letter = msgspec.json.decode(entry, type=DeadLetter)
    assert (letter.id, letter.reason) == ("b", "duplicate_prompt")
    assert "same prompt token ids as code/a" in letter.message
    assert final_marks(budget, "code") == {}  # nothing of code was touched


def test_the_feed_takes_what_the_producer_asked_already(redis) -> None:
    # Given a batch the producer asked about once (its screens and the feed share it), the
    # other category first and the category's own last
    budget = Budget(redis, Keys("tokencap", "x"))
    budget.feeding.init_run(make_cfg(cats=("code", "chat")))
    deadline = now_ms() + LEASE_MS
    assert budget.feeding.feed("code", 0, 1, deadline, [pending("a", (7, 8))], []) == ["a"]
    assert budget.feeding.feed("chat", 0, 1, deadline, [pending("b", (5,))], []) == ["b"]
    batch = [pending("c", (7, 8)), pending("d", (5,)), pending("e", (6,))]
    seen = budget.feeding.seen(["code", "chat"], batch)
    assert seen.owners == ["code/a", "chat/b", None]
    # When chat feeds it with that answer: code's copy is dropped here, its own copy is left
    # to the script (both duplicate_prompt), and Redis is not asked again
    asked: list[object] = []
    budget.feeding.fed_elsewhere = lambda *a: asked.append(a)  # type: ignore[method-assign]
    ids = budget.feeding.feed("chat", 1, 4, deadline, batch, [], ["code"], seen=seen)
    assert ids == ["e"] and asked == []
    marks = final_marks(budget, "chat")
    assert marks == {"c": "r:duplicate_prompt", "d": "r:duplicate_prompt"}


def test_feed_leases_records_rejections_and_duplicate_prompts(budget: Budget) -> None:
    bad = DeadLetter(id="x", category="code", outcome="rejected", reason="invalid_json",
                     where="f:3")
    deadline = now_ms() + LEASE_MS
    ids = budget.feeding.feed("code", 0, 4, deadline,
                      [pending("a", (1, 2)), pending("b", (1, 2)), pending("c", (3,))], [bad])
    assert ids == ["a", "c"]
    assert budget.redis.zscore(ck(budget).leases, "a") == deadline
    st = budget.telemetry.status()["categories"]["code"]
    assert (st["pending"], st["rejected"], st["duplicate_prompts"]) == (2, 2, 1)
    assert st["reasons"] == {"duplicate_prompt": 1, "invalid_json": 1}
    final = final_marks(budget, "code")
    assert final == {"b": "r:duplicate_prompt", "x": "r:invalid_json"}
    assert budget.redis.xlen(ck(budget).dead) == 2
    assert budget.redis.hget(ck(budget).prompts, prompt_digest([1, 2])) == b"a"
    # its own earlier feed is not a duplicate, and a rejection is recorded once
    assert budget.feeding.feed("code", 4, 5, deadline, [pending("a", (1, 2))], [bad]) == []
    assert budget.telemetry.status()["categories"]["code"]["rejected"] == 2


# -- the reaper: requeue and lease -----------------------------------------------------

def test_requeue_gives_a_lost_sample_a_new_seq_and_lease(budget: Budget) -> None:
    feed(budget, "a")
    budget.samples.admit("code", "a", 100, LEASE_MS, max_add=64)
    budget.redis.zadd(ck(budget).leases, {"a": 1})  # the worker died: its lease expired
    p = msgspec.structs.replace(pending("a"), failures=1)
    deadline = now_ms() + LEASE_MS
    assert budget.feeding.requeue("code", p, 0, deadline) == 1
    st = ledger_state(budget, "code")
    assert (st["reserved"], st["worst"]) == (0, 0)  # the lost reservation is returned
    assert budget.redis.zscore(ck(budget).leases, "a") == deadline
    assert ledger_entry(budget, "code", "a") == (p, 1, False)
    # read at seq 0 (a second reaper pass on stale data): refused, nothing changes
    budget.redis.zadd(ck(budget).leases, {"a": 1})
    assert budget.feeding.requeue("code", p, 0, deadline) == -1
    assert ledger_entry(budget, "code", "a").seq == 1


def test_requeue_leaves_a_sample_whose_lease_was_extended_meanwhile(budget: Budget) -> None:
    feed(budget, "a")
    budget.samples.admit("code", "a", 100, LEASE_MS)  # lease in the future: the worker lives
    assert budget.feeding.requeue("code", pending("a"), 0, now_ms() + LEASE_MS) == -1
    assert ledger_state(budget, "code")["reserved"] == 100
    budget.samples.commit(result("a", 5), 0, 0.0)
    assert budget.feeding.requeue("code", pending("a"), 0, now_ms()) == -1  # final


def test_lease_extends_a_waiting_sample_and_drops_a_stray_entry(budget: Budget) -> None:
    feed(budget, "a")
    assert budget.feeding.keep_lease("code", "a", 777) is True
    assert budget.redis.zscore(ck(budget).leases, "a") == 777
    budget.redis.zadd(ck(budget).leases, {"ghost": 1})
    assert budget.feeding.keep_lease("code", "ghost", 777) is False
    assert budget.redis.zscore(ck(budget).leases, "ghost") is None


# -- unpark ----------------------------------------------------------------------------

def park(budget: Budget, sids: str) -> None:
    for sid in sids:
        feed(budget, sid)
        budget.redis.zadd(ck(budget).parked, {sid: now_ms()})
        budget.redis.zrem(ck(budget).leases, sid)


def test_unpark_takes_and_reserves_as_many_as_admission_would(budget: Budget) -> None:
    feed(budget, "x")
    assert budget.samples.admit("code", "x", 300, LEASE_MS)[0] == "ok"  # reserved 300 of 1000
    park(budget, "abcd")
    deadline = now_ms() + LEASE_MS
    # 300 + 300 < 1000 ok, 600 + 300 < 1000 ok, 900 + 300 no: two leave the park
    got = budget.feeding.unpark("code", 300, 0, 0, 0.0, deadline, 100)
    assert got.leased == [("a", 1), ("b", 1)] and got.prompts == [0, 0]
    assert budget.redis.zrange(ck(budget).parked, 0, -1) == [b"c", b"d"]
    assert budget.redis.zscore(ck(budget).leases, "a") == deadline
    assert ledger_state(budget, "code")["reserved"] == 900  # each reserved for as admit would
    # the stale job of b's first enqueue is refused; the new one finds its reservation
    assert budget.samples.admit("code", "b", 300, LEASE_MS, seq=0)[0] == "stale"
    assert budget.samples.admit("code", "b", 300, LEASE_MS, seq=1)[0] == "ok"
    assert ledger_state(budget, "code")["reserved"] == 900
    budget.samples.commit(result("x", 100), 0, 0.0)  # used 100, reserved 600
    # with a margin of 1 sigma of 150^2 each: 100 + 600 + 100 + 150 < 1000 takes c, then
    # 100 + 700 + 100 + sqrt(2 * 150^2) >= 1000 stops at d
    got = budget.feeding.unpark("code", 100, 150**2, 0, 1.0, deadline, 100)
    assert got.leased == [("c", 1)]
    assert int(budget.redis.hget(ck(budget).var, "c")) == 150**2


def test_unpark_asks_for_the_prompt_tokens_admit_parked_a_sample_with(budget: Budget) -> None:
    feed(budget, "x")
    feed(budget, "a")
    assert budget.samples.admit("code", "x", 300, LEASE_MS, extra=200)[0] == "ok"  # 500
    # a: 500 + 300 + 200 >= 1000 waits; its prompt tokens are kept beside it
    assert budget.samples.admit("code", "a", 300, LEASE_MS, 100, extra=200)[0] == "wait"
    assert budget.redis.hget(ck(budget).extra, "a") == b"200"
    deadline = now_ms() + LEASE_MS
    assert budget.feeding.unpark("code", 300, 0, 100, 0.0, deadline, 100).leased == []
    budget.samples.commit(result("x", 100), 0, 0.0)  # used 100, reserved 0
    got = budget.feeding.unpark("code", 300, 0, 100, 0.0, deadline, 100)
    assert got.leased == [("a", 1)] and got.prompts == [200]
    assert ledger_state(budget, "code")["reserved"] == 500  # 300 + its 200 prompt tokens
    assert ledger_state(budget, "code")["worst"] == 300  # max_add 100 + 200
    assert budget.redis.hget(ck(budget).extra, "a") is None
    assert budget.samples.admit("code", "a", 300, LEASE_MS, 100, seq=1, extra=200)[0] == "ok"


def test_unpark_takes_one_when_nothing_is_in_flight(budget: Budget) -> None:
    park(budget, "ab")
    got = budget.feeding.unpark("code", 5000, 0, 0, 0.0, now_ms() + LEASE_MS, 100)
    assert got.leased == [("a", 1)]


def test_unpark_leaves_the_parked_samples_of_a_closed_category_held(budget: Budget) -> None:
    park(budget, "abc")
    budget.samples.commit(result("a", 5), 0, 0.0)  # a is final already
    budget.operating.set_cap("code", 0)  # closes it
    got = budget.feeding.unpark("code", 10, 0, 0, 0.0, now_ms() + LEASE_MS, 100)
    assert got.leased == []
    assert final_marks(budget, "code") == {"a": "c:5"}
    st = budget.telemetry.status()["categories"]["code"]
    assert (st["parked"], st["pending"], st["skipped"]) == (2, 2, 2)


def test_unpark_drops_entries_of_samples_no_longer_pending(budget: Budget) -> None:
    budget.redis.zadd(ck(budget).parked, {"gone": 1})
    park(budget, "a")
    got = budget.feeding.unpark("code", 10, 0, 0, 0.0, now_ms() + LEASE_MS, 100)
    assert got.leased == [("a", 1)] and budget.redis.zcard(ck(budget).parked) == 0


def test_unpark_hard_guard_counts_what_each_taken_sample_can_add(budget: Budget) -> None:
    park(budget, "abcd")
    got = budget.feeding.unpark("code", 10, 0, 300, 0.0, now_ms() + LEASE_MS, 100)
    assert [s for s, _ in got.leased] == ["a", "b", "c", "d"]  # 0, 300, 600, 900 < 1000
    assert ledger_state(budget, "code")["worst"] == 1200  # each holds what it can add
    park(budget, "e")
    assert budget.feeding.unpark("code", 10, 0, 300, 0.0, now_ms(), 100).leased == []


# -- exhausted, source_size, reconcile ------------------------------------------------

def test_exhausted_waits_for_pending_followups_and_the_writer(budget: Budget) -> None:
    budget.redis.zadd(ck(budget).follow, {"c#t2": 0})
    assert budget.feeding.mark_exhausted("code", 0) is False  # a conversation waits for its turn
    budget.redis.delete(ck(budget).follow)
    feed(budget, "a")
    assert budget.feeding.mark_exhausted("code", 1) is False  # a sample is pending
    budget.samples.commit(result("a", 5), 0, 0.0)
    assert budget.feeding.mark_exhausted("code", 1) is False  # its result is not written yet
    [(_, entries)] = budget.redis.xreadgroup(WRITER_GROUP, "w", {ck(budget).results: ">"})
    budget.writing.acknowledge("code", False, [e for e, _ in entries], {"a": 5})
    assert budget.feeding.mark_exhausted("code", 1) is True


def test_source_size_sends_the_cursor_back_and_reopens_when_the_source_grew(
        budget: Budget) -> None:
    # a new source: its size recorded, nothing moved
    assert budget.feeding.source_size("code", 2) is False
    feed(budget, "a")
    feed(budget, "b")
    budget.samples.commit(result("a", 5), 0, 0.0)
    budget.samples.commit(result("b", 5), 0, 0.0)
    [(_, entries)] = budget.redis.xreadgroup(WRITER_GROUP, "w", {ck(budget).results: ">"})
    budget.writing.acknowledge("code", False, [e for e, _ in entries], {"a": 5, "b": 5})
    assert budget.feeding.mark_exhausted("code", 2) is True
    # the same source opened again (a resume): nothing changes
    assert budget.feeding.source_size("code", 2) is False
    assert budget.feeding.cursor("code") == 2
    assert budget.telemetry.status()["categories"]["code"]["state"] == "exhausted"
    # the source grew: its order is another one, so the cursor starts over (what is final
    # is skipped by the feed) and the category is open again, its counts kept
    assert budget.feeding.source_size("code", 5) is True
    assert budget.feeding.cursor("code") == 0
    st = budget.telemetry.status()["categories"]["code"]
    assert (st["state"], st["samples"], st["used"]) == ("open", 2, 10)
    assert feed(budget, "a") == 0 and feed(budget, "c") == 1
    # a run older than the field, its cursor past 0: started over once, to be safe
    budget.redis.hdel(ck(budget).state, "records")
    assert budget.feeding.source_size("code", 5) is True
    assert budget.feeding.cursor("code") == 0
    # a closed category stays closed (its cap holds it)
    budget.operating.set_cap("code", 1)
    feed(budget, "d")
    assert budget.feeding.source_size("code", 9) is True
    assert budget.telemetry.status()["categories"]["code"]["state"] == "closed"


def test_reconcile_adds_only_missing_and_forgets_what_is_on_disk(budget: Budget) -> None:
    feed(budget, "a")
    budget.samples.admit("code", "a", 10, LEASE_MS)
    budget.samples.commit(result("a", 30), 0, 0.0)
    feed(budget, "b")
    budget.samples.admit("code", "b", 40, LEASE_MS)  # in flight when Redis lost its commit
    records = [("a", "c:30", 30, 0, 1, "", 30, "think"),
               ("b", "c:50", 50, 50, 3, "loop", 50, "fast"),
               ("c", "r:invalid_json", 0, 0, "", "", 0, "")]
    assert budget.feeding.reconcile("code", records) == 2
    assert budget.feeding.reconcile("code", records) == 0
    st = budget.telemetry.status()["categories"]["code"]
    assert (st["used"], st["samples"], st["waste_tokens"], st["rejected"]) == (80, 2, 50, 1)
    # "a" was counted by its commit already; "b" is a reply the gate kept out
    assert (st["kept_tokens"], st["rejected_tokens"], st["rejected_replies"]) == (
        30, {"loop": 50}, {"loop": 1})
    assert (st["pending"], st["in_flight"], st["reserved"]) == (0, 0, 0)
    # per mode: "b" rebuilt from its row ("a"'s commit carried no mode)
    assert st["modes"] == {"fast": {"rows": 1, "tokens": 50}}


# -- conversations: restore, feed_follow, cut ------------------------------------------

def test_restore_puts_back_next_turns_and_histories_and_touches_no_stream(
        budget: Budget) -> None:

    # Given what the files hold of two conversations: c's turn 1 written (c#t2 next), d ended
    go_on = turn_event(msgspec.structs.replace(turn_result("c", 1, 3, [5, 6]), engine="http://e"))
    ended = turn_event(turn_result("d", 2, 2, [9]))
    assert go_on is not None and ended is not None
    budget.redis.hset(ck(budget).history, "d#t1", "[1]")  # left over from before
    budget.samples.commit(result("x", 5), 0, 0.0)  # an unwritten result in the stream
    budget.feeding.restore_followups("code", [go_on, ended])
    # c waits for its next turn with its history and engine; d's history is gone
    [f] = budget.feeding.followups("code", 10)
    assert (f.sample_id, f.ordinal, f.outputs, f.engine) == ("c#t2", 7, [[5, 6]], "http://e")
    assert budget.redis.hget(ck(budget).history, "d#t1") is None
    # the results stream, the written marks and `used` are left alone
    assert budget.redis.xlen(ck(budget).results) == 1
    assert budget.redis.hlen(ck(budget).written) == 0
    assert ledger_state(budget, "code")["used"] == 5
    # a next turn already pending is not put back in `follow`
    budget.redis.delete(ck(budget).follow)
    budget.redis.hset(ck(budget).pending, "c#t2", "{}")
    budget.feeding.restore_followups("code", [go_on])
    assert budget.redis.zcard(ck(budget).follow) == 0
    with pytest.raises(ResponseError, match="unknown conversation event"):
        budget.scripts.restore(keys=ck(budget), args=["bogus"])


def test_feed_follow_feeds_each_waiting_turn_once(budget: Budget) -> None:
    budget.redis.zadd(ck(budget).follow, {"c#t2": 3, "d#t2": 4, "e#t2": 5})
    p = msgspec.structs.replace(pending("c#t2"), conversation_id="c", turn=2, turns_total=2)
    late = pending("z#t2")  # not waiting (fed by another call): left alone
    bad = DeadLetter(id="d#t2", category="code", outcome="rejected", reason="prompt_too_long",
                     conversation_id="d", turn=2)
    assert budget.feeding.feed_follow("code", now_ms() + LEASE_MS, [p, late], [bad]) == ["c#t2"]
    assert budget.feeding.feed_follow("code", now_ms() + LEASE_MS, [p], [bad]) == []
    assert ledger_entry(budget, "code", "c#t2").pending == p
    assert final_marks(budget, "code") == {"d#t2": "r:prompt_too_long"}
    assert budget.redis.zrange(ck(budget).follow, 0, -1) == [b"e#t2"]
    assert budget.redis.hexists(ck(budget).pending, "z#t2") is False
    st = budget.telemetry.status()["categories"]["code"]
    assert (st["pending"], st["followups"], st["rejected"]) == (1, 1, 1)


def test_cut_reports_each_held_turn_once_while_closed(budget: Budget) -> None:
    budget.redis.zadd(ck(budget).follow, {"c#t2": 3})
    letter = DeadLetter(id="c#t2", category="code", outcome="cut", reason="cap",
                        conversation_id="c", turn=2)
    other = msgspec.structs.replace(letter, id="x#t3")  # not held: not reported
    assert budget.feeding.cut("code", [letter]) == 0  # open: nothing is cut
    budget.operating.set_cap("code", 0)  # closes it
    assert budget.feeding.held("code") == [("c#t2", 3)]
    assert budget.feeding.cut("code", [letter, other]) == 1
    assert budget.feeding.cut("code", [letter]) == 0
    assert budget.feeding.held("code") == []
    assert budget.redis.xlen(ck(budget).dead) == 1
    assert final_marks(budget, "code") == {}  # not an end: a raised cap sends the turn
    st = budget.telemetry.status()["categories"]["code"]
    assert (st["skipped"], st["followups"]) == (1, 1)
