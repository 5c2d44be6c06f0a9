"""Each Lua script called directly against a real Redis."""

from __future__ import annotations

import msgspec
import pytest

from budget_service.budget import Budget, now_ms
from budget_service.keys import Keys
from tokencap.config import Category, RunConfig, SamplingParams
from tokencap.wire import DeadLetter, Pending, Result

LEASE_MS = 30_000


def make_cfg(cap: int = 1000, cats: tuple[str, ...] = ("code",)) -> RunConfig:
    return RunConfig(
        run="t", output_dir="/tmp/unused", cap_tokens=cap,
        category=[Category(name=c, sampling=SamplingParams(max_new_tokens=64), sources=["x"])
                  for c in cats],
    )


@pytest.fixture
def budget(redis) -> Budget:
    b = Budget(redis, Keys("tokencap", "t"))
    b.init_run(make_cfg())
    return b


def pending(sid: str) -> Pending:
    return Pending(sample_id=sid, ordinal=0, prompt_ids=[1, 2, 3], sampling={"max_new_tokens": 64})


def result(sid: str, n: int, finish: str = "stop") -> Result:
    return Result(id=sid, category="code", prompt_ids=[1, 2, 3], output_ids=list(range(n)),
                  prompt_tokens=3, completion_tokens=n, finish_reason=finish, text="x",
                  sampling={}, counted_tokens=n)


def feed(budget: Budget, sid: str) -> int:
    return budget.feed("code", pending(sid), now_ms() + LEASE_MS)


def test_feed_records_once(budget: Budget) -> None:
    assert feed(budget, "a") == 1
    assert feed(budget, "a") == 0
    budget.commit(result("a", 5), 0, 0.0)
    assert feed(budget, "a") == 0  # final samples are never fed again


def test_admit_returns_payload_and_reserves(budget: Budget) -> None:
    feed(budget, "a")
    status, p = budget.admit("code", "a", 100, LEASE_MS)
    assert status == "ok" and p == pending("a")
    st = budget.state("code")
    assert st["reserved"] == 100
    # admitted again (a retry of the same sample) keeps one reservation
    assert budget.admit("code", "a", 100, LEASE_MS)[0] == "ok"
    assert budget.state("code")["reserved"] == 100


def test_commit_twice_counts_once(budget: Budget) -> None:
    feed(budget, "a")
    budget.admit("code", "a", 100, LEASE_MS)
    assert budget.commit(result("a", 40), 0, 10.0) == ("ok", 40)
    assert budget.commit(result("a", 40), 0, 10.0) == ("dup", 40)
    st = budget.state("code")
    assert (st["used"], st["reserved"], st["samples"]) == (40, 0, 1)
    assert budget.redis.xlen(budget.keys.cat("code").results) == 1
    assert budget.redis.hlen(budget.keys.cat("code").pending) == 0


def test_admit_refuses_a_closed_category(budget: Budget) -> None:
    budget.close("code", "close")
    feed(budget, "a")
    assert budget.admit("code", "a", 10, LEASE_MS) == ("closed", None)
    st = budget.state("code")
    assert st["skipped"] == 1 and st["reserved"] == 0
    assert budget.redis.hget(budget.keys.cat("code").final, "a") == b"s"


def test_commit_closes_at_cap(budget: Budget) -> None:
    for sid in ("a", "b"):
        feed(budget, sid)
        budget.admit("code", sid, 10, LEASE_MS)
    budget.commit(result("a", 600), 0, 0.0)
    assert budget.status()["categories"]["code"]["state"] == "open"
    budget.commit(result("b", 500), 0, 0.0)
    st = budget.status()["categories"]["code"]
    assert st["state"] == "closed" and st["overshoot"] == 100


def test_admit_waits_when_reservations_fill_the_cap(budget: Budget) -> None:
    for sid in ("a", "b", "c"):
        feed(budget, sid)
    assert budget.admit("code", "a", 600, LEASE_MS)[0] == "ok"
    assert budget.admit("code", "b", 600, LEASE_MS)[0] == "wait"  # 600 + 600 >= 1000
    ck = budget.keys.cat("code")
    assert budget.redis.zscore(ck.parked, "b") is not None
    assert budget.redis.zscore(ck.leases, "b") is None
    budget.commit(result("a", 900), 0, 0.0)
    # nothing in flight and used < cap: the next sample is admitted even if it may pass
    assert budget.admit("code", "b", 600, LEASE_MS)[0] == "ok"
    assert budget.redis.zscore(ck.parked, "b") is None
    budget.commit(result("b", 200), 0, 0.0)
    assert budget.admit("code", "c", 600, LEASE_MS)[0] == "closed"


def test_heartbeat_moves_reservation(budget: Budget) -> None:
    feed(budget, "a")
    budget.admit("code", "a", 100, LEASE_MS)
    assert budget.heartbeat("code", "a", 250, LEASE_MS)
    assert budget.state("code")["reserved"] == 250
    budget.commit(result("a", 260), 0, 0.0)
    assert budget.state("code")["reserved"] == 0
    assert not budget.heartbeat("code", "a", 300, LEASE_MS)


def test_fail_is_terminal_and_uncounted(budget: Budget) -> None:
    feed(budget, "a")
    budget.admit("code", "a", 100, LEASE_MS)
    dead = DeadLetter(id="a", category="code", outcome="dead", reason="server_error")
    assert budget.fail(dead) == 1
    assert budget.fail(dead) == 0
    st = budget.state("code")
    assert (st["failed"], st["used"], st["reserved"]) == (1, 0, 0)
    assert budget.commit(result("a", 10), 0, 0.0)[0] == "dup"
    assert budget.state("code")["used"] == 0


