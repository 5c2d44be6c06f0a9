"""`budget_service/scripts.py` and the Lua scripts of `budget_service/lua/` as files: each
file registered once under its name (a category's with the library before it), the library
naming the keys in `CategoryKeys` order, no script building a key name.

Every script has a direct test named `test_<script>_...`, through the method of the role
that calls it, against a real Redis, in this folder: `test_feeding.py` (the producer's
scripts), `test_samples.py` (the workers'), `test_writing.py` (the writer's),
`test_operating.py` (caps, retry), `test_telemetry.py` (engine info and trouble, the time
series). `test_every_script_has_a_direct_test` holds that.
"""

from __future__ import annotations

import ast
import hashlib
import re
from pathlib import Path

from redis.commands.core import Script

from budget_service.budget import Budget
from budget_service.keys import CategoryKeys
from budget_service.scripts import (
    CATEGORY_SCRIPTS,
    LUA_DIR,
    OTHER_SCRIPTS,
    PRELUDE,
    Scripts,
    script_text,
)
from tests.helpers import feed

HERE = Path(__file__).parent


def test_lib_names_the_keys_in_category_keys_order() -> None:
    table = (LUA_DIR / "_lib.lua").read_text().split("local K = {", 1)[1].split("}", 1)[0]
    names = re.findall(r"(\w+) = KEYS\[(\d+)\]", table)
    assert [(n, int(i)) for n, i in names] == [
        (f, i) for i, f in enumerate(CategoryKeys._fields, 1)]


def _test_names() -> list[str]:
    """The test functions of this folder's test files."""
    return [node.name for path in sorted(HERE.glob("test_*.py"))
            for node in ast.parse(path.read_text()).body
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")]


def test_every_script_has_a_direct_test() -> None:
    on_disk = {p.stem for p in LUA_DIR.glob("*.lua") if not p.stem.startswith("_")}
    assert on_disk == set(CATEGORY_SCRIPTS) | set(OTHER_SCRIPTS)
    tests = _test_names()
    assert "test_every_script_has_a_direct_test" in tests  # this file is read too
    untested = [s for s in sorted(on_disk) if not any(t.startswith(f"test_{s}_") for t in tests)]
    assert untested == []


def test_no_script_builds_a_key_name() -> None:
    for path in Path(LUA_DIR).glob("*.lua"):
        code = "\n".join(line.split("--", 1)[0] for line in path.read_text().splitlines())
        assert "..':'" not in code.replace(" ", "") and "':'.." not in code.replace(" ", ""), \
            path.name


def test_a_category_script_runs_after_the_library_and_a_run_wide_one_alone() -> None:
    lib = (LUA_DIR / PRELUDE).read_text()
    for name in CATEGORY_SCRIPTS:
        assert script_text(name) == lib + (LUA_DIR / f"{name}.lua").read_text(), name
    for name in OTHER_SCRIPTS:
        assert script_text(name) == (LUA_DIR / f"{name}.lua").read_text(), name
    assert not set(CATEGORY_SCRIPTS) & set(OTHER_SCRIPTS)


def test_each_file_is_registered_once_under_its_name(redis) -> None:
    scripts = Scripts(redis)
    for name in CATEGORY_SCRIPTS + OTHER_SCRIPTS:
        script = getattr(scripts, name)
        assert isinstance(script, Script), name
        assert script.sha == hashlib.sha1(script_text(name).encode()).hexdigest(), name
        assert name in Scripts.__annotations__, name


def test_a_redis_that_lost_its_scripts_is_given_them_again(budget: Budget) -> None:
    assert feed(budget, "a") == 1
    # Given a Redis whose script cache was emptied (a restart, SCRIPT FLUSH)
    budget.redis.script_flush()
    assert budget.redis.script_exists(budget.scripts.feed.sha) == [False]
    # When a role calls one, Then it runs (EVALSHA answered NOSCRIPT: loaded again)
    assert feed(budget, "b") == 1
    assert budget.feeding.cursor("code") == 2
    assert budget.redis.script_exists(budget.scripts.feed.sha) == [True]
