"""`up`'s progress lines: no repeats, and what holds the end back once every category is
done (the writer)."""

from __future__ import annotations

import io

from tokencap.progress import ProgressPrinter


def status(state: str, used: int, unwritten: int, holder: str | None = "h:1:x",
           error: str | None = None) -> dict:
    return {"run": "r",
            "categories": {"a": {"used": used, "cap": 100, "state": state}},
            "writer": {"holder": holder, "error": error, "unwritten": unwritten}}


def test_progress_says_it_waits_for_the_writer_and_never_repeats_a_line() -> None:
    out = io.StringIO()
    p = ProgressPrinter(out)
    p(status("open", 50, 0))
    p(status("closed", 120, 7))
    p(status("closed", 120, 7))  # nothing changed: no line
    p(status("closed", 120, 3, holder=None))
    p(status("closed", 120, 2, error="cannot write /out/a/part-00001.jsonl: No space left"))
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("[progress] a 50/100 (50%)")
    assert lines[1:] == [
        "[progress] waiting for the writer (7 results unwritten)",
        "[progress] waiting for the writer (3 results unwritten); writer: no writer runs",
        "[progress] waiting for the writer (2 results unwritten); writer: cannot write "
        "/out/a/part-00001.jsonl: No space left",
    ]
