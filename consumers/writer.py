"""The writer: drains each category's result and dead-letter streams into JSONL files.

Order per batch: append lines, flush, fsync, then acknowledge (`Budget.acknowledge`: XACK,
XDEL and any correction of `used`, in one Lua call). A crash between fsync and the ack
redelivers entries that are already on disk: the writer keeps the ids it has written (read
back from the files at start) and skips them, so no id is written twice. A torn last line
from a crash mid-write is cut off at start. The file layout is `foundation.outputs`'.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import IO, cast

import msgspec
from redis import Redis
from redis.exceptions import ResponseError

from budget_service.budget import Budget
from budget_service.keys import WRITER_GROUP, Keys
from foundation.backoff import REDIS_DOWN, Backoff
from foundation.outputs import (
    PART_MAX_BYTES,
    BadLine,
    category_dir,
    dead_letter_path,
    part_files,
    part_path,
    read_dead_letters,
    read_results,
    repair_tail,
)
from foundation.wire import DeadLetter, Result

log = logging.getLogger(__name__)

# XREADGROUP's reply: (stream, [(entry id, {field: value})])
StreamEntries = tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]
READ_COUNT = 512
BLOCK_MS = 500
RECOVER_EVERY_S = 5.0


class CategorySink:
    """Append-only files of one category, with the set of ids already written."""

    def __init__(self, root: Path, category: str) -> None:
        self.dir = category_dir(root, category)
        self.dir.mkdir(parents=True, exist_ok=True)
        parts = part_files(self.dir)
        for p in [*parts, dead_letter_path(self.dir)]:
            if p.exists() and repair_tail(p):
                log.warning("cut a torn last line in %s", p)
        self.seen: dict[str, int] = {}  # id -> counted tokens on disk
        self.dead_seen: set[str] = set()
        for rec in read_results(self.dir):
            if isinstance(rec, BadLine):
                log.warning("%s: unreadable result line kept as is: %s", rec.where, rec.error)
            else:
                self.seen[rec.id] = rec.counted_tokens
        for dead in read_dead_letters(self.dir):
            if not isinstance(dead, BadLine):
                self.dead_seen.add(dead.id)
        self.part_no = len(parts)
        self._part: IO[bytes] | None = None
        self._dead: IO[bytes] | None = None
        self._result = msgspec.json.Decoder(Result)
        self._dead_letter = msgspec.json.Decoder(DeadLetter)

    def _part_file(self) -> IO[bytes]:
        if self._part is None or self._part.tell() >= PART_MAX_BYTES:
            if self._part is not None:
                self._part.close()
            path = part_path(self.dir, self.part_no)
            if path.exists() and path.stat().st_size >= PART_MAX_BYTES:
                self.part_no += 1
                path = part_path(self.dir, self.part_no)
            self._part = path.open("ab")
        return self._part

    def write(self, payloads: list[bytes], dead: bool) -> tuple[int, int]:
        """Append payloads not written before; fsync. Returns (lines appended, token
        correction): a result whose id is already on disk with another count (it was
        generated again after Redis lost its commit) is not written, and the difference
        is returned so that `used` can be set back to what the files hold."""
        new: list[bytes] = []
        correction = 0
        for raw in payloads:
            if dead:
                sid = self._dead_letter.decode(raw).id
                if sid in self.dead_seen:
                    continue
                self.dead_seen.add(sid)
            else:
                rec = self._result.decode(raw)
                on_disk = self.seen.get(rec.id)
                if on_disk is not None:
                    correction += on_disk - rec.counted_tokens
                    continue
                self.seen[rec.id] = rec.counted_tokens
            new.append(raw)
        if not new:
            return 0, correction
        if dead:
            if self._dead is None:
                self._dead = dead_letter_path(self.dir).open("ab")
            f = self._dead
        else:
            f = self._part_file()
        f.write(b"".join(raw.rstrip(b"\n") + b"\n" for raw in new))
        f.flush()
        os.fsync(f.fileno())
        return len(new), correction

    def close(self) -> None:
        for f in (self._part, self._dead):
            if f is not None:
                f.close()


class Writer:
    """Reads the run's streams with one consumer group and writes them to disk."""

    def __init__(self, redis: Redis, keys: Keys, categories: list[str], out_dir: Path,
                 consumer: str = "writer-1") -> None:
        self.redis = redis
        self.budget = Budget(redis, keys)
        self.out_dir = out_dir
        self.consumer = consumer
        self.sinks = {c: CategorySink(out_dir, c) for c in categories}
        self.streams: dict[str, tuple[str, bool]] = {}
        for c in categories:
            ck = keys.cat(c)
            self.streams[ck.results] = (c, False)
            self.streams[ck.dead] = (c, True)
        self.written = 0
        self.stop_event = threading.Event()

    def _read(self, start: str, block_ms: int | None) -> list[StreamEntries]:
        reply = self.redis.xreadgroup(WRITER_GROUP, self.consumer,
                                      {s: start for s in self.streams}, count=READ_COUNT,
                                      block=block_ms)
        return cast(list[StreamEntries], reply or [])

    def drain_once(self, block_ms: int | None = BLOCK_MS, pending: bool = False) -> int:
        """One XREADGROUP round over every stream. `pending` re-reads unacked entries."""
        n = 0
        for stream, entries in self._read("0" if pending else ">",
                                          None if pending else block_ms):
            name = stream.decode() if isinstance(stream, bytes) else stream
            category, dead = self.streams[name]
            if not entries:
                continue
            ids = [eid for eid, _ in entries]
            payloads = [fields[b"r"] for _, fields in entries if fields]
            written, correction = self.sinks[category].write(payloads, dead)
            n += written
            if correction:
                log.warning("%s: a sample already on disk was generated again (Redis lost its "
                            "commit); used corrected by %+d tokens", category, correction)
            self.budget.acknowledge(category, dead, ids, correction)
        self.written += n
        return n

    def recover(self) -> int:
        """Write entries delivered before a crash and never acked."""
        total = 0
        while True:
            if not any(entries for _, entries in self._read("0", None)):
                return total
            total += self.drain_once(pending=True)

    def lag(self) -> int:
        """Entries not yet written and acked, over all streams."""
        return self.budget.unwritten(self.sinks)

    def ensure_groups(self) -> None:
        """Create the consumer group on every stream (after Redis lost them)."""
        for category in self.sinks:
            self.budget.ensure_groups(category)

    def run(self) -> None:
        """Drain until stopped; ride out Redis outages and restarts."""
        backoff = Backoff(stop=self.stop_event)
        recovered = False
        last_recover = 0.0
        while not self.stop_event.is_set():
            try:
                # entries delivered but never acked (a crash, or a Redis restart that replayed
                # the delivery but not the ack) are read again now and then
                if not recovered or time.monotonic() - last_recover > RECOVER_EVERY_S:
                    self.recover()
                    recovered = True
                    last_recover = time.monotonic()
                self.drain_once()
                backoff.reset()
            except ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                log.warning("writer group missing (Redis restarted?); creating it again")
                self.ensure_groups()
            except REDIS_DOWN as exc:
                # after a restart from AOF, entries delivered before the crash may be back in
                # our pending list: read it again once Redis answers
                recovered = False
                log.error("Redis unavailable (%s); writer retries in %.1f s", exc,
                          backoff.delay_s)
                backoff.wait()

    def close(self) -> None:
        for s in self.sinks.values():
            s.close()
