"""The `tokencap` command: wiring only. Every option has an environment twin.

Exit codes: `foundation.errors.exit_codes()`, shown at the foot of `tokencap --help`.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

import click

from foundation.config import DEFAULT_BUDGET_PORT, DEFAULT_KEY_PREFIX
from foundation.errors import (
    SIGNALLED,
    RunNotFound,
    TokencapError,
    UnknownCategory,
    exit_codes_text,
)
from foundation.redisconn import DEFAULT_REDIS_URL
from tokencap import logs

log = logging.getLogger("tokencap")

STATE_META = "tokencap.state_dir"
SERIES_FOR_RATES = 30  # the series' last points a board reads (a minute at one every 2-5 s)


def _remember_state_dir(ctx: click.Context, _param: click.Parameter, value: str) -> str:
    ctx.meta[STATE_META] = value
    return value


def _from_run_file(key: str, default: str | None = None) -> Any:
    """An option's value when it is not given: the run file of the stack (`tokencap.runfile`),
    else `default`."""
    def callback(ctx: click.Context, _param: click.Parameter, value: Any) -> Any:
        if value:
            return value
        from tokencap.runfile import run_file, state_dir

        return run_file(state_dir(ctx.meta.get(STATE_META))).get(key) or default
    return callback


STATE_OPT = click.option("--state-dir", envvar="TOKENCAP_STATE_DIR", default=".run",
                         show_default=True, is_eager=True, callback=_remember_state_dir,
                         help="The stack `tokencap up` keeps there (pids, logs, Redis data, "
                         "and the run file that gives Redis, engines, run and token to the "
                         "other commands). Env: TOKENCAP_STATE_DIR.")
REDIS_OPT = click.option("--redis-url", envvar="REDIS_URL", default=None,
                         callback=_from_run_file("REDIS_URL", DEFAULT_REDIS_URL),
                         help="Redis URL (redis://, rediss://, unix://). Env: REDIS_URL. "
                         f"Default: the stack's run file, else {DEFAULT_REDIS_URL}.")
SGLANG_OPT = click.option("--sglang-url", envvar="SGLANG_URL", default=None,
                          callback=_from_run_file("SGLANG_URL", ""),
                          help="Engine URL(s), comma separated (sglang+/openai+ prefixes, "
                          "http://:KEY@host for a key). Env: SGLANG_URL. Default: the "
                          "stack's run file.")
RUN_OPT = click.option("--run", "run_name", envvar="TOKENCAP_RUN", default=None,
                       callback=_from_run_file("TOKENCAP_RUN"),
                       help="Run name (default: the stack's, else the only run in Redis). "
                       "Env: TOKENCAP_RUN.")
PREFIX_OPT = click.option("--prefix", envvar="TOKENCAP_PREFIX", default=DEFAULT_KEY_PREFIX,
                          show_default=True, help="Redis key prefix. Env: TOKENCAP_PREFIX.")


def stack_run_options(command: Any) -> Any:
    """--state-dir, --run, --redis-url and --prefix: the run of the stack `up` started here,
    for the commands that act on a running or finished run."""
    for option in (PREFIX_OPT, REDIS_OPT, RUN_OPT, STATE_OPT):
        command = option(command)
    return command


def _fail(exc: TokencapError) -> None:
    click.echo(f"tokencap: error: {exc}", err=True)
    sys.exit(exc.exit_code)


class _Group(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except TokencapError as exc:
            _fail(exc)


@click.group(cls=_Group, epilog="Exit codes: " + exit_codes_text() + ".")
@click.option("--log-level", envvar="TOKENCAP_LOG_LEVEL", default="INFO", show_default=True,
              help="Logging level. Env: TOKENCAP_LOG_LEVEL.")
@click.version_option(package_name="tokencap")
def main(log_level: str) -> None:
    """tokencap: token-budgeted LLM data generation over Redis queues.

    A producer tokenizes prompts and feeds one RQ queue per category; workers send them to
    SGLang's /generate with input_ids and count tokens exactly once per category; each
    category stops at its token cap. Start everything locally with `tokencap up CONFIG`.
    """
    logs.setup(log_level)


def _resolve_run(redis: Any, prefix: str, run_name: str | None) -> str:
    from budget_service.keys import Keys

    if run_name:
        return run_name
    runs = sorted(
        Keys.run_of_meta(prefix, k.decode())
        for k in redis.scan_iter(match=Keys.runs_pattern(prefix), count=1000)
    )
    if len(runs) == 1:
        return runs[0]
    if not runs:
        raise RunNotFound(f"no tokencap run in this Redis (prefix {prefix!r})")
    raise TokencapError(f"several runs in Redis ({', '.join(runs)}): pick one with --run")


def _stored_config(budget: Any) -> Any:
    cfg = budget.load_config()
    if cfg is None:
        raise RunNotFound(f"run {budget.keys.run!r} has no stored config in Redis")
    return cfg


def _budget(redis_url: str, prefix: str, run_name: str | None) -> Any:
    from budget_service.budget import Budget
    from budget_service.keys import Keys
    from foundation.redisconn import connect

    redis = connect(redis_url)
    run = _resolve_run(redis, prefix, run_name)
    budget = Budget(redis, Keys(prefix, run))
    if not budget.has_run():
        raise RunNotFound(f"run {run!r} not found in Redis (prefix {prefix!r})")
    return budget


@main.command()
@click.argument("config", type=click.Path(dir_okay=False))
@REDIS_OPT
@SGLANG_OPT
@click.option("--progress-s", default=2.0, show_default=True,
              help="Seconds between progress lines.")
@click.option("--dry-run", is_flag=True,
              help="Render one prompt per category, show it and exit: nothing is enqueued.")
def run(config: str, redis_url: str, sglang_url: str, progress_s: float, dry_run: bool) -> None:
    """Run the producer for CONFIG until every category is closed or exhausted.

    Creates (or resumes) the run in Redis, rebuilds counters from the output files, feeds
    each open category, re-enqueues lost samples, and waits for the writer to catch up.
    Safe to stop and restart: committed samples are never fed again.
    """
    from foundation.config import load_config
    from foundation.engine import parse_urls
    from foundation.redisconn import connect
    from producer.run import run_to_end
    from tokencap.progress import ProgressPrinter, summary_table

    cfg = load_config(config)
    if dry_run:
        from tokencap.plan import preview, preview_text

        click.echo(preview_text(preview(cfg)))
        return
    redis = connect(redis_url)
    stop = {"flag": False}

    def on_signal(signum: int, _frame: Any) -> None:
        stop["flag"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    status = run_to_end(cfg, redis, parse_urls(sglang_url), on_progress=ProgressPrinter(),
                        should_stop=lambda: stop["flag"], progress_s=progress_s)
    click.echo(summary_table(status))
    if stop["flag"]:
        click.echo("stopped before the end; run the same command again to resume", err=True)
        sys.exit(SIGNALLED)


@main.command()
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
        from consumers.pool import run_pool

        argv = [sys.executable, "-m", "tokencap.cli", "worker"] + (["--burst"] if burst else [])
        env = {**os.environ, "REDIS_URL": redis_url, "SGLANG_URL": sglang_url,
               "TOKENCAP_PREFIX": prefix, **({"TOKENCAP_RUN": run_name} if run_name else {})}
        sys.exit(run_pool(argv, env, pool, restart=not burst))
    from consumers.job import configure, flush_stats
    from consumers.worker import supervise
    from foundation.engine import parse_urls
    from foundation.redisconn import connect

    urls = parse_urls(sglang_url)
    if not urls:
        raise TokencapError("no engine: set --sglang-url or SGLANG_URL")
    budget = _budget(redis_url, prefix, run_name)
    cfg = _stored_config(budget)
    ctx = configure(redis_url, urls, prefix)
    _check_engines(ctx.run(budget.keys.run).client.preflight(), budget)
    code = supervise(lambda: connect(redis_url), budget.keys, [c.name for c in cfg.category],
                     name, burst=burst)
    flush_stats()
    sys.exit(code)


def _check_engines(infos: list[Any], budget: Any) -> None:
    """A worker's engines must serve a model the run's producer checked (its preflight):
    else it would feed the run another model's outputs."""
    from foundation.errors import EngineUnusable

    seen = {i.model for i in budget.samples.engines_seen().values()}
    for info in infos:
        if seen and info.model not in seen:
            raise EngineUnusable(f"engine {info.url} serves {info.model!r}; the run's producer "
                                 f"checked {sorted(seen)}: this worker would commit another "
                                 "model's outputs")


