"""docs/RELIABILITY.md names only tests that exist, and lists every fault test."""

from __future__ import annotations

import ast
import re

from tests.conftest import ROOT

DOC = ROOT / "docs" / "RELIABILITY.md"


def test_every_row_names_an_existing_test_and_every_fault_test_is_listed() -> None:
    named = set(re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", DOC.read_text()))
    assert named, "no tests named in the table"
    for path, func in named:
        tree = ast.parse((ROOT / path).read_text())
        funcs = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert func in funcs, f"{path}::{func} is named in RELIABILITY.md but does not exist"
    for path in sorted((ROOT / "tests" / "faults").glob("test_*.py")):
        rel = path.relative_to(ROOT).as_posix()
        tree = ast.parse(path.read_text())
        for n in tree.body:
            if isinstance(n, ast.FunctionDef) and n.name.startswith("test_"):
                assert (rel, n.name) in named, f"{rel}::{n.name} is missing from RELIABILITY.md"


def test_every_test_file_named_exists() -> None:
    """A file named alone (`tests/unit/producer/test_preflight.py`) exists too: a test moved
    to another folder is renamed here with it."""
    named = set(re.findall(r"`(tests/[\w/]+\.py)(?:::\w+)?`", DOC.read_text()))
    assert named, "no test files named"
    missing = sorted(p for p in named if not (ROOT / p).is_file())
    assert not missing, f"docs/RELIABILITY.md names test files that do not exist: {missing}"
