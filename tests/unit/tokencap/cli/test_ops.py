"""The commands that look at or steer a run (`tokencap/cli/ops.py`: `status`, `cap set`,
`retry`; `report` is `tests/unit/tokencap/reports/test_report.py`'s), on a run driven
directly in a real Redis: what they print, what they change, and the mistakes they refuse in
one line."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from redis import Redis

from budget_service.budget import Budget
from budget_service.keys import Keys
from foundation.wire import DeadLetter
from testing.harness import ledger_state
from tests.helpers import LEASE_MS, feed, make_cfg, one_line_error, result
from tokencap.cli.main import main


@pytest.fixture
def budget(redis: Redis) -> Budget:
    """Run "t": categories code and math capped at 1,000 tokens; code holds one committed
    sample of 40 tokens and two dead ones (timeout, server_error)."""
    b = Budget(redis, Keys("tokencap", "t"))
    b.feeding.init_run(make_cfg(cap=1000, cats=("code", "math")))
    feed(b, "s1")
    b.samples.admit("code", "s1", 100, LEASE_MS)
    b.samples.commit(result("s1", 40), 0, 0.0)
    for sid, reason in (("s2", "timeout"), ("s3", "server_error")):
        feed(b, sid)
        b.samples.fail(DeadLetter(id=sid, category="code", outcome="dead", reason=reason))
    return b


def ops(redis_url: str, *args: str) -> object:
    return CliRunner().invoke(main, [*args, "--redis-url", redis_url],
                              env={"TOKENCAP_RUN": None, "USER": "tester"})


def test_status_is_a_table_or_the_json_document_alone_on_stdout(budget, redis_url) -> None:
    res = ops(redis_url, "status")
    assert res.exit_code == 0, res.output
    rows = {line.split()[0]: line.split() for line in res.stdout.splitlines()[1:]
            if line.split() and line.split()[0] in ("code", "math")}
    assert rows["code"][:3] == ["code", "1000", "40"] and rows["code"][-1] == "open"
    assert rows["math"][:3] == ["math", "1000", "0"]
    res = ops(redis_url, "status", "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["run"] == "t"
    assert (doc["categories"]["code"]["used"], doc["categories"]["code"]["samples"]) == (40, 1)
    assert doc["categories"]["code"]["failed"] == 2


def test_cap_set_changes_the_cap_says_so_and_is_in_the_event_log(budget, redis_url) -> None:
    assert ops(redis_url, "status", "--events").stdout.strip() == "no events"
    res = ops(redis_url, "cap", "set", "code", "30", "--run", "t")
    assert res.exit_code == 0, res.output
    assert res.stdout == "code: cap 1000 -> 30 (closed)\n"  # below what is used: closed
    assert ledger_state(budget, "code")["cap"] == 30
    res = ops(redis_url, "cap", "set", "code", "none", "--run", "t")
    assert res.stdout == "code: cap 30 -> uncapped (open)\n"
    assert ledger_state(budget, "code")["cap"] is None
    events = ops(redis_url, "status", "--events").stdout.splitlines()
    assert len(events) == 2
    assert "  code  cap 1000 -> 30  by tokencap cap set (tester)  (40 tokens used)" in events[0]
    doc = json.loads(ops(redis_url, "status", "--events", "--json").stdout)
    assert [(e["category"], e["old"], e["new"]) for e in doc] == [("code", "1000", "30"),
                                                                  ("code", "30", "none")]


def test_cap_set_refuses_a_bad_number_or_an_unknown_category_in_one_line(
        budget, redis_url) -> None:
    res = ops(redis_url, "cap", "set", "code", "lots", "--run", "t")
    assert one_line_error(res) and "'lots' is not a count" in res.output
    assert one_line_error(ops(redis_url, "cap", "set", "code", "-5", "--run", "t"))
    res = ops(redis_url, "cap", "set", "nope", "5000", "--run", "t")
    assert one_line_error(res, 1) and "no category 'nope' in run 't'" in res.output
    assert ledger_state(budget, "code")["cap"] == 1000  # nothing changed


def test_retry_sends_the_dead_samples_of_a_reason_again_and_says_who_feeds_them(
        budget, redis_url) -> None:
    res = ops(redis_url, "retry", "--run", "t", "--reason", "timeout")
    assert res.exit_code == 0, res.output
    assert res.stdout.splitlines() == [
        "code: 1 dead sample(s) sent again", "math: 0 dead sample(s) sent again",
        "no producer runs this run: `tokencap up CONFIG` (or `tokencap run CONFIG`) feeds them "
        "again"]
    assert budget.operating.dead_samples("code") == ["s3"]  # the other reason stays dead
    res = ops(redis_url, "retry", "--run", "t", "--category", "math")
    assert res.stdout.splitlines() == ["math: 0 dead sample(s) sent again"]  # nothing: no hint
    res = ops(redis_url, "retry", "--run", "t", "--category", "nope")
    assert one_line_error(res, 1) and "no category 'nope' in run 't'" in res.output
    assert budget.operating.dead_samples("code") == ["s3"]
