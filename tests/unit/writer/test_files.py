"""`writer/files.py`: one category's append-only files (`CategorySink`): each record to its
file, written once (what the files or Redis already hold is not written again, and the
token correction said), parts rolled over, a torn last line cut at start, a failed append
cut back whole (`WriterDiskError`), the ids Redis has no mark for; and the output folder's
lock (`OutputLock`)."""

from __future__ import annotations

import errno
import logging
import os
import socket
from pathlib import Path

import msgspec
import pytest

from budget_service.budget import Budget
from budget_service.keys import Keys
from foundation.errors import WriterBusy
from foundation.outputs import (
    FAILED_FILE,
    REJECTED_FILE,
    STOPPED_FILE,
    BadLine,
    part_files,
    read_committed,
    read_dead_letters,
    read_results,
)
from foundation.wire import DeadLetter, Outcome, Result, encode
from tests.helpers import LEASE_MS, feed, make_cfg, result
from writer import files
from writer.files import CategorySink, OutputLock, WriterDiskError, output_digest


def write(sink: CategorySink, *records: Result | DeadLetter,
          marks: list[str | None] | None = None) -> tuple[int, int, dict, list]:
    return sink.write([(encode(r), r) for r in records], marks or [None] * len(records))


def ids(items) -> list[str]:
    return [i.id for i in items if not isinstance(i, BadLine)]


def test_each_record_goes_to_its_file_once(tmp_path: Path) -> None:
    sink = CategorySink(tmp_path, "code")
    gated = msgspec.structs.replace(result("g", 4), gate="loop")
    failed = DeadLetter("f", "code", Outcome.REJECTED, "invalid_json")
    stopped = DeadLetter("s#t2", "code", Outcome.STOPPED, "tool_divergence")
    cut = DeadLetter("c#t2", "code", Outcome.CUT, "cap")
    n, correction, marks, _ = write(sink, result("a", 5), gated, failed, stopped, cut)
    assert (n, correction) == (5, 0)
    assert marks == {"a": 5, "g": 4, "f": "d", "s#t2": "d"}  # a cut turn is no end: no mark
    cat = tmp_path / "code"
    assert ids(read_results(cat)) == ["a"]
    assert ids(read_committed(cat)) == ["a", "g"]
    assert (cat / REJECTED_FILE).exists() and (cat / FAILED_FILE).exists()
    assert ids(read_dead_letters(cat)) == ["f", "s#t2", "c#t2"]
    assert [d.id for d in read_dead_letters(cat) if isinstance(d, DeadLetter)
            and d.outcome in (Outcome.CUT, Outcome.STOPPED)] == ["s#t2", "c#t2"]
    assert (cat / STOPPED_FILE).read_bytes().count(b"\n") == 2
    # the same batch again (read twice from the streams): nothing is appended
    n, correction, marks, _ = write(sink, result("a", 5), gated, failed, stopped, cut)
    assert (n, correction) == (0, 0) and marks == {"a": 5, "g": 4, "f": "d", "s#t2": "d"}
    sink.close()
    # a sink started on the files knows them
    again = CategorySink(tmp_path, "code")
    assert write(again, result("a", 5), failed, cut)[0] == 0
    again.close()
    assert ids(read_committed(cat)) == ["a", "g"]


def test_a_result_generated_again_is_not_written_and_used_is_set_back(tmp_path: Path) -> None:
    sink = CategorySink(tmp_path, "code")
    write(sink, result("a", 30))
    # Redis lost the commit: "a" was generated again with 20 tokens, "b" has a mark of 50
    n, correction, marks, _ = write(sink, result("a", 20), result("b", 45),
                                    marks=[None, "50"])
    assert n == 0 and correction == (30 - 20) + (50 - 45)
    assert marks == {"a": 30, "b": 50}
    sink.close()
    assert ids(read_results(tmp_path / "code")) == ["a"]


def test_the_parts_roll_over_at_their_size(tmp_path: Path, monkeypatch) -> None:
    line = len(encode(result("a00", 3))) + 1
    monkeypatch.setattr(files, "PART_MAX_BYTES", 2 * line)  # two rows a part
    sink = CategorySink(tmp_path, "code")
    for k in range(5):
        write(sink, result(f"a{k:02d}", 3))
    sink.close()
    cat = tmp_path / "code"
    assert [p.name for p in part_files(cat)] == [
        "part-00000.jsonl", "part-00001.jsonl", "part-00002.jsonl"]
    assert [p.stat().st_size for p in part_files(cat)] == [2 * line, 2 * line, line]
    # a sink started later opens a part of its own: the last one is never appended to
    later = CategorySink(tmp_path, "code")
    write(later, result("b", 3))
    later.close()
    assert [len(ids(read_results(cat))), len(part_files(cat))] == [6, 4]
    assert ids(read_results(cat))[-1] == "b"


