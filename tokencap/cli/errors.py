"""The one map from an error that reaches a command to the line it prints and its exit code
(`foundation/errors.py` lists the codes): every command, invoked through the group or alone,
ends a user's mistake with one line, never a traceback."""

from __future__ import annotations

import errno
import sys
from typing import Any, NoReturn

import click

from foundation.errors import ConfigError, DiskFull, TokencapError


def exit_for(exc: BaseException) -> tuple[str, int] | None:
    """(the line, the exit code) for `exc`: a `TokencapError`'s message and code; a file or
    folder that cannot be read or made (an `OSError` naming it) as a bad path (2), or no room
    on the disk (`DiskFull`'s code); None for anything else (a bug: its traceback shows)."""
    if isinstance(exc, TokencapError):
        return str(exc), exc.exit_code
    if isinstance(exc, OSError):
        where = f"{exc.filename}: " if exc.filename else ""
        line = f"{where}{exc.strerror or exc}"
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return line, DiskFull.exit_code
        return line, ConfigError.exit_code if exc.filename else TokencapError.exit_code
    return None


def fail(exc: BaseException) -> NoReturn:
    """Print `exc` as one line and exit with its code (re-raised when it is a bug)."""
    found = exit_for(exc)
    if found is None:
        raise exc
    click.echo(f"tokencap: error: {found[0]}", err=True)
    sys.exit(found[1])


class Command(click.Command):
    """A command that ends an expected error as one line (`exit_for`), also invoked alone:
    raised while its arguments are read (a config file that does not load) or run."""

    def make_context(self, info_name: str | None, args: list[str],
                     parent: click.Context | None = None, **extra: Any) -> click.Context:
        try:
            return super().make_context(info_name, args, parent, **extra)
        except (TokencapError, OSError) as exc:
            fail(exc)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (TokencapError, OSError) as exc:
            fail(exc)
