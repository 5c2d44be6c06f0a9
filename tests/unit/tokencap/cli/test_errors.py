"""The one error map (`tokencap/cli/errors.py`): an expected error that reaches a command is
one line and its exit code (`foundation/errors.py` lists the codes), through the group or a
command invoked alone; anything else is a bug, and its traceback shows."""

from __future__ import annotations

import errno

import pytest
from click.testing import CliRunner

from foundation.errors import ConfigError, DiskFull, RunNotFound, TokencapError
from tests.helpers import one_line_error
from tokencap.cli.errors import exit_for, fail
from tokencap.cli.main import main


def test_an_expected_error_is_its_message_and_its_exit_code() -> None:
    assert exit_for(RunNotFound("run 'x' not found")) == ("run 'x' not found", 7)
    assert exit_for(ConfigError("run.toml", "$.run: missing")) == (
        "run.toml: $.run: missing", 2)
    assert exit_for(TokencapError("no engine")) == ("no engine", 1)
    # a file or folder that cannot be read or made: a bad path, naming it
    missing = FileNotFoundError(errno.ENOENT, "No such file or directory", "/data/x.jsonl")
    assert exit_for(missing) == ("/data/x.jsonl: No such file or directory", 2)
    # no room on the disk: DiskFull's code, whatever call ran out of it
    for code in (errno.ENOSPC, errno.EDQUOT):
        full = OSError(code, "No space left on device", "/out/a/part-00001.jsonl")
        assert exit_for(full) == ("/out/a/part-00001.jsonl: No space left on device",
                                  DiskFull.exit_code)
    # an OSError that names no file: an error, not a bad path
    assert exit_for(ConnectionResetError(errno.ECONNRESET, "Connection reset")) == (
        "Connection reset", 1)
    assert exit_for(ValueError("a bug")) is None


def test_fail_prints_one_line_and_exits_with_the_code_and_re_raises_a_bug(capsys) -> None:
    with pytest.raises(SystemExit) as done:
        fail(RunNotFound("run 'x' not found in Redis"))
    assert done.value.code == 7
    assert capsys.readouterr().err == "tokencap: error: run 'x' not found in Redis\n"
    bug = KeyError("a bug")
    with pytest.raises(KeyError) as raised:
        fail(bug)
    assert raised.value is bug  # its traceback shows: never turned into a line


def test_a_command_invoked_alone_ends_a_bad_config_in_one_line(tmp_path) -> None:
    """`tokencap.cli.errors.Command`: the config argument is loaded while the command's
    arguments are read, before the command runs: its mistake is the one line too, also
    without the group around it."""
    from tokencap.cli.stages import run

    bad = tmp_path / "run.toml"
    bad.write_text('run = "r"\noutput_dir = "out"\nno_such_field = 1\n')
    res = CliRunner().invoke(run, [str(bad), "--dry-run"])
    assert one_line_error(res), res.output
    assert "no_such_field" in res.output and str(bad) in res.output


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


@pytest.mark.parametrize("argv", [["run", "/nope.toml"], ["plan", "/nope.toml"],
                                  ["preview", "/nope.toml"], ["up", "/nope.toml", "--sim"],
                                  ["export", "--config", "/nope.toml", "--dest", "/tmp/x"],
                                  ["audit", "/nope.jsonl"], ["plan", "x.toml", "--tok-s", "x"],
                                  ["verify", "/nope-states"],
                                  ["up", "x.toml", "--workers", "many"],
                                  ["export", "--out", "o", "--dest", "d", "--format", "csv"]])
def test_a_missing_file_or_a_bad_value_is_exit_2_in_one_line(argv) -> None:
    assert one_line_error(CliRunner().invoke(main, argv))


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
    assert one_line_error(res), res.output
    assert f"$.{field}" in res.output and str(tmp_path / "taken") in res.output


@pytest.mark.parametrize(("argv", "code", "words"), [
    (["cap", "set", "code", "10Q"], 2, "write 10000000, 10_000_000, 10M"),
    (["init", "x.jsonl", "--tokenizer", "t", "--cap", "ten"], 2, "is not a count"),
    (["rq-info", "--state-dir", "{tmp}"], 1, "no run file"),
    (["down", "--state-dir", "{tmp}"], 7, "no pid file of a stack in"),
])
def test_the_newcomer_s_errors_say_where_they_looked_in_one_line(tmp_path, argv, code,
                                                                 words) -> None:
    """The errors a newcomer meets first: a cap as people write it gone wrong, and the stack
    commands run where no stack is (the folder they looked in, named; `down` non-zero)."""
    res = CliRunner().invoke(main, [a.format(tmp=tmp_path) for a in argv])
    assert one_line_error(res, code), res.output
    assert words in res.output
    if "{tmp}" in argv:
        assert str(tmp_path) in res.output
