"""docs/ARCHITECTURE.md stays true: every repository path it names exists, and every Lua
script of the ledger is named in it."""

from __future__ import annotations

import re

from tests.conftest import ROOT

DOC = ROOT / "docs" / "ARCHITECTURE.md"
# a backquoted path with a folder (`producer/feeder.py`, `budget_service/lua/`)
PATH = re.compile(r"`([a-z_]+/[A-Za-z0-9_./-]*)`")


def test_every_path_the_architecture_names_exists() -> None:
    named = {m for m in PATH.findall(DOC.read_text()) if not m.startswith("<")}
    assert len(named) >= 20, named
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, f"docs/ARCHITECTURE.md names paths that do not exist: {missing}"


def test_every_ledger_script_of_a_sample_is_in_the_flow() -> None:
    text = DOC.read_text()
    telemetry = {"series", "engine_counts", "engine_info", "engine_trouble", "lease", "retry",
                 "_lib"}
    scripts = {p.stem for p in (ROOT / "budget_service" / "lua").glob("*.lua")} - telemetry
    missing = sorted(s for s in scripts if f"budget_service/lua/{s}.lua" not in text)
    assert not missing, f"scripts of a sample's path not in docs/ARCHITECTURE.md: {missing}"
