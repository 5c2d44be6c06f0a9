"""The layers hold: every import of a project package, at module level or inside a function,
points down (foundation <- ledger <- stages <- roof <- the test harness <- bench, gpu_check),
two packages of one layer never import each other, nothing of the wheel imports the harness,
and sglang_sim stands apart. Within a layer, no module imports one that imports it back,
however far round (a type-only import counts: it is the same knot)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import ROOT

# package -> its layer (higher imports lower)
LAYER = {
    "foundation": 0,
    "budget_service": 1,
    "producer": 2,
    "consumers": 2,
    "writer": 2,
    "tokencap": 3,
    # outside the wheel: the harness (tests use it too), and what runs on it
    "testing": 4,
    "bench": 5,
    "gpu_check": 5,
}
APART = "sglang_sim"  # imports none of the layers; only the roof imports it


def project_imports(path: Path) -> list[tuple[int, str]]:
    """(line, top-level package) of every import of a project package in `path`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            if top in LAYER or top == APART:
                found.append((node.lineno, top))
    return found


def violations(root: Path) -> list[str]:
    """Every import that runs up a layer, across a stage, or into sglang_sim from a layer."""
    bad = []
    for package in [*LAYER, APART]:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            for line, target in project_imports(path):
                if target == package:
                    continue
                where = f"{rel}:{line} imports {target}"
                if package == APART:
                    bad.append(f"{where}: sglang_sim stands apart")
                elif target == APART:
                    if LAYER[package] < LAYER["tokencap"]:
                        bad.append(f"{where}: only the roof may use the simulator")
                elif LAYER[target] > LAYER[package]:
                    bad.append(f"{where}: an import up a layer")
                elif LAYER[target] == LAYER[package]:
                    bad.append(f"{where}: one stage imports another")
    return bad


def test_no_import_runs_up_a_layer_or_across_the_stages() -> None:
    assert violations(ROOT) == []


def module_graph(root: Path) -> dict[str, set[str]]:
    """Each project module (dotted name) -> the project modules it imports."""
    mods: dict[str, Path] = {}
    for package in [*LAYER, APART]:
        for path in sorted((root / package).rglob("*.py")):
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = path

    def resolve(name: str) -> str | None:  # the module a dotted name lives in
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for module, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            else:
                continue
            for name in names:
                target = resolve(name)
                if target is not None and target != module:
                    graph[module].add(target)
    return graph


def cycles(root: Path) -> list[list[str]]:
    """The import cycles between modules: each set of modules that reach one another, sorted
    (Tarjan's strongly connected components, iteratively)."""
    graph = module_graph(root)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def test_no_module_imports_one_that_imports_it_back() -> None:
    assert cycles(ROOT) == []


def test_the_check_finds_a_cycle_through_a_type_only_import(tmp_path: Path) -> None:
    for name in [*LAYER, APART]:
        (tmp_path / name).mkdir()
    (tmp_path / "producer" / "a.py").write_text("from producer.b import B\n")
    (tmp_path / "producer" / "b.py").write_text("from producer import c\n")
    (tmp_path / "producer" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from producer.a import A\n")
    (tmp_path / "producer" / "d.py").write_text("import producer.a\n")
    assert cycles(tmp_path) == [["producer.a", "producer.b", "producer.c"]]


@pytest.mark.parametrize(
    ("package", "source", "rule"),
    [
        ("foundation", "from budget_service.keys import Keys\n", "up a layer"),
        ("budget_service", "def f():\n    from consumers.stats import x\n", "up a layer"),
        ("producer", "import consumers.job\n", "one stage imports another"),
        ("consumers", "from tokencap.cli.main import main\n", "up a layer"),
        ("sglang_sim", "from foundation.wire import encode\n", "stands apart"),
        ("producer", "from sglang_sim.testing import SimServer\n", "only the roof"),
        ("tokencap", "from testing.harness import Pipeline\n", "up a layer"),
        ("bench", "from gpu_check.run_check import main\n", "one stage imports another"),
    ],
)
def test_the_check_catches_each_kind_of_wrong_import(tmp_path: Path, package: str, source: str,
                                                     rule: str) -> None:
    for name in [*LAYER, APART]:
        (tmp_path / name).mkdir()
    (tmp_path / package / "bad.py").write_text(source)
    [problem] = violations(tmp_path)
    assert problem.startswith(f"{package}/bad.py:") and rule in problem
