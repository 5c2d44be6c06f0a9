"""The repository's shape holds where a newcomer looks first: no class grows past what one
reader holds (250 lines in the stages and the ledger, 300 in the roof), the roof stays a few
rooms (at most 8 directly under `tokencap/`, a subpackage counting as one), and every module
over 40 lines has its tests at its mirror path, or tests/README.md says where they are.

Each limit was met once and then lost without a word (`Producer` and `CategorySource` grew
from 237 and 220 lines to 270 each in two feature merges): a failing test says so the day
it happens."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests import mirror
from tests.conftest import ROOT

CLASS_LINES = {"foundation": 250, "budget_service": 250, "producer": 250, "consumers": 250,
               "writer": 250, "tokencap": 300}
ROOF_ROOMS = 8


def classes(path: Path) -> list[tuple[str, int]]:
    """(name, lines from `class` to its last line) of every class in `path`, nested ones too."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [(node.name, (node.end_lineno or node.lineno) - node.lineno + 1)
            for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]


@pytest.mark.parametrize("package", sorted(CLASS_LINES))
def test_no_class_is_longer_than_its_layer_allows(package: str) -> None:
    limit = CLASS_LINES[package]
    over = [f"{path.relative_to(ROOT)}:{name} ({n} lines)"
            for path in sorted((ROOT / package).rglob("*.py"))
            for name, n in classes(path) if n > limit]
    assert not over, f"classes over {limit} lines in {package}/: split by owner: {over}"


def test_classes_are_counted_from_their_class_line_to_their_last(tmp_path: Path) -> None:
    path = tmp_path / "m.py"
    path.write_text("class A:\n    x = 1\n\n    def f(self):\n        return 2\n\n\n"
                    "class B:\n    class C:\n        pass\n")
    assert classes(path) == [("A", 5), ("B", 3), ("C", 2)]


def roof_rooms() -> list[str]:
    """What stands directly under `tokencap/`: its modules and its subpackages."""
    return sorted(p.name for p in (ROOT / "tokencap").iterdir()
                  if (p.suffix == ".py" and p.name != "__init__.py")
                  or (p.is_dir() and (p / "__init__.py").exists()))


def test_the_roof_is_a_few_rooms() -> None:
    rooms = roof_rooms()
    assert 0 < len(rooms) <= ROOF_ROOMS, rooms


def test_every_module_has_its_mirror_or_the_tests_readme_says_where_its_tests_are() -> None:
    readme = (ROOT / "tests" / "README.md").read_text()
    unsaid = [str(m.relative_to(ROOT)) for m in mirror.modules()
              if not mirror.mirror_of(m) and str(m.relative_to(ROOT)) not in readme]
    assert not unsaid, (f"no tests/unit/... mirror and not named in tests/README.md: {unsaid} "
                        "(`python -m tests.mirror`)")