@main.command()
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

    Also writes rejected and dead-lettered samples to <out>/<category>/dead-letter.jsonl.
    One writer per run: a second one waits for the run's writer lease (lock_ttl_s x 1.5),
    then exits 8 naming the holder. A full disk is reported and retried; the run's
    admission pauses meanwhile (max_unwritten).
    """
    from writer.writer import Writer

    budget = _budget(redis_url, prefix, run_name)
    cfg = _stored_config(budget)
    if supervise:
        from consumers.pool import run_pool

        argv = [sys.executable, "-m", "tokencap.cli", "writer"] + (
            ["--out", out_dir] if out_dir else [])
        env = {**os.environ, "REDIS_URL": redis_url, "TOKENCAP_PREFIX": prefix,
               "TOKENCAP_RUN": budget.keys.run}
        sys.exit(run_pool(argv, env, 1, restart=True, what="writer"))
    w = Writer(budget.redis, budget.keys, [c.name for c in cfg.category],
               Path(out_dir or cfg.output_dir), lease_ttl_s=cfg.lock_ttl_s)
    signal.signal(signal.SIGTERM, lambda *_: w.stop_event.set())
    try:
        w.run()
    except KeyboardInterrupt:
        pass
    finally:
        w.close()


@main.command()
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
    """Show each category's cap, used, reserved, samples and state."""
    from tokencap.progress import summary_table

    budget = _budget(redis_url, prefix, run_name)
    if events_flag:
        events = budget.operating.events(list(budget.telemetry.status()["categories"]))
        click.echo(json.dumps(events, indent=2) if as_json else "\n".join(
            _event_line(e) for e in events) or "no events")
        return
    if watch_flag:
        from budget_service.server import worker_count
        from foundation.engine import parse_urls
        from tokencap.watch import watch

        watch(budget.telemetry.status, parse_urls(sglang_url), lambda: worker_count(budget),
              interval_s=interval,
              fetch_series=lambda: budget.telemetry.series(count=SERIES_FOR_RATES))
        return
    st = budget.telemetry.status(by_engine=True)
    click.echo(json.dumps(st, indent=2) if as_json else summary_table(st))


