"""`budget_service/codec.py`: a sample's final value and written mark, written and read back,
and the same strings the Lua scripts write (a committed, a rejected and a dead sample's
final values read from a real Redis)."""

from __future__ import annotations

import pytest

from budget_service import codec
from budget_service.budget import Budget
from budget_service.codec import Final, FinalKind, read_final
from budget_service.keys import WRITER_GROUP
from budget_service.ledger import now_ms
from foundation.wire import DeadLetter, Outcome
from tests.helpers import LEASE_MS, ck, feed, pending, result


def test_a_final_value_is_read_back_as_it_was_written() -> None:
    assert read_final(codec.committed(40)) == Final(FinalKind.COMMITTED, 40, "")
    assert read_final(codec.committed(0)) == Final(FinalKind.COMMITTED, 0, "")
    assert read_final(codec.dead("timeout")) == Final(FinalKind.DEAD, 0, "timeout")
    assert read_final(b"r:invalid_json") == Final(FinalKind.REJECTED, 0, "invalid_json")


def test_a_dead_letter_s_outcome_says_whether_it_was_ever_sent() -> None:
    assert codec.ended(Outcome.REJECTED, "prompt_too_long") == "r:prompt_too_long"
    assert codec.ended(Outcome.STOPPED, "tool_divergence") == "r:tool_divergence"
    assert codec.ended(Outcome.DEAD, "server_error") == "d:server_error"


@pytest.mark.parametrize("value", ["", "x:1", "c:", "c:many", "40", codec.WRITTEN_DEAD])
def test_a_value_this_module_did_not_write_is_refused(value: str) -> None:
    with pytest.raises(ValueError):
        read_final(value)


def test_dead_is_a_dead_letter_for_its_reason_or_any() -> None:
    assert codec.is_dead(b"d:timeout") and codec.is_dead("d:timeout", "timeout")
    assert not codec.is_dead("d:timeout", "server_error")
    assert not codec.is_dead("r:timeout") and not codec.is_dead(codec.committed(3))


def test_the_scripts_write_the_values_this_module_reads(budget: Budget) -> None:
    for sid in ("a", "b"):
        feed(budget, sid)
        budget.samples.admit("code", sid, 10, LEASE_MS)
    budget.samples.commit(result("a", 12), 0, 0.0)
    budget.samples.fail(DeadLetter("b", "code", Outcome.DEAD, "timeout"))
    refused = DeadLetter("r", "code", Outcome.REJECTED, "invalid_json")
    assert budget.feeding.feed("code", 2, 3, now_ms() + LEASE_MS, [pending("c")], [refused])
    final = {k.decode(): read_final(v) for k, v in budget.redis.hgetall(ck(budget).final).items()}
    assert final == {"a": Final(FinalKind.COMMITTED, 12, ""),
                     "b": Final(FinalKind.DEAD, 0, "timeout"),
                     "r": Final(FinalKind.REJECTED, 0, "invalid_json")}
    assert budget.operating.dead_samples("code") == ["b"]
    # the written mark of a dead letter on disk
    [(_, entries)] = budget.redis.xreadgroup(WRITER_GROUP, "w", {ck(budget).dead: ">"})
    budget.writing.acknowledge("code", True, [e for e, _ in entries], {"b": codec.WRITTEN_DEAD})
    assert budget.writing.written("code", ["b"]) == [codec.WRITTEN_DEAD]
