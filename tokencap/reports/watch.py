"""`tokencap status --watch`: a live board of every category's budget and the engines' load.

Each refresh reads the run's typed status (`TelemetryLedger.snapshot()`), the number of workers,
and each engine's load (`foundation.engine.load.LoadReader`: SGLang's `/v1/loads`, else the
Prometheus `/metrics` page of SGLang or vLLM). On a terminal the board is redrawn in place
with `rich.live.Live`; otherwise (a pipe, a log file) plain lines without escape codes are
printed each interval, one per category and one for the engines and workers.

Token rates come from a `tokencap.reports.rates.RateTracker`, which keeps the `used` counter of each
category over the last minute, so tok/s and ETA follow what the run does now, not its
average since start.

When the run's hidden-state stage exists (the run `<run>.hs`, `fetch_stage`), the board
shows it below the run: per category its rows with states, the bytes kept against its
budget, the row tokens per second, the ETA and its state (one `hidden states` line per
category in plain text).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import requests
from rich.console import Console, Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from budget_service.ledger import CategoryState
from budget_service.telemetry import RunStatus, SeriesPoint
from foundation.engine.api import engine_spec
from foundation.engine.load import NO_LOAD_READINGS, LoadReader
from foundation.errors import TokencapError
from foundation.units import size_text
from tokencap.reports.progress import (
    SIMULATED_TEXT,
    gate_lines,
    mode_lines,
    since_text,
    trouble_lines,
)
from tokencap.reports.rates import NO_VALUE, CategoryRate, RateTracker, format_eta, series_rates

ENGINE_TIMEOUT_S = 2.0
BAR_WIDTH_CHARS = 24

@dataclass(frozen=True)
class EngineLoad:
    """One engine's load as read from its `/metrics`; `up` is False when it did not answer."""

    url: str
    up: bool
    running: float | None = None
    queued: float | None = None
    token_usage: float | None = None
    gen_throughput: float | None = None
    error: str = ""
    readings: bool = True  # False: the engine has neither /v1/loads nor /metrics


def _one_engine(item: str, timeout_s: float, loads: LoadReader) -> EngineLoad:
    spec = engine_spec(item)
    try:
        m, _ = loads.read(spec.url, spec.headers(), (timeout_s, timeout_s))
    except requests.RequestException as exc:
        return EngineLoad(spec.url, False, error=type(exc).__name__)
    if m is None:
        return EngineLoad(spec.url, True, readings=False)
    return EngineLoad(spec.url, True, running=m["running"], queued=m["queued"],
                      token_usage=m["token_usage"], gen_throughput=m["gen_throughput"])


def engine_load(urls: list[str], timeout_s: float = ENGINE_TIMEOUT_S,
                loads: LoadReader | None = None) -> list[EngineLoad]:
    """Each engine's load, in the order of `urls`, read in parallel (`loads`: a board's
    reader kept between boards, which remembers the engines without /v1/loads).

    An engine that refuses the connection, times out (connect or read, each `timeout_s`) or
    answers with an HTTP error is returned with `up=False`; this never raises for that.
    """
    if not urls:
        return []
    with ThreadPoolExecutor(max_workers=len(urls), thread_name_prefix="watch-engine") as pool:
        reader = loads or LoadReader()
        return list(pool.map(lambda u: _one_engine(u, timeout_s, reader), urls))


def _si(n: float) -> str:
    """A compact count: exact below 10,000 (9,999), else 3 significant digits (12.3k, 4.56M)."""
    if abs(n) < 10_000:
        return f"{n:,.0f}"
    for div, suffix in ((1e3, "k"), (1e6, "M"), (1e9, "G"), (1e12, "T")):
        digits = f"{n / div:.3g}"
        if abs(float(digits)) < 1000:
            return digits + suffix
    return f"{n:.3g}"


def _pct(used: int, cap: int) -> float:
    return 100.0 * used / cap if cap else 100.0