def _event_line(ev: dict[str, Any]) -> str:
    import time

    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ev["at"] / 1000))
    return (f"{when}  {ev['category']}  {ev.get('kind')} {ev.get('old')} -> {ev.get('new')}  "
            f"by {ev.get('by') or '?'}  ({ev.get('used')} tokens used)")


@main.command()
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

    budget = _budget(redis_url, prefix, run_name)
    try:
        server = make_server(budget, host, port, token)
    except OSError as exc:
        raise TokencapError(f"cannot serve on {host}:{port}: {exc.strerror} (another budget "
                            "service? --port / TOKENCAP_PORT picks another)") from None
    if record_s > 0:
        Recorder(budget, record_s).start()
    log.info("budget service on http://%s:%d", host, server.server_address[1])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    server.serve_forever()


@main.group()
def cap() -> None:
    """Change a category's cap while the run goes on."""


class CapType(click.ParamType):
    """Tokens (>= 0), or "none" for uncapped."""

    name = "TOKENS|none"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> int | None:
        from budget_service.ledger import parse_cap

        if value is None or isinstance(value, int):
            return value
        try:
            return parse_cap(str(value))
        except ValueError:
            self.fail(f"{value!r} is not a number of tokens >= 0 or \"none\"", param, ctx)


@cap.command("set")
@click.argument("category")
@click.argument("tokens", type=CapType())
@stack_run_options
def cap_set(category: str, tokens: int | None, state_dir: str, run_name: str | None,
            redis_url: str, prefix: str) -> None:
    """Set CATEGORY's cap to TOKENS ("none": uncapped, the whole source): raising it
    reopens a closed category and sends what it held back, lowering it below what is used
    closes it at once."""
    from budget_service.ledger import cap_text

    budget = _budget(redis_url, prefix, run_name)
    if category not in budget.telemetry.status()["categories"]:
        raise UnknownCategory(budget.keys.run, category)
    who = os.environ.get("USER") or os.environ.get("LOGNAME") or "?"
    closed, old = budget.operating.set_cap(category, tokens, by=f"tokencap cap set ({who})")
    log.warning("cap of %s changed from %s to %s", category, cap_text(old), cap_text(tokens))
    click.echo(f"{category}: cap {cap_text(old)} -> {cap_text(tokens)} "
               f"({'closed' if closed else 'open'})")


