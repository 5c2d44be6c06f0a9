"""The commands that look at or steer a running or finished run: `tokencap status`, `cap set`,
`report` and `retry`: wiring only."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import click

from budget_service.lease import producer_lease
from foundation.errors import UnknownCategory
from tokencap.cli.errors import Command
from tokencap.cli.find_run import (
    PREFIX_OPT,
    REDIS_OPT,
    RUN_OPT,
    SGLANG_OPT,
    STATE_OPT,
    open_budget,
    stack_run_options,
    stored_config,
)

log = logging.getLogger("tokencap")

SERIES_FOR_RATES = 30  # the series' last points a board reads (a minute at one every 2-5 s)


@click.command(cls=Command)
@STATE_OPT
@RUN_OPT
@REDIS_OPT
@SGLANG_OPT
@PREFIX_OPT
@click.option("--json", "as_json", is_flag=True, help="Print the status document as JSON.")
@click.option("--watch", "watch_flag", is_flag=True,
              help="Live board (redrawn in place on a terminal, plain lines otherwise), with "
              "tok/s over the last minute, ETA, engine load from SGLANG_URL and workers.")
@click.option("--interval", default=2.0, show_default=True, help="Seconds between redraws.")
@click.option("--events", "events_flag", is_flag=True,
              help="Print the run's event log instead (cap changes: when, old and new cap, "
              "who, tokens used then; the last 1,000 per category).")
def status(state_dir: str, run_name: str | None, redis_url: str, sglang_url: str, prefix: str,
           as_json: bool, watch_flag: bool, interval: float, events_flag: bool) -> None:
    """Show each category's cap, used, reserved, samples and state; the run's hidden-state
    stage (`<run>.hs`) beside it when it exists (under `hidden_states` in --json)."""
    from tokencap.reports.progress import summary_table

    budget = open_budget(redis_url, prefix, run_name)
    if events_flag:
        events = budget.operating.events(list(budget.telemetry.snapshot().categories))
        click.echo(json.dumps(events, indent=2) if as_json else "\n".join(
            _event_line(e) for e in events) or "no events")
        return
    if watch_flag:
        from foundation.engine.api import parse_urls
        from tokencap.reports.watch import watch

        def fetch_stage() -> Any:
            stage = budget.telemetry.stage()
            return None if stage is None else stage.snapshot()

        watch(budget.telemetry.snapshot, parse_urls(sglang_url), budget.telemetry.workers,
              interval_s=interval,
              fetch_series=lambda: budget.telemetry.series(count=SERIES_FOR_RATES),
              fetch_stage=fetch_stage)
        return
    if as_json:
        click.echo(json.dumps(budget.telemetry.status(by_engine=True), indent=2))
        return
    click.echo(summary_table(budget.telemetry.snapshot(by_engine=True)))
    stage = budget.telemetry.stage()
    if stage is not None:
        click.echo("\n" + summary_table(stage.snapshot()))


def _event_line(ev: dict[str, Any]) -> str:
    import time

    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ev["at"] / 1000))
    return (f"{when}  {ev['category']}  {ev.get('kind')} {ev.get('old')} -> {ev.get('new')}  "
            f"by {ev.get('by') or '?'}  ({ev.get('used')} tokens used)")


@click.group()
def cap() -> None:
    """Change a category's cap while the run goes on."""


class CapType(click.ParamType):
    """Tokens as people write them (10000000, 10_000_000, 10M, 500K), or "none" for
    uncapped."""

    name = "TOKENS|none"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> int | None:
        from budget_service.ledger import parse_cap

        if value is None or isinstance(value, int):
            return value
        try:
            return parse_cap(str(value))
        except ValueError as exc:
            self.fail(f"{exc}, or \"none\" (uncapped)", param, ctx)


@cap.command("set", cls=Command)
@click.argument("category")
@click.argument("tokens", type=CapType())
@stack_run_options
def cap_set(category: str, tokens: int | None, state_dir: str, run_name: str | None,
            redis_url: str, prefix: str) -> None:
    """Set CATEGORY's cap to TOKENS ("none": uncapped, the whole source): raising it
    reopens a closed category and sends what it held back, lowering it below what is used
    closes it at once."""
    from budget_service.ledger import cap_text

    budget = open_budget(redis_url, prefix, run_name, changes="change a cap")
    snap = budget.telemetry.snapshot()
    if category not in snap.categories:
        # a `share = "tokens"` category: each mode's budget has its own cap
        parts = [p for p in snap.mode_parts.get(category, []) if p != category]
        raise UnknownCategory(budget.keys.run, category, (
            f": share = \"tokens\" runs it as one budget per mode, each capped: "
            f"{', '.join(parts)}") if parts else "")
    who = os.environ.get("USER") or os.environ.get("LOGNAME") or "?"
    closed, old = budget.operating.set_cap(category, tokens, by=f"tokencap cap set ({who})")
    log.warning("cap of %s changed from %s to %s", category, cap_text(old), cap_text(tokens))
    click.echo(f"{category}: cap {cap_text(old)} -> {cap_text(tokens)} "
               f"({'closed' if closed else 'open'})")


@click.command(cls=Command)
@stack_run_options
@click.option("--out", "out_dir", default=None,
              help="The run's output folder (default: the run config's output_dir).")
@click.option("--dest", default=None, help="Where to write the report (default: --out).")
def report(state_dir: str, run_name: str | None, redis_url: str, prefix: str,
           out_dir: str | None, dest: str | None) -> None:
    """Write <dest>/<run>-report.html (self-contained) and its PNG figures: output lengths,
    finish reasons, tokens against caps, throughput and engine batch over time, the tail,
    rejected/dead by reason, cap changes. `up` writes one at the end of a run."""
    from tokencap.reports.report import build_report

    budget = open_budget(redis_url, prefix, run_name, changes="write a report")
    out = Path(out_dir or stored_config(budget).output_dir)
    path = build_report(budget, out, Path(dest) if dest else out)
    click.echo(f"report: {path}")


@click.command(cls=Command)
@stack_run_options
@click.option("--category", "categories", multiple=True,
              help="Only this category (repeat for several; default: all).")
@click.option("--reason", default="",
              help="Only samples dead for this reason (e.g. server_error, timeout; default: "
              "any). Rejected samples (bad records) are never sent again.")
def retry(state_dir: str, run_name: str | None, redis_url: str, prefix: str,
          categories: tuple[str, ...], reason: str) -> None:
    """Send dead-lettered samples again, e.g. after an engine outage: each stops being dead
    (counted once whatever happens next) and waits for the producer, which feeds it again;
    with no producer running, `tokencap up CONFIG` (or `run`) again finishes them. Their
    lines in failed.jsonl stay, as history. Conversation turns are not sent again (a
    turn needs the turns before it)."""
    budget = open_budget(redis_url, prefix, run_name, changes="send dead samples again")
    known = list(budget.telemetry.snapshot().categories)
    for name in categories:
        if name not in known:
            raise UnknownCategory(budget.keys.run, name)
    total = 0
    for name in categories or known:
        moved, turns = budget.operating.retry(name, reason)
        total += moved
        left = f"; {turns} conversation turn(s) stay dead" if turns else ""
        click.echo(f"{name}: {moved} dead sample(s) sent again{left}")
    if total and producer_lease(budget.redis, budget.keys).holder() is None:
        click.echo("no producer runs this run: `tokencap up CONFIG` (or `tokencap run CONFIG`) "
                   "feeds them again")
