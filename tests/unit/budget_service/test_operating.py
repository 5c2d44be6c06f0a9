"""`budget_service/operating.py`, the operators' role: its Lua scripts called directly against
a real Redis through its methods (`set_cap`, `retry`), and the event log a cap change leaves;
the tests of a script are named `test_<script>_...`
(`test_scripts.py::test_every_script_has_a_direct_test`)."""

from __future__ import annotations

from budget_service.budget import Budget
from budget_service.keys import WRITER_GROUP
from foundation.wire import DeadLetter
from testing.harness import final_marks, ledger_state
from tests.helpers import LEASE_MS, ck, feed, result

# -- caps ------------------------------------------------------------------------------

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


# -- retry -----------------------------------------------------------------------------

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
    assert budget.feeding.reconcile("code", [("a", "d:server_error", 0, 0, "", "", 0, "")]) == 0
    assert final_marks(budget, "code").get("a") is None
