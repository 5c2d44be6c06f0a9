"""Length limits on training rows, the way the trainers apply them.

A row longer than `max_length` tokens is cut to its first `max_length` (``truncate``: what
SpecForge's `max_length` and speculators' `--seq-length` do) or left out (``drop``: what
EAGLE's own scripts do); the loss mask is cut with it, so the loss and the draft vocabulary
count only what lies within the limit. A row left with fewer than `min_loss_tokens` loss
tokens is left out (both trainers drop rows with nothing to learn from: SpecForge below its
`min_loss_tokens`, speculators with no loss token at all).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

OverLength = Literal["truncate", "drop"]
OVER_LENGTH: tuple[OverLength, ...] = ("truncate", "drop")


class Limits(NamedTuple):
    max_length: int | None = None  # None: no limit
    over_length: OverLength = "truncate"
    min_loss_tokens: int = 1

    def describe(self) -> dict[str, object]:
        return {"max_length": self.max_length, "over_length": self.over_length,
                "min_loss_tokens": self.min_loss_tokens}


def apply(ids: list[int], mask: list[int], limits: Limits
          ) -> tuple[list[int], list[int], str]:
    """The row within `limits`: (ids, mask, "") when it is kept (cut when ``truncate``), or
    ([], [], reason) when it is left out: ``over_length`` or ``too_few_loss_tokens``."""
    if limits.max_length is not None and len(ids) > limits.max_length:
        if limits.over_length == "drop":
            return [], [], "over_length"
        ids, mask = ids[:limits.max_length], mask[:limits.max_length]
    if sum(mask) < limits.min_loss_tokens:
        return [], [], "too_few_loss_tokens"
    return ids, mask, ""
