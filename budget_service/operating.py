"""The operators' ledger: caps, retry and the event log (CLI and HTTP)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from budget_service import codec
from budget_service.ledger import (
    Ledger,
    as_str,
    cap_arg,
    now_ms,
)
from foundation.wire import split_turn_id


class Retried(NamedTuple):
    """`OperatorLedger.retry`'s answer."""

    moved: int  # dead samples sent again
    turns_kept: int  # dead conversation turns left dead


class OperatorLedger(Ledger):
    """What operators change: a cap (the category closes or reopens by it), dead samples
    sent again; and the event log those changes leave."""

    def set_cap(self, category: str, cap: int | None, by: str = "") -> tuple[bool, int | None]:
        """Change the cap (None: uncapped): a category below it (re)opens, and what it held
        back is sent; one at or above it closes. The change goes to the category's event
        log with `by` (who asked). Returns (closed, old cap)."""
        closed, _exhausted, old = self._close(self.scripts.set_cap, category, cap_arg(cap),
                                            now_ms(), by)
        return closed, old

    def dead_samples(self, category: str, reason: str = "") -> list[str]:
        """Ids of the category's dead-lettered samples (with `reason`, or any), read with
        HSCAN (Redis is not blocked however many there are)."""
        return sorted(as_str(k) for k, v in self.redis.hscan_iter(self._ck(category).final)
                      if codec.is_dead(v, reason))

    def retry(self, category: str, reason: str = "", batch: int = 500) -> Retried:
        """Send the category's dead samples (dead for `reason`, or any) again
        (`lua/retry.lua`): each one still dead stops being final and waits to be fed by the
        producer. The policy, the only copy: rejected samples (bad records) are never sent
        again, nor conversation turns (a turn needs the turns before it, which are final)."""
        dead = self.dead_samples(category, reason)
        turns = [i for i in dead if split_turn_id(i)]
        ids = [i for i in dead if not split_turn_id(i)]
        moved = 0
        for k in range(0, len(ids), batch):
            moved += int(self.scripts.retry(keys=self._ck(category),
                                            args=[reason, *ids[k:k + batch]]))
        return Retried(moved, len(turns))

    def events(self, categories: Sequence[str], after: Mapping[str, str] | None = None
               ) -> list[dict[str, Any]]:
        """The event log of `categories` (cap changes), oldest first, each with its
        `category` and stream `id`; with `after` (category -> id), only later entries."""
        pipe = self.redis.pipeline(transaction=False)
        for name in categories:
            last = (after or {}).get(name)
            pipe.xrange(self._ck(name).events, min=f"({last}" if last else "-")
        out = []
        for name, entries in zip(categories, pipe.execute(), strict=True):
            for entry_id, fields in entries:
                ev: dict[str, Any] = {as_str(k): as_str(v) for k, v in fields.items()}
                ev.update(category=name, id=as_str(entry_id), at=int(ev.get("at") or 0))
                out.append(ev)
        return sorted(out, key=lambda e: (e["at"], e["id"]))
