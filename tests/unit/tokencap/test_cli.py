"""`tokencap --help` and each subcommand's help describe what they do."""

from __future__ import annotations

from typing import Any

import click
import pytest
from click.testing import CliRunner

from tokencap.cli.main import main

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


def _gz_config(tmp_path) -> str:
    (tmp_path / "x.jsonl.gz").write_bytes(b"\x1f\x8b not really")
    (tmp_path / "run.toml").write_text(
        'run = "gz"\noutput_dir = "out"\n[[category]]\nname = "a"\nsource = "x.jsonl.gz"\n'
        'format = "input_ids"\nsampling = { max_new_tokens = 8, temperature = 0.7 }\n')
    return str(tmp_path / "run.toml")


@pytest.mark.parametrize("argv", [["plan"], ["preview"], ["run", "--dry-run"]])
def test_an_unreadable_source_is_a_clear_error_with_exit_2(tmp_path, argv) -> None:
    out = CliRunner().invoke(main, [*argv, _gz_config(tmp_path)])
    assert out.exit_code == 2, out.output
    assert "x.jsonl.gz: cannot decompress" in out.output  # a corrupt gzip file
    assert out.exception is None or isinstance(out.exception, SystemExit)


def test_every_error_has_an_exit_code_and_the_codes_are_documented() -> None:
    import inspect

    from foundation import errors

    classes = [c for _, c in inspect.getmembers(errors, inspect.isclass)
               if c.__module__ == errors.__name__]
    assert all(issubclass(c, errors.TokencapError) for c in classes)
    doc = errors.__doc__ or ""
    for c in classes:
        assert isinstance(c.exit_code, int) and 1 <= c.exit_code < 128, c
        assert f"| {c.exit_code} |" in doc, f"exit code of {c.__name__} not in the table"


def test_a_run_that_is_not_there_exits_7(redis_url) -> None:
    out = CliRunner().invoke(main, ["status", "--redis-url", redis_url, "--run", "nope"])
    assert out.exit_code == 7 and "run 'nope' not found" in out.output


def test_the_exit_codes_are_one_table_shown_in_help_and_the_readme() -> None:
    from foundation.errors import exit_codes, exit_codes_text
    from tests.conftest import ROOT

    codes = exit_codes()
    assert codes[0] == "done" and codes[2] == "bad config or source" and 130 in codes
    assert len(codes) == len(set(codes.values())), "two codes with one meaning"
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"Exit codes of every command: {exit_codes_text()} (" in readme
    shown = CliRunner().invoke(main, ["--help"])
    assert shown.exit_code == 0
    assert exit_codes_text() in " ".join(shown.output.split())


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


def _one_line_usage_error(res: Any) -> bool:
    lines = [ln for ln in res.output.splitlines() if ln.startswith(("Error", "tokencap: error"))]
    return res.exit_code == 2 and len(lines) == 1 and "Traceback" not in res.output and (
        res.exception is None or isinstance(res.exception, SystemExit))


@pytest.mark.parametrize("path", [p for p in _commands(main) if p != ("sim",)])
def test_every_command_takes_h_and_refuses_a_bad_flag_in_one_line(path) -> None:
    runner = CliRunner()
    assert runner.invoke(main, [*path, "-h"]).exit_code == 0
    assert _one_line_usage_error(runner.invoke(main, [*path, "--no-such-flag"]))
    # the group's options after the subcommand too
    res = runner.invoke(main, [*path, "--log-level", "LOUD"])
    assert _one_line_usage_error(res) and "--log-level" in res.output


@pytest.mark.parametrize("argv", [["run", "/nope.toml"], ["plan", "/nope.toml"],
                                  ["preview", "/nope.toml"], ["up", "/nope.toml", "--sim"],
                                  ["export", "--config", "/nope.toml", "--dest", "/tmp/x"],
                                  ["audit", "/nope.jsonl"], ["plan", "x.toml", "--tok-s", "x"],
                                  ["up", "x.toml", "--workers", "many"],
                                  ["export", "--out", "o", "--dest", "d", "--format", "csv"]])
def test_a_missing_file_or_a_bad_value_is_exit_2_in_one_line(argv) -> None:
    assert _one_line_usage_error(CliRunner().invoke(main, argv))


def test_up_takes_the_connection_flags_and_the_prefixed_variables() -> None:
    out = CliRunner().invoke(main, ["up", "-h"]).output
    assert "--redis-url" in out and "--sglang-url" in out
    assert "TOKENCAP_WORKERS" in out and "TOKENCAP_BUDGET_PORT" in out


def _folder_is_a_file(tmp_path, field: str) -> list[str]:
    """A config whose `field` (output_dir, or [hidden_states] output_dir) names a file."""
    (tmp_path / "taken").write_text("a file, not a folder\n")
    (tmp_path / "ids.jsonl").write_text('{"input_ids": [1, 2]}\n')
    (tmp_path / "model.json").write_text('{"num_hidden_layers": 8, "hidden_size": 64}')
    out = "taken" if field == "output_dir" else "out"
    hs = "taken" if field != "output_dir" else "hs"
    (tmp_path / "run.toml").write_text(
        f'run = "r"\noutput_dir = "{out}"\nsampling_defaults = "engine"\n'
        f'[hidden_states]\nmodel_config = "model.json"\noutput_dir = "{hs}"\n'
        '[[category]]\nname = "a"\nsource = "ids.jsonl"\nformat = "input_ids"\n'
        "sampling = { max_new_tokens = 8 }\n")
    return [str(tmp_path / "run.toml")]


@pytest.mark.parametrize(("argv", "field"), [
    (["run"], "output_dir"), (["plan"], "output_dir"),
    (["hidden-states", "--plan"], "hidden_states.output_dir")])
def test_an_output_folder_that_is_a_file_is_exit_2_naming_the_file_and_field(
        tmp_path, argv, field) -> None:
    res = CliRunner().invoke(main, [*argv, *_folder_is_a_file(tmp_path, field)])
    assert _one_line_usage_error(res), res.output
    assert f"$.{field}" in res.output and str(tmp_path / "taken") in res.output


def test_init_on_a_file_that_is_not_utf8_is_exit_2_naming_the_file_and_line(tmp_path) -> None:
    from tests.conftest import QWEN

    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(b'{"prompt": "caf\xe9"}\n')
    res = CliRunner().invoke(main, ["init", str(bad), "--tokenizer", str(QWEN),
                                    "--out", str(tmp_path / "run.toml")])
    assert _one_line_usage_error(res), res.output
    assert f"{bad}:1: invalid_utf8" in res.output
