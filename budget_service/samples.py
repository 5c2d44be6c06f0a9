"""The sample ledger: what a worker writes for the sample it runs (one Lua call each)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from budget_service.estimator import bucket_of
from budget_service.ledger import (
    RATE_EWMA_WEIGHT,
    REFUSED_STREAM_MAXLEN,
    Ledger,
    as_str,
    now_ms,
)
from foundation.engine.info import EngineInfo
from foundation.wire import (
    DeadLetter,
    Pending,
    Result,
    encode,
)


class SampleLedger(Ledger):
    """A worker's calls: admit (reserve), heartbeat, commit (count exactly once), release,
    fail; its engine counters and the jobs it refused."""

    def admit(
        self, category: str, sample_id: str, estimate: int, lease_ms: int, max_add: int = 0,
        variance: int = 0, sigmas: float = 0.0, seq: int = 0, max_unwritten: int = 0,
        extra: int = 0,
    ) -> tuple[str, Pending | None]:
        """Admit a sample: reserve `estimate` tokens (whose variance is `variance`) while
        used + reserved + estimate + `sigmas` standard deviations of the in-flight total stay
        below the cap; with `max_add` > 0 (the most the sample can add to `used`), also keep
        `used` + what in-flight samples can add below the cap. `seq` is the job's: a job of
        an earlier enqueue of the sample is refused ('stale'). While the category has
        `max_unwritten` (> 0) results the writer has not written, nothing is admitted.
        `extra` (the prompt tokens the sample counts, count = "total") is added to `estimate`
        and to `max_add` by the script, and kept beside a sample it parks so that unpark
        asks for it the same way (`estimator.admission` makes the rest of the ask)."""
        now = now_ms()
        out = self.scripts.admit(
            keys=self._ck(category),
            args=[sample_id, estimate, now + lease_ms, now, max_add, variance, sigmas, seq,
                  max_unwritten, extra],
        )
        status = as_str(out[0])
        payload = msgspec.json.decode(out[1], type=Pending) if status == "ok" else None
        return status, payload

    def heartbeat(self, category: str, sample_id: str, estimate: int, lease_ms: int,
                  variance: int = 0) -> bool:
        return bool(self.scripts.heartbeat(
            keys=self._ck(category),
            args=[sample_id, estimate, now_ms() + lease_ms, variance],
        ))

    def commit(self, result: Result, waste: int, rate_tok_s: float) -> tuple[str, int]:
        out = self.scripts.commit(
            keys=self._ck(result.category),
            args=[
                result.id, result.counted_tokens, waste, bucket_of(result.completion_tokens),
                f"{rate_tok_s:.6g}", RATE_EWMA_WEIGHT, encode(result), result.out_of_vocab,
                result.prompt_tokens, result.cached_tokens or 0, result.reusable_tokens or 0,
                result.engine, result.gate, result.completion_tokens, result.mode,
            ],  # fmt: skip
        )
        return as_str(out[0]), int(out[1])

    def release(self, category: str, p: Pending, retry_at_ms: int) -> bool:
        return bool(self.scripts.release(keys=self._ck(category),
                                         args=[p.sample_id, encode(p), retry_at_ms]))

    def fail(self, dead: DeadLetter) -> bool:
        """Record a terminal rejection (`outcome` rejected) or dead letter (`outcome` dead).
        False if the sample was final already."""
        return bool(self.scripts.fail(keys=self._ck(dead.category),
                                      args=[dead.id, dead.outcome, dead.reason, encode(dead)]))

    def add_engine_counts(self, counts: Mapping[str, int]) -> None:
        """Add a worker's per-engine counters (`consumers.stats`) to the run's totals."""
        args: list[Any] = []
        for field, delta in counts.items():
            args += [field, delta]
        if args:
            self.scripts.engine_counts(keys=[self.keys.engines], args=args)

    def refuse(self, record: Mapping[str, Any]) -> None:
        """Record a job a worker refused to run (capped stream, for operators)."""
        self.redis.xadd(self.keys.refused, {"r": encode(record)},
                        maxlen=REFUSED_STREAM_MAXLEN, approximate=True)

    def record_disk_trouble(self, folder: str, why: str | None, at_ms: int) -> int:
        """A hidden-state stage's workers pause: its states folder has no room for the next
        row (`why`; the first time seen is kept), or (`why` None) a file was kept again.
        Returns since when (ms) while in trouble; when cleared, how long it lasted (-1: it
        was not). The stage's workers are the one writer (`consumers/job.py`); status reads
        it (`RunStatus.disk_trouble`)."""
        return int(self.scripts.engine_trouble(keys=[self.keys.disk_trouble],
                                               args=[folder, why or "", at_ms]))

    def engines_seen(self) -> dict[str, EngineInfo]:
        """What the producer's preflight found each engine serves (url -> info)."""
        raw = self.redis.hgetall(self.keys.engine_info)
        return {as_str(k): msgspec.json.decode(v, type=EngineInfo) for k, v in raw.items()}
