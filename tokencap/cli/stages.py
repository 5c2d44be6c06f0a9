"""The commands that run one stage of a run: `tokencap run` (the producer), `worker`,
`writer` and `serve` (the budget service): wiring only."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from foundation.config import DEFAULT_BUDGET_PORT, RunConfig
from foundation.errors import SIGNALLED, SourceError, TokencapError
from foundation.stopping import StopFlag, on_stop_signals
from tokencap.cli.errors import Command
from tokencap.cli.find_run import (
    CONFIG,
    PREFIX_OPT,
    REDIS_OPT,
    RUN_OPT,
    SGLANG_OPT,
    open_budget,
    stored_config,
)

if TYPE_CHECKING:
    from budget_service.budget import Budget
    from foundation.engine.info import EngineInfo

log = logging.getLogger("tokencap")


@click.command(cls=Command)
@click.argument("config", type=CONFIG)
@REDIS_OPT
@SGLANG_OPT
@click.option("--progress-s", default=2.0, show_default=True,
              help="Seconds between progress lines.")
@click.option("--dry-run", is_flag=True,
              help="Render one prompt per category, show it and exit: nothing is enqueued.")
def run(config: RunConfig, redis_url: str, sglang_url: str, progress_s: float,
        dry_run: bool) -> None:
    """Run the producer for CONFIG until every category is closed or exhausted.

    Creates (or resumes) the run in Redis, rebuilds counters from the output files, feeds
    each open category, re-enqueues lost samples, and waits for the writer to catch up.
    Safe to stop and restart: committed samples are never fed again.
    """
    from foundation.engine.api import parse_urls
    from foundation.redisconn import connect
    from producer.run import run_to_end
    from tokencap.reports.progress import ProgressPrinter, nothing_usable, summary_table

    cfg = config
    if dry_run:
        from tokencap.prepare.plan import preview, preview_text

        click.echo(preview_text(preview(cfg)))
        return
    redis = connect(redis_url)
    stop = StopFlag()
    with stop.catch():
        status = run_to_end(cfg, redis, parse_urls(sglang_url),
                            on_progress=ProgressPrinter(),
                            should_stop=lambda: bool(stop), progress_s=progress_s)
    click.echo(summary_table(status))
    if stop:
        click.echo("stopped before the end; run the same command again to resume", err=True)
        sys.exit(SIGNALLED)
    why = nothing_usable(status, cfg.output_dir)
    if why:
        raise SourceError(why)


@click.command("hidden-states", cls=Command)
@click.argument("config", type=CONFIG)
@REDIS_OPT
@click.option("--extract-url", envvar="TOKENCAP_EXTRACT_URL", default=None,
              help="The extraction server(s): vLLM with extract_hidden_states, comma "
              "separated. Env: TOKENCAP_EXTRACT_URL. Default: hidden_states.engine_url.")
@click.option("--workers", type=click.IntRange(min=1), default=4, show_default=True,
              help="Worker processes this command runs for the stage.")
@click.option("--plan", "plan_only", is_flag=True,
              help="Print the bytes per token, per category and in all (with the rows not "
              "yet in the stage's rows files), check them against the free disk, and exit: "
              "nothing is sent or written.")
@click.option("--progress-s", default=2.0, show_default=True,
              help="Seconds between progress lines.")
def hidden_states(config: RunConfig, redis_url: str, extract_url: str | None, workers: int,
                  plan_only: bool, progress_s: float) -> None:
    """Extract the target model's hidden states of every kept row of CONFIG's run (EAGLE-3's
    low, middle and high layers and the last one before the final norm) with a vLLM
    extraction server, through the same queue, ledger, workers and writer as generation:
    each row's states once, in a checked file named by the row, under a byte budget per
    category (`[hidden_states]` in the config; docs/HIDDEN_STATES.md). The same command
    resumes: a row whose file is kept is not asked for again, and the rows generated since
    the last stage run (a raised cap, a resumed run) are added to its rows files and
    extracted. `tokencap up` runs it beside generation, each category as it ends. At a
    category's end, its manifest.json is written beside its states (`tokencap verify`
    rereads the files against it; the export checks it)."""
    from tokencap import extraction
    from tokencap.reports.progress import ProgressPrinter, summary_table
    from tokencap.stack.stage import run_hidden_states

    if plan_only:
        extraction.say_disk_plan(config, click.echo)
        return
    stop = StopFlag()
    with stop.catch():
        status = run_hidden_states(config, redis_url, workers, extract_url=extract_url,
                                on_progress=ProgressPrinter(), should_stop=lambda: bool(stop),
                                progress_s=progress_s, say=click.echo)
    click.echo(summary_table(status))
    if stop:
        click.echo("stopped before the end; run the same command again to resume", err=True)
        sys.exit(SIGNALLED)


@click.command(cls=Command)
@RUN_OPT
@REDIS_OPT
@SGLANG_OPT
@PREFIX_OPT
@click.option("--burst", is_flag=True, help="Exit when the queues are empty.")
@click.option("--name", default=None, help="Worker name (default: RQ's).")
@click.option("--pool", type=click.IntRange(min=1), default=None,
              help="Run N worker processes, restarting any that dies; SIGTERM stops them all "
              "after their current sample.")
def worker(run_name: str | None, redis_url: str, sglang_url: str, prefix: str, burst: bool,
           name: str | None, pool: int | None) -> None:
    """Start one consumer: an RQ worker on every category queue of the run.

    Sends each admitted sample to SGLang /generate and commits the result. Add more of these
    (on any host that reaches Redis and SGLang) to raise concurrency. SIGTERM finishes the
    current sample, then exits.
    """
    if pool:
        from tokencap.stack.supervisor import run_pool, tokencap_argv

        argv = tokencap_argv("worker", *(["--burst"] if burst else []))
        env = {**os.environ, "REDIS_URL": redis_url, "SGLANG_URL": sglang_url,
               "TOKENCAP_PREFIX": prefix, **({"TOKENCAP_RUN": run_name} if run_name else {})}
        sys.exit(run_pool(argv, env, pool, restart=not burst))
    from consumers.job import configure, flush_stats
    from consumers.worker import supervise
    from foundation.engine.api import parse_urls
    from foundation.redisconn import connect

    urls = parse_urls(sglang_url)
    if not urls:
        raise TokencapError("no engine: set --sglang-url or SGLANG_URL")
    budget = open_budget(redis_url, prefix, run_name)
    cfg = stored_config(budget)
    ctx = configure(redis_url, urls, prefix)
    _check_engines(ctx.run(budget.keys.run).client.preflight(), budget)
    code = supervise(lambda: connect(redis_url), budget.keys, [c.name for c in cfg.category],
                     name, burst=burst)
    flush_stats()
    sys.exit(code)


def _check_engines(infos: list[EngineInfo], budget: Budget) -> None:
    """A worker's engines must serve a model the run's producer checked (its preflight):
    else it would feed the run another model's outputs."""
    from foundation.errors import EngineUnusable

    seen = {i.model for i in budget.samples.engines_seen().values()}
    for info in infos:
        if seen and info.model not in seen:
            raise EngineUnusable(f"engine {info.url} serves {info.model!r}; the run's producer "
                                 f"checked {sorted(seen)}: this worker would commit another "
                                 "model's outputs")


