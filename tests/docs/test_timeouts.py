"""A test's own limits sit inside pytest's: no subprocess, request or wait in a test module
is allowed longer than the test itself may run (its `timeout` mark, else pytest's 300 s from
pyproject.toml), so a slow machine gives a slow pass, not a timeout of pytest's that cuts a
test its own limits would have let finish."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

from tests.conftest import ROOT

DEFAULT_S = float(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"][
    "ini_options"]["timeout"])
WAIT_KEYWORDS = ("timeout", "timeout_s")


def _mark_timeout(decorators: list[ast.expr]) -> float | None:
    """The `pytest.mark.timeout(N)` among `decorators` (or a pytestmark list), N or None."""
    for d in decorators:
        if isinstance(d, ast.Call) and ast.unparse(d.func) == "pytest.mark.timeout" \
                and d.args and isinstance(d.args[0], ast.Constant):
            return float(d.args[0].value)
    return None


def _literal_waits(node: ast.AST) -> list[tuple[int, float]]:
    """(line, seconds) of every call with a literal `timeout=` / `timeout_s=` inside `node`."""
    found = []
    for call in ast.walk(node):
        if isinstance(call, ast.Call):
            for kw in call.keywords:
                if kw.arg in WAIT_KEYWORDS and isinstance(kw.value, ast.Constant) \
                        and isinstance(kw.value.value, int | float):
                    found.append((call.lineno, float(kw.value.value)))
    return found


def limits_past_the_test(path: Path) -> list[str]:
    """Every literal wait in a test module at or past what its test may run."""
    tree = ast.parse(path.read_text())
    module = DEFAULT_S
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "pytestmark" for t in stmt.targets):
            marks = stmt.value.elts if isinstance(stmt.value, ast.List) else [stmt.value]
            module = _mark_timeout(marks) or module
    funcs = [s for s in tree.body if isinstance(s, ast.FunctionDef | ast.AsyncFunctionDef)]
    tests = {f.name: _mark_timeout(f.decorator_list) or module for f in funcs
             if f.name.startswith("test_")}
    longest = max(tests.values(), default=module)  # what a helper's caller may run at most
    bad = []
    for func in funcs:
        limit = tests.get(func.name, longest)
        for line, seconds in _literal_waits(func):
            if seconds >= limit:
                bad.append(f"{path.relative_to(ROOT)}:{line}: waits {seconds:g} s, its test "
                           f"may run {limit:g} s")
    return bad


def test_no_test_waits_longer_than_it_may_run() -> None:
    bad = [b for p in sorted((ROOT / "tests").rglob("test_*.py")) for b in limits_past_the_test(p)]
    assert not bad, bad


def test_the_check_finds_a_wait_past_the_limit(tmp_path) -> None:
    path = ROOT / "tests" / "docs" / "_timeouts_probe_test.py"
    try:
        path.write_text("import subprocess\n\ndef test_x():\n"
                        "    subprocess.run(['true'], timeout=900)\n")
        [problem] = limits_past_the_test(path)
        assert "waits 900 s, its test may run 300 s" in problem
    finally:
        path.unlink()
