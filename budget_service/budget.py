"""The budget: every state change of a run, each one Lua call, plus status.

Workers call `admit`, `heartbeat`, `commit`, `release` and `fail`; the producer calls
`init_run`, `feed`, `close` and `reconcile`; everybody may call `status`.
"""

from __future__ import annotations

import hashlib
import time
from array import array
from typing import Any

import msgspec
from redis import Redis
from redis.exceptions import ResponseError

from budget_service.estimator import bucket_of
from budget_service.keys import WRITER_GROUP, Keys
from budget_service.scripts import Scripts
from tokencap.config import RunConfig, config_from_json, config_to_json
from tokencap.errors import RunMismatch
from tokencap.wire import DeadLetter, Pending, Result, encode

RATE_EWMA_WEIGHT = 0.1
STATE_FIELDS = (
    "cap", "used", "reserved", "samples", "skipped", "failed", "rejected", "waste",
    "closed", "exhausted", "rate", "dup_prompts", "worst", "var",
)  # fmt: skip


def now_ms() -> int:
    return int(time.time() * 1000)


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class Budget:
    """All reads and writes of one run's budget state."""

    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self.scripts = Scripts(redis)

    # -- run lifecycle (producer) -------------------------------------------------------
    def load_config(self) -> RunConfig | None:
        raw = self.redis.hget(self.keys.meta, "config")
        return config_from_json(raw) if raw else None

    def has_run(self) -> bool:
        return bool(self.redis.exists(self.keys.meta))

    def init_run(self, cfg: RunConfig) -> bool:
        """Create the run's keys if absent. Returns True if the run was created now.

        An existing run must have the same categories; caps already in Redis win (they
        may have been changed live), the rest of the stored config is replaced.
        """
        existing = self.load_config()
        if existing is not None:
            old = sorted(c.name for c in existing.category)
            new = sorted(c.name for c in cfg.category)
            if old != new:
                raise RunMismatch(
                    f"run {cfg.run!r} already exists in Redis with categories {old}; the config "
                    f"has {new}. Use another run name, or `tokencap reset {cfg.run}`."
                )
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(self.keys.meta, mapping={"config": config_to_json(cfg), "run": cfg.run})
        pipe.hsetnx(self.keys.meta, "created_ms", now_ms())
        for cat in cfg.category:
            ck = self.keys.cat(cat.name)
            pipe.hsetnx(ck.state, "cap", cfg.cap_for(cat))
            pipe.hsetnx(ck.state, "used", 0)
            pipe.hsetnx(ck.state, "reserved", 0)
        pipe.execute()
        for cat in cfg.category:
            ck = self.keys.cat(cat.name)
            for stream in (ck.results, ck.dead):
                try:
                    self.redis.xgroup_create(stream, WRITER_GROUP, id="0", mkstream=True)
                except ResponseError as exc:
                    if "BUSYGROUP" not in str(exc):
                        raise
        return existing is None

    # -- feeding (producer) -------------------------------------------------------------
    def feed(self, category: str, p: Pending, deadline_ms: int, pipe: Any = None) -> Any:
        ck = self.keys.cat(category)
        return self.scripts.feed(
            keys=[ck.pending, ck.leases, ck.final],
            args=[p.sample_id, encode(p), deadline_ms],
            client=pipe or self.redis,
        )

    def close(self, category: str, action: str, cap: int | None = None) -> tuple[bool, bool, int]:
        ck = self.keys.cat(category)
        args = [action] + ([cap] if cap is not None else [])
        closed, exhausted, old = self.scripts.close(keys=[ck.state], args=args)
        return _s(closed) == "1", _s(exhausted) == "1", int(old)

    def reconcile(self, category: str, records: list[tuple[str, str, int, int, int | str]]) -> int:
        ck = self.keys.cat(category)
        args: list[Any] = []
        for rec in records:
            args.extend(rec)
        if not args:
            return 0
        return int(self.scripts.reconcile(keys=[ck.state, ck.final, ck.hist, ck.reasons],
                                          args=args))

    # -- per sample (workers) -----------------------------------------------------------
    def admit(
        self, category: str, sample_id: str, estimate: int, lease_ms: int, max_add: int = 0,
        variance: int = 0, sigmas: float = 0.0,
    ) -> tuple[str, Pending | None]:
        """Admit a sample: reserve `estimate` tokens (whose variance is `variance`) while
        used + reserved + estimate + `sigmas` standard deviations of the in-flight total stay
        below the cap; with `max_add` > 0 (the most the sample can add to `used`), also keep
        `used` + what in-flight samples can add below the cap."""
        ck = self.keys.cat(category)
        now = now_ms()
        out = self.scripts.admit(
            keys=[ck.state, ck.pending, ck.leases, ck.parked, ck.reserved, ck.final, ck.worst,
                  ck.var],
            args=[sample_id, estimate, now + lease_ms, now, max_add, variance, sigmas],
        )
        status = _s(out[0])
        payload = msgspec.json.decode(out[1], type=Pending) if status == "ok" else None
        return status, payload

    def heartbeat(self, category: str, sample_id: str, estimate: int, lease_ms: int,
                  variance: int = 0) -> bool:
        ck = self.keys.cat(category)
        return bool(
            self.scripts.heartbeat(
                keys=[ck.state, ck.reserved, ck.leases, ck.var],
                args=[sample_id, estimate, now_ms() + lease_ms, variance],
            )
        )

    def commit(self, result: Result, waste: int, rate_tok_s: float) -> tuple[str, int]:
        ck = self.keys.cat(result.category)
        out = self.scripts.commit(
            keys=[ck.state, ck.reserved, ck.final, ck.pending, ck.leases, ck.hist, ck.results,
                  ck.worst, ck.var],
            args=[
                result.id, result.counted_tokens, waste, bucket_of(result.completion_tokens),
                f"{rate_tok_s:.6g}", RATE_EWMA_WEIGHT, encode(result),
            ],  # fmt: skip
        )
        return _s(out[0]), int(out[1])

    def release(self, category: str, p: Pending, retry_at_ms: int) -> bool:
        ck = self.keys.cat(category)
        return bool(
            self.scripts.release(
                keys=[ck.state, ck.reserved, ck.pending, ck.final, ck.leases, ck.worst, ck.var],
                args=[p.sample_id, encode(p), retry_at_ms],
            )
        )

    def fail(self, dead: DeadLetter, pipe: Any = None) -> Any:
        """Record a terminal rejection (`outcome` rejected) or dead letter (`outcome` dead)."""
        ck = self.keys.cat(dead.category)
        rejected = dead.outcome == "rejected"
        value = ("r:" if rejected else "d:") + dead.reason
        return self.scripts.fail(
            keys=[ck.state, ck.reserved, ck.final, ck.pending, ck.leases, ck.parked, ck.dead,
                  ck.reasons, ck.worst, ck.var],
            args=[dead.id, value, "rejected" if rejected else "failed", encode(dead),
                  dead.reason],
            client=pipe or self.redis,
        )

    def dedup(self, category: str, sample_id: str, prompt_ids: list[int], where: str,
              pipe: Any = None) -> Any:
        """Reject (`duplicate_prompt`) a sample whose token ids another sample already has."""
        ck = self.keys.cat(category)
        digest = hashlib.blake2b(array("q", prompt_ids).tobytes(), digest_size=12).hexdigest()
        dead = DeadLetter(id=sample_id, category=category, outcome="rejected",
                          reason="duplicate_prompt", where=where,
                          message="same prompt token ids as an earlier sample")
        return self.scripts.dedup(
            keys=[ck.state, ck.prompts, ck.final, ck.reasons, ck.dead],
            args=[sample_id, digest, encode(dead)],
            client=pipe or self.redis,
        )

    # -- reads --------------------------------------------------------------------------
    def state(self, category: str) -> dict[str, int | float]:
        ck = self.keys.cat(category)
        vals = self.redis.hmget(ck.state, STATE_FIELDS)
        out: dict[str, int | float] = {}
        for f, v in zip(STATE_FIELDS, vals, strict=True):
            out[f] = float(v) if f == "rate" and v else int(v or 0)
        return out

    def hist(self, category: str) -> dict[int, int]:
        raw = self.redis.hgetall(self.keys.cat(category).hist)
        return {int(k): int(v) for k, v in raw.items()}

    def status(self, categories: list[str] | None = None) -> dict[str, Any]:
        """The `tokencap status --json` document."""
        if categories is None:
            cfg = self.load_config()
            categories = [c.name for c in cfg.category] if cfg else []
        pipe = self.redis.pipeline(transaction=False)
        for name in categories:
            ck = self.keys.cat(name)
            pipe.hmget(ck.state, STATE_FIELDS)
            pipe.hlen(ck.pending)
            pipe.hlen(ck.reserved)
            pipe.zcard(ck.parked)
            pipe.hgetall(ck.reasons)
        raw = pipe.execute()
        cats: dict[str, Any] = {}
        for i, name in enumerate(categories):
            vals, pending, inflight, parked, reasons = raw[5 * i : 5 * i + 5]
            st = {f: (v.decode() if v else "0") for f, v in zip(STATE_FIELDS, vals, strict=True)}
            cap, used = int(st["cap"]), int(st["used"])
            state = "closed" if st["closed"] == "1" else "open"
            if state == "open" and st["exhausted"] == "1":
                state = "exhausted"
            cats[name] = {
                "cap": cap,
                "used": used,
                "reserved": int(st["reserved"]),
                "worst": int(st["worst"]),
                "var": int(st["var"]),
                "samples": int(st["samples"]),
                "skipped": int(st["skipped"]),
                "failed": int(st["failed"]),
                "rejected": int(st["rejected"]),
                "waste_tokens": int(st["waste"]),
                "overshoot": max(0, used - cap),
                "state": state,
                "pending": int(pending),
                "in_flight": int(inflight),
                "parked": int(parked),
                "duplicate_prompts": int(st["dup_prompts"]),
                "reasons": {_s(k): int(v) for k, v in sorted(reasons.items())},
            }
        return {"run": self.keys.run, "categories": cats}
