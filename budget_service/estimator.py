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
from typing import NamedTuple

from budget_service.keys import HIST_BUCKET_TOKENS
from foundation.config import Category, RunConfig
from foundation.modes import most_new_tokens
from foundation.outputs import TRUNCATED

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


class Ask(NamedTuple):
    """What admission asks for one sample of a category before its own prompt is counted:
    the Lua scripts add that (`extra`, count = "total") to `estimate` and `max_add`."""

    estimate: int  # tokens to reserve: E[L | L > 0]
    variance: int  # of the estimate (tokens^2), for the margin
    max_add: int  # the most the sample can add (hard_cap), 0 = no hard guard
    sigmas: float  # the margin in standard deviations
    max_unwritten: int  # nothing is taken while the writer has this many to write (0 = no bound)


def admission(cfg: RunConfig, cat: Category, model: LengthModel) -> Ask:
    """The ask of a sample of `cat` that has produced nothing yet: the only copy, which the
    worker's admit and the producer's unpark both send (so what unpark releases, admit
    takes)."""
    est, var = model.moments(0)
    return Ask(est, var, most_new_tokens(cat) if cfg.hard_cap else 0,
               cfg.margin_sigmas, cfg.max_unwritten)


def counts_prompt(cfg: RunConfig) -> bool:
    """Whether a sample's prompt tokens count against its cap (count = "total")."""
    return cfg.count == "total"


def counted_prompt(cfg: RunConfig, prompt_tokens: int) -> int:
    """The prompt tokens a sample counts against its cap: all under count = "total", none
    under "output"."""
    return prompt_tokens if counts_prompt(cfg) else 0


def kept_out(gate: str, finish_reason: str) -> bool:
    """Whether a reply is no training row: the reply gate kept it out (`gate`, its reason),
    or, with the gate off, it was cut at max_new_tokens (with the gate on such a reply is
    always gated: `length`)."""
    return bool(gate) or finish_reason == TRUNCATED


def waste_tokens(completion_tokens: int, gate: str, finish_reason: str) -> int:
    """The output tokens a committed sample wastes: all of a reply kept out of training."""
    return completion_tokens if kept_out(gate, finish_reason) else 0


def counted_tokens(cfg: RunConfig, completion_tokens: int, prompt_tokens: int, gate: str,
                   finish_reason: str) -> int:
    """The tokens a committed sample counts against its cap: its output, and its prompt
    under count = "total" (`counted_prompt`); none for a reply kept out of training when
    `count_rejected` is false. The one rule: the worker's commit, and what plan and
    reconcile read back, agree on it."""
    if kept_out(gate, finish_reason) and not cfg.counts_rejected:
        return 0
    return completion_tokens + counted_prompt(cfg, prompt_tokens)
