"""The writer: drains each category's result and dead-letter streams into JSONL files.

Order per batch: append lines, flush, fsync, then XACK + XDEL. A crash between fsync and
ack redelivers entries that are already on disk: the writer keeps the ids it has written
(read back from the files at start) and skips them, so no id is written twice. A torn last
line from a crash mid-write is cut off at start.

Layout: `<out>/<category>/part-NNNNN.jsonl` (results, rotated at `PART_MAX_BYTES`) and
`<out>/<category>/dead-letter.jsonl` (rejected and dead samples).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import msgspec
from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from budget_service.keys import WRITER_GROUP, Keys

log = logging.getLogger(__name__)

PART_MAX_BYTES = 256 * 1024 * 1024
READ_COUNT = 512
BLOCK_MS = 500
DEAD_FILE = "dead-letter.jsonl"
PART_GLOB = "part-*.jsonl"
RECOVER_EVERY_S = 5.0
REDIS_BACKOFF_MIN_S = 0.2
REDIS_BACKOFF_MAX_S = 5.0


class _Id(msgspec.Struct):
    id: str
    counted_tokens: int = 0


_id_decoder = msgspec.json.Decoder(_Id)


def repair_tail(path: Path) -> int:
    """Cut a partial last line (no trailing newline). Returns bytes removed."""
    size = path.stat().st_size
    if size == 0:
        return 0
    with path.open("rb+") as f:
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return 0
        pos = size
        chunk = 65536
        while pos > 0:
            start = max(0, pos - chunk)
            f.seek(start)
            buf = f.read(pos - start)
            nl = buf.rfind(b"\n")
            if nl >= 0:
                keep = start + nl + 1
                break
            pos = start
        else:
            keep = 0
        f.truncate(keep)
        os.fsync(f.fileno())
        return size - keep


def iter_lines(path: Path) -> Iterator[bytes]:
    with path.open("rb") as f:
        for line in f:
            if line.strip():
                yield line


class CategorySink:
    """Append-only files of one category, with the set of ids already written."""

    def __init__(self, root: Path, category: str) -> None:
        self.dir = root / category
        self.dir.mkdir(parents=True, exist_ok=True)
        self.seen: dict[str, int] = {}  # id -> counted tokens on disk
        self.dead_seen: set[str] = set()
        parts = sorted(self.dir.glob(PART_GLOB))
        for p in parts + [self.dir / DEAD_FILE]:
            if p.exists() and repair_tail(p):
                log.warning("cut a torn last line in %s", p)
        for p in parts:
            for line in iter_lines(p):
                rec = _id_decoder.decode(line)
                self.seen[rec.id] = rec.counted_tokens
        dead = self.dir / DEAD_FILE
        if dead.exists():
            self.dead_seen.update(_id_decoder.decode(line).id for line in iter_lines(dead))
        self.part_no = len(parts)
        self._part: IO[bytes] | None = None
        self._dead: IO[bytes] | None = None

    def _part_file(self) -> IO[bytes]:
        if self._part is None or self._part.tell() >= PART_MAX_BYTES:
            if self._part is not None:
                self._part.close()
            path = self.dir / f"part-{self.part_no:05d}.jsonl"
            if path.exists() and path.stat().st_size >= PART_MAX_BYTES:
                self.part_no += 1
                path = self.dir / f"part-{self.part_no:05d}.jsonl"
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
            rec = _id_decoder.decode(raw)
            if dead:
                if rec.id in self.dead_seen:
                    continue
                self.dead_seen.add(rec.id)
            else:
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
                self._dead = (self.dir / DEAD_FILE).open("ab")
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
        self.keys = keys
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

    def drain_once(self, block_ms: int | None = BLOCK_MS, pending: bool = False) -> int:
        """One XREADGROUP round over every stream. `pending` re-reads unacked entries."""
        start = "0" if pending else ">"
        reply = self.redis.xreadgroup(
            WRITER_GROUP, self.consumer, {s: start for s in self.streams},
            count=READ_COUNT, block=None if pending else block_ms,
        )
        n = 0
        for stream, entries in reply or []:
            name = stream.decode() if isinstance(stream, bytes) else stream
            category, dead = self.streams[name]
            if not entries:
                continue
            ids = [eid for eid, _ in entries]
            payloads = [fields[b"r"] for _, fields in entries if fields]
            written, correction = self.sinks[category].write(payloads, dead)
            n += written
            pipe = self.redis.pipeline(transaction=True)
            if correction:
                log.warning("%s: a sample already on disk was generated again (Redis lost its "
                            "commit); used corrected by %+d tokens", category, correction)
                pipe.hincrby(self.keys.cat(category).state, "used", correction)
            pipe.xack(name, WRITER_GROUP, *ids)
            pipe.xdel(name, *ids)
            pipe.execute()
        self.written += n
        return n

    def recover(self) -> int:
        """Write entries delivered before a crash and never acked."""
        total = 0
        while True:
            reply = self.redis.xreadgroup(
                WRITER_GROUP, self.consumer, {s: "0" for s in self.streams}, count=READ_COUNT
            )
            if not any(entries for _, entries in reply or []):
                return total
            total += self.drain_once(pending=True)

    def lag(self) -> int:
        """Entries not yet written and acked, over all streams."""
        pipe = self.redis.pipeline(transaction=False)
        for s in self.streams:
            pipe.xlen(s)
        return sum(pipe.execute())

    def ensure_groups(self) -> None:
        """Create the consumer group on every stream (after Redis lost them)."""
        for stream in self.streams:
            try:
                self.redis.xgroup_create(stream, WRITER_GROUP, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    def run(self) -> None:
        """Drain until stopped; ride out Redis outages and restarts."""
        backoff = REDIS_BACKOFF_MIN_S
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
                backoff = REDIS_BACKOFF_MIN_S
            except ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                log.warning("writer group missing (Redis restarted?); creating it again")
                self.ensure_groups()
            except (RedisConnectionError, RedisTimeoutError) as exc:
                # after a restart from AOF, entries delivered before the crash may be back in
                # our pending list: read it again once Redis answers
                recovered = False
                log.error("Redis unavailable (%s); writer retries in %.1f s", exc, backoff)
                self.stop_event.wait(backoff)
                backoff = min(backoff * 2, REDIS_BACKOFF_MAX_S)

    def close(self) -> None:
        for s in self.sinks.values():
            s.close()
