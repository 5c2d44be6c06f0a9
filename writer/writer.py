"""The writer: drains each category's result and dead-letter streams into JSONL files.

One writer per run: it holds the run's writer lease in Redis (renewed as it goes; a writer
that loses it stops) and an exclusive lock on `<out>/.tokencap-writer.lock`, so that a writer
stopped past its lease (SIGSTOP) and a new one never append to the same files at once.

Per batch: decode, drop the samples already written (their written mark in Redis, or their id
in the files read at start), append the rest, fsync, then one `WritingLedger.acknowledge` call marks
them written, acks and deletes the stream entries and corrects `used`. A crash between the
fsync and that call leaves the entries to be read again: the files read at the next start
have them, so no id is written twice. A write that fails (disk full) is cut back to where the
batch began, reported (`status`, `/metrics`) and tried again; meanwhile the category's
admission pauses once `max_unwritten` results wait (admit.lua). The files' side (the sinks,
the append, the output lock) is `writer/files.py`; the file layout `foundation.outputs`'.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from redis import Redis
from redis.exceptions import ResponseError

from budget_service.keys import Keys
from budget_service.lease import writer_lease
from budget_service.writing import StreamEntries, WritingLedger
from foundation.backoff import REDIS_DOWN, Backoff
from writer.files import CategorySink, OutputLock, WriterDiskError

log = logging.getLogger(__name__)

READ_COUNT = 512
BLOCK_MS = 500
RECOVER_EVERY_S = 5.0


class Writer:
    """Reads the run's streams with one consumer group and writes them to disk."""

    def __init__(self, redis: Redis, keys: Keys, categories: list[str], out_dir: Path,
                 consumer: str = "writer-1", lease_ttl_s: float = 15.0) -> None:
        self.redis = redis
        self.keys = keys
        self.ledger = WritingLedger(redis, keys)
        self.out_dir = out_dir
        self.consumer = consumer
        self.categories = categories
        self.lease_ttl_s = lease_ttl_s
        self.sinks: dict[str, CategorySink] = {}
        self.streams: dict[str, tuple[str, bool]] = {}
        for c in categories:
            ck = keys.cat(c)
            self.streams[ck.results] = (c, False)
            self.streams[ck.dead] = (c, True)
        self.written = 0
        self.stop_event = threading.Event()
        self.error: str | None = None

    def open(self) -> None:
        """Read the files (cutting torn tails), and mark in Redis what they hold."""
        self.sinks = {c: CategorySink(self.out_dir, c) for c in self.categories}
        for c, sink in self.sinks.items():
            missing = sink.unmarked(self.ledger)
            if not missing:
                continue
            # still in the streams: a writer stopped between its fsync and its acknowledge
            # (they are acknowledged when read again); else Redis lost their marks
            unacked = self.ledger.unacknowledged(c) & missing.keys()
            if unacked:
                log.warning("%s: %d results on disk were not acknowledged (the writer before "
                            "stopped between its fsync and its acknowledge): marked written, "
                            "their stream entries are acknowledged now", c, len(unacked))
            if len(missing) > len(unacked):
                log.warning("%s: %d samples on disk had no written mark in Redis and are no "
                            "longer in its streams (Redis lost their marks): marked written",
                            c, len(missing) - len(unacked))
            self.ledger.mark_written(c, missing)

    def _read(self, start: str, block_ms: int | None) -> list[StreamEntries]:
        return self.ledger.read_batch(self.consumer, list(self.streams), start, READ_COUNT,
                                      block_ms)

    def drain_once(self, block_ms: int | None = BLOCK_MS, pending: bool = False) -> int:
        """One XREADGROUP round over every stream. `pending` re-reads unacked entries."""
        if not self.sinks:
            self.open()
        n = 0
        for stream, entries in self._read("0" if pending else ">",
                                          None if pending else block_ms):
            name = stream.decode() if isinstance(stream, bytes) else stream
            category, dead = self.streams[name]
            if not entries:
                continue
            ids = [eid for eid, _ in entries]
            sink = self.sinks[category]
            records = [(fields[b"r"], sink.decode(fields[b"r"], dead))
                       for _, fields in entries if fields]
            marked = self.ledger.written(category, [rec.id for _, rec in records])
            written, correction, marks, events = sink.write(records, marked)
            n += written
            if correction:
                log.warning("%s: a sample already on disk was generated again (Redis lost its "
                            "commit); used corrected by %+d tokens", category, correction)
            self.ledger.acknowledge(category, dead, ids, marks, correction, events)
        self.written += n
        return n

    def recover(self) -> int:
        """Write entries delivered before a crash and never acked."""
        total = 0
        while True:
            if not any(entries for _, entries in self._read("0", None)):
                return total
            total += self.drain_once(pending=True)

    def ensure_groups(self) -> None:
        """Create the consumer group on every stream (after Redis lost them)."""
        for category in self.categories:
            self.ledger.ensure_groups(category)

    def _report(self, message: str | None) -> None:
        if message == self.error:
            return
        if message is None:
            log.warning("writer writes again")
        else:
            log.error("%s; retrying (admission pauses once %s)", message,
                      "max_unwritten results wait")
        self.error = message
        self.ledger.set_writer_error(message)

    def run(self) -> None:
        """Hold the run's writer lease and the output folder, then drain until stopped;
        ride out Redis outages and restarts and disk errors. Raises `WriterBusy` when
        another writer holds either, or took the lease over."""
        lease = writer_lease(self.redis, self.keys, self.lease_ttl_s)
        lease.acquire()
        out_lock = OutputLock(self.out_dir)
        try:
            out_lock.acquire(self.lease_ttl_s * 1.5, while_waiting=lease.renew)
            self._loop(lease.renew)
        finally:
            out_lock.release()
            with contextlib.suppress(*REDIS_DOWN):
                lease.release()

    def _loop(self, renew: Callable[[], None]) -> None:
        backoff = Backoff(stop=self.stop_event)
        recovered = False
        last_recover = 0.0
        while not self.stop_event.is_set():
            try:
                renew()
                if not self.sinks:
                    self.open()
                # entries delivered but never acked (a crash, or a Redis restart that replayed
                # the delivery but not the ack) are read again now and then
                if not recovered or time.monotonic() - last_recover > RECOVER_EVERY_S:
                    self.recover()
                    recovered = True
                    last_recover = time.monotonic()
                self.drain_once()
                self._report(None)
                backoff.reset()
            except ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                log.warning("writer group missing (Redis restarted?); creating it again")
                self.ensure_groups()
            except WriterDiskError as exc:
                recovered = False  # the batch was not acknowledged: it is read again
                self._report(str(exc))
                backoff.wait()
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
