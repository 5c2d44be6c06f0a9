"""`tokencap --help` and each subcommand's help describe what they do."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from tokencap.cli import main

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


def test_status_without_redis_is_a_clear_error() -> None:
    out = CliRunner().invoke(main, ["status", "--redis-url", "redis://:hunter2@127.0.0.1:1/0"])
    assert out.exit_code == 3
    assert "cannot reach Redis" in out.output
    assert "hunter2" not in out.output
