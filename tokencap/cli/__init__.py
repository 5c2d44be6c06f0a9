"""The `tokencap` command: wiring only. Every option has an environment twin.

Here: the group and the commands of the stack (`up`, `down`, `add-workers`, `token`, `sim`);
the stages' commands are `tokencap.cli.stages`, those that look at or steer a run
`tokencap.cli.ops`, the data commands `tokencap.cli.offline`; the options they share
`tokencap.cli.find_run`.

Exit codes: `foundation.errors.exit_codes()`, shown at the foot of `tokencap --help`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import click

from foundation.config import DEFAULT_BUDGET_PORT
from foundation.errors import SIGNALLED, TokencapError, exit_codes_text
from tokencap import logs
from tokencap.cli.find_run import STATE_OPT


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
              type=click.Choice(logs.LEVELS, case_sensitive=False),
              help="Logging level. Env: TOKENCAP_LOG_LEVEL.")
@click.version_option(package_name="tokencap")
def main(log_level: str) -> None:
    """tokencap: token-budgeted LLM data generation over Redis queues.

    A producer tokenizes prompts and feeds one RQ queue per category; workers send them to
    SGLang's /generate with input_ids and count tokens exactly once per category; each
    category stops at its token cap. Start everything locally with `tokencap up CONFIG`.
    """
    logs.setup(log_level)


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
    Ctrl-C stops the feeding and leaves the stack up: the same command resumes, also after
    a crash of the whole stack (pid files name a process by pid and start time: stale ones
    are replaced). While it feeds, a writer, budget service, simulator or worker of the
    stack that dies is started again."""
    from foundation.engine_api import display
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


def _register_commands() -> None:
    from tokencap.cli.offline import audit_cmd, export_cmd, plan_cmd, preview_cmd
    from tokencap.cli.ops import cap, report, retry, status
    from tokencap.cli.stages import run, serve, worker, writer

    for cmd in (run, worker, writer, status, serve, cap, report, retry,
                export_cmd, plan_cmd, preview_cmd, audit_cmd):
        main.add_command(cmd)


_register_commands()
