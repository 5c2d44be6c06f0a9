"""The `tokencap` command: wiring only. Every option has an environment twin.

Here: the group, its logging (`tokencap.cli.logs`) and its one error handler
(`tokencap.cli.errors`, which every command uses, also invoked alone). The commands: the
stack's (`up`, `down`, `add-workers`, `token`, `sim`) in `tokencap.cli.stack`, the stages'
in `tokencap.cli.stages`, those that look at or steer a run in `tokencap.cli.ops`, the data
commands in `tokencap.cli.offline`; the options they share in `tokencap.cli.find_run`.

Exit codes: `foundation.errors.exit_codes()`, shown at the foot of `tokencap --help`.
"""

from __future__ import annotations

from typing import Any

import click

from foundation.errors import TokencapError, exit_codes_text
from tokencap.cli import logs
from tokencap.cli.errors import fail

HELP_NAMES = ["-h", "--help"]
GLOBAL_OPTIONS = ("--log-level",)  # options of the group also taken after the subcommand
OWN_OPTIONS = {"sim"}  # subcommands that pass their arguments on, --log-level included


def hoist_global_options(args: list[str]) -> list[str]:
    """`args` with the group's options moved before the subcommand where they were given
    after it (`tokencap status --log-level DEBUG` = `tokencap --log-level DEBUG status`)."""
    first = 0
    while first < len(args) and args[first].startswith("-"):  # the group's own options
        first += 2 if args[first] in GLOBAL_OPTIONS else 1
    if first >= len(args) or args[first] in OWN_OPTIONS:
        return args
    out, rest = list(args[:first]), []
    i = first
    while i < len(args):
        arg = args[i]
        if arg == "--":
            rest += args[i:]
            break
        name = arg.split("=", 1)[0]
        if name in GLOBAL_OPTIONS and i > first:
            if "=" in arg:
                out.append(arg)
            else:
                out += args[i:i + 2]
                i += 1
        else:
            rest.append(arg)
        i += 1
    return out + rest


class _Group(click.Group):
    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        return super().parse_args(ctx, hoist_global_options(args))

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (TokencapError, OSError) as exc:
            fail(exc)


@click.group(cls=_Group, epilog="Exit codes: " + exit_codes_text() + ".")
@click.option("--log-level", envvar="TOKENCAP_LOG_LEVEL", default="INFO", show_default=True,
              type=click.Choice(logs.LEVELS, case_sensitive=False),
              help="Logging level. Env: TOKENCAP_LOG_LEVEL.")
@click.version_option(package_name="tokencap")
def main(log_level: str) -> None:
    """tokencap: token-budgeted LLM data generation over Redis queues.

    A producer tokenizes prompts and feeds one RQ queue per category; workers send them to
    SGLang's /generate with input_ids and count tokens exactly once per category; each
    category stops at its token cap. Start everything locally with `tokencap up CONFIG`.
    """
    logs.setup(log_level)


def _register_commands() -> None:
    from tokencap.cli.offline import (
        audit_cmd,
        export_cmd,
        init_cmd,
        plan_cmd,
        preview_cmd,
        verify_cmd,
    )
    from tokencap.cli.ops import cap, report, retry, status
    from tokencap.cli.stack import add_workers, down, rq_info, sim, token, up
    from tokencap.cli.stages import hidden_states, run, serve, worker, writer

    for cmd in (sim, up, down, add_workers, token, rq_info, run, worker, writer, status, serve, cap,
                report, retry, export_cmd, plan_cmd, preview_cmd, audit_cmd, verify_cmd,
                init_cmd, hidden_states):
        main.add_command(cmd)
    _help_names(main)


def _help_names(cmd: click.Command) -> None:
    """-h beside --help on every command, also one invoked on its own (click keeps the help
    option a command made first)."""
    names = ["--help"] if cmd.name == "sim" else HELP_NAMES  # sim passes -h on: its own help
    cmd.context_settings = {**cmd.context_settings, "help_option_names": names}
    for sub in getattr(cmd, "commands", {}).values():
        _help_names(sub)


_register_commands()
