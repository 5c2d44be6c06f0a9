"""The front door stays short and its doors open: README under 12 KB, every docs page
linked from it, every relative link of README, CONTRIBUTING and docs/ resolving, and the
test commands as the README says them (CI calls them)."""

from __future__ import annotations

import re

from tests.conftest import ROOT

README = ROOT / "README.md"
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_the_readme_is_short() -> None:
    assert README.stat().st_size < 12 * 1024


def test_every_docs_page_is_linked_from_the_readme() -> None:
    linked = set(LINK.findall(README.read_text()))
    pages = {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")}
    assert pages - linked == set()


def test_every_relative_link_resolves() -> None:
    bad = []
    for page in [README, ROOT / "CONTRIBUTING.md", *(ROOT / "docs").glob("*.md")]:
        for link in LINK.findall(page.read_text()):
            if not link.startswith(("http://", "https://")) and \
                    not (page.parent / link).exists():
                bad.append(f"{page.relative_to(ROOT)}: {link}")
    assert bad == []


def test_the_test_commands_are_the_ones_ci_runs() -> None:
    text = README.read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    for command in ("make test", "make test-engine"):
        assert command in text and command in ci
