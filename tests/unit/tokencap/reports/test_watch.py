"""`tokencap status --watch` (`tokencap/reports/watch.py`): the engines' load read from their
/metrics, plain output and in-place redraw, the run's hidden-state stage below the board. Its
rates are `test_rates.py`'s."""

from __future__ import annotations

import io
import os
import pty
import re
import select
import subprocess
import sys
import termios
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from rich.console import Console

from budget_service.budget import Budget
from budget_service.keys import Keys
from budget_service.ledger import CategoryState
from budget_service.telemetry import RunStatus, WriterState
from foundation.engine.load import parse_metrics as parse_sglang_metrics
from sglang_sim.testing import SimServer, free_port
from tests.conftest import ROOT
from tests.helpers import LEASE_MS, category_state, feed, make_cfg, result, run_status
from tokencap.reports.progress import summary_table
from tokencap.reports.rates import CategoryRate, RateTracker
from tokencap.reports.watch import (
    EngineLoad,
    engine_load,
    plain_lines,
    render_board,
    watch,
)

TIMEOUT_S = 30.0
# Environment variables with which rich overrides its own terminal detection.
RICH_TTY_ENV = ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "COLUMNS", "LINES")
ESC = "\x1b"


def refused_url() -> str:
    """A loopback URL nothing listens on (the port was free a moment ago)."""
    return f"http://127.0.0.1:{free_port()}"


def cat(used: int, cap: int | None = 1000, state: str = "open",
        **extra: object) -> CategoryState:
    over = 0 if cap is None else max(0, used - cap)
    return category_state(**{"cap": cap, "used": used, "samples": used // 10,
                             "overshoot": over, "state": state, **extra})


def doc(categories: dict[str, CategoryState], run: str = "t") -> RunStatus:
    return run_status(categories, run)


# --- parsing SGLang's /metrics ------------------------------------------------------------

def test_parse_metrics_of_a_running_simulator() -> None:
    """Two requests on a one-slot engine, frozen: one runs, one waits."""
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 8}}
    with SimServer(time_scale=100, max_running_requests=1) as sim, \
            ThreadPoolExecutor(max_workers=2) as pool:
        sim.pause()
        posts = [pool.submit(requests.post, f"{sim.url}/generate", json=body, timeout=TIMEOUT_S)
                 for _ in range(2)]
        sim.wait_until(lambda s: s["running"] == 1 and s["queued"] == 1)
        busy = parse_sglang_metrics(requests.get(f"{sim.url}/metrics", timeout=TIMEOUT_S).text)
        stats = sim.stats()
        loads = engine_load([sim.url, refused_url()], timeout_s=TIMEOUT_S)
        sim.resume()
        assert all(p.result(TIMEOUT_S).status_code == 200 for p in posts)
        sim.wait_until(lambda s: s["running"] == 0 and s["queued"] == 0)
        idle = parse_sglang_metrics(requests.get(f"{sim.url}/metrics", timeout=TIMEOUT_S).text)

    assert busy["running"] == 1 and busy["queued"] == 1
    assert busy["token_usage"] == pytest.approx(stats["token_usage"]) and busy["token_usage"] > 0
    assert busy["gen_throughput"] == pytest.approx(stats["decode_tok_per_sim_s"] * 100)
    assert busy["gen_throughput"] > 0
    assert (idle["running"], idle["queued"], idle["gen_throughput"]) == (0, 0, 0)
    assert loads[0].up and (loads[0].running, loads[0].queued) == (1, 1)
    assert not loads[1].up and loads[1].running is None






@pytest.mark.parametrize("shape", [{"metrics_dp_ranks": 2, "metrics_tp_ranks": 4,
                                    "metrics_priority": True},
                                   {"metrics_priority": True}, {"metrics_tp_ranks": 2},
                                   {"flavor": "vllm"}])
