"""docs/LAYOUT.md stays true: it names every module of the wheel, and every path it names
exists (a module moved or added is moved or added on the page with it)."""

from __future__ import annotations

import re

from tests.conftest import ROOT

DOC = ROOT / "docs" / "LAYOUT.md"
WHEEL = ("foundation", "budget_service", "producer", "consumers", "writer", "tokencap")
PATH = re.compile(r"`([a-z_]+/[A-Za-z0-9_./-]*)`")


def test_every_module_of_the_wheel_is_named() -> None:
    text = DOC.read_text()
    modules = sorted(p.relative_to(ROOT).as_posix() for pkg in WHEEL
                     for p in (ROOT / pkg).rglob("*.py") if p.name != "__init__.py")
    missing = [m for m in modules if f"`{m}`" not in text]
    assert not missing, f"modules docs/LAYOUT.md does not name: {missing}"


def test_every_path_named_exists() -> None:
    named = set(PATH.findall(DOC.read_text()))
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, f"docs/LAYOUT.md names paths that do not exist: {missing}"
