"""One exception base for every error tokencap raises on purpose, with its exit code.

A `TokencapError` is a user-facing condition (bad config or source, unreachable or unsafe
Redis, another producer on the run): the CLI prints its message and exits with `exit_code`,
never a traceback. Anything else reaching the CLI is a bug. The signals the pipeline raises
and catches itself (`producer.formats.records.Rejected`, `foundation.engine.api.EngineError`,
`producer.parsers.base.Unparsed`, `producer.parsers.registry.Ambiguous`,
`foundation.sources.SourceMissing`, `writer.files.WriterDiskError`) are `TokencapError`s too,
so one that escapes is still printed as a message.

| code | error |
|---|---|
| 1 | `TokencapError`: any other expected failure (no engine, no such category, ...) |
| 2 | `ConfigError`, `SourceError`: the run config, a path it names or a source file |
| 3 | `RedisUnavailable`: Redis cannot be reached; nothing was fed or sent |
| 4 | `RedisRefused`: Redis evicts keys (`maxmemory-policy` not `noeviction`) |
| 5 | `RunMismatch`: the run exists in Redis with other categories, or other modes |
| 6 | `ProducerBusy`: another producer holds the run |
| 7 | `RunNotFound`: no such run in Redis |
| 8 | `WriterBusy`: another writer holds the run, or lost the lease to one |
| 9 | `EngineUnusable`: an engine is unreachable, too old, or serves another model than the |
|   | tokenizer's (found before anything is fed); `EngineNotReady` while it may still come |
|   | up by itself (the preflight waits `preflight_wait_s` for it first) |
| 10 | `DiskFull`: what a stage would write does not fit the free space of its folder |
| 11 | `StackBusy`: the stack in the state dir serves another run (its workers and writer take |
|    | only that run's queues) |
"""

from __future__ import annotations


class TokencapError(Exception):
    """Base of all expected errors. `exit_code` is what the CLI exits with, `meaning` what the
    code says in a word (`exit_codes`)."""

    exit_code = 1
    meaning = "error"


class ConfigError(TokencapError):
    """The run config (or a path it names) is invalid. Raised before anything is enqueued."""

    exit_code = 2
    meaning = "bad config or source"

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message


class SourceError(TokencapError):
    """A source file cannot be read as a whole (unsupported type, broken JSON array,
    unreadable Parquet). A single bad record is not this: it is dead-lettered."""

    exit_code = 2
    meaning = "bad config or source"


class RedisUnavailable(TokencapError):
    """Redis cannot be reached or refused a command; the budget fails closed."""

    exit_code = 3
    meaning = "Redis unreachable"


class RedisRefused(TokencapError):
    """Redis is reachable but configured unsafely (for example an evicting maxmemory-policy)."""

    exit_code = 4
    meaning = "Redis evicts keys"


class RunMismatch(TokencapError):
    """Redis holds a run of the same name whose categories (or modes) differ from the config."""

    exit_code = 5
    meaning = "the run exists with other categories"


class ProducerBusy(TokencapError):
    """Another producer holds the run's lock."""

    exit_code = 6
    meaning = "another producer runs the run"


class WriterBusy(TokencapError):
    """Another writer holds the run's writer lease or its output folder."""

    exit_code = 8
    meaning = "another writer holds the run"


class EngineUnusable(TokencapError):
    """An engine that cannot be used: unreachable, refusing the API key, too old for the
    protocol, or serving a model whose vocabulary is not the tokenizer's. Found before the
    first sample is fed."""

    exit_code = 9
    meaning = ("an engine unusable (unreachable, too old, or serving another model than the "
               "tokenizer's)")


class EngineNotReady(EngineUnusable):
    """An engine that may become usable by itself: it refuses or resets connections (it is
    starting or restarting), answers 429 or 5xx (busy, loading), or does not answer in time.
    `reason` is that in a word or a status code ("503", "connection refused"). The
    preflight tries again with backoff for `preflight_wait_s` before it gives up."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class RunNotFound(TokencapError):
    """No such run (or no run at all) under the key prefix in this Redis."""

    exit_code = 7
    meaning = "no such run"


class UnknownCategory(TokencapError):
    """A category name that the run does not have."""

    def __init__(self, run: str, category: str, hint: str = "") -> None:
        super().__init__(f"no category {category!r} in run {run!r}{hint}")
        self.run = run
        self.category = category


class PayloadRefused(TokencapError):
    """A job payload that is not tokencap's msgspec JSON (pickle, garbage, wrong shape)."""


class DiskFull(TokencapError):
    """What a stage would write (hidden states) does not fit the free space of its folder:
    found before anything is sent."""

    exit_code = 10
    meaning = "no room on the disk"


class StackBusy(TokencapError):
    """`up` of a run on a stack whose processes serve another run: refused at once (its
    workers and writer would never take the new run's queues)."""

    exit_code = 11
    meaning = "the stack serves another run"


SIGNALLED = 130  # stopped by a signal before the end (Ctrl-C, SIGTERM)


def exit_codes() -> dict[int, str]:
    """Every exit code a command can end with and what it means: 0, the codes of
    `TokencapError` and its subclasses, and `SIGNALLED` (one table: the CLI's help, the worker
    pool's log lines and the README's list are read from it)."""
    table = {0: "done"}
    todo: list[type[TokencapError]] = [TokencapError]
    while todo:
        cls = todo.pop(0)
        table.setdefault(cls.exit_code, cls.meaning)
        todo.extend(cls.__subclasses__())
    table[SIGNALLED] = "stopped by a signal"
    return dict(sorted(table.items()))


def exit_codes_text() -> str:
    """`0 done, 1 error, ...`: the table in one line."""
    return ", ".join(f"{code} {meaning}" for code, meaning in exit_codes().items())
