"""Reservation estimates: the expected final length of a sample given how far it has got.

A flat mean under-reserves because long samples stay in flight longer (inspection paradox).
For a sample that has produced `g` tokens we reserve E[L | L > g], with L taken from the
category's committed output lengths (a histogram of `HIST_BUCKET_TOKENS`-wide buckets).
Before `MIN_SAMPLES` commits the configured expected length stands in for the histogram.
"""

from __future__ import annotations

from collections.abc import Mapping

from budget_service.keys import HIST_BUCKET_TOKENS

MIN_SAMPLES = 16


def bucket_of(tokens: int) -> int:
    return max(0, int(tokens)) // HIST_BUCKET_TOKENS


class LengthModel:
    """E[L | L > g] over a bucketed histogram of committed output lengths."""

    def __init__(self, hist: Mapping[int, int], expected_tokens: int, max_tokens: int) -> None:
        self.expected = max(1, int(expected_tokens))
        self.max_tokens = max(1, int(max_tokens))
        items = sorted((int(b), int(c)) for b, c in hist.items() if int(c) > 0)
        self.n = sum(c for _, c in items)
        # suffix sums over buckets: count and token mass at or above each bucket
        self._buckets = [b for b, _ in items]
        self._suffix: list[tuple[int, float]] = []
        cnt, mass = 0, 0.0
        for b, c in reversed(items):
            cnt += c
            mass += c * (b + 0.5) * HIST_BUCKET_TOKENS
            self._suffix.append((cnt, mass))
        self._suffix.reverse()

    @classmethod
    def from_redis(cls, raw: Mapping[bytes | str, bytes | str], expected: int, max_tokens: int):
        return cls({int(k): int(v) for k, v in raw.items()}, expected, max_tokens)

    def mean(self) -> int:
        return self.conditional(0)

    def conditional(self, progressed_tokens: float) -> int:
        """Expected final output length of a sample known to exceed `progressed_tokens`."""
        g = max(0.0, float(progressed_tokens))
        if self.n < MIN_SAMPLES:
            est = max(float(self.expected), g + 1)
        else:
            est = None
            for i, b in enumerate(self._buckets):
                if (b + 1) * HIST_BUCKET_TOKENS > g:
                    cnt, mass = self._suffix[i]
                    est = max(mass / cnt, g + 1)
                    break
            if est is None:  # longer than anything seen so far
                est = g + HIST_BUCKET_TOKENS
        return int(min(self.max_tokens, round(est)))
