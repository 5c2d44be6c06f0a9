"""`foundation/errors.py`: every error tokencap raises on purpose is a `TokencapError` with an
exit code, the codes are one table (the module's docstring, the CLI's help, the README), and
the errors carry what they say."""

from __future__ import annotations

import inspect

import pytest
from click.testing import CliRunner

from foundation import errors
from foundation.errors import (
    SIGNALLED,
    ConfigError,
    EngineNotReady,
    EngineUnusable,
    TokencapError,
    UnknownCategory,
    exit_codes,
    exit_codes_text,
)
from tests.conftest import ROOT
from tokencap.cli.main import main


def test_every_error_has_an_exit_code_and_the_codes_are_documented() -> None:
    classes = [c for _, c in inspect.getmembers(errors, inspect.isclass)
               if c.__module__ == errors.__name__]
    assert all(issubclass(c, errors.TokencapError) for c in classes)
    doc = errors.__doc__ or ""
    for c in classes:
        assert isinstance(c.exit_code, int) and 1 <= c.exit_code < 128, c
        assert f"| {c.exit_code} |" in doc, f"exit code of {c.__name__} not in the table"


def test_the_exit_codes_are_one_table_shown_in_help_and_the_readme() -> None:
    codes = exit_codes()
    assert codes[0] == "done" and codes[2] == "bad config or source" and 130 in codes
    assert len(codes) == len(set(codes.values())), "two codes with one meaning"
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"Exit codes of every command: {exit_codes_text()} (" in readme
    shown = CliRunner().invoke(main, ["--help"])
    assert shown.exit_code == 0
    assert exit_codes_text() in " ".join(shown.output.split())


def test_the_table_says_each_code_once_in_order_from_done_to_signalled() -> None:
    codes = exit_codes()
    assert list(codes) == sorted(codes) and list(codes)[-1] == SIGNALLED == 130
    assert codes[EngineNotReady.exit_code] == EngineUnusable.meaning  # the first class's word
    assert exit_codes_text().startswith("0 done, 1 error, 2 bad config or source, ")
    assert exit_codes_text().endswith(f", {SIGNALLED} stopped by a signal")


def test_the_signals_the_pipeline_raises_and_catches_are_tokencap_errors() -> None:
    from foundation.engine.api import EngineError
    from foundation.sources import SourceMissing
    from producer.formats.records import Rejected
    from producer.parsers.base import Unparsed
    from producer.parsers.registry import Ambiguous
    from writer.files import WriterDiskError

    for cls in (EngineError, SourceMissing, Rejected, Unparsed, Ambiguous, WriterDiskError):
        assert issubclass(cls, TokencapError), cls


def test_the_errors_carry_what_they_name() -> None:
    bad = ConfigError("$.category[0].source", "no such file")
    assert (str(bad), bad.path, bad.message, bad.exit_code) == (
        "$.category[0].source: no such file", "$.category[0].source", "no such file", 2)
    unknown = UnknownCategory("r", "maths")
    assert (str(unknown), unknown.run, unknown.category, unknown.exit_code) == (
        "no category 'maths' in run 'r'", "r", "maths", 1)
    starting = EngineNotReady("engine http://e: answers HTTP 503", "HTTP 503")
    assert isinstance(starting, EngineUnusable) and starting.exit_code == 9
    assert starting.reason == "HTTP 503"
    with pytest.raises(TokencapError):
        raise starting
