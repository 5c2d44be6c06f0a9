"""The one backoff for loops that must ride out a Redis outage (producer, writer, worker
supervisor): wait, double the wait up to a ceiling, start again from the floor once a round
went through."""

from __future__ import annotations

import threading

from redis import exceptions as redis_exc

# Errors that mean "Redis is not there right now"; anything else is not retried.
REDIS_DOWN: tuple[type[Exception], ...] = (redis_exc.ConnectionError, redis_exc.TimeoutError)
REDIS_BACKOFF_MIN_S = 0.2
REDIS_BACKOFF_MAX_S = 5.0


class Backoff:
    """`wait()` sleeps the current delay (waking early when `stop` is set) and doubles it,
    up to `max_s`; `reset()` goes back to `min_s`."""

    def __init__(self, min_s: float = REDIS_BACKOFF_MIN_S, max_s: float = REDIS_BACKOFF_MAX_S,
                 stop: threading.Event | None = None) -> None:
        if not 0 < min_s <= max_s:
            raise ValueError(f"need 0 < min_s <= max_s, got {min_s}, {max_s}")
        self.min_s = min_s
        self.max_s = max_s
        self.stop = stop or threading.Event()
        self.delay_s = min_s

    def wait(self) -> bool:
        """Sleep the current delay, then double it. True if `stop` was set meanwhile."""
        stopped = self.stop.wait(self.delay_s)
        self.delay_s = min(self.delay_s * 2, self.max_s)
        return stopped

    def reset(self) -> None:
        self.delay_s = self.min_s
