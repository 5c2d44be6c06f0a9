"""The ledger's value encodings, written and read here only (the Lua scripts write the same
strings: `commit.lua`, `fail.lua`, `_lib.lua`'s reject, read by `retry.lua` and
`reconcile.lua`).

- A sample's final value (`final` hash, sample id -> value): `c:TOKENS` committed with its
  counted tokens, `r:REASON` rejected before generation (it never reached an engine),
  `d:REASON` dead-lettered after its tries.
- A sample's written mark (`written` hash, set by the writer's acknowledge): its counted
  tokens as text, or `d` for a dead letter on disk.
"""

from __future__ import annotations

from enum import StrEnum
from typing import NamedTuple

from foundation.wire import Outcome

COMMITTED = "c:"
REJECTED = "r:"
DEAD = "d:"
WRITTEN_DEAD = "d"


class FinalKind(StrEnum):
    """What ended a sample, as its final value says."""

    COMMITTED = "committed"
    REJECTED = "rejected"
    DEAD = "dead"


class Final(NamedTuple):
    """A final value, read: its kind and its tokens (committed) or reason (the others)."""

    kind: FinalKind
    tokens: int
    reason: str


_PREFIX = {COMMITTED: FinalKind.COMMITTED, REJECTED: FinalKind.REJECTED, DEAD: FinalKind.DEAD}


def committed(tokens: int) -> str:
    """The final value of a sample committed with `tokens` counted."""
    return f"{COMMITTED}{tokens}"


def ended(outcome: Outcome, reason: str) -> str:
    """The final value of a sample that ended without a result (a dead letter's outcome:
    rejected or stopped, never sent; dead, after its tries)."""
    never_sent = outcome in (Outcome.REJECTED, Outcome.STOPPED)
    return (REJECTED if never_sent else DEAD) + reason


def dead(reason: str) -> str:
    """The final value of a sample dead-lettered for `reason`."""
    return DEAD + reason


def read_final(value: str | bytes) -> Final:
    """A final value read; ValueError for one this module did not write."""
    text = value.decode() if isinstance(value, bytes) else value
    kind = _PREFIX.get(text[:2])
    if kind is None:
        raise ValueError(f"not a final value: {text!r}")
    if kind is FinalKind.COMMITTED:
        return Final(kind, int(text[2:]), "")
    return Final(kind, 0, text[2:])


def is_dead(value: str | bytes, reason: str = "") -> bool:
    """A dead letter's final value (for `reason`, or any)."""
    f = read_final(value)
    return f.kind is FinalKind.DEAD and (not reason or f.reason == reason)