def test_a_torn_last_line_is_cut_when_a_sink_starts(tmp_path: Path, caplog) -> None:
    cat = tmp_path / "code"
    cat.mkdir()
    part = cat / "part-00000.jsonl"
    part.write_bytes(encode(result("a", 3)) + b"\n" + encode(result("b", 3))[:25])
    (cat / FAILED_FILE).write_bytes(b'{"id": "x", "categ')
    with caplog.at_level(logging.WARNING, "writer.files"):
        sink = CategorySink(tmp_path, "code")
    assert f"cut a torn last line in {part}" in caplog.text
    assert f"cut a torn last line in {cat / FAILED_FILE}" in caplog.text
    assert (cat / FAILED_FILE).read_bytes() == b""
    assert sink.on_disk == {"a": 3}  # b was never whole: it is written again
    write(sink, result("b", 3))
    sink.close()
    assert list(read_committed(cat)) == [result("a", 3), result("b", 3)]


def test_a_failed_append_leaves_no_partial_batch_and_is_written_next_time(
        tmp_path: Path, monkeypatch) -> None:
    sink = CategorySink(tmp_path, "code")
    write(sink, result("a", 3))
    real_fsync, calls = os.fsync, []

    def full_disk_on_the_second_file(fd: int) -> None:
        calls.append(fd)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", full_disk_on_the_second_file)
    letter = DeadLetter("d", "code", Outcome.DEAD, "timeout")
    with pytest.raises(WriterDiskError, match="No space left on device") as err:
        write(sink, result("b", 3), letter)
    assert "bytes free" in str(err.value) and err.value.path == tmp_path / "code" / FAILED_FILE
    # the part file was appended to before the failure: it holds "b"; failed.jsonl nothing
    assert ids(read_results(tmp_path / "code")) == ["a", "b"]
    assert (tmp_path / "code" / FAILED_FILE).read_bytes() == b""
    monkeypatch.setattr(os, "fsync", real_fsync)
    n, _, marks, _ = write(sink, result("b", 3), letter)  # the batch read again
    assert n == 1 and marks == {"b": 3, "d": "d"}
    sink.close()
    assert ids(read_dead_letters(tmp_path / "code")) == ["d"]


def test_a_turn_generated_again_goes_on_from_the_turn_on_disk(tmp_path: Path) -> None:
    def turn(out: list[int]) -> Result:
        return Result(id="c#t1", category="code", prompt_ids=[1], output_ids=out,
                      prompt_tokens=1, completion_tokens=len(out), finish_reason="stop",
                      text="x", sampling={}, counted_tokens=len(out), ordinal=2,
                      conversation_id="c", turn=1, turns_total=2)

    assert output_digest([1, 2]) != output_digest([2, 1])
    sink = CategorySink(tmp_path, "code")
    [first] = write(sink, turn([5, 6]))[3]
    assert first.output_ids == [5, 6] and first.next_id == "c#t2"
    sink.close()
    again = CategorySink(tmp_path, "code")  # a writer started after Redis lost the commit
    n, _, _, [event] = write(again, turn([7, 8, 9]))
    again.close()
    assert n == 0 and event.output_ids == [5, 6]


def test_the_ids_redis_has_no_mark_for_are_found(tmp_path: Path, redis) -> None:
    budget = Budget(redis, Keys("tokencap", "t"))
    budget.feeding.init_run(make_cfg())
    sink = CategorySink(tmp_path, "code")
    write(sink, result("a", 3), result("b", 4), DeadLetter("d", "code", Outcome.DEAD, "lost"),
          DeadLetter("r", "code", Outcome.DEAD, "lost"))
    budget.writing.mark_written("code", {"a": 3})
    # "r" was sent again by `tokencap retry`: its dead letter on disk is history
    feed(budget, "r")
    budget.samples.admit("code", "r", 10, LEASE_MS)
    budget.samples.fail(DeadLetter("r", "code", Outcome.DEAD, "server_error"))
    assert budget.operating.retry("code").moved == 1
    assert sink.unmarked(budget.writing) == {"b": 4, "d": "d"}
    sink.close()


def test_one_writer_process_holds_the_output_folder(tmp_path: Path) -> None:
    first, second = OutputLock(tmp_path / "out"), OutputLock(tmp_path / "out")
    first.acquire(wait_s=0)
    holder = first.path.read_text()
    assert holder.startswith(f"{socket.gethostname()}:{os.getpid()}:")
    with pytest.raises(WriterBusy, match="another writer process") as busy:
        second.acquire(wait_s=0)
    assert holder in str(busy.value) and str(tmp_path / "out") in str(busy.value)
    first.release()
    second.acquire(wait_s=0)
    assert first.path.read_text() != holder  # the new holder's token
    second.release()
    first.release()  # twice: nothing
