"""The writing ledger: what the writer reads and marks (its streams, its written marks)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

from budget_service.keys import WRITER_GROUP
from budget_service.ledger import (
    SAMPLE_ID,
    STREAM_PAGE,
    Ledger,
    TurnEvent,
    as_str,
    now_ms,
)

# XREADGROUP's answer: per stream, its (entry id, fields) pairs
StreamEntries = tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]


class WritingLedger(Ledger):
    """The writer's calls: its consumer groups, each batch read (XREADGROUP) and acknowledged
    with its written marks, its trouble for status."""

    def ensure_groups(self, category: str) -> None:
        """The writer's consumer group on the category's streams (after Redis lost them)."""
        self.scripts.init_category(keys=self._ck(category), args=["", WRITER_GROUP])

    def acknowledge(self, category: str, dead: bool, entry_ids: Sequence[bytes | str],
                    marks: Mapping[str, int | str], correction: int = 0,
                    events: Sequence[TurnEvent] = ()) -> int:
        """Mark the samples written (`marks`: sample id -> counted tokens, or "d" for a dead
        letter), ack and delete their stream entries, correct `used` by `correction`, and
        carry their conversations on (`events`): one call, so a sample is marked, and its
        conversation's next turn put in `follow`, exactly when its entry leaves the stream."""
        args: list[Any] = ["dead" if dead else "results", WRITER_GROUP, correction,
                           len(entry_ids), *entry_ids, len(marks)]
        for sid, mark in marks.items():
            args += [sid, mark]
        for ev in events:
            args += ev.args()
        return int(self.scripts.acknowledge(keys=self._ck(category), args=args))

    def mark_written(self, category: str, marks: Mapping[str, int | str]) -> None:
        """Mark samples found on disk written (a writer starting on files Redis has not
        seen marked: a commit lost, a Redis restarted empty)."""
        if marks:
            self.acknowledge(category, False, [], marks)

    def written(self, category: str, sample_ids: Sequence[str]) -> list[str | None]:
        """The written mark of each sample: counted tokens (as text), "d", or None."""
        if not sample_ids:
            return []
        raw = self.redis.hmget(self._ck(category).written, list(sample_ids))
        return [None if v is None else as_str(v) for v in raw]

    def unacknowledged(self, category: str) -> set[str]:
        """The sample ids of the results and dead letters still in the category's streams:
        committed, not acknowledged by a writer (written or not)."""
        ck = self._ck(category)
        ids: set[str] = set()
        for stream in (ck.results, ck.dead):
            start = "-"
            while True:
                batch = cast(list[tuple[bytes, dict[bytes, bytes]]],
                             self.redis.xrange(stream, start, "+", count=STREAM_PAGE))
                for _eid, fields in batch:
                    if b"r" in fields:
                        ids.add(SAMPLE_ID.decode(fields[b"r"]).id)
                if len(batch) < STREAM_PAGE:
                    break
                start = "(" + as_str(batch[-1][0])
        return ids

    def set_writer_error(self, message: str | None) -> None:
        """The writer's trouble (a full disk, ...) for status and `/metrics`; None clears it."""
        if message is None:
            self.redis.hdel(self.keys.writer_state, "error", "error_at_ms")
        else:
            self.redis.hset(self.keys.writer_state,
                            mapping={"error": message, "error_at_ms": now_ms()})

    def writer_holder(self) -> str | None:
        """Who holds the run's writer lease (host:pid:...), or None."""
        raw = self.redis.get(self.keys.writer_lock)
        return None if raw is None else as_str(raw)

    def read_batch(self, consumer: str, streams: Sequence[str], start: str, count: int,
                   block_ms: int | None) -> list[StreamEntries]:
        """One XREADGROUP of the writer's group over `streams`: new entries (`start` ">",
        waiting up to `block_ms`) or this consumer's unacknowledged ones ("0")."""
        reply = self.redis.xreadgroup(WRITER_GROUP, consumer, dict.fromkeys(streams, start),
                                      count=count, block=block_ms)
        return cast(list[StreamEntries], reply or [])
