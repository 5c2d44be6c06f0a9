"""Each Lua script called directly against a real Redis, through its `Budget` method.

Every script of `budget_service/lua/` has tests here named `test_<script>_...`
(`test_every_script_has_a_direct_test` holds that).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import msgspec
import pytest
from redis.exceptions import ResponseError

from budget_service.budget import Budget
from budget_service.keys import WRITER_GROUP, CategoryKeys, Keys
from budget_service.ledger import now_ms, prompt_digest
from budget_service.scripts import CATEGORY_SCRIPTS, LUA_DIR, OTHER_SCRIPTS
from foundation.engine.info import EngineInfo
from foundation.errors import RunMismatch
from foundation.wire import DeadLetter, Pending, Result, encode
from testing.harness import final_marks, ledger_entry, ledger_state
from tests.helpers import LEASE_MS, feed, make_cfg, pending, result


@pytest.fixture
def budget(redis) -> Budget:
    b = Budget(redis, Keys("tokencap", "t"))
    b.feeding.init_run(make_cfg())
    return b


def ck(budget: Budget, category: str = "code") -> CategoryKeys:
    return budget.keys.cat(category)


# -- the library and the registry -----------------------------------------------------------

def test_lib_names_the_keys_in_category_keys_order() -> None:
    table = (LUA_DIR / "_lib.lua").read_text().split("local K = {", 1)[1].split("}", 1)[0]
    names = re.findall(r"(\w+) = KEYS\[(\d+)\]", table)
    assert [(n, int(i)) for n, i in names] == [
        (f, i) for i, f in enumerate(CategoryKeys._fields, 1)]


def test_every_script_has_a_direct_test() -> None:
    on_disk = {p.stem for p in LUA_DIR.glob("*.lua") if not p.stem.startswith("_")}
    assert on_disk == set(CATEGORY_SCRIPTS) | set(OTHER_SCRIPTS)
    tests = [n for n in dir(sys.modules[__name__]) if n.startswith("test_")]
    untested = [s for s in sorted(on_disk) if not any(t.startswith(f"test_{s}_") for t in tests)]
    assert untested == []


def test_no_script_builds_a_key_name() -> None:
    for path in Path(LUA_DIR).glob("*.lua"):
        code = "\n".join(line.split("--", 1)[0] for line in path.read_text().splitlines())
        assert "..':'" not in code.replace(" ", "") and "':'.." not in code.replace(" ", ""), \
            path.name


# -- init ---------------------------------------------------------------------------------

def test_init_run_creates_once_and_keeps_live_caps(redis) -> None:
    b = Budget(redis, Keys("tokencap", "t"))
    assert b.feeding.init_run(make_cfg(cap=1000, cats=("code", "math"))) is True
    b.operating.set_cap("code", 5000)
    assert b.feeding.init_run(make_cfg(cap=1000, cats=("code", "math"))) is False
    assert ledger_state(b, "code")["cap"] == 5000 and ledger_state(b, "math")["cap"] == 1000
    with pytest.raises(RunMismatch):
        b.feeding.init_run(make_cfg(cats=("code",)))


def test_init_category_creates_the_writer_group_on_both_streams(budget: Budget) -> None:
    for stream in (ck(budget).results, ck(budget).dead):
        groups = budget.redis.xinfo_groups(stream)
        assert [g["name"] for g in groups] == [WRITER_GROUP.encode()]
    budget.redis.delete(ck(budget).results)
    # again after Redis lost it; BUSYGROUP on the other ignored
    budget.writing.ensure_groups("code")
    assert budget.redis.xinfo_groups(ck(budget).results)[0]["name"] == WRITER_GROUP.encode()
    assert ledger_state(budget, "code")["cap"] == 1000


# -- feed ---------------------------------------------------------------------------------

def test_feed_records_once(budget: Budget) -> None:
    assert feed(budget, "a") == 1
    assert feed(budget, "a") == 0
    budget.samples.commit(result("a", 5), 0, 0.0)
    assert feed(budget, "a") == 0  # final samples are never fed again
    assert budget.feeding.cursor("code") == 3


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


# -- admit, heartbeat, commit, release, fail -----------------------------------------------

def test_admit_returns_payload_and_reserves(budget: Budget) -> None:
    feed(budget, "a")
    status, p = budget.samples.admit("code", "a", 100, LEASE_MS)
    assert status == "ok" and p is not None and p.sample_id == "a"
    assert ledger_state(budget, "code")["reserved"] == 100
    # admitted again (a retry of the same sample) keeps one reservation
    assert budget.samples.admit("code", "a", 100, LEASE_MS)[0] == "ok"
    assert ledger_state(budget, "code")["reserved"] == 100


def test_admit_waits_while_the_writer_is_behind(budget: Budget) -> None:
    for sid in "abc":
        feed(budget, sid)
    budget.samples.commit(result("a", 5), 0, 0.0)  # one result the writer has not written
    assert budget.samples.admit("code", "b", 10, LEASE_MS, max_unwritten=2)[0] == "ok"
    budget.samples.fail(DeadLetter(id="x", category="code", outcome="rejected", reason="r"))
    # a result and a dead letter wait: at the bound, nothing more is admitted...
    assert budget.samples.admit("code", "c", 10, LEASE_MS, max_unwritten=2) == ("wait", None)
    assert budget.redis.zscore(ck(budget).parked, "c") is not None
    # ... nor given back from the park, until the writer catches up
    assert budget.feeding.unpark("code", 10, 0, 0, 0.0, now_ms(), 10, max_unwritten=2).leased == []
    budget.redis.delete(ck(budget).results)
    assert budget.feeding.unpark("code", 10, 0, 0, 0.0, now_ms(), 10, max_unwritten=2).leased == [
        ("c", 1)]
    assert budget.samples.admit("code", "c", 10, LEASE_MS, seq=1, max_unwritten=2)[0] == "ok"


def test_admit_refuses_the_job_of_an_earlier_enqueue(budget: Budget) -> None:
    feed(budget, "a")
    budget.redis.zadd(ck(budget).leases, {"a": 1})  # its lease expired
    p = msgspec.json.decode(budget.redis.hget(ck(budget).pending, "a"), type=Pending)
    assert budget.feeding.requeue("code", p, 0, now_ms() + LEASE_MS) == 1
    assert budget.samples.admit("code", "a", 100, LEASE_MS, seq=0) == ("stale", None)
    assert ledger_state(budget, "code")["reserved"] == 0
    assert budget.samples.admit("code", "a", 100, LEASE_MS, seq=1)[0] == "ok"
    assert budget.samples.admit("code", "zz", 100, LEASE_MS) == ("unknown", None)


def test_admit_holds_back_the_samples_of_a_closed_category(budget: Budget) -> None:
    budget.operating.set_cap("code", 0)  # closes it
    feed(budget, "a")
    assert budget.samples.admit("code", "a", 10, LEASE_MS) == ("closed", None)
    st = budget.telemetry.status()["categories"]["code"]
    assert (st["skipped"], st["parked"], st["pending"], st["reserved"]) == (1, 1, 1, 0)
    assert final_marks(budget, "code") == {}  # held, not final
    assert budget.redis.zscore(ck(budget).leases, "a") is None
    assert budget.samples.admit("code", "a", 10, LEASE_MS) == ("closed", None)  # still held once
    assert budget.telemetry.status()["categories"]["code"]["skipped"] == 1
    budget.operating.set_cap("code", 5000)  # a raised cap reopens: the held sample is sent
    got = budget.feeding.unpark("code", 10, 0, 0, 0.0, now_ms() + LEASE_MS, 100)
    assert got.leased == [("a", 1)]
    assert budget.samples.admit("code", "a", 10, LEASE_MS, seq=1)[0] == "ok"


def test_admit_waits_when_reservations_fill_the_cap(budget: Budget) -> None:
    for sid in ("a", "b", "c"):
        feed(budget, sid)
    assert budget.samples.admit("code", "a", 600, LEASE_MS)[0] == "ok"
    assert budget.samples.admit("code", "b", 600, LEASE_MS)[0] == "wait"  # 600 + 600 >= 1000
    assert budget.redis.zscore(ck(budget).parked, "b") is not None
    assert budget.redis.zscore(ck(budget).leases, "b") is None
    budget.samples.commit(result("a", 900), 0, 0.0)
    # nothing in flight and used < cap: the next sample is admitted even if it may pass
    assert budget.samples.admit("code", "b", 600, LEASE_MS)[0] == "ok"
    assert budget.redis.zscore(ck(budget).parked, "b") is None
    budget.samples.commit(result("b", 200), 0, 0.0)
    assert budget.samples.admit("code", "c", 600, LEASE_MS)[0] == "closed"


def test_admit_hard_guard_keeps_used_below_cap_plus_one_sample(budget: Budget) -> None:
    # cap 1000; each sample may add up to 300 tokens; reservations (10) alone would admit all
    for sid in "abcdef":
        feed(budget, sid)
    outcomes = [budget.samples.admit("code", sid, 10, LEASE_MS, max_add=300)[0] for sid in "abcde"]
    assert outcomes == ["ok", "ok", "ok", "ok", "wait"]  # 0+900 < 1000, then 1200 >= 1000
    assert ledger_state(budget, "code")["worst"] == 1200
    for sid in "abcd":  # every in-flight sample produces its maximum
        budget.samples.commit(result(sid, 300), 0, 0.0)
    st = budget.telemetry.status()["categories"]["code"]
    assert st["used"] == 1200 and st["overshoot"] < 300 and st["state"] == "closed"
    assert ledger_state(budget, "code")["worst"] == 0
    assert budget.samples.admit("code", "f", 10, LEASE_MS, max_add=300)[0] == "closed"


def test_admit_margin_holds_back_by_sigmas_of_the_in_flight_total(budget: Budget) -> None:
    # cap 1000, estimates 200 with variance 100^2 each, margin 2 sigmas:
    # a: nothing in flight -> admitted; b: 0+200+200 + 2*sqrt(2e4)=283 -> 683 < 1000 ok;
    # c: 400+200 + 2*sqrt(3e4)=346 -> 946 ok; d: 600+200 + 2*sqrt(4e4)=400 -> 1200 wait
    for sid in "abcd":
        feed(budget, sid)
    outcomes = [budget.samples.admit("code", sid, 200, LEASE_MS, variance=10_000, sigmas=2.0)[0]
                for sid in "abcd"]
    assert outcomes == ["ok", "ok", "ok", "wait"]
    assert ledger_state(budget, "code")["var"] == 30_000
    # without the margin the same request fits (600 + 200 < 1000)
    assert budget.samples.admit("code", "d", 200, LEASE_MS, variance=10_000, sigmas=0.0)[0] == "ok"
    # a heartbeat moves a sample's variance; commit, release and fail drop it
    assert budget.samples.heartbeat("code", "a", 250, LEASE_MS, variance=2_500)
    assert ledger_state(budget, "code")["var"] == 32_500
    assert budget.samples.heartbeat("code", "d", 64, LEASE_MS, variance=0)  # at its max: no spread
    assert ledger_state(budget, "code")["var"] == 22_500
    budget.samples.commit(result("a", 240), 0, 0.0)
    budget.samples.release("code", pending("b"), 1)
    budget.samples.fail(DeadLetter(id="c", category="code", outcome="dead", reason="timeout"))
    budget.samples.commit(result("d", 10), 0, 0.0)
    st = ledger_state(budget, "code")
    assert (st["var"], st["reserved"]) == (0, 0)
    assert not budget.redis.exists(ck(budget).var)


def test_heartbeat_moves_reservation_and_lease(budget: Budget) -> None:
    feed(budget, "a")
    budget.samples.admit("code", "a", 100, LEASE_MS)
    before = budget.redis.zscore(ck(budget).leases, "a")
    assert budget.samples.heartbeat("code", "a", 250, 10 * LEASE_MS)
    assert ledger_state(budget, "code")["reserved"] == 250
    assert budget.redis.zscore(ck(budget).leases, "a") > before
    budget.samples.commit(result("a", 260), 0, 0.0)
    assert ledger_state(budget, "code")["reserved"] == 0
    assert not budget.samples.heartbeat("code", "a", 300, LEASE_MS)
    assert budget.redis.zscore(ck(budget).leases, "a") is None  # no lease comes back


def test_commit_twice_counts_once(budget: Budget) -> None:
    feed(budget, "a")
    budget.samples.admit("code", "a", 100, LEASE_MS)
    assert budget.samples.commit(result("a", 40), 0, 10.0) == ("ok", 40)
    assert budget.samples.commit(result("a", 40), 0, 10.0) == ("dup", 40)
    st = ledger_state(budget, "code")
    assert (st["used"], st["reserved"], st["samples"]) == (40, 0, 1)
    assert budget.redis.xlen(ck(budget).results) == 1
    assert budget.redis.hlen(ck(budget).pending) == 0


def test_commit_counts_kept_and_gated_output_tokens_by_reason(budget: Budget) -> None:
    for sid in ("a", "b", "c"):
        feed(budget, sid)
        budget.samples.admit("code", sid, 10, LEASE_MS)
    budget.samples.commit(result("a", 40), 0, 0.0)
    loop = msgspec.structs.replace(result("b", 64, "length"), gate="loop")
    empty = msgspec.structs.replace(result("c", 5), gate="empty", counted_tokens=0)
    for r in (loop, empty, loop):  # the second commit of `b` is a duplicate
        budget.samples.commit(r, r.completion_tokens, 0.0)
    st = budget.telemetry.status()["categories"]["code"]
    assert (st["used"], st["samples"], st["kept_tokens"], st["waste_tokens"]) == (104, 3, 40, 69)
    assert st["rejected_tokens"] == {"loop": 64, "empty": 5}
    assert st["rejected_replies"] == {"loop": 1, "empty": 1}


def test_commit_counts_prompt_cache_and_out_of_vocab_once_per_engine(budget: Budget) -> None:
    for sid in ("a", "b"):
        feed(budget, sid)
        budget.samples.admit("code", sid, 10, LEASE_MS)
    a = msgspec.structs.replace(result("a", 4), prompt_tokens=300, cached_tokens=256,
                                out_of_vocab=2)
    a = msgspec.structs.replace(a, engine="http://e1", reusable_tokens=280)
    b = msgspec.structs.replace(result("b", 4), prompt_tokens=40,  # the engine did not say
                                engine="http://e2")
    for r in (a, b, a):  # the second commit of `a` is a duplicate: nothing counted again
        budget.samples.commit(r, 0, 0.0)
    st = budget.telemetry.status(by_engine=True)["categories"]["code"]
    assert (st["prompt_tokens"], st["cached_tokens"], st["reusable_tokens"],
            st["out_of_vocab"]) == (340, 256, 280, 1)
    assert st["engines"] == {
        "http://e1": {"samples": 1, "prompt_tokens": 300, "cached_tokens": 256,
                      "reusable_tokens": 280},
        "http://e2": {"samples": 1, "prompt_tokens": 40, "cached_tokens": 0,
                      "reusable_tokens": 0}}
    assert "engines" not in budget.telemetry.status()["categories"]["code"]  # the producer's tick


def test_commit_closes_at_cap(budget: Budget) -> None:
    for sid in ("a", "b"):
        feed(budget, sid)
        budget.samples.admit("code", sid, 10, LEASE_MS)
    budget.samples.commit(result("a", 600), 0, 0.0)
    assert budget.telemetry.status()["categories"]["code"]["state"] == "open"
    budget.samples.commit(result("b", 500), 0, 0.0)
    st = budget.telemetry.status()["categories"]["code"]
    assert st["state"] == "closed" and st["overshoot"] == 100


def test_release_returns_reservation_and_reschedules(budget: Budget) -> None:
    feed(budget, "a")
    budget.samples.admit("code", "a", 100, LEASE_MS, max_add=64)
    p = msgspec.structs.replace(pending("a"), failures=1)
    assert budget.samples.release("code", p, 12345)
    st = ledger_state(budget, "code")
    assert (st["reserved"], st["worst"]) == (0, 0)
    assert budget.redis.zscore(ck(budget).leases, "a") == 12345
    stored = msgspec.json.decode(budget.redis.hget(ck(budget).pending, "a"), type=Pending)
    assert stored.failures == 1
    budget.samples.commit(result("a", 3), 0, 0.0)
    assert not budget.samples.release("code", p, 1)  # final: nothing to give back


def test_fail_is_terminal_and_uncounted(budget: Budget) -> None:
    feed(budget, "a")
    budget.samples.admit("code", "a", 100, LEASE_MS)
    dead = DeadLetter(id="a", category="code", outcome="dead", reason="server_error")
    assert budget.samples.fail(dead) is True
    assert budget.samples.fail(dead) is False
    st = ledger_state(budget, "code")
    assert (st["failed"], st["used"], st["reserved"]) == (1, 0, 0)
    assert budget.samples.commit(result("a", 10), 0, 0.0)[0] == "dup"
    assert ledger_state(budget, "code")["used"] == 0
    rejected = DeadLetter(id="b", category="code", outcome="rejected", reason="bad_request")
    feed(budget, "b")
    assert budget.samples.fail(rejected) is True
    assert budget.telemetry.status()["categories"]["code"]["reasons"] == {"bad_request": 1,
                                                                "server_error": 1}
    assert final_marks(budget, "code") == {"a": "d:server_error", "b": "r:bad_request"}
    assert budget.redis.hlen(ck(budget).pending) == 0


# -- the reaper: requeue and lease ---------------------------------------------------------

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


# -- unpark ---------------------------------------------------------------------------------

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


# -- caps -------------------------------------------------------------------------------------

def test_set_cap_reopens_and_closes(budget: Budget) -> None:
    feed(budget, "a")
    budget.samples.admit("code", "a", 10, LEASE_MS)
    budget.samples.commit(result("a", 1500), 0, 0.0)
    assert budget.telemetry.status()["categories"]["code"]["state"] == "closed"
    assert budget.operating.set_cap("code", 5000) == (False, 1000)
    assert budget.telemetry.status()["categories"]["code"]["state"] == "open"
    assert budget.operating.set_cap("code", 100) == (True, 5000)
    [(_, entries)] = budget.redis.xreadgroup(WRITER_GROUP, "w", {ck(budget).results: ">"})
    budget.writing.acknowledge("code", False, [e for e, _ in entries], {"a": 1500})  # written
    assert budget.feeding.mark_exhausted("code", budget.feeding.cursor("code")) is True
    budget.operating.set_cap("code", 9000)  # raising the cap reopens an exhausted category too
    assert budget.telemetry.status()["categories"]["code"]["state"] == "open"
    # a producer whose cursor is past Redis's (Redis lost feeds) cannot mark it exhausted
    assert budget.feeding.mark_exhausted("code", budget.feeding.cursor("code") + 8) is False
    assert budget.telemetry.status()["categories"]["code"]["state"] == "open"
    assert budget.feeding.mark_exhausted("code", budget.feeding.cursor("code")) is True
    assert budget.telemetry.status()["categories"]["code"]["state"] == "exhausted"


def test_set_cap_records_each_change_in_the_categorys_event_log(budget: Budget) -> None:
    feed(budget, "a")
    budget.samples.admit("code", "a", 10, LEASE_MS)
    budget.samples.commit(result("a", 1500), 0, 0.0)
    budget.operating.set_cap("code", 5000, by="tokencap cap set (ann)")
    budget.operating.set_cap("code", None, by="POST /cap from 127.0.0.1")
    first, second = budget.operating.events(["code"])
    assert {k: first[k] for k in ("category", "kind", "old", "new", "by", "used")} == {
        "category": "code", "kind": "cap", "old": "1000", "new": "5000",
        "by": "tokencap cap set (ann)", "used": "1500"}
    assert (second["old"], second["new"]) == ("5000", "none")
    assert first["at"] <= second["at"] and first["at"] > 0
    # only what came after a given entry
    assert budget.operating.events(["code"], {"code": first["id"]}) == [second]
    assert budget.operating.events(["code"], {"code": second["id"]}) == []


def test_retry_sends_a_dead_sample_again_once_and_keeps_its_dead_letter_history(
        budget: Budget) -> None:
    for sid in ("a", "b", "c", "v#t2"):
        feed(budget, sid)
        budget.samples.admit("code", sid, 10, LEASE_MS)
    budget.samples.fail(DeadLetter("a", "code", "dead", "server_error"))
    budget.samples.fail(DeadLetter("b", "code", "dead", "timeout"))
    budget.samples.fail(DeadLetter("c", "code", "rejected", "bad_request"))
    budget.samples.fail(DeadLetter("v#t2", "code", "dead", "server_error"))
    budget.redis.hset(ck(budget).written, mapping={"a": "d", "b": "d", "c": "d", "v#t2": "d"})
    # rejected samples are not dead
    assert budget.operating.dead_samples("code") == ["a", "b", "v#t2"]
    assert budget.operating.dead_samples("code", "timeout") == ["b"]
    # only the reason asked for, each sample once, and never a conversation's turn
    assert budget.operating.retry("code", "server_error") == (1, 1)
    assert budget.operating.retry("code", "server_error") == (0, 1)
    assert final_marks(budget, "code")["v#t2"].startswith("d:")
    st = budget.telemetry.status()["categories"]["code"]
    assert (st["failed"], st["reasons"], st["followups"]) == (
        2, {"timeout": 1, "bad_request": 1, "server_error": 1}, 1)
    assert final_marks(budget, "code").get("a") is None
    assert budget.redis.hget(ck(budget).written, "a") is None  # its result will be written
    assert budget.redis.zscore(ck(budget).follow, "a") == -1
    # its dead letter on disk no longer makes it final when Redis is rebuilt from the files
    assert budget.feeding.reconcile("code", [("a", "d:server_error", 0, 0, "", "", 0)]) == 0
    assert final_marks(budget, "code").get("a") is None


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


def test_set_cap_none_uncaps(budget: Budget) -> None:
    feed(budget, "a")
    budget.samples.commit(result("a", 1500), 0, 0.0)
    assert budget.telemetry.status()["categories"]["code"]["state"] == "closed"
    assert budget.operating.set_cap("code", None) == (False, 1000)
    st = budget.telemetry.status()["categories"]["code"]
    assert (st["state"], st["cap"], st["overshoot"]) == ("open", None, 0)
    assert ledger_state(budget, "code")["cap"] is None
    feed(budget, "b")
    assert budget.samples.admit("code", "b", 10**12, LEASE_MS, max_add=10**12)[0] == "ok"
    budget.samples.commit(result("b", 10**6), 0, 0.0)  # never closes uncapped
    assert budget.telemetry.status()["categories"]["code"]["state"] == "open"
    assert budget.operating.set_cap("code", 10) == (True, None)


# -- reconcile, acknowledge, engine counts -----------------------------------------------------

def test_reconcile_adds_only_missing_and_forgets_what_is_on_disk(budget: Budget) -> None:
    feed(budget, "a")
    budget.samples.admit("code", "a", 10, LEASE_MS)
    budget.samples.commit(result("a", 30), 0, 0.0)
    feed(budget, "b")
    budget.samples.admit("code", "b", 40, LEASE_MS)  # in flight when Redis lost its commit
    records = [("a", "c:30", 30, 0, 1, "", 30), ("b", "c:50", 50, 50, 3, "loop", 50),
               ("c", "r:invalid_json", 0, 0, "", "", 0)]
    assert budget.feeding.reconcile("code", records) == 2
    assert budget.feeding.reconcile("code", records) == 0
    st = budget.telemetry.status()["categories"]["code"]
    assert (st["used"], st["samples"], st["waste_tokens"], st["rejected"]) == (80, 2, 50, 1)
    # "a" was counted by its commit already; "b" is a reply the gate kept out
    assert (st["kept_tokens"], st["rejected_tokens"], st["rejected_replies"]) == (
        30, {"loop": 50}, {"loop": 1})
    assert (st["pending"], st["in_flight"], st["reserved"]) == (0, 0, 0)


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


def turn_result(conv: str, turn: int, total: int, out: list[int]) -> Result:
    return Result(id=f"{conv}#t{turn}", category="code", prompt_ids=[1], output_ids=out,
                  prompt_tokens=1, completion_tokens=len(out), finish_reason="stop", text="x",
                  sampling={}, counted_tokens=len(out), ordinal=7, conversation_id=conv,
                  turn=turn, turns_total=total)


def test_acknowledge_hands_a_written_turn_to_the_next_and_ends_conversations(
        budget: Budget) -> None:
    from budget_service.ledger import turn_event

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


def test_restore_puts_back_next_turns_and_histories_and_touches_no_stream(
        budget: Budget) -> None:
    from budget_service.ledger import turn_event

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


def test_engine_counts_add_up(budget: Budget) -> None:
    budget.samples.add_engine_counts({"http://e|requests|ok": 2, "http://e|latency_sum_ms": 150})
    budget.samples.add_engine_counts({"http://e|requests|ok": 1})
    assert budget.telemetry.engine_counts() == {"http://e|requests|ok": 3,
                                                "http://e|latency_sum_ms": 150}


def test_engine_info_replaces_what_the_preflight_found(budget: Budget) -> None:
    a = EngineInfo(url="http://a:30000", api="sglang", model="Qwen/Qwen3-8B", version="0.5.23",
                   context_length=40960)
    b = EngineInfo(url="http://b:8000", api="openai", model="Qwen/Qwen3-8B", version="0.11.0")
    budget.telemetry.record_engines([a, b])
    assert budget.samples.engines_seen() == {a.url: a, b.url: b}
    sim = EngineInfo(url="http://a:30000", api="sglang", model="tokencap-sglang-sim",
                     simulated=True)
    budget.telemetry.record_engines([sim])  # a later preflight: engines no longer used are dropped
    assert budget.samples.engines_seen() == {sim.url: sim}
    assert budget.telemetry.status()["simulated"] is True


def test_engine_trouble_keeps_when_it_began_and_says_how_long_it_lasted(budget: Budget) -> None:
    t = budget.telemetry
    assert t.record_engine_trouble("http://a:30000", None, 1_000) == -1  # none to clear
    assert t.record_engine_trouble("http://a:30000", "connection refused", 5_000) == 5_000
    # asked again later with another reason: the reason is the latest, the start the first
    assert t.record_engine_trouble("http://a:30000", "HTTP 503", 9_000) == 5_000
    assert t.record_engine_trouble("http://b:30000", "read timeout", 7_000) == 7_000
    doc = t.status()["engine_trouble"]
    assert doc == {"http://a:30000": {"why": "HTTP 503", "since_ms": 5_000},
                   "http://b:30000": {"why": "read timeout", "since_ms": 7_000}}
    assert t.record_engine_trouble("http://a:30000", None, 12_500) == 7_500
    assert set(t.engine_trouble()) == {"http://b:30000"}
    from budget_service.telemetry import render_metrics

    page = render_metrics(t).decode()
    assert 'tokencap_engine_down{engine="http://b:30000",run="t"} 1.0' in page
    assert 'tokencap_engine_down_since_seconds{engine="http://b:30000",run="t"} 7.0' in page
    assert 'tokencap_engine_down{engine="http://a:30000"' not in page


def test_series_keeps_the_last_points_and_serves_those_after_an_id(budget: Budget) -> None:
    from budget_service.server import take_point

    for _ in range(3):
        budget.telemetry.record_point(take_point(budget))
    points = budget.telemetry.series()
    assert len(points) == 3 and points[0].categories["code"].used == 0
    assert points[0].at <= points[-1].at and points[-1].workers == 0
    assert budget.telemetry.series(points[0].id) == points[1:]
    assert budget.telemetry.series(count=1) == points[-1:]
    # bounded: the last `keep` stay, and at most one stream node (100 entries) more
    point = take_point(budget)
    for _ in range(400):
        budget.telemetry.record_point(point, keep=10)
    assert 10 <= len(budget.telemetry.series()) <= 110


def test_the_status_document_is_the_typed_state_the_producer_steers_on(budget) -> None:
    assert feed(budget, "s:1") == 1
    states = budget.states(["code"])
    assert states["code"].pending == 1 and states["code"].state == "open"
    doc = budget.telemetry.status(["code"])["categories"]
    assert doc == {k: msgspec.structs.asdict(st) for k, st in states.items()}
