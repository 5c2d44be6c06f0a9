"""The `tokencap` group (`tokencap/cli/main.py`): every command registered with a help that says
what it does, -h beside --help, the group's options also after the subcommand, the exit
codes at the foot of the help."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from tests.helpers import one_line_error
from tokencap.cli.main import hoist_global_options, main

COMMANDS = {
    "run": "producer",
    "worker": "consumer",
    "writer": "part-",
    "status": "cap",
    "serve": "/metrics",
    "up": "Redis",
    "down": "Stop",
    "add-workers": "consumers",
    "cap": "cap",
    "sim": "simulator",
    "verify": "manifest",
}


def test_top_level_help_lists_every_command() -> None:
    out = CliRunner().invoke(main, ["--help"])
    assert out.exit_code == 0
    assert "token-budgeted" in out.output
    for name in COMMANDS:
        assert name in out.output


@pytest.mark.parametrize("name,word", sorted(COMMANDS.items()))
def test_subcommand_help(name, word) -> None:
    out = CliRunner().invoke(main, [name, "--help"])
    assert out.exit_code == 0, out.output
    assert word in out.output




@pytest.mark.parametrize(("argv", "env"), [(["--log-level", "LOUD", "status"], {}),
                                           (["status"], {"TOKENCAP_LOG_LEVEL": "loud"})])
def test_a_bad_log_level_is_a_usage_error_listing_the_levels(argv, env) -> None:
    out = CliRunner().invoke(main, argv, env=env)
    assert out.exit_code == 2
    assert "'loud' is not one of" in out.output.lower() and "warning" in out.output
    assert "Traceback" not in out.output


def _commands(group: click.Group, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = []
    for name, cmd in group.commands.items():
        if isinstance(cmd, click.Group):
            out += _commands(cmd, (*prefix, name))
        else:
            out.append((*prefix, name))
    return sorted(out)


@pytest.mark.parametrize("path", [p for p in _commands(main) if p != ("sim",)])
def test_every_command_takes_h_and_refuses_a_bad_flag_in_one_line(path) -> None:
    runner = CliRunner()
    assert runner.invoke(main, [*path, "-h"]).exit_code == 0
    assert one_line_error(runner.invoke(main, [*path, "--no-such-flag"]))
    # the group's options after the subcommand too
    res = runner.invoke(main, [*path, "--log-level", "LOUD"])
    assert one_line_error(res) and "--log-level" in res.output


@pytest.mark.parametrize(("given", "read"), [
    (["status", "--log-level", "DEBUG", "--json"], ["--log-level", "DEBUG", "status", "--json"]),
    (["cap", "set", "a", "5", "--log-level=DEBUG"], ["--log-level=DEBUG", "cap", "set", "a", "5"]),
    (["--log-level", "INFO", "status", "--json"], ["--log-level", "INFO", "status", "--json"]),
    # after `--` an argument is the command's, whatever it looks like
    (["plan", "--", "--log-level"], ["plan", "--", "--log-level"]),
    # `sim` passes everything on to the simulator, --log-level included
    (["sim", "--log-level", "debug"], ["sim", "--log-level", "debug"]),
    (["--help"], ["--help"]),
])
def test_the_groups_options_after_the_subcommand_are_read_as_the_groups(given, read) -> None:
    assert hoist_global_options(given) == read

