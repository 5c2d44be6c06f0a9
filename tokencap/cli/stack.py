"""The stack's commands: `up`, `down`, `add-workers`, `token`, `sim` (wiring only; the
stack is `tokencap/stack/`)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from foundation.config import DEFAULT_BUDGET_PORT, RunConfig
from foundation.errors import SIGNALLED, TokencapError
from tokencap.cli.errors import Command
from tokencap.cli.find_run import CONFIG, STATE_OPT


@click.command(cls=Command, context_settings={"ignore_unknown_options": True,
                                             "allow_extra_args": True})
@click.pass_context
def sim(ctx: click.Context) -> None:
    """Start the SGLang simulator (no GPU); arguments go to `python -m sglang_sim`."""
    from sglang_sim.__main__ import main as sim_main

    sys.argv = ["sglang_sim", *ctx.args]
    sys.exit(sim_main())


RENAMED_ENV = {"WORKERS": "TOKENCAP_WORKERS", "BUDGET_PORT": "TOKENCAP_BUDGET_PORT"}


def _warn_renamed_env() -> None:
    """The environment variables renamed with the TOKENCAP_ prefix: the old names are read
    for one more version, with a line saying so."""
    for old, new in RENAMED_ENV.items():
        if old in os.environ and new not in os.environ:
            click.echo(f"[up] {old} is read for one more version: set {new} instead", err=True)


@click.command(cls=Command)
@click.argument("config", type=CONFIG)
@click.option("--workers", "n_workers", envvar=["TOKENCAP_WORKERS", "WORKERS"], default=8,
              show_default=True, help="Consumers to start. Env: TOKENCAP_WORKERS.")
@STATE_OPT
@click.option("--redis-url", envvar="REDIS_URL", default=None,
              help="Redis to use (redis://, rediss://, unix://). Env: REDIS_URL. Default: a "
              "local redis-server with AOF under the state dir.")
@click.option("--sglang-url", envvar="SGLANG_URL", default=None,
              help="The engine(s), comma separated (sglang+/openai+ prefixes). Env: "
              "SGLANG_URL. Default: the engine of the stack running here, if any.")
@click.option("--budget-port", envvar=["TOKENCAP_BUDGET_PORT", "BUDGET_PORT"],
              default=DEFAULT_BUDGET_PORT, show_default=True,
              help="Port of the budget service on 127.0.0.1 (/status, /metrics, POST /cap); "
              "0: any free port (the run file says which). Env: TOKENCAP_BUDGET_PORT.")
@click.option("--sim", "use_sim", is_flag=True,
              help="Run on the SGLang simulator (no GPU; synthetic outputs, labelled "
              "simulated) instead of SGLANG_URL.")
@click.option("--sim-time-scale", default=20.0, show_default=True,
              help="Speed-up of the simulator (with --sim).")
def up(config: RunConfig, n_workers: int, state_dir: str, redis_url: str | None,
       sglang_url: str | None, budget_port: int, use_sim: bool, sim_time_scale: float) -> None:
    """Start what is missing (Redis, budget service, writer, workers; the simulator with
    --sim) and run CONFIG to completion with progress, then print a summary. Uses REDIS_URL
    if set, else a local redis-server with AOF (or an embedded one). The engine is SGLANG_URL
    (checked before anything is fed: reachable, served model = the tokenizer's; a busy or
    restarting one is waited for, preflight_wait_s), the simulator with --sim, or else the
    engine of the stack already running in the state dir; never the simulator by default.
    Ctrl-C stops the feeding and leaves the stack up: the same command resumes, also after
    a crash of the whole stack (pid files name a process by pid and start time: stale ones
    are replaced). While it feeds, a writer, budget service, simulator or worker of the
    stack that dies is started again."""
    from foundation.engine.api import display
    from tokencap.stack.launcher import Stack

    _warn_renamed_env()
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
        code = stack.up(config, n_workers, redis_url, sglang_url,
                        sim_time_scale, budget_port)
    except KeyboardInterrupt:
        click.echo("tokencap: stopped (Ctrl-C) before anything was fed; what this `up` "
                   "started is stopped again", err=True)
        sys.exit(SIGNALLED)
    sys.exit(code)


@click.command(cls=Command, )
@STATE_OPT
def down(state_dir: str) -> None:
    """Stop every process `tokencap up` started (Redis data stays under the state dir)."""
    from tokencap.stack.launcher import Stack

    Stack(Path(state_dir)).down()


@click.command("add-workers", cls=Command)
@click.argument("n", type=click.IntRange(min=1))
@STATE_OPT
def add_workers(n: int, state_dir: str) -> None:
    """Add N consumers to the stack `tokencap up` started."""
    from tokencap.stack.launcher import Stack

    Stack(Path(state_dir)).add_workers(n)


@click.command(cls=Command, )
@STATE_OPT
def token(state_dir: str) -> None:
    """Print the budget service's bearer token of the stack `tokencap up` started (for
    POST /cap: curl -H "Authorization: Bearer $(tokencap token)" ...)."""
    from tokencap.stack.runfile import run_file

    value = run_file(Path(state_dir)).get("TOKENCAP_TOKEN")
    if not value:
        raise TokencapError(f"no stack started by `tokencap up` in {state_dir} (no run file "
                            f"{Path(state_dir) / 'env'})")
    click.echo(value)


@click.command("rq-info", cls=Command)
@click.argument("rq_args", nargs=-1, type=click.UNPROCESSED)
@STATE_OPT
def rq_info(rq_args: tuple[str, ...], state_dir: str) -> None:
    """RQ's `rq info` (queues, workers, jobs) on the Redis of the stack `tokencap up` started
    here (its run file's REDIS_URL). RQ_ARGS go to `rq info` after `--`
    (`tokencap rq-info -- -i 2`: every 2 s)."""
    import subprocess

    from tokencap.stack.runfile import RUN_FILE, run_file

    url = run_file(Path(state_dir)).get("REDIS_URL")
    if not url:
        raise TokencapError(f"no stack started by `tokencap up` in {Path(state_dir).resolve()} "
                            f"(no run file {Path(state_dir).resolve() / RUN_FILE}); for another "
                            "Redis: rq info --url URL")
    sys.exit(subprocess.call([sys.executable, "-m", "rq.cli", "info", "--url", url,
                              *rq_args]))