def _used_of(st: CategoryState, exact: bool) -> str:
    """``used/cap (pct%)``, or ``used (uncapped)``."""
    used, cap = st.used, st.cap
    num = (lambda n: str(n)) if exact else _si
    if cap is None:
        return f"{num(used)} (uncapped)"
    sep = "/" if exact else " / "
    pct = f"{_pct(used, cap):.1f}" if exact else f"{_pct(used, cap):.0f}"
    return f"{num(used)}{sep}{num(cap)} ({pct}%)"


def _engine_text(e: EngineLoad) -> str:
    if not e.up:
        return f"{e.url} down ({e.error})" if e.error else f"{e.url} down"
    if not e.readings:
        return f"{e.url} up, {NO_LOAD_READINGS}"

    def num(v: float | None) -> str:
        return NO_VALUE if v is None else f"{v:g}"

    kv = NO_VALUE if e.token_usage is None else f"{100.0 * e.token_usage:.0f}%"
    gen = NO_VALUE if e.gen_throughput is None else f"{e.gen_throughput:.0f}"
    return f"{e.url} running={num(e.running)} queued={num(e.queued)} kv={kv} gen_tok_s={gen}"


def _no_rate() -> CategoryRate:
    return CategoryRate(0.0, None)


def stage_lines(stage: RunStatus, rates: Mapping[str, CategoryRate]) -> list[str]:
    """A hidden-state stage in plain text: one line per category (exact numbers)."""
    lines = []
    for name, st in stage.categories.items():
        r = rates.get(name) or _no_rate()
        b = stage.state_bytes(st)
        size = "" if b is None else f"bytes={b.used}" + ("" if b.cap is None else f"/{b.cap}")
        lines.append(f"hidden states {name} rows={st.samples} {size} tok_s={r.tok_s:.1f} "
                     f"eta={format_eta(r.eta_s)} state={st.state} failed={st.failed}")
    return lines


def plain_lines(status: RunStatus, rates: Mapping[str, CategoryRate],
                engines: list[EngineLoad], workers: int, stage: RunStatus | None = None,
                stage_rates: Mapping[str, CategoryRate] | None = None) -> list[str]:
    """The board as plain text: one line per category, then one line for engines and workers
    (and the hidden-state stage's lines, `stage_lines`, when it exists).

    Numbers are exact (no k/M suffixes) so a log can be grepped and parsed.
    """
    lines = []
    for name, st in status.categories.items():
        r = rates.get(name) or _no_rate()
        lines.append(
            f"{name} used={_used_of(st, exact=True)} "
            f"samples={st.samples} tok_s={r.tok_s:.1f} eta={format_eta(r.eta_s)} "
            f"state={st.state} skipped={st.skipped} failed={st.failed} "
            f"rejected={st.rejected} overshoot={st.overshoot} "
            f"kept_tokens={st.kept_tokens} "
            f"kept_out_tokens={sum(st.rejected_tokens.values())}"
        )
    engine_part = " | ".join(_engine_text(e) for e in engines) or "none"
    lines.append(f"engines: {engine_part}; workers={workers}")
    lines += trouble_lines(status)
    lines.append(writer_text(status))
    if stage is not None:
        lines += stage_lines(stage, stage_rates or {})
    if status.simulated:
        lines.append(SIMULATED_TEXT)
    return lines


def writer_text(status: RunStatus) -> str:
    """The writer line: who holds the run's writer lease, results not yet on disk, trouble."""
    w = status.writer
    who = w.holder or "NONE (nothing reaches the disk)"
    text = f"writer: {who}; unwritten={w.unwritten}"
    if not w.error:
        return text
    since = w.error_at_ms
    return text + f"; error: {w.error}" + (f", {since_text(since)}" if since else "")


_STATE_STYLE = {"open": "green", "exhausted": "yellow", "closed": "bold"}


# Columns in the order they drop when the terminal is too narrow for the table (the bar
# narrows first): overshoot, then skipped/failed/rejected, then samples. At 80 columns the
# board keeps the bar, used / cap, tok/s, ETA and state.
LEVELS: tuple[tuple[frozenset[str], int], ...] = (
    (frozenset({"samples", "skip/fail/rej", "overshoot"}), BAR_WIDTH_CHARS),
    (frozenset({"samples", "skip/fail/rej", "overshoot"}), 16),
    (frozenset({"samples", "skip/fail/rej"}), 16),
    (frozenset({"samples"}), 12),
    (frozenset(), 10),
    (frozenset(), 6),
)