@main.command()
@stack_run_options
@click.option("--out", "out_dir", default=None,
              help="The run's output folder (default: the run config's output_dir).")
@click.option("--dest", default=None, help="Where to write the report (default: --out).")
def report(state_dir: str, run_name: str | None, redis_url: str, prefix: str,
           out_dir: str | None, dest: str | None) -> None:
    """Write <dest>/<run>-report.html (self-contained) and its PNG figures: output lengths,
    finish reasons, tokens against caps, throughput and engine batch over time, the tail,
    rejected/dead by reason, cap changes. `up` writes one at the end of a run."""
    from tokencap.report import build_report

    budget = _budget(redis_url, prefix, run_name)
    out = Path(out_dir or _stored_config(budget).output_dir)
    path = build_report(budget, out, Path(dest) if dest else out)
    click.echo(f"report: {path}")


@main.command()
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
    lines in dead-letter.jsonl stay, as history. Conversation turns are not sent again (a
    turn needs the turns before it)."""
    from foundation.wire import split_turn_id

    budget = _budget(redis_url, prefix, run_name)
    known = list(budget.telemetry.status()["categories"])
    for name in categories:
        if name not in known:
            raise UnknownCategory(budget.keys.run, name)
    total = 0
    for name in categories or known:
        dead = budget.operating.dead_samples(name, reason)
        turns = [i for i in dead if split_turn_id(i)]
        moved = budget.operating.retry(name, [i for i in dead if not split_turn_id(i)], reason)
        total += moved
        left = f"; {len(turns)} conversation turn(s) stay dead" if turns else ""
        click.echo(f"{name}: {moved} dead sample(s) sent again{left}")
    if total and not budget.redis.exists(budget.keys.producer_lock):
        click.echo("no producer runs this run: `tokencap up CONFIG` (or `tokencap run CONFIG`) "
                   "feeds them again")


@main.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.pass_context
def sim(ctx: click.Context) -> None:
    """Start the SGLang simulator (no GPU); arguments go to `python -m sglang_sim`."""
    from sglang_sim.__main__ import main as sim_main

    sys.argv = ["sglang_sim", *ctx.args]
    sys.exit(sim_main())


@main.command()
@click.argument("config", type=click.Path(dir_okay=False))
@click.option("--workers", "n_workers", envvar="WORKERS", default=8, show_default=True,
              help="Consumers to start. Env: WORKERS.")
@STATE_OPT
@click.option("--budget-port", envvar="BUDGET_PORT", default=DEFAULT_BUDGET_PORT, show_default=True,
              help="Port of the budget service on 127.0.0.1 (/status, /metrics, POST /cap); "
              "0: any free port (the run file says which). Env: BUDGET_PORT.")
@click.option("--sim", "use_sim", is_flag=True,
              help="Run on the SGLang simulator (no GPU; synthetic outputs, labelled "
              "simulated) instead of SGLANG_URL.")
@click.option("--sim-time-scale", default=20.0, show_default=True,
              help="Speed-up of the simulator (with --sim).")
def up(config: str, n_workers: int, state_dir: str, budget_port: int, use_sim: bool,
       sim_time_scale: float) -> None:
    """Start what is missing (Redis, budget service, writer, workers; the simulator with
    --sim) and run CONFIG to completion with progress, then print a summary. Uses REDIS_URL
    if set, else a local redis-server with AOF (or an embedded one). The engine is SGLANG_URL
    (checked before anything is fed: reachable, served model = the tokenizer's; a busy or
    restarting one is waited for, preflight_wait_s), the simulator with --sim, or else the
    engine of the stack already running in the state dir; never the simulator by default.
    Ctrl-C stops the feeding and leaves the stack up: the same command resumes."""
    from foundation.engine import display
    from tokencap.launcher import Stack

    sglang_url = os.environ.get("SGLANG_URL")
    if use_sim and sglang_url:
        raise TokencapError("--sim and SGLANG_URL both given: choose the simulator or the "
                            "engine")
    stack = Stack(Path(state_dir))
    if not use_sim and not sglang_url:
        # the engine of the stack running here (`make up` twice), said as such
        sglang_url, use_sim = stack.running_engine()
        if not sglang_url:
            raise TokencapError("no engine: set SGLANG_URL to your SGLang or vLLM server "
                                "(http://host:30000), or pass --sim to run on the simulator "
                                "(synthetic outputs, not training data)")
        click.echo(f"[up] the engine of the stack running here: {display(sglang_url)}"
                   + (" (the simulator it started with --sim)" if use_sim else ""))
        if use_sim:
            sglang_url = None
    try:
        code = stack.up(config, n_workers, os.environ.get("REDIS_URL"), sglang_url,
                        sim_time_scale, budget_port)
    except KeyboardInterrupt:
        click.echo("tokencap: stopped (Ctrl-C) before anything was fed; what this `up` "
                   "started is stopped again", err=True)
        sys.exit(SIGNALLED)
    sys.exit(code)


@main.command()
@STATE_OPT
def down(state_dir: str) -> None:
    """Stop every process `tokencap up` started (Redis data stays under the state dir)."""
    from tokencap.launcher import Stack

    Stack(Path(state_dir)).down()


@main.command("add-workers")
@click.argument("n", type=click.IntRange(min=1))
@STATE_OPT
def add_workers(n: int, state_dir: str) -> None:
    """Add N consumers to the stack `tokencap up` started."""
    from tokencap.launcher import Stack

    Stack(Path(state_dir)).add_workers(n)


@main.command()
@STATE_OPT
def token(state_dir: str) -> None:
    """Print the budget service's bearer token of the stack `tokencap up` started (for
    POST /cap: curl -H "Authorization: Bearer $(tokencap token)" ...)."""
    from tokencap.runfile import run_file

    value = run_file(Path(state_dir)).get("TOKENCAP_TOKEN")
    if not value:
        raise TokencapError(f"no stack started by `tokencap up` in {state_dir} (no run file "
                            f"{Path(state_dir) / 'env'})")
    click.echo(value)


def _register_data_commands() -> None:
    from tokencap.cli_data import export_cmd, plan_cmd, preview_cmd

    for cmd in (export_cmd, plan_cmd, preview_cmd):
        main.add_command(cmd)


_register_data_commands()

if __name__ == "__main__":
    main()
