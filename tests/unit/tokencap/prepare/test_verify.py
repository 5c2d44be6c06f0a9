"""`tokencap verify STATES_DIR`'s body (`tokencap/prepare/verify.py`): each category reread
against its manifest, one line each (clean, or its problems by kind) and one per problem; a
category with states and no manifest named as not ended; a progress line at most every few
seconds on long work; a folder that is no states folder refused naming it."""

from __future__ import annotations

from pathlib import Path

import pytest

from foundation import states_manifest as sm
from foundation.errors import SourceError
from foundation.units import size_text
from tests.helpers import keep_states
from tokencap.prepare.verify import report_lines, verify_states


def two_categories(root: Path) -> dict[str, list[sm.StatesFile]]:
    """"code" (3 rows) and "chat" (2 rows, FP8), their stages ended: manifests written."""
    out = {}
    for cat, n, fp8 in (("code", 3, False), ("chat", 2, True)):
        out[cat] = [keep_states(root, cat, f"{cat}{i}", list(range(i, i + 5)), fp8)
                    for i in range(n)]
        sm.write(root, cat, "run.hs", out[cat])
    return out


def test_clean_categories_say_so_one_line_each(tmp_path) -> None:
    files = two_categories(tmp_path)
    checks = verify_states(tmp_path)
    assert [c.category for c in checks] == ["chat", "code"] and all(c.clean for c in checks)
    size = sum(f.bytes for f in files["code"])
    assert report_lines(checks)[1] == (
        f"code: 3 files, {size_text(size)}, every file as the manifest says")
    assert checks[1].read == size
    # one category asked for
    assert [c.category for c in verify_states(tmp_path, ["code"])] == ["code"]


def test_problems_are_counted_on_the_category_s_line_and_named_one_a_line(tmp_path) -> None:
    files = two_categories(tmp_path)["code"]
    (tmp_path / files[0].file).unlink()
    (tmp_path / files[1].file).write_bytes(b"cut")
    lines = report_lines(verify_states(tmp_path))
    assert lines[0].startswith("chat: 2 files") and lines[0].endswith("as the manifest says")
    assert lines[1].startswith("code: 3 files, ") and lines[1].endswith(
        ": 2 problems (missing 1, torn 1)")
    assert lines[2] == f"missing: {files[0].file}: row code0: no such file"
    assert lines[3].startswith(f"torn: {files[1].file}: row code1: ")


def test_states_without_a_manifest_are_a_stage_not_ended(tmp_path) -> None:
    two_categories(tmp_path)
    keep_states(tmp_path, "math", "m0", [1, 2, 3])  # its stage stopped before its end
    [check] = verify_states(tmp_path, ["math"])
    assert not check.clean and check.line() == (
        "math: 1 states files and no manifest.json: its stage has not ended (or was "
        "stopped), so nothing proves them; run `tokencap hidden-states CONFIG` to its end (it "
        "writes the manifest of each category that ended)")


def test_a_progress_line_at_most_every_few_seconds(tmp_path) -> None:
    two_categories(tmp_path)
    ticks = iter(range(0, 1000, 3))  # each reading of the clock 3 s after the one before
    said: list[str] = []
    verify_states(tmp_path, say=said.append, every_s=5.0, clock=lambda: next(ticks))
    # 5 files, a reading after each: lines at 6 s, 12 s (>= 5 s apart), the last at 15 s
    assert len(said) == 2 and said[0].startswith("verified 2 of 5 files, 0.0 GB read, ")
    assert said[1].startswith("verified 4 of 5 files") and said[1].endswith(" GB/s")


@pytest.mark.parametrize("what", ["missing", "file", "empty", "unknown"])
def test_a_folder_that_holds_no_states_is_refused_naming_it(tmp_path, what) -> None:
    two_categories(tmp_path / "hs")
    (tmp_path / "run.toml").write_text("")
    (tmp_path / "empty").mkdir()
    given, names, words = {
        "missing": (tmp_path / "nope", None, "no such folder"),
        "file": (tmp_path / "run.toml", None, "a file, not a folder"),
        "empty": (tmp_path / "empty", None, "no category folder with a states/ folder"),
        "unknown": (tmp_path / "hs", ["math"], r"no states of category math \(found: chat, code\)"),
    }[what]
    with pytest.raises(SourceError, match=words) as exc:
        verify_states(given, names)
    assert exc.value.exit_code == 2 and str(given) in str(exc.value)