def test_release_returns_reservation_and_reschedules(budget: Budget) -> None:
    feed(budget, "a")
    budget.admit("code", "a", 100, LEASE_MS)
    p = msgspec.structs.replace(pending("a"), failures=1)
    assert budget.release("code", p, 12345)
    ck = budget.keys.cat("code")
    assert budget.state("code")["reserved"] == 0
    assert budget.redis.zscore(ck.leases, "a") == 12345
    stored = msgspec.json.decode(budget.redis.hget(ck.pending, "a"), type=Pending)
    assert stored.failures == 1


def test_close_cap_reopens_and_closes(budget: Budget) -> None:
    feed(budget, "a")
    budget.admit("code", "a", 10, LEASE_MS)
    budget.commit(result("a", 1500), 0, 0.0)
    assert budget.status()["categories"]["code"]["state"] == "closed"
    closed, _, old = budget.close("code", "cap", 5000)
    assert (closed, old) == (False, 1000)
    assert budget.status()["categories"]["code"]["state"] == "open"
    closed, _, _ = budget.close("code", "cap", 100)
    assert closed


def test_reconcile_adds_only_missing(budget: Budget) -> None:
    feed(budget, "a")
    budget.admit("code", "a", 10, LEASE_MS)
    budget.commit(result("a", 30), 0, 0.0)
    records = [("a", "c:30", 30, 0, 1), ("b", "c:50", 50, 50, 3), ("c", "r:invalid_json", 0, 0, "")]
    assert budget.reconcile("code", records) == 2
    assert budget.reconcile("code", records) == 0
    st = budget.state("code")
    assert (st["used"], st["samples"], st["waste"], st["rejected"]) == (80, 2, 50, 1)


def test_dedup_rejects_a_second_sample_with_the_same_prompt(budget: Budget) -> None:
    assert budget.dedup("code", "a", [1, 2, 3], "f:1") == 1
    assert budget.dedup("code", "a", [1, 2, 3], "f:1") == 1  # its own earlier feed
    assert budget.dedup("code", "b", [1, 2, 3], "f:2") == 0
    assert budget.dedup("code", "b", [1, 2, 3], "f:2") == 0  # recorded once
    assert budget.dedup("code", "c", [1, 2, 4], "f:3") == 1
    st = budget.status()["categories"]["code"]
    assert (st["rejected"], st["duplicate_prompts"]) == (1, 1)
    assert st["reasons"] == {"duplicate_prompt": 1}
    assert budget.redis.hget(budget.keys.cat("code").final, "b") == b"r:duplicate_prompt"


def test_hard_guard_keeps_used_below_cap_plus_one_sample(budget: Budget) -> None:
    # cap 1000; each sample may add up to 300 tokens; reservations (10) alone would admit all
    for sid in "abcdef":
        feed(budget, sid)
    outcomes = [budget.admit("code", sid, 10, LEASE_MS, max_add=300)[0] for sid in "abcde"]
    assert outcomes == ["ok", "ok", "ok", "ok", "wait"]  # 0+900 < 1000, then 1200 >= 1000
    assert budget.state("code")["worst"] == 1200
    for sid in "abcd":  # every in-flight sample produces its maximum
        budget.commit(result(sid, 300), 0, 0.0)
    st = budget.status()["categories"]["code"]
    assert st["used"] == 1200 and st["overshoot"] < 300 and st["state"] == "closed"
    assert budget.state("code")["worst"] == 0
    assert budget.admit("code", "f", 10, LEASE_MS, max_add=300)[0] == "closed"


def test_margin_holds_back_by_sigmas_of_the_in_flight_total(budget: Budget) -> None:
    # cap 1000, estimates 200 with variance 100^2 each, margin 2 sigmas:
    # a: nothing in flight -> admitted; b: 0+200+200 + 2*sqrt(2e4)=283 -> 683 < 1000 ok;
    # c: 400+200 + 2*sqrt(3e4)=346 -> 946 ok; d: 600+200 + 2*sqrt(4e4)=400 -> 1200 wait
    for sid in "abcd":
        feed(budget, sid)
    outcomes = [budget.admit("code", sid, 200, LEASE_MS, variance=10_000, sigmas=2.0)[0]
                for sid in "abcd"]
    assert outcomes == ["ok", "ok", "ok", "wait"]
    assert budget.state("code")["var"] == 30_000
    # without the margin the same request fits (600 + 200 < 1000)
    assert budget.admit("code", "d", 200, LEASE_MS, variance=10_000, sigmas=0.0)[0] == "ok"
    # a heartbeat moves a sample's variance; commit, release and fail drop it
    assert budget.heartbeat("code", "a", 250, LEASE_MS, variance=2_500)
    assert budget.state("code")["var"] == 32_500
    assert budget.heartbeat("code", "d", 64, LEASE_MS, variance=0)  # at its max: no spread
    assert budget.state("code")["var"] == 22_500
    budget.commit(result("a", 240), 0, 0.0)
    budget.release("code", pending("b"), 1)
    budget.fail(DeadLetter(id="c", category="code", outcome="dead", reason="timeout"))
    budget.commit(result("d", 10), 0, 0.0)
    st = budget.state("code")
    assert (st["var"], st["reserved"]) == (0, 0)
    assert not budget.redis.exists(budget.keys.cat("code").var)


def test_worst_is_released_by_fail_and_release(budget: Budget) -> None:
    feed(budget, "a")
    feed(budget, "b")
    budget.admit("code", "a", 10, LEASE_MS, max_add=300)
    budget.admit("code", "b", 10, LEASE_MS, max_add=300)
    budget.release("code", pending("a"), 1)
    budget.fail(DeadLetter(id="b", category="code", outcome="dead", reason="timeout"))
    assert budget.state("code")["worst"] == 0 and budget.state("code")["reserved"] == 0
