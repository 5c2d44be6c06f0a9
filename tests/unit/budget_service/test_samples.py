"""`budget_service/samples.py`, the workers' role: each of its Lua scripts called directly
against a real Redis through its method (`admit`, `heartbeat`, `commit`, `release`, `fail`,
`engine_counts`); the tests of a script are named `test_<script>_...`
(`test_scripts.py::test_every_script_has_a_direct_test`)."""

from __future__ import annotations

import msgspec

from budget_service.budget import Budget
from budget_service.ledger import now_ms
from foundation.wire import DeadLetter, Pending
from testing.harness import final_marks, ledger_state
from tests.helpers import LEASE_MS, ck, feed, pending, result

# -- admit -----------------------------------------------------------------------------

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


# -- heartbeat, commit, release, fail --------------------------------------------------

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


# -- engine counts ---------------------------------------------------------------------

def test_engine_counts_add_up(budget: Budget) -> None:
    budget.samples.add_engine_counts({"http://e|requests|ok": 2, "http://e|latency_sum_ms": 150})
    budget.samples.add_engine_counts({"http://e|requests|ok": 1})
    assert budget.telemetry.engine_counts() == {"http://e|requests|ok": 3,
                                                "http://e|latency_sum_ms": 150}


# -- engine_trouble, as the stage's workers record a full states folder ----------------------

def test_disk_trouble_is_the_workers_record_of_a_pause_shown_in_status(budget: Budget) -> None:
    s = budget.samples
    assert s.record_disk_trouble("/hs/a/states", None, 1_000) == -1  # none to clear
    assert s.record_disk_trouble("/hs/a/states", "0.00 GB free", 5_000) == 5_000
    assert s.record_disk_trouble("/hs/a/states", "0.01 GB free", 9_000) == 5_000  # its start
    snap = budget.telemetry.snapshot()
    assert snap.disk_trouble["/hs/a/states"].why == "0.01 GB free"
    assert budget.telemetry.status()["disk_trouble"] == {
        "/hs/a/states": {"why": "0.01 GB free", "since_ms": 5_000}}
    assert snap.trouble == {}  # not an engine's
    assert s.record_disk_trouble("/hs/a/states", None, 12_000) == 7_000
    assert budget.telemetry.snapshot().disk_trouble == {}


def test_commit_counts_rows_and_tokens_per_mode_once(budget: Budget) -> None:
    for sid in ("a", "b", "c", "d"):
        feed(budget, sid)
        budget.samples.admit("code", sid, 10, LEASE_MS)
    for sid, n, mode in (("a", 40, "think"), ("b", 30, "think"), ("c", 5, "fast"),
                         ("a", 40, "think"), ("d", 7, "")):  # a twice: counted once
        budget.samples.commit(msgspec.structs.replace(result(sid, n), mode=mode), 0, 0.0)
    st = budget.telemetry.status()["categories"]["code"]
    # a row made in no mode counts in no mode
    assert st["modes"] == {"fast": {"rows": 1, "tokens": 5}, "think": {"rows": 2, "tokens": 70}}
