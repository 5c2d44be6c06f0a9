"""Leases: one holder of a role per run (the producer, the writer), on redis-py's `Lock`.

SET NX PX takes a lease; extending and releasing are Lua calls that act only while this
holder's token is the value. A holder that stalls past the TTL (SIGSTOP, a long GC, a lost
network) finds the lease gone or taken at its next `renew`, and must stop.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid

from redis import Redis
from redis.exceptions import LockError

from budget_service.keys import Keys
from foundation.errors import ProducerBusy, TokencapError, WriterBusy

log = logging.getLogger(__name__)

POLL_S = 0.2


def holder_token() -> str:
    """Who holds a lease: host, pid and a random suffix (pids are reused)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class Lease:
    """The lease `key` of run `run` for `role` ("producer", "writer"), `ttl_s` long; `busy`
    is the error raised when another holder has it."""

    def __init__(self, redis: Redis, key: str, run: str, role: str, ttl_s: float,
                 busy: type[TokencapError]) -> None:
        self.redis = redis
        self.key = key
        self.run = run
        self.role = role
        self.ttl_s = ttl_s
        self.busy = busy
        self.token = holder_token()
        self.lock = redis.lock(key, timeout=ttl_s, sleep=POLL_S, thread_local=False)
        self._renewed_at = float("-inf")

    def holder(self) -> str | None:
        raw = self.redis.get(self.key)
        return raw.decode() if isinstance(raw, bytes) else raw

    def acquire(self, wait_s: float | None = None) -> None:
        """Take the lease, waiting up to `wait_s` (default: a little over its TTL, so that a
        killed holder's lease has expired); raise `busy` if another keeps it."""
        wait_s = self.ttl_s * 1.5 if wait_s is None else wait_s
        if self.lock.acquire(blocking=False, token=self.token):
            self._renewed_at = time.monotonic()
            return
        if wait_s > 0:  # said, not waited in silence: after a crash, the rerun's first wait
            log.warning("the %s lease of run %r is held by %s: waiting up to %g s for it "
                        "(a killed holder's runs out within %g s)", self.role, self.run,
                        self.holder() or "someone", wait_s, self.ttl_s)
        if self.lock.acquire(blocking=True, blocking_timeout=wait_s, token=self.token):
            self._renewed_at = time.monotonic()
            return
        raise self.busy(
            f"another {self.role} is running run {self.run!r} (lease {self.key} held by "
            f"{self.holder() or 'someone'}); stop it first, or wait {self.ttl_s:g} s for "
            f"the lease of a killed one to expire"
        )

    def renew(self) -> None:
        """Extend the lease (at most every third of its TTL); take it again if Redis lost it;
        raise `busy` if someone else holds it."""
        now = time.monotonic()
        if now - self._renewed_at < self.ttl_s / 3:
            return
        self._renewed_at = now
        try:
            self.lock.reacquire()
        except LockError:
            if self.lock.acquire(blocking=False, token=self.token):
                log.warning("%s lease %s was gone (Redis restarted?); took it again", self.role,
                            self.key)
                return
            raise self.busy(f"lost the {self.role} lease of run {self.run!r} to "
                            f"{self.holder() or 'someone'} (this one stalled longer than "
                            f"its {self.ttl_s:g} s lease?)") from None

    def release(self) -> None:
        try:
            self.lock.release()
        except LockError:
            log.warning("%s lease %s was no longer ours at the end", self.role, self.key)


def producer_lease(redis: Redis, keys: Keys, ttl_s: float = 15.0) -> Lease:
    """One producer per run."""
    return Lease(redis, keys.producer_lock, keys.run, "producer", ttl_s, ProducerBusy)


def writer_lease(redis: Redis, keys: Keys, ttl_s: float = 15.0) -> Lease:
    """One writer per run."""
    return Lease(redis, keys.writer_lock, keys.run, "writer", ttl_s, WriterBusy)
