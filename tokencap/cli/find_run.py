"""What the `tokencap` commands share: a run config argument (`ConfigFile`: loaded and
checked once, where the command's options are read), the options that find a run
(--state-dir, --redis-url, --sglang-url, --run, --prefix; each falls back on the stack's run
file) and the lookup of the run and its `Budget` in Redis.

A run is always named before it is touched: `open_budget` says which run, on which Redis
(password hidden) and under which prefix, and where each came from (a flag or its
environment variable, the stack's run file, or a default); a command that changes a run
refuses one it found only by a fallback (the default Redis, or the only run there), naming
the flag that would make it explicit."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from foundation.config import DEFAULT_KEY_PREFIX
from foundation.errors import RunNotFound, TokencapError
from foundation.redisconn import DEFAULT_REDIS_URL

if TYPE_CHECKING:
    from budget_service.budget import Budget
    from foundation.config import RunConfig

STATE_META = "tokencap.state_dir"
SOURCE_META = "tokencap.source."  # + a run-file key: where the option's value came from
FLAG, RUN_FILE, DEFAULT = "flag", "run file", "default"


class ConfigFile(click.ParamType):
    """A run config file, loaded (`foundation.config.load_config`): a mistake in it is the
    command's one line (file, field, exit 2) before the command does anything."""

    name = "CONFIG"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> RunConfig:
        from foundation.config import RunConfig, load_config

        if isinstance(value, RunConfig):
            return value
        return load_config(value)


CONFIG = ConfigFile()


class Count(click.ParamType):
    """A count of tokens as people write it: 10000000, 10_000_000, 10M, 500K, 1.5B."""

    name = "TOKENS"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> int:
        from foundation.units import parse_count

        try:
            count = parse_count(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)
        if count < 1:
            self.fail(f"{value!r}: at least 1 token", param, ctx)
        return count


COUNT = Count()


def _remember_state_dir(ctx: click.Context, _param: click.Parameter, value: str) -> str:
    ctx.meta[STATE_META] = value
    return value


def _from_run_file(key: str, default: str | None = None) -> Any:
    """An option's value when it is not given: the run file of the stack (`tokencap.stack.runfile`),
    else `default`."""
    def callback(ctx: click.Context, _param: click.Parameter, value: Any) -> Any:
        if value:
            ctx.meta[SOURCE_META + key] = FLAG
            return value
        from tokencap.stack.runfile import run_file, state_dir

        found = run_file(state_dir(ctx.meta.get(STATE_META))).get(key)
        ctx.meta[SOURCE_META + key] = RUN_FILE if found else DEFAULT
        return found or default
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
PREFIX_OPT = click.option("--prefix", envvar="TOKENCAP_PREFIX", default=None,
                          callback=_from_run_file("TOKENCAP_PREFIX", DEFAULT_KEY_PREFIX),
                          help="Redis key prefix. Env: TOKENCAP_PREFIX. Default: the stack's "
                          f"run file, else {DEFAULT_KEY_PREFIX}.")


def stack_run_options(command: Any) -> Any:
    """--state-dir, --run, --redis-url and --prefix: the run of the stack `up` started here,
    for the commands that act on a running or finished run."""
    for option in (PREFIX_OPT, REDIS_OPT, RUN_OPT, STATE_OPT):
        command = option(command)
    return command


def looked_where(redis_url: str, prefix: str) -> str:
    """Where a command looked for a run, for a line that says it found none: the Redis
    (password hidden), the prefix, and the stack's run file it read (or found none in)."""
    from foundation.redisconn import redact
    from tokencap.stack.runfile import RUN_FILE, state_dir

    ctx = click.get_current_context(silent=True)
    folder = state_dir((ctx.meta if ctx is not None else {}).get(STATE_META))
    run_file = (folder / RUN_FILE).resolve()
    read = "read" if run_file.is_file() else "none there"
    return (f"looked in Redis {redact(redis_url)} under prefix {prefix!r}, and for a stack's "
            f"run file at {run_file} ({read}; another stack: --state-dir DIR, or --redis-url "
            "and --run)")


def _resolve_run(redis: Any, redis_url: str, prefix: str, run_name: str | None) -> str:
    """`run_name`, else the only run under `prefix` in this Redis (its hidden-state stage
    beside it)."""
    from budget_service.keys import Keys
    from foundation.config import STATES_RUN_SUFFIX

    if run_name:
        return run_name
    runs = sorted(
        Keys.run_of_meta(prefix, k.decode())
        for k in redis.scan_iter(match=Keys.runs_pattern(prefix), count=1000)
    )
    # a run's hidden-state stage (`<run>.hs`) is shown with the run: not another run
    alone = [r for r in runs
             if not (r.endswith(STATES_RUN_SUFFIX) and r.removesuffix(STATES_RUN_SUFFIX) in runs)]
    if len(alone) == 1:
        return alone[0]
    if not runs:
        raise RunNotFound(f"no tokencap run: {looked_where(redis_url, prefix)}")
    raise TokencapError(f"several runs in Redis ({', '.join(runs)}): pick one with --run")


def stored_config(budget: Budget) -> RunConfig:
    cfg = budget.load_config()
    if cfg is None:
        raise RunNotFound(f"run {budget.keys.run!r} has no stored config in Redis")
    return cfg


def _sources() -> dict[str, str]:
    """Where this command's connection settings came from (FLAG, RUN_FILE or DEFAULT)."""
    ctx = click.get_current_context(silent=True)
    meta = ctx.meta if ctx is not None else {}
    return {key: meta.get(SOURCE_META + key, FLAG)
            for key in ("REDIS_URL", "TOKENCAP_RUN", "TOKENCAP_PREFIX")}


def open_budget(redis_url: str, prefix: str, run_name: str | None,
                changes: str = "") -> Any:
    """The run's `Budget`, after one line on stderr naming the run, the Redis and the prefix
    it acts on and where they came from. `changes` (what the command is about to do, e.g.
    "change a cap"): refused when the run was found only by a fallback."""
    from budget_service.budget import Budget
    from budget_service.keys import Keys
    from foundation.redisconn import connect, redact

    sources = _sources()
    redis = connect(redis_url)
    run = _resolve_run(redis, redis_url, prefix, run_name)
    found_by = {"run": "the only run in this Redis" if not run_name
                else sources["TOKENCAP_RUN"],
                "redis": sources["REDIS_URL"], "prefix": sources["TOKENCAP_PREFIX"]}
    click.echo(f"run {run} on {redact(redis_url)} (prefix {prefix}; run from "
               f"{found_by['run']}, Redis from {found_by['redis']})", err=True)
    if changes:
        guessed = [what for what, src in (("--run", found_by["run"]),
                                          ("--redis-url", found_by["redis"]))
                   if src in (DEFAULT, "the only run in this Redis")]
        if guessed:
            raise TokencapError(
                f"will not {changes} on run {run!r} found only by a fallback (no run file "
                f"in this folder's state dir, no {' or '.join(guessed)}): name it with "
                f"--run {run} --redis-url {redact(redis_url)}, or run this in the folder of "
                "the stack `tokencap up` started")
    budget = Budget(redis, Keys(prefix, run))
    if not budget.has_run():
        raise RunNotFound(f"run {run!r} not found: {looked_where(redis_url, prefix)}")
    return budget
