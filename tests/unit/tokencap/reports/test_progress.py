"""`up`'s progress lines: no repeats, and what holds the end back once every category is
done (the writer)."""

from __future__ import annotations

import io

from budget_service.telemetry import EngineTrouble, RunStatus, WriterState
from tests.helpers import category_state, run_status
from tokencap.reports.progress import ProgressPrinter


def status(state: str, used: int, unwritten: int, holder: str | None = "h:1:x",
           error: str | None = None) -> RunStatus:
    return run_status({"a": category_state(used=used, cap=100, state=state)},
                      writer=WriterState(holder, error, unwritten))


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


def flight(used: int, trouble: dict[str, EngineTrouble] | None = None) -> RunStatus:
    return run_status({"a": category_state(used=used, cap=1000, in_flight=4)},
                      writer=WriterState("h", None, 0), trouble=trouble or {})


def test_an_engine_away_is_said_in_every_line_with_since_when_until_it_answers() -> None:
    clock = {"ms": 1_700_000_000_000}
    since = clock["ms"] - 3_000
    away = {"http://gpu:30000": EngineTrouble("connection refused", since)}
    out = io.StringIO()
    p = ProgressPrinter(out, clock_ms=lambda: clock["ms"])
    p(flight(100))
    p(flight(100, away))
    clock["ms"] += 5_000
    p(flight(100, away))
    clock["ms"] += 5_000
    p(flight(140))
    lines = out.getvalue().splitlines()
    assert "engine" not in lines[0]
    assert "engine http://gpu:30000: connection refused, for 3 s (since " in lines[1]
    assert "engine http://gpu:30000: connection refused, for 8 s (since " in lines[2]
    assert lines[3] == "[progress] engine http://gpu:30000 answers again, after 13 s"
    assert "engine" not in lines[4]


def test_the_summary_breaks_the_rejected_and_failed_down_by_reason() -> None:
    from tokencap.reports.progress import summary_table

    st = run_status({
        "agent": category_state(rejected=240, failed=3, reasons={
            "tool_divergence": 89, "duplicate_prompt": 151, "server_error": 3}),
        "clean": category_state()})
    lines = summary_table(st).splitlines()
    assert ("agent: rejected 240, failed 3: duplicate_prompt 151, tool_divergence 89, "
            "server_error 3") in lines
    assert not any(line.startswith("clean:") for line in lines)  # nothing to break down


def test_a_stage_paused_on_a_full_states_folder_is_said_in_every_line_until_it_is_over() -> None:
    out = io.StringIO()
    p = ProgressPrinter(out, clock_ms=lambda: 65_000)
    paused = EngineTrouble("/hs/a/states has 0.00 GB free, a row of 0.003 GB needs more", 5_000)
    p(run_status({"a": category_state()}, disk_trouble={"/hs/a/states": paused}))
    p(run_status({"a": category_state(used=10)}))
    first, second = out.getvalue().splitlines()
    assert "states paused, /hs/a/states has 0.00 GB free" in first and "for 60 s" in first
    assert "states paused" not in second


def test_the_summary_says_each_mode_against_its_weight(redis) -> None:
    from tests.helpers import modes_budget
    from tokencap.reports.progress import mode_lines, summary_table

    snap = modes_budget(redis, "p").telemetry.snapshot()
    assert mode_lines(snap) == [
        "conv by mode: think 2 rows (66.7%), 60 tokens (60.0%), weight 75.0%; "
        "fast 1 rows (33.3%), 40 tokens (40.0%), weight 25.0%",
        "tok by mode: think 1 rows (50.0%), 60 tokens (75.0%), weight 75.0%; "
        "fast 1 rows (50.0%), 20 tokens (25.0%), weight 25.0%"]
    assert mode_lines(snap)[0] in summary_table(snap)
