"""Left here for `tests/unit/foundation/test_errors.py` (made beside this change): the table of
exit codes is `foundation/errors.py`'s. The commands' tests are `tests/unit/tokencap/cli/`."""

from __future__ import annotations


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