def test_every_load_reading_of_a_busy_simulator_is_its_true_count(shape: dict) -> None:
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 8}}
    with SimServer(time_scale=100, max_running_requests=3, **shape) as sim, \
            ThreadPoolExecutor(max_workers=5) as pool:
        sim.pause()
        if shape.get("flavor") == "vllm":
            posts = [pool.submit(requests.post, f"{sim.url}/v1/completions",
                                 json={"prompt": [1, 2, 3], "max_tokens": 8},
                                 timeout=TIMEOUT_S) for _ in range(5)]
        else:
            posts = [pool.submit(requests.post, f"{sim.url}/generate", json=body,
                                 timeout=TIMEOUT_S) for _ in range(5)]
        sim.wait_until(lambda s: s["running"] == 3 and s["queued"] == 2)
        page = parse_sglang_metrics(requests.get(f"{sim.url}/metrics", timeout=TIMEOUT_S).text)
        (board,) = engine_load([sim.url], timeout_s=TIMEOUT_S)  # /v1/loads where it exists
        sim.resume()
        assert all(p.result(TIMEOUT_S).status_code == 200 for p in posts)
    assert (page["running"], page["queued"]) == (3, 2)
    assert (board.running, board.queued) == (3, 2)




# --- output -----------------------------------------------------------------------------------

