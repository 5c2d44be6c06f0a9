"""How far the tests mirror the code: `python -m tests.mirror` prints, for the wheel's
packages, how many modules over 40 lines have a test file at
`tests/unit/<package>/[<subpackage>/]test_<module>*.py`, and names those that have none
(tests/README.md says where those are tested instead)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WHEEL = ("foundation", "budget_service", "producer", "consumers", "writer", "tokencap")
MIN_LINES = 40  # a shorter module is a table or a face: no file of its own asked for


def modules() -> list[Path]:
    """The wheel's modules over MIN_LINES lines (package faces and `__main__` aside)."""
    return [p for pkg in WHEEL for p in sorted((ROOT / pkg).rglob("*.py"))
            if p.name not in ("__init__.py", "__main__.py")
            and len(p.read_text().splitlines()) > MIN_LINES]


def mirror_of(module: Path) -> list[Path]:
    """The test files of `module` (`foundation/engine/api.py`:
    `tests/unit/foundation/engine/test_api*.py`)."""
    rel = module.relative_to(ROOT).with_suffix("")
    folder = ROOT / "tests" / "unit" / rel.parent
    return sorted(folder.glob(f"test_{rel.name}*.py")) if folder.is_dir() else []


def main() -> int:
    found = modules()
    missing = [m for m in found if not mirror_of(m)]
    have = len(found) - len(missing)
    print(f"{have} of {len(found)} modules over {MIN_LINES} lines have their tests at "
          f"tests/unit/<package>/[<subpackage>/]test_<module>*.py ({have / len(found):.0%})")
    for m in missing:
        print(f"  no mirror: {m.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
