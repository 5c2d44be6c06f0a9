"""The writer's output files: one category's append-only files and the ids they hold
(`CategorySink`: what is written once, what is already on disk, the token correction and
the conversation events of a batch), the append-and-fsync that leaves no partial batch
(`WriterDiskError`), and the exclusive lock on the output folder (`OutputLock`). The file
layout is `foundation.outputs`'; the stream side is `writer/writer.py`."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from budget_service import codec
from budget_service.lease import holder_token
from budget_service.ledger import TurnEvent, turn_event
from budget_service.writing import WritingLedger
from foundation.errors import TokencapError, WriterBusy
from foundation.outputs import (
    PART_MAX_BYTES,
    BadLine,
    category_dir,
    letter_path,
    part_files,
    part_path,
    read_committed,
    read_dead_letters,
    rejected_path,
    repair_tail,
    written_files,
)
from foundation.wire import DeadLetter, Outcome, Result

log = logging.getLogger(__name__)

MARK_BATCH = 1000
OUTPUT_LOCK = ".tokencap-writer.lock"
LOCK_POLL_S = 0.2
DEAD_MARK = codec.WRITTEN_DEAD


def output_digest(output_ids: list[int]) -> bytes:
    """What tells two generations of one turn apart."""
    return hashlib.blake2b(msgspec.json.encode(output_ids), digest_size=8).digest()


class WriterDiskError(TokencapError, OSError):
    """Appending to an output file failed (a full disk, ...); nothing of the batch stayed."""

    def __init__(self, path: Path, cause: OSError) -> None:
        try:
            free = f"{shutil.disk_usage(path.parent).free:,} bytes free"
        except OSError:
            free = "free space unknown"
        super().__init__(cause.errno, f"cannot write {path}: {cause.strerror or cause} ({free})")
        self.path = path


class OutputLock:
    """An exclusive `flock` on the output folder: one writer process appends there at a time,
    even when a stopped one still believes it holds the run."""

    def __init__(self, out_dir: Path) -> None:
        self.path = out_dir / OUTPUT_LOCK
        self._fd: int | None = None

    def acquire(self, wait_s: float, while_waiting: Callable[[], None] = lambda: None) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    holder = os.pread(fd, 200, 0).decode(errors="replace").strip()
                    os.close(fd)
                    raise WriterBusy(f"another writer process ({holder or 'unknown'}) writes "
                                     f"to {self.path.parent}; stop it first") from None
                while_waiting()
                time.sleep(LOCK_POLL_S)
        os.ftruncate(fd, 0)
        os.pwrite(fd, holder_token().encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None


def _append(fd: int, path: Path, data: bytes) -> None:
    """Append `data` and fsync; on failure cut the file back to where it was and raise
    `WriterDiskError` (no partial batch stays on disk)."""
    start = os.lseek(fd, 0, os.SEEK_END)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, start)
        raise WriterDiskError(path, exc) from None


class CategorySink:
    """Append-only files of one category, and the ids its files hold (read at start)."""

    def __init__(self, root: Path, category: str) -> None:
        self.category = category
        self.dir = category_dir(root, category)
        self.dir.mkdir(parents=True, exist_ok=True)
        for p in written_files(self.dir):
            if repair_tail(p):
                log.warning("cut a torn last line in %s", p)
        # id -> counted tokens of every committed sample on disk (training rows and the
        # replies the gate kept out), or "d" (dead letter)
        self.on_disk: dict[str, int | str] = {}
        self.turn_digests: dict[str, bytes] = {}  # turn id -> output digest, of rows on disk
        for rec in read_committed(self.dir):
            if isinstance(rec, BadLine):
                log.warning("%s: unreadable result line kept as is: %s", rec.where, rec.error)
            else:
                self.on_disk[rec.id] = rec.counted_tokens
                if rec.conversation_id is not None:
                    self.turn_digests[rec.id] = output_digest(rec.output_ids)
        self.dead_on_disk: set[str] = set()
        self.cut_on_disk: set[str] = set()
        for dead in read_dead_letters(self.dir):
            if not isinstance(dead, BadLine):
                cut = dead.outcome == Outcome.CUT
                (self.cut_on_disk if cut else self.dead_on_disk).add(dead.id)
        self.part_no = len(part_files(self.dir))
        self._part: tuple[int, Path] | None = None
        self._others: dict[Path, int] = {}  # the other files' descriptors, opened once
        self._result = msgspec.json.Decoder(Result)
        self._dead_letter = msgspec.json.Decoder(DeadLetter)

    def _part_file(self) -> tuple[int, Path]:
        if self._part is not None and os.fstat(self._part[0]).st_size < PART_MAX_BYTES:
            return self._part
        if self._part is not None:
            os.close(self._part[0])
            self.part_no += 1
        path = part_path(self.dir, self.part_no)
        if path.exists() and path.stat().st_size >= PART_MAX_BYTES:
            self.part_no += 1
            path = part_path(self.dir, self.part_no)
        self._part = (os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644), path)
        return self._part

    def _file(self, rec: Result | DeadLetter) -> tuple[int, Path]:
        """Where `rec` goes: a training row to the current part file, a gated reply to
        `rejected-replies.jsonl`, a dead letter to `failed.jsonl` or `stopped.jsonl`."""
        if isinstance(rec, Result) and not rec.gate:
            return self._part_file()
        path = rejected_path(self.dir) if isinstance(rec, Result) else \
            letter_path(self.dir, rec.outcome)
        if path not in self._others:
            self._others[path] = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        return self._others[path], path

    def decode(self, payload: bytes, dead: bool) -> Result | DeadLetter:
        return self._dead_letter.decode(payload) if dead else self._result.decode(payload)

    def write(self, records: list[tuple[bytes, Result | DeadLetter]], marks: list[str | None]
              ) -> tuple[int, int, dict[str, int | str], list[TurnEvent]]:
        """Append the records (raw line, decoded) whose samples are not written yet (`marks`:
        each one's written mark in Redis, None if unmarked; the ids read from the files
        count too); fsync.

        Returns (lines appended, token correction, the written marks to set, what the
        written turns mean for their conversations): a result already on disk with another
        count (generated again after Redis lost its commit) is not written, and the
        difference is returned so that `used` can be set back to what the files hold; a
        conversation goes on from the turn the files hold. A cut record (a turn held back)
        is written once and marks nothing."""
        new: list[tuple[bytes, Result | DeadLetter]] = []
        correction = 0
        to_mark: dict[str, int | str] = {}
        events: list[TurnEvent | None] = []
        for (raw, rec), mark in zip(records, marks, strict=True):
            if isinstance(rec, DeadLetter) and rec.outcome == Outcome.CUT:
                if rec.id in self.cut_on_disk:
                    continue
                self.cut_on_disk.add(rec.id)
            elif isinstance(rec, DeadLetter):
                events.append(turn_event(rec))
                if mark is not None or rec.id in self.dead_on_disk:
                    to_mark.setdefault(rec.id, DEAD_MARK)
                    continue
                self.dead_on_disk.add(rec.id)
                to_mark[rec.id] = DEAD_MARK
            else:
                known = self.on_disk.get(rec.id) if mark is None else mark
                if known is not None:
                    correction += int(known) - rec.counted_tokens
                    to_mark[rec.id] = int(known)
                    events.append(self._event_of_written(rec))
                    continue
                self.on_disk[rec.id] = rec.counted_tokens
                to_mark[rec.id] = rec.counted_tokens
                if rec.conversation_id is not None:
                    self.turn_digests[rec.id] = output_digest(rec.output_ids)
                events.append(turn_event(rec))
            new.append((raw, rec))
        # one append per file, in the order the batch first names each; a failed one is
        # cut back and raises, and only its records and later files' are unmarked: the
        # files appended before it hold theirs (the batch is read again, and they are
        # found on disk)
        groups: dict[tuple[int, Path], list[tuple[bytes, Result | DeadLetter]]] = {}
        for raw, rec in new:
            groups.setdefault(self._file(rec), []).append((raw, rec))
        pending = list(groups.items())
        for i, ((fd, path), lines) in enumerate(pending):
            try:
                _append(fd, path, b"".join(raw.rstrip(b"\n") + b"\n" for raw, _ in lines))
            except WriterDiskError:
                for _, later in pending[i:]:
                    for _, rec in later:
                        self._forget(rec)
                raise
        return len(new), correction, to_mark, [e for e in events if e is not None]

    def _forget(self, rec: Result | DeadLetter) -> None:
        """`rec` is not on disk after all (its append failed): it is written next time."""
        if isinstance(rec, Result):
            self.on_disk.pop(rec.id, None)
            self.turn_digests.pop(rec.id, None)
        elif rec.outcome == Outcome.CUT:
            self.cut_on_disk.discard(rec.id)
        else:
            self.dead_on_disk.discard(rec.id)

    def _event_of_written(self, rec: Result) -> TurnEvent | None:
        """The conversation event of a turn already on disk, from the row on disk: the one
        in the stream may be another generation of it (Redis lost the first commit)."""
        if rec.conversation_id is None:
            return None
        if self.turn_digests.get(rec.id) == output_digest(rec.output_ids):
            return turn_event(rec)
        for row in read_committed(self.dir):
            if not isinstance(row, BadLine) and row.id == rec.id:
                log.warning("%s/%s: generated again after Redis lost its commit; its "
                            "conversation goes on from the turn on disk", self.category, rec.id)
                return turn_event(row)
        return turn_event(rec)

    def unmarked(self, budget: WritingLedger) -> dict[str, int | str]:
        """Ids in the files that Redis has no written mark for (it lost them). A dead
        letter of a sample sent again (`tokencap retry`) is history: its mark was dropped on
        purpose, for the result to come."""
        retried = budget.retried(self.category)
        ids = [*self.on_disk, *(self.dead_on_disk - retried)]
        missing: dict[str, int | str] = {}
        for i in range(0, len(ids), MARK_BATCH):
            chunk = ids[i : i + MARK_BATCH]
            for sid, mark in zip(chunk, budget.written(self.category, chunk), strict=True):
                if mark is None:
                    missing[sid] = self.on_disk.get(sid, DEAD_MARK)
        return missing

    def close(self) -> None:
        for fd in [*([self._part[0]] if self._part else []), *self._others.values()]:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._part = None
        self._others = {}