def test_plain_output_without_a_tty(redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real budget: each refresh commits one more sample of 40 tokens to `code`."""
    for name in RICH_TTY_ENV:
        monkeypatch.delenv(name, raising=False)
    budget = Budget(redis, Keys("tokencap", "t"))
    budget.feeding.init_run(make_cfg(cap=1000, cats=("code", "math")))
    committed = []

    def fetch_status() -> RunStatus:
        sid = f"s{len(committed)}"
        feed(budget, sid)
        budget.samples.admit("code", sid, 100, LEASE_MS)
        committed.append(budget.samples.commit(result(sid, 40), 0, 0.0))
        return budget.telemetry.snapshot()

    buf = io.StringIO()
    down = refused_url()
    watch(fetch_status, [down], lambda: 5, interval_s=0.0, console=Console(file=buf),
          iterations=3)

    out = buf.getvalue()
    assert ESC not in out
    lines = out.splitlines()
    # per refresh: one line per category, the engines, the writer
    assert len(lines) == 3 * (2 + 2)
    assert [ln.split()[0] for ln in lines] == ["code", "math", "engines:", "writer:"] * 3
    assert lines[8].startswith("code used=120/1000 (12.0%) samples=3 ")
    assert "state=open" in lines[8] and "overshoot=0" in lines[8]
    assert lines[9].startswith("math used=0/1000 (0.0%) samples=0 ") and "eta=-" in lines[9]
    assert lines[10] == f"engines: {down} down (ConnectionError); workers=5"
    # no writer holds the run and three results wait for one: said in so many words
    assert lines[11] == "writer: NONE (nothing reaches the disk); unwritten=3"


def test_board_shows_every_category_and_a_down_engine() -> None:
    status = doc({"code": cat(4_123_456, cap=10_000_000),
                  "math": cat(1_200, state="closed")}, "demo")
    rates = {"code": CategoryRate(4115.2, 1428.0), "math": CategoryRate(0.0, None)}
    engines = [EngineLoad("http://a:30000", True, 12, 3, 0.45, 1234.0),
               EngineLoad("http://b:30000", False, error="ConnectTimeout")]
    buf = io.StringIO()
    Console(file=buf, width=200).print(render_board(status, rates, engines, 8))
    text = buf.getvalue()
    assert "4.12M / 10M (41%)" in text and "0:23:48" in text and "4,115" in text
    assert "1,200 / 1,000 (120%)" in text and "closed" in text and "200" in text
    assert "http://a:30000 running=12 queued=3 kv=45% gen_tok_s=1234" in text
    assert "http://b:30000 down (ConnectTimeout)" in text and "workers: 8" in text
    assert plain_lines(status, rates, engines, 8)[-2].endswith("; workers=8")


@pytest.mark.parametrize("width", [80, 90, 100, 120, 160])
def test_the_board_fits_the_terminal_dropping_the_least_needed_columns(width: int) -> None:
    status = doc({
        "math_proofs": cat(12_345_678, cap=20_000_000, samples=98_765, skipped=12, failed=3),
        "chat": cat(15_068, cap=15_000, state="closed", overshoot=68),
        "instruct": cat(9_999_999, cap=10_000_000)}, "demo")
    rates = {"math_proofs": CategoryRate(12_345.6, 3_600.0 * 12),
             "chat": CategoryRate(0.0, None), "instruct": CategoryRate(1.0, 1.0)}
    buf = io.StringIO()
    Console(file=buf, width=width).print(render_board(status, rates, [], 8, width=width))
    lines = buf.getvalue().splitlines()
    assert max(len(line) for line in lines) <= width and "…" not in buf.getvalue()
    text = buf.getvalue()
    # what is never dropped: the bar's numbers, tok/s, ETA and state
    assert "12.3M / 20M (62%)" in text and "12,346" in text and "12:00:00" in text
    assert "closed" in text and "open" in text
    # the least needed go first: overshoot, then skipped/failed/rejected, then samples
    shown = [c in text for c in ("samples", "skip/fail/rej", "overshoot")]
    assert shown == sorted(shown, reverse=True)
    if width >= 160:
        assert all(shown)


CHILD = """
import itertools, sys
from tests.helpers import category_state, run_status
from tokencap.reports.watch import watch
calls = itertools.count()

def status():
    n = next(calls)
    cat = lambda used: category_state(cap=1000, used=used, samples=n)
    return run_status({"code": cat(100 * n), "math": cat(7 * n)}, "pty")

watch(status, [sys.argv[1]], lambda: 3, interval_s=0.01, iterations=3)
"""


_CSI_RE = re.compile(r"\x1b\[([0-9;?]*)([A-Za-z])")


def screen_after(out: str) -> list[str]:
    """The lines left on a terminal after `out`: a tiny emulator of what Live emits
    (text, CR, LF, cursor up, erase line; colours and cursor visibility are ignored)."""
    rows, row, col, i = [""], 0, 0, 0
    while i < len(out):
        m = _CSI_RE.match(out, i)
        if m:
            arg, op = m.groups()
            if op == "A":
                row = max(0, row - int(arg or 1))
            elif op == "K" and arg == "2":
                rows[row] = ""
            i = m.end()
            continue
        ch = out[i]
        i += 1
        if ch == "\r":
            col = 0
        elif ch == "\n":
            row += 1
            if row == len(rows):
                rows.append("")
        else:
            line = rows[row].ljust(col)
            rows[row] = line[:col] + ch + line[col + 1:]
            col += 1
    return [r.rstrip() for r in rows]


def _child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in RICH_TTY_ENV}
    env.update(TERM="xterm-256color", PYTHONPATH=str(ROOT))
    return env


def test_watch_redraws_in_place_on_a_terminal() -> None:
    master, slave = pty.openpty()
    termios.tcsetwinsize(slave, (40, 160))
    proc = subprocess.Popen([sys.executable, "-c", CHILD, refused_url()], cwd=ROOT,
                            stdin=slave, stdout=slave, stderr=slave, env=_child_env(),
                            start_new_session=True)
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while True:
            ready, _, _ = select.select([master], [], [], max(0.0, deadline - time.monotonic()))
            assert ready, "the watch did not finish in time"
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every copy of the slave is closed, the child is gone
                break
            if not data:
                break
            chunks.append(data)
        assert proc.wait(TIMEOUT_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)

    out = b"".join(chunks).decode("utf-8", "replace")
    assert "Traceback" not in out
    assert "\x1b[2K" in out  # erase line
    # Each of the two redraws moves up over the whole board (title, borders, 2 rows, footer).
    assert out.count("\x1b[1A") >= 2 * 8, out.count("\x1b[1A")
    assert "200 / 1,000 (20%)" in out and "14 / 1,000 (1%)" in out  # the third status
    assert out.count("workers: 3") >= 3 and "down" in out
    # What stays on screen is one board, the last one: earlier boards were overwritten.
    screen = screen_after(out)
    assert sum("tokencap run pty" in ln for ln in screen) == 1
    assert sum("workers: 3" in ln for ln in screen) == 1
    assert any("200 / 1,000 (20%)" in ln for ln in screen)
    assert not any("100 / 1,000 (10%)" in ln for ln in screen)


def test_watch_prints_plain_lines_to_a_pipe() -> None:
    proc = subprocess.run([sys.executable, "-c", CHILD, refused_url()], cwd=ROOT,
                          env=_child_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr
    assert ESC not in proc.stdout
    lines = proc.stdout.splitlines()
    assert [ln.split()[0] for ln in lines] == ["code", "math", "engines:", "writer:"] * 3
    assert lines[-4].startswith("code used=200/1000 (20.0%) samples=2 ")


def test_ctrl_c_ends_the_watch_cleanly(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in RICH_TTY_ENV:
        monkeypatch.delenv(name, raising=False)
    calls = []

    def fetch_status() -> RunStatus:
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return doc({"code": cat(10)})

    buf = io.StringIO()
    watch(fetch_status, [], lambda: 0, interval_s=0.0, console=Console(file=buf))
    assert len(calls) == 2
    assert buf.getvalue().splitlines() == [
        "code used=10/1000 (1.0%) samples=1 tok_s=0.0 eta=- state=open skipped=0 failed=0 "
        "rejected=0 overshoot=0 kept_tokens=0 kept_out_tokens=0",
        "engines: none; workers=0",
        "writer: NONE (nothing reaches the disk); unwritten=0",
    ]


def test_an_uncapped_category_shows_as_uncapped_not_a_number() -> None:
    status = run_status({"all": cat(123_456, cap=None)}, "r",
                        writer=WriterState("h", None, 0))
    lines = plain_lines(status, {}, [], 1)
    assert lines[0].startswith("all used=123456 (uncapped) ")
    board = Console(width=160, record=True, color_system=None)
    board.print(render_board(status, {}, [], 1))
    text = board.export_text()
    assert "uncapped" in text and "123k" in text
    assert "uncapped" in summary_table(status)
    assert RateTracker().rate("all", None, 10, "open").eta_s is None


def test_the_run_s_hidden_state_stage_shows_below_the_board() -> None:
    status = run_status({"a": cat(500, state="exhausted"), "b": cat(200)}, "r",
                        writer=WriterState("h", None, 0))
    stage = run_status({"a": cat(40, cap=None, state="exhausted", samples=4),
                        "b": cat(0, cap=100, samples=0)}, "r.hs",
                       writer=WriterState("h", None, 0), bytes_per_token=1000)
    rates = {"b": CategoryRate(5.0, 20.0)}
    lines = plain_lines(status, {}, [], 1, stage, rates)
    assert lines[-2:] == [
        "hidden states a rows=4 bytes=40000 tok_s=0.0 eta=- state=exhausted failed=0",
        "hidden states b rows=0 bytes=0/100000 tok_s=5.0 eta=0:00:20 state=open failed=0"]
    assert not any(ln.startswith("hidden states") for ln in plain_lines(status, {}, [], 1))
    board = Console(width=160, record=True, color_system=None)
    board.print(render_board(status, {}, [], 1, stage=stage, stage_rates=rates))
    text = board.export_text()
    assert "tokencap run r" in text and "hidden states: run r.hs" in text
    assert "40.00 KB" in text and "0 B / 100.00 KB" in text
    assert text.index("tokencap run r") < text.index("hidden states: run r.hs")


def test_the_board_says_each_mode_against_its_weight(redis) -> None:
    from tests.helpers import modes_budget

    status = modes_budget(redis, "w").telemetry.snapshot()
    buf = io.StringIO()
    Console(file=buf, width=200).print(render_board(status, {}, [], 1))
    assert ("conv by mode: think 2 rows (66.7%), 60 tokens (60.0%), weight 75.0%; fast 1 rows "
            "(33.3%), 40 tokens (40.0%), weight 25.0%") in buf.getvalue()
