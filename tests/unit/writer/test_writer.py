"""A writer starting on files whose samples Redis has not seen marked written says why: the
writer before it stopped between its fsync and its acknowledge (the entries are still in the
streams), or Redis lost the marks (the entries are gone too). Either way each sample is
marked once and written once; a conversation's turn generated again after Redis lost its
commit is not written twice, and the conversation goes on from the turn on disk."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from budget_service.budget import Budget
from budget_service.keys import Keys
from foundation.outputs import read_results
from foundation.wire import Result
from testing.harness import ledger_state
from tests.helpers import LEASE_MS, feed, make_cfg, result
from writer.writer import Writer


class Killed(Exception):
    """The writer process dies here."""


def _committed(budget: Budget, ids: list[str]) -> None:
    for sid in ids:
        feed(budget, sid)
        budget.samples.admit("code", sid, 10, LEASE_MS)
        budget.samples.commit(result(sid, 20), 0, 0.0)


def _messages(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.name == "writer.writer")


def test_a_writer_killed_between_fsync_and_acknowledge_is_not_reported_as_redis_loss(
        tmp_path: Path, redis, caplog: pytest.LogCaptureFixture) -> None:
    budget = Budget(redis, Keys("tokencap", "t"))
    budget.feeding.init_run(make_cfg())
    _committed(budget, ["a", "b"])
    # Given a writer that appended and fsynced both results, then died before acknowledging
    first = Writer(redis, budget.keys, ["code"], tmp_path)
    first.ledger.acknowledge = lambda *a, **k: (_ for _ in ()).throw(Killed())  # type: ignore
    with pytest.raises(Killed):
        first.drain_once(block_ms=None)
    first.close()
    assert sorted(r.id for r in read_results(tmp_path / "code")) == ["a", "b"]
    # When the next writer starts
    caplog.set_level(logging.WARNING, "writer.writer")
    second = Writer(redis, budget.keys, ["code"], tmp_path)
    second.open()
    # Then it says what happened, and marks them; reading the streams again writes nothing
    text = _messages(caplog)
    assert "2 results on disk were not acknowledged" in text and "fsync" in text
    assert "Redis lost" not in text
    assert budget.writing.written("code", ["a", "b"]) == ["20", "20"]
    second.recover()
    second.close()
    assert sorted(r.id for r in read_results(tmp_path / "code")) == ["a", "b"]
    assert budget.writing.unacknowledged("code") == set()


def test_a_writer_starting_after_redis_lost_the_marks_says_so(tmp_path: Path, redis,
                                                             caplog: pytest.LogCaptureFixture
                                                             ) -> None:
    budget = Budget(redis, Keys("tokencap", "t"))
    budget.feeding.init_run(make_cfg())
    _committed(budget, ["a", "b", "c"])
    writer = Writer(redis, budget.keys, ["code"], tmp_path)
    writer.drain_once(block_ms=None)  # written and acknowledged
    writer.close()
    # Given Redis lost the written marks (its last second of AOF, say)
    redis.delete(budget.keys.cat("code").written)
    caplog.set_level(logging.WARNING, "writer.writer")
    again = Writer(redis, budget.keys, ["code"], tmp_path)
    again.open()
    again.close()
    text = _messages(caplog)
    assert "3 samples on disk had no written mark in Redis" in text and "lost" in text
    assert "not acknowledged" not in text
    assert budget.writing.written("code", ["a", "b", "c"]) == ["20", "20", "20"]


# -- conversations go on from what is on disk -------------------------------------------

def turn_row(turn: int, out: list[int]) -> Result:
    return Result(id=f"c#t{turn}", category="code", prompt_ids=[1, 2], output_ids=out,
                  prompt_tokens=2, completion_tokens=len(out), finish_reason="stop", text="x",
                  sampling={}, counted_tokens=len(out), ordinal=4, conversation_id="c",
                  turn=turn, turns_total=3)


def test_a_turn_generated_again_goes_on_from_the_row_on_disk(tmp_path, redis) -> None:
    """Redis lost turn 1's commit after the writer wrote it; turn 1 was generated again
    (other output) and committed: the file keeps the first, and the conversation goes on
    from the first, the one on disk."""
    keys = Keys("tokencap", "t")
    budget = Budget(redis, keys)
    budget.feeding.init_run(make_cfg())
    on_disk = turn_row(1, [11, 12, 13])
    writer = Writer(redis, keys, ["code"], tmp_path)
    budget.samples.commit(on_disk, 0, 0.0)
    assert writer.drain_once(block_ms=None) == 1
    assert budget.feeding.followups("code", 10)[0].outputs == [[11, 12, 13]]
    redis.flushdb()  # Redis restarted empty: the commit, the marks, the follow-up are gone
    budget.feeding.init_run(make_cfg())
    again = turn_row(1, [21, 22])
    budget.samples.commit(again, 0, 0.0)
    writer2 = Writer(redis, keys, ["code"], tmp_path)  # a writer starting on the files
    assert writer2.drain_once(block_ms=None) == 0  # not written twice
    [f] = budget.feeding.followups("code", 10)
    assert (f.sample_id, f.ordinal, f.outputs) == ("c#t2", 4, [[11, 12, 13]])
    assert ledger_state(budget, "code")["used"] == 3  # corrected to what the file holds
    writer.close()
    writer2.close()