def render_board(status: RunStatus, rates: Mapping[str, CategoryRate],
                 engines: list[EngineLoad], workers: int, width: int = 120,
                 stage: RunStatus | None = None,
                 stage_rates: Mapping[str, CategoryRate] | None = None) -> Group:
    """The board for a terminal of `width` columns: a table with one row per category (the
    richest of `LEVELS` that fits), then a footer with engines, workers and the writer; the
    hidden-state stage's table below when it exists."""
    measure = Console(width=10_000)
    for shown, bar_width in LEVELS:
        table = _table(status, rates, shown, bar_width)
        if measure.measure(table).maximum <= width:
            break
    if stage is None:
        return Group(table, _footer(status, engines, workers))
    return Group(table, _footer(status, engines, workers),
                 _stage_table(stage, stage_rates or {}, bar_width))


def _stage_table(stage: RunStatus, rates: Mapping[str, CategoryRate],
                 bar_width: int) -> Table:
    """The hidden-state stage: per category its rows with states, bytes kept of its budget
    (a bar), row tokens per second, ETA, state."""
    table = Table(title=f"hidden states: run {stage.run}", title_justify="left", expand=False)
    for col, right in (("category", False), ("budget", False), ("bytes / budget", True),
                       ("rows", True), ("tok/s (1m)", True), ("ETA", True), ("state", False),
                       ("failed", True)):
        table.add_column(col, justify="right" if right else "left", no_wrap=True)
    for name, st in stage.categories.items():
        r = rates.get(name) or _no_rate()
        b = stage.state_bytes(st)
        used, cap = (b.used, b.cap) if b is not None else (st.used, st.cap)
        bar = ProgressBar(total=None if cap is None and st.state == "open" else max(cap or 1, 1),
                          completed=min(used, cap) if cap else 1, width=bar_width,
                          complete_style="cyan")
        size = size_text(used) + ("" if cap is None else f" / {size_text(cap)}")
        table.add_row(name, bar, size, _si(st.samples), f"{r.tok_s:,.0f}",
                      format_eta(r.eta_s), Text(st.state, style=_STATE_STYLE.get(st.state, "")),
                      str(st.failed))
    return table


def _table(status: RunStatus, rates: Mapping[str, CategoryRate], shown: frozenset[str],
           bar_width: int) -> Table:
    table = Table(title=f"tokencap run {status.run}", title_justify="left", expand=False)
    table.add_column("category", no_wrap=True)
    table.add_column("budget", no_wrap=True)
    table.add_column("used / cap", justify="right", no_wrap=True)
    if "samples" in shown:
        table.add_column("samples", justify="right", no_wrap=True)
    table.add_column("tok/s (1m)", justify="right", no_wrap=True)
    table.add_column("ETA", justify="right", no_wrap=True)
    table.add_column("state", no_wrap=True)
    if "skip/fail/rej" in shown:
        table.add_column("skip/fail/rej", justify="right", no_wrap=True)
    if "overshoot" in shown:
        table.add_column("overshoot", justify="right", no_wrap=True)
    for name, st in status.categories.items():
        r = rates.get(name) or _no_rate()
        cap, used = st.cap, st.used
        over = st.overshoot
        if cap is None:  # uncapped: the bar shows only whether it still grows
            bar = ProgressBar(total=None if st.state == "open" else 1, completed=1,
                              width=bar_width, complete_style="cyan")
        else:
            bar = ProgressBar(total=max(cap, 1),
                              completed=min(used, cap) if cap else 1,
                              width=bar_width, complete_style="cyan",
                              finished_style="red" if over else "green")
        cells: list[Any] = [name, bar, _used_of(st, exact=False)]
        if "samples" in shown:
            cells.append(_si(st.samples))
        cells += [f"{r.tok_s:,.0f}", format_eta(r.eta_s),
                  Text(st.state, style=_STATE_STYLE.get(st.state, ""))]
        if "skip/fail/rej" in shown:
            cells.append(f"{st.skipped}/{st.failed}/{st.rejected}")
        if "overshoot" in shown:
            cells.append(Text(_si(over), style="red" if over else ""))
        table.add_row(*cells)
    return table


