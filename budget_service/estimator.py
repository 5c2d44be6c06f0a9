"""Reservation estimates: the expected final length of a sample given how far it has got.

A flat mean under-reserves because long samples stay in flight longer (inspection paradox).
For a sample that has produced `g` tokens we reserve E[L | L > g], with L taken from the
category's committed output lengths (a histogram of `HIST_BUCKET_TOKENS`-wide buckets).
Before `MIN_SAMPLES` commits the configured expected length stands in for the histogram.

Admission also keeps a margin of `margin_sigmas` standard deviations of what the in-flight
samples will still add, so each sample carries Var[L | L > g] from the same histogram
(before `MIN_SAMPLES` commits: a coefficient of variation of PRIOR_CV).
"""

from __future__ import annotations

from collections.abc import Mapping

from budget_service.keys import HIST_BUCKET_TOKENS

MIN_SAMPLES = 16
PRIOR_CV = 1.0


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
        self._suffix: list[tuple[int, float, float]] = []
        cnt, mass, sq = 0, 0.0, 0.0
        for b, c in reversed(items):
            x = (b + 0.5) * HIST_BUCKET_TOKENS
            cnt += c
            mass += c * x
            sq += c * x * x
            self._suffix.append((cnt, mass, sq))
        self._suffix.reverse()

    @classmethod
    def from_redis(cls, raw: Mapping[bytes | str, bytes | str], expected: int,
                   max_tokens: int) -> LengthModel:
        return cls({int(k): int(v) for k, v in raw.items()}, expected, max_tokens)

    def mean(self) -> int:
        return self.conditional(0)

    def conditional(self, progressed_tokens: float) -> int:
        """Expected final output length of a sample known to exceed `progressed_tokens`."""
        return self.moments(progressed_tokens)[0]

    def moments(self, progressed_tokens: float) -> tuple[int, int]:
        """(E[L | L > g], Var[L | L > g]) in tokens and tokens squared, g = progressed."""
        g = max(0.0, float(progressed_tokens))
        if self.n < MIN_SAMPLES:
            est = max(float(self.expected), g + 1)
            var = (PRIOR_CV * est) ** 2
        else:
            # longer than anything seen so far, unless a bucket above g is found below
            est, var = g + HIST_BUCKET_TOKENS, float(HIST_BUCKET_TOKENS ** 2)
            for i, b in enumerate(self._buckets):
                if (b + 1) * HIST_BUCKET_TOKENS > g:
                    cnt, mass, sq = self._suffix[i]
                    mean = mass / cnt
                    est = max(mean, g + 1)
                    # within-bucket spread (uniform over a bucket) on top of the bucket centres
                    var = max(0.0, sq / cnt - mean * mean) + HIST_BUCKET_TOKENS ** 2 / 12
                    break
        est = min(self.max_tokens, round(est))
        # what is left can be no more than max_tokens - g: cap the spread at that range
        room = max(0.0, self.max_tokens - g)
        return int(est), int(round(min(var, room * room)))
