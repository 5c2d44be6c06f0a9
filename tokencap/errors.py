"""One exception base for every error tokencap raises on purpose.

A `TokencapError` is a user-facing condition (bad config, unreachable Redis, refused Redis
settings): the CLI prints its message and exits with `exit_code`, never a traceback.
"""

from __future__ import annotations


class TokencapError(Exception):
    """Base of all expected errors. `exit_code` is what the CLI exits with."""

    exit_code = 1


class ConfigError(TokencapError):
    """The run config (or a path it names) is invalid. Raised before anything is enqueued."""

    exit_code = 2

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message


class RedisUnavailable(TokencapError):
    """Redis cannot be reached or refused a command; the budget fails closed."""

    exit_code = 3


class RedisRefused(TokencapError):
    """Redis is reachable but configured unsafely (for example an evicting maxmemory-policy)."""

    exit_code = 4


class RunMismatch(TokencapError):
    """Redis holds a run of the same name whose categories differ from the config."""

    exit_code = 5