@click.command(cls=Command)
@RUN_OPT
@REDIS_OPT
@PREFIX_OPT
@click.option("--out", "out_dir", envvar="TOKENCAP_OUT", default=None,
              help="Output folder (default: the run config's output_dir). Env: TOKENCAP_OUT.")
@click.option("--supervise", is_flag=True,
              help="Run the writer as a child process and start it again (with backoff) "
              "whenever it dies; SIGTERM stops both.")
def writer(run_name: str | None, redis_url: str, prefix: str, out_dir: str | None,
           supervise: bool) -> None:
    """Write committed results to <out>/<category>/part-*.jsonl (fsync, then ack).

    Also writes the replies the reply gate kept out to rejected-replies.jsonl, samples never
    generated (bad input, engine failures) to failed.jsonl, and conversations' turns held
    back by a cap or stopped by policy to stopped.jsonl, beside them.
    One writer per run: a second one waits for the run's writer lease (lock_ttl_s x 1.5),
    then exits 8 naming the holder. A full disk is reported and retried; the run's
    admission pauses meanwhile (max_unwritten).
    """
    from writer.writer import Writer

    budget = open_budget(redis_url, prefix, run_name)
    cfg = stored_config(budget)
    if supervise:
        from tokencap.stack.supervisor import run_pool, tokencap_argv

        argv = tokencap_argv("writer", *(["--out", out_dir] if out_dir else []))
        env = {**os.environ, "REDIS_URL": redis_url, "TOKENCAP_PREFIX": prefix,
               "TOKENCAP_RUN": budget.keys.run}
        sys.exit(run_pool(argv, env, 1, restart=True, what="writer"))
    w = Writer(budget.redis, budget.keys, [c.name for c in cfg.category],
               Path(out_dir or cfg.output_dir), lease_ttl_s=cfg.lock_ttl_s)
    try:
        with on_stop_signals(lambda _signum: w.stop_event.set()):
            w.run()
    finally:
        w.close()


@click.command(cls=Command)
@RUN_OPT
@REDIS_OPT
@PREFIX_OPT
@click.option("--host", envvar="TOKENCAP_HOST", default="127.0.0.1", show_default=True,
              help="Address to bind. Env: TOKENCAP_HOST.")
@click.option("--port", envvar="TOKENCAP_PORT", default=DEFAULT_BUDGET_PORT, show_default=True,
              help="Port (0: any free port, logged). Env: TOKENCAP_PORT.")
@click.option("--token", envvar="TOKENCAP_TOKEN", default=None,
              help="Bearer token for POST /cap; without one caps cannot change over HTTP. "
              "Env: TOKENCAP_TOKEN.")
@click.option("--record-s", default=5.0, show_default=True,
              help="Seconds between two points of the run's time series (rates, ETAs, the "
              "report's charts); 0: record none.")
def serve(run_name: str | None, redis_url: str, prefix: str, host: str, port: int,
          token: str | None, record_s: float) -> None:
    """Serve the live page (GET /), GET /status (JSON), GET /series (the run's time series),
    GET /metrics (Prometheus) and POST /cap (token); record the time series."""
    from budget_service.server import Recorder, make_server

    budget = open_budget(redis_url, prefix, run_name)
    try:
        server = make_server(budget, host, port, token)
    except OSError as exc:
        raise TokencapError(f"cannot serve on {host}:{port}: {exc.strerror} (another budget "
                            "service? --port / TOKENCAP_PORT picks another)") from None
    if record_s > 0:
        Recorder(budget, record_s).start()
    log.info("budget service on http://%s:%d", host, server.server_address[1])
    with on_stop_signals(lambda _signum: sys.exit(0)):
        server.serve_forever()