def _footer(status: RunStatus, engines: list[EngineLoad], workers: int) -> Text:
    footer = Text()
    for e in engines:
        footer.append("engine ")
        if e.up:
            footer.append(_engine_text(e))
        else:
            footer.append(_engine_text(e), style="bold red")
        footer.append("\n")
    if not engines:
        footer.append("engines: none configured\n")
    for line in trouble_lines(status):  # the engine watch's finds, a stage's full disk
        footer.append(line + "\n", style="bold red")
    footer.append(f"workers: {workers}\n")
    for line in gate_lines(status):  # what of the budget a trainer can use
        footer.append(line + "\n")
    for line in mode_lines(status):  # each decode mode against its weight
        footer.append(line + "\n")
    w = status.writer
    footer.append(writer_text(status), style="bold red" if w.error or (
        w.unwritten and not w.holder) else "")
    if status.simulated:
        footer.append("\n" + SIMULATED_TEXT, style="bold yellow")
    return footer


def watch(fetch_status: Callable[[], RunStatus], engine_urls: list[str],
          count_workers: Callable[[], int], *, interval_s: float = 2.0,
          console: Console | None = None, iterations: int | None = None,
          fetch_series: Callable[[], Sequence[SeriesPoint]] | None = None,
          fetch_stage: Callable[[], RunStatus | None] | None = None) -> None:
    """Show the board every `interval_s` until Ctrl-C (or after `iterations` boards).

    Rates come from the run's time series (`fetch_series`: the budget service records it)
    when there is one, else from what this watcher has seen since it started. The run's
    hidden-state stage (`fetch_stage`: its status, None while there is none) is shown below
    it, its rates from what this watcher has seen.

    On a terminal the board is redrawn in place (`rich.live.Live`, no alternate screen, so
    the last board stays on screen afterwards); elsewhere plain lines are printed each time.
    Errors raised by `fetch_status` or `count_workers` (Redis down) propagate; an engine
    that does not answer is shown as down. Ctrl-C returns normally.
    """
    if iterations is not None and iterations < 1:
        raise TokencapError(f"iterations must be None or >= 1, got {iterations}")
    console = console if console is not None else Console()
    tracker, stage_tracker = RateTracker(), RateTracker()
    stop = threading.Event()
    engine_timeout_s = min(ENGINE_TIMEOUT_S, max(interval_s, 0.1))
    loads = LoadReader()

    def frame() -> tuple[RunStatus, dict[str, CategoryRate], list[EngineLoad], int,
                         RunStatus | None, dict[str, CategoryRate]]:
        status = fetch_status()
        points = fetch_series() if fetch_series else []
        rates = series_rates(points, status, time.time()) if points else \
            tracker.update(status)
        stage = fetch_stage() if fetch_stage else None
        stage_rates = stage_tracker.update(stage) if stage is not None else {}
        return (status, rates, engine_load(engine_urls, engine_timeout_s, loads),
                count_workers(), stage, stage_rates)

    def board() -> Group:
        status, rates, engines, workers, stage, stage_rates = frame()
        return render_board(status, rates, engines, workers, width=console.width,
                            stage=stage, stage_rates=stage_rates)

    def done(n: int) -> bool:
        return iterations is not None and n >= iterations

    n = 0
    try:
        if console.is_terminal and not console.is_dumb_terminal:
            with Live(board(), console=console, screen=False,
                      auto_refresh=False, transient=False) as live:
                n = 1
                while not done(n):
                    stop.wait(interval_s)
                    live.update(board(), refresh=True)
                    n += 1
        else:
            while not done(n):
                if n:
                    stop.wait(interval_s)
                for line in plain_lines(*frame()):
                    console.out(line, highlight=False)
                console.file.flush()
                n += 1
    except KeyboardInterrupt:
        return
