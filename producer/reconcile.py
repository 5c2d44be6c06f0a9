"""Rebuild Redis done-marks and counters from the output files.

Run at every producer start, before anything is fed. The files are the durable truth:
a sample on disk is final even if Redis lost it (restart without AOF, a lost last second,
a flushed instance). `reconcile.lua` adds only what Redis lacks, so this is idempotent.
"""

from __future__ import annotations

import logging
from pathlib import Path

import msgspec

from budget_service.budget import Budget
from budget_service.estimator import bucket_of
from consumers.writer import DEAD_FILE, PART_GLOB, iter_lines

log = logging.getLogger(__name__)

BATCH = 500


class _Committed(msgspec.Struct):
    id: str
    counted_tokens: int
    completion_tokens: int
    finish_reason: str


class _Dead(msgspec.Struct):
    id: str
    outcome: str
    reason: str


def read_records(cat_dir: Path) -> list[tuple[str, str, int, int, int | str]]:
    """(sample id, final value, counted, waste, bucket) for every sample on disk."""
    out: list[tuple[str, str, int, int, int | str]] = []
    dec = msgspec.json.Decoder(_Committed)
    for part in sorted(cat_dir.glob(PART_GLOB)):
        for n, line in enumerate(iter_lines(part), 1):
            try:
                r = dec.decode(line)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.warning("%s:%d: unreadable result line ignored: %s", part, n, exc)
                continue
            waste = r.completion_tokens if r.finish_reason == "length" else 0
            out.append((r.id, f"c:{r.counted_tokens}", r.counted_tokens, waste,
                        bucket_of(r.completion_tokens)))
    dead = cat_dir / DEAD_FILE
    if dead.exists():
        ddec = msgspec.json.Decoder(_Dead)
        for n, line in enumerate(iter_lines(dead), 1):
            try:
                d = ddec.decode(line)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.warning("%s:%d: unreadable dead-letter line ignored: %s", dead, n, exc)
                continue
            prefix = "r:" if d.outcome == "rejected" else "d:"
            out.append((d.id, prefix + d.reason, 0, 0, ""))
    return out


def reconcile(budget: Budget, out_dir: Path, categories: list[str]) -> dict[str, int]:
    """Add to Redis every final sample found on disk. Returns how many were new, per category."""
    added: dict[str, int] = {}
    for name in categories:
        cat_dir = out_dir / name
        if not cat_dir.is_dir():
            continue
        records = read_records(cat_dir)
        n = 0
        for i in range(0, len(records), BATCH):
            n += budget.reconcile(name, records[i : i + BATCH])
        if n:
            log.warning("%s: %d samples found on disk but not in Redis; counted them", name, n)
        added[name] = n
    return added
