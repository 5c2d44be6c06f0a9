"""`producer/reconcile.py`: after Redis lost its data, the counters and done-marks are rebuilt
from the output files. The files are written as the writer writes them (`writer.files.
CategorySink`: training rows, the replies the gate kept out, failed and stopped records);
reconcile adds exactly the samples on disk that Redis lacks, counts each once, forgets what
the ledger still held of them, and a second call adds nothing. Conversations whose last turn
on disk is not their last wait again for their next turn."""

from __future__ import annotations

import logging
from pathlib import Path

import msgspec
import pytest
from redis import Redis

from budget_service.budget import Budget
from budget_service.keys import Keys
from foundation.outputs import category_dir, part_files
from foundation.wire import DeadLetter, Outcome, Result, encode
from producer.reconcile import reconcile
from testing.harness import final_marks
from tests.helpers import LEASE_MS, feed, make_cfg, result
from writer.files import CategorySink

CATS = ("code", "other")


def write(out: Path, records: list[Result | DeadLetter]) -> None:
    """Append `records` to category "code"'s files as the writer does."""
    sink = CategorySink(out, "code")
    sink.write([(encode(r), r) for r in records], [None] * len(records))
    sink.close()


def turn(conv: str, n: int, total: int, out: list[int], gate: str = "") -> Result:
    return Result(id=f"{conv}#t{n}", category="code", prompt_ids=[1, 2], output_ids=out,
                  prompt_tokens=2, completion_tokens=len(out), finish_reason="stop", text="x",
                  sampling={}, counted_tokens=len(out), ordinal=3, conversation_id=conv,
                  turn=n, turns_total=total, gate=gate)


def gated(sid: str, n: int) -> Result:
    """A reply the reply gate kept out of training (a loop): written to rejected-replies."""
    return msgspec.structs.replace(result(sid, n), gate="loop")


@pytest.fixture
def budget(redis: Redis) -> Budget:
    b = Budget(redis, Keys("tokencap", "t"))
    b.feeding.init_run(make_cfg(cats=CATS))
    return b


def test_reconcile_adds_what_redis_lacks_once(tmp_path, budget: Budget, caplog) -> None:
    # Given the files: two training rows, a reply the gate kept out, a rejected and a dead
    # sample, and a cut turn (not an end)
    write(tmp_path, [
        result("a", 30), result("b", 20), gated("g", 50),
        DeadLetter("r", "code", Outcome.REJECTED, "invalid_json"),
        DeadLetter("d", "code", Outcome.DEAD, "server_error"),
        DeadLetter("c#t2", "code", Outcome.CUT, "cap", conversation_id="c", turn=2),
    ])
    # And Redis, which lost the rest: it knows "a" committed and "b" in flight
    feed(budget, "a")
    budget.samples.admit("code", "a", 10, LEASE_MS)
    budget.samples.commit(result("a", 30), 0, 0.0)
    feed(budget, "b")
    budget.samples.admit("code", "b", 40, LEASE_MS)
    with caplog.at_level(logging.WARNING, logger="producer.reconcile"):
        added = reconcile(budget, tmp_path, list(CATS))
    # Then each sample on disk that Redis lacked is added once; "other" has no folder
    assert added == {"code": 4}
    assert "4 samples found on disk but not in Redis" in caplog.text
    marks = final_marks(budget, "code")
    assert marks == {"a": "c:30", "b": "c:20", "g": "c:50", "r": "r:invalid_json",
                     "d": "d:server_error"}
    st = budget.telemetry.status()["categories"]["code"]
    assert (st["used"], st["samples"], st["rejected"], st["failed"]) == (100, 3, 1, 1)
    assert st["reasons"] == {"invalid_json": 1, "server_error": 1}
    assert (st["waste_tokens"], st["kept_tokens"], st["rejected_replies"]) == (50, 50, {"loop": 1})
    # "b" was in flight: final on disk, the ledger forgets its lease and reservation
    assert (st["pending"], st["in_flight"], st["reserved"]) == (0, 0, 0)
    assert budget.hist("code") and sum(budget.hist("code").values()) == 3
    # And a second call adds nothing
    before = budget.telemetry.status()["categories"]["code"]
    assert reconcile(budget, tmp_path, list(CATS)) == {"code": 0}
    assert budget.telemetry.status()["categories"]["code"] == before
    assert budget.telemetry.status()["categories"]["other"]["used"] == 0


def test_an_unreadable_line_is_skipped_naming_its_place(tmp_path, budget: Budget,
                                                       caplog) -> None:
    write(tmp_path, [result("a", 30)])
    [part] = part_files(category_dir(tmp_path, "code"))
    with part.open("ab") as f:
        f.write(b'{"id": "half"}\n')
    write(tmp_path, [gated("g", 40)])
    with caplog.at_level(logging.WARNING, logger="producer.reconcile"):
        assert reconcile(budget, tmp_path, ["code"]) == {"code": 2}
    assert "unreadable result line ignored" in caplog.text and f"{part}:2" in caplog.text
    st = budget.telemetry.status()["categories"]["code"]
    assert (st["used"], st["samples"], st["waste_tokens"]) == (70, 2, 40)
    assert (st["kept_tokens"], st["rejected_tokens"]) == (30, {"loop": 40})


def test_conversations_not_over_on_disk_wait_again_for_their_next_turn(tmp_path,
                                                                       budget: Budget) -> None:
    write(tmp_path, [
        turn("v", 1, 3, [11, 12]),  # goes on: turn 2 waits, with turn 1's output
        turn("w", 1, 2, [21]),  # its turn 2 was stopped: over
        DeadLetter("w#t2", "code", Outcome.STOPPED, "tool_divergence", conversation_id="w",
                   turn=2, turns_total=2),
        turn("x", 1, 2, [31] * 4, gate="empty"),  # the gate kept its turn 1 out: over
        turn("y", 1, 2, [41]), turn("y", 2, 2, [42]),  # its last turn is on disk: over
    ])
    assert reconcile(budget, tmp_path, ["code"]) == {"code": 6}
    [f] = budget.feeding.followups("code", 10)
    assert (f.sample_id, f.ordinal, f.outputs) == ("v#t2", 3, [[11, 12]])
    # a second call puts nothing back twice
    assert reconcile(budget, tmp_path, ["code"]) == {"code": 0}
    assert [f.sample_id for f in budget.feeding.followups("code", 10)] == ["v#t2"]
