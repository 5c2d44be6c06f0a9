"""Rebuild Redis done-marks and counters from the output files.

Run at every producer start, before anything is fed. The files are the durable truth:
a sample on disk is final even if Redis lost it (restart without AOF, a lost last second,
a flushed instance). `reconcile.lua` adds only what Redis lacks, so this is idempotent.
Conversations regenerated turn by turn get their next turn back too: one whose last turn on
disk is not its last, and that no rejected, dead or stopped turn nor a reply the gate kept
out of training ended, waits again for it (with the
outputs on disk as its history) unless Redis has that turn pending or final already.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

from budget_service import codec
from budget_service.budget import Budget
from budget_service.estimator import bucket_of, waste_tokens
from budget_service.ledger import TurnEvent, turn_event
from foundation.outputs import BadLine, category_dir, read_committed, read_dead_letters
from foundation.wire import Outcome

log = logging.getLogger(__name__)

BATCH = 500
Record = tuple[str, str, int, int, int | str, str, int, str]


def read_records(cat_dir: Path) -> Iterator[Record]:
    """(sample id, final value, counted, waste, bucket, gate reason, output tokens, decode
    mode) for every sample on disk."""
    for r in read_committed(cat_dir):
        if isinstance(r, BadLine):
            log.warning("%s: unreadable result line ignored: %s", r.where, r.error)
            continue
        waste = waste_tokens(r.completion_tokens, r.gate, r.finish_reason)
        yield (r.id, codec.committed(r.counted_tokens), r.counted_tokens, waste,
               bucket_of(r.completion_tokens), r.gate, r.completion_tokens, r.mode)
    for d in read_dead_letters(cat_dir):
        if isinstance(d, BadLine):
            log.warning("%s: unreadable dead-letter line ignored: %s", d.where, d.error)
            continue
        if d.outcome == Outcome.CUT:  # a turn held back, not an end
            continue
        yield (d.id, codec.ended(d.outcome, d.reason), 0, 0, "", "", 0, "")


def reconcile(budget: Budget, out_dir: Path, categories: list[str]) -> dict[str, int]:
    """Add to Redis every final sample found on disk. Returns how many were new, per category."""
    added: dict[str, int] = {}
    for name in categories:
        cat_dir = category_dir(out_dir, name)
        if not cat_dir.is_dir():
            continue
        n = 0
        batch: list[Record] = []
        for rec in read_records(cat_dir):
            batch.append(rec)
            if len(batch) >= BATCH:
                n += budget.feeding.reconcile(name, batch)
                batch = []
        n += budget.feeding.reconcile(name, batch)
        if n:
            log.warning("%s: %d samples found on disk but not in Redis; counted them", name, n)
        added[name] = n
        restore_followups(budget, cat_dir, name)
    return added


def restore_followups(budget: Budget, cat_dir: Path, category: str) -> int:
    """Give every conversation that is not over its next turn back (module docstring).
    Returns how many conversations were looked at. Two passes: the outputs are read only
    for the conversations that go on."""
    last: dict[str, tuple[int, int]] = {}  # conversation -> (last turn on disk, turns)
    ended: set[str] = set()
    for r in read_committed(cat_dir):
        if isinstance(r, BadLine) or r.conversation_id is None:
            continue
        if r.gate:  # a reply kept out of training ends its conversation
            ended.add(r.conversation_id)
        turn, _ = last.get(r.conversation_id, (0, 0))
        if r.turn > turn:
            last[r.conversation_id] = (r.turn, r.turns_total)
    for d in read_dead_letters(cat_dir):
        if not isinstance(d, BadLine) and d.conversation_id and d.outcome != "cut":
            ended.add(d.conversation_id)
    going = {c for c, (turn, total) in last.items() if turn < total and c not in ended}
    if not going:
        return 0
    events: list[TurnEvent] = []
    for r in read_committed(cat_dir):
        if isinstance(r, BadLine) or r.conversation_id not in going:
            continue
        ev = turn_event(r)
        if ev is not None and ev.next_id is not None:
            events.append(ev)
        if len(events) >= BATCH:
            budget.feeding.restore_followups(category, events)
            events = []
    budget.feeding.restore_followups(category, events)
    log.info("%s: %d conversations on disk go on (their next turn waits unless known)",
             category, len(going))
    return len(going)
