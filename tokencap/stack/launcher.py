"""`tokencap up` / `down` / `add-workers`: a local stack of processes with pid files.

State lives under the state dir (`.run/` of the current directory, `--state-dir` or
`TOKENCAP_STATE_DIR`): `pids/<name>.pid`, `logs/<name>.log`, `redis/` (AOF data of a Redis
this launcher started) and the run file `env` (mode 0600): the Redis URL, the engines, the
run, the budget service's URL and its bearer token. Every other command reads the run file
(`run_file`) for what it is not given, so a second shell in the same directory finds the
stack. Whatever is given through REDIS_URL / SGLANG_URL is used as is and never stopped.

A process of the stack counts as running only while it is the process its pid file records
(`tokencap.stack.processes`: pid and start time; for Redis also the port answering with the
stack's data folder), so after the whole stack was killed at once (a node that rebooted or
ran out of memory) the same `up` starts everything again, Redis on its port from its AOF.
`up` runs the config through the one stage runner (`tokencap/stack/stage.py`): while it
feeds, a writer, budget service, simulator or worker that died is started again (the
stack's supervisor, `tokencap/stack/supervisor.py`). When the config names an extraction
server the hidden-state stage runs beside it (`StatesBeside`): from the moment a category
of generation ends, each category's states as its generation ends, the rest still
generating; `up` ends when both have.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

from foundation.config import DEFAULT_BUDGET_PORT, RunConfig
from foundation.errors import SIGNALLED, RunNotFound, SourceError, StackBusy, TokencapError
from foundation.redisconn import connect, redact
from foundation.stopping import StopFlag
from tokencap import extraction
from tokencap.reports.progress import ProgressPrinter, nothing_usable, summary_table
from tokencap.stack import processes
from tokencap.stack.localredis import free_port, free_port_of, port_free
from tokencap.stack.runfile import RUN_FILE, run_file, stop_hint
from tokencap.stack.services import PROGRAMS, START_TIMEOUT_S, Services, sim_family
from tokencap.stack.stage import Stage, StageRun, StatesBeside
from tokencap.stack.supervisor import Supervisor, tokencap_argv

log = logging.getLogger(__name__)

__all__ = ["START_TIMEOUT_S", "Stack"]

STOP_TIMEOUT_S = 10.0
POLL_S = 0.1
STACK_LOCK = "lock"  # `down` holds it while it stops the stack: `up` starts nothing meanwhile


class NothingToStop(RunNotFound):
    """`down` in a state dir where no stack runs (said with where it looked)."""


def say(line: str) -> None:
    print(f"[up] {line}", flush=True)


class Stack:
    def __init__(self, state_dir: Path) -> None:
        self.dir = state_dir
        self.env_file = state_dir / RUN_FILE
        self.procs = processes.Table(state_dir, PROGRAMS, "tokencap.cli")
        self.sup = Supervisor(self.procs)
        self.services = Services(state_dir, self.sup, say)
        self.fed = False  # `up` got as far as starting the run's processes

    # -- the run file and the lock -------------------------------------------------------
    def _read_env(self) -> dict[str, str]:
        return run_file(self.dir)

    def _write_env(self, env: dict[str, str]) -> None:
        """The run file, created 0600 (it holds the token and any password in the URLs)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.env_file.with_suffix(".tmp")
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("".join(f"{k}={v}\n" for k, v in sorted(env.items())))
        os.replace(tmp, self.env_file)

    @contextlib.contextmanager
    def _locked(self, wait: bool) -> Iterator[bool]:
        """The state dir's lock (`down` holds it while it stops the stack); yields whether
        it was taken."""
        self.dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.dir / STACK_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)  # drops the lock

    @contextlib.contextmanager
    def _tending(self, first: bool) -> Iterator[bool]:
        """Whether the stack may start processes now: not while `down` stops it (it holds
        the lock, then removes the run file)."""
        with self._locked(wait=first) as locked:
            yield locked and self.env_file.exists()

    # -- what runs here ------------------------------------------------------------------
    def running_engine(self) -> tuple[str | None, bool]:
        """The engine of the stack running in this state dir (its run file's, while its
        budget service or simulator lives), and whether it is the simulator `up --sim`
        started; (None, False) when no stack runs here."""
        saved = self._read_env()
        url = saved.get("SGLANG_URL")
        if not url:
            return None, False
        if self.procs.alive("sim"):
            return url, True
        return (url, False) if self.procs.alive("budget") else (None, False)

    def add_workers(self, n: int) -> None:
        """N more workers on the stack's run (`tokencap add-workers`: the `up` that feeds
        keeps them running from its next look)."""
        env = self._read_env()
        if not env.get("REDIS_URL"):
            raise TokencapError("no stack is running here (start one with `make up`)")
        env = {k: v for k, v in env.items() if k != "TOKENCAP_TOKEN"}
        slots = self.procs.names("worker-")
        first = int(slots[-1].rsplit("-", 1)[1]) + 1 if slots else 0
        for i in range(first, first + n):
            self.procs.spawn(f"worker-{i}", tokencap_argv("worker"), {**os.environ, **env})
        say(f"{n} worker(s) started ({len(slots) + n} in all)")

    # -- up ------------------------------------------------------------------------------
    def up(self, cfg: RunConfig, n_workers: int, redis_url: str | None, sglang_url: str | None,
           time_scale: float, budget_port: int = DEFAULT_BUDGET_PORT) -> int:
        """Start what is missing and run `config` to the end. When it fails before anything is
        fed (a bad config, an unusable engine, another producer), what this call started
        (Redis, the simulator) is stopped again."""
        self.fed = False
        before = self._read_env()
        try:
            return self._up(cfg, n_workers, redis_url, sglang_url, time_scale, budget_port)
        except (TokencapError, KeyboardInterrupt):
            if not self.fed:
                if self.procs.spawned:
                    say(f"stopping what it started: {', '.join(self.procs.spawned)}")
                    # Redis last: nothing else may still need it
                    self._stop(sorted(self.procs.spawned, key=lambda n: n == "redis"))
                # the run file says again what it said before this call
                if before and "redis" not in self.procs.spawned:
                    self._write_env(before)
                else:
                    self.env_file.unlink(missing_ok=True)
            raise

    def _budget_port(self, saved: dict[str, str], port: int) -> int:
        """The budget service's port: the running one's, else `port` (0: any free one, or
        the one it had before a crash), refused when another process holds it."""
        if self.procs.alive("budget") and saved.get("BUDGET_URL"):
            return urlsplit(saved["BUDGET_URL"]).port or port
        if port == 0:
            return free_port_of(saved.get("BUDGET_URL")) or free_port()
        if not port_free("127.0.0.1", port):
            raise TokencapError(f"port {port} is taken (another budget service?): give the "
                                "budget service another one with --budget-port PORT "
                                "(TOKENCAP_BUDGET_PORT), or --budget-port 0 for any free port")
        return port

    def _serving(self) -> list[str]:
        """The stack's processes that run (its workers, writer, budget service)."""
        return [n for n in self.procs.names() if n not in ("redis", "sim")
                and self.procs.alive(n)]

    def _refuse_another_run(self, cfg: RunConfig, saved: dict[str, str],
                            redis_url: str | None) -> None:
        """`StackBusy` when this stack's processes serve another run than `cfg`'s (its
        workers and writer take only that run's queues: the new run would wait forever),
        naming it and the two ways out; nothing is started and the run file is kept."""
        run, prefix = saved.get("TOKENCAP_RUN"), saved.get("TOKENCAP_PREFIX")
        other_redis = bool(redis_url) and redis_url != saved.get("REDIS_URL")
        if not run or (run == cfg.run and prefix == cfg.key_prefix and not other_redis):
            return
        serving = self._serving()
        if not serving:
            return
        raise StackBusy(
            f"the stack in {self.dir.resolve()} serves run {run!r} (prefix {prefix}; running: "
            f"{', '.join(serving)}): its workers and writer take only that run's queues, so "
            f"run {cfg.run!r} would wait for ever. Stop it first ({stop_hint(self.dir)}), or "
            f"give {cfg.run!r} a stack of its own beside it: `tokencap up CONFIG --state-dir "
            f".run-{cfg.run} --budget-port 0`")

    def _up(self, cfg: RunConfig, n_workers: int, redis_url: str | None, sglang_url: str | None,
            time_scale: float, budget_port: int) -> int:
        saved = self._read_env()
        self._refuse_another_run(cfg, saved, redis_url)
        port = self._budget_port(saved, budget_port)
        token = (saved.get("TOKENCAP_TOKEN") or os.environ.get("TOKENCAP_TOKEN")
                 or secrets.token_urlsafe(24))
        rurl = self.services.redis(redis_url, saved)
        eurl = sglang_url or self.services.simulator(saved, time_scale, cfg.tokenizer,
                                                     sim_family(cfg))
        env = {"REDIS_URL": rurl, "SGLANG_URL": eurl, "TOKENCAP_RUN": cfg.run,
               "TOKENCAP_PREFIX": cfg.key_prefix}
        self._write_env({**env, "BUDGET_URL": f"http://127.0.0.1:{port}",
                         "TOKENCAP_TOKEN": token})
        say(f"queues and workers: `tokencap rq-info` (= rq info --url {redact(rurl)})")
        budget_env = {**os.environ, **env, "TOKENCAP_TOKEN": token}
        redis = connect(rurl)
        stopped = StopFlag()
        catching = contextlib.ExitStack()

        def before_start() -> None:
            # the config, tokenizer and sources are checked and the run created: from here a
            # stop ends the feeding cleanly, and the stack stays up
            self.fed = True
            catching.enter_context(stopped.catch())

        def also_tend(first: bool) -> None:
            self.services.budget_service(port, budget_env, first)
            self.services.tend_simulator()

        gen = StageRun(Stage(cfg, rurl, eurl, n_workers, whose="this stack's"),
                       redis, self.sup, keep=True, say=say, also_tend=also_tend,
                       guard=self._tending)
        beside = self._states_beside(cfg, rurl, n_workers, stopped)
        with catching:
            try:
                status = gen.run(on_progress=ProgressPrinter(),
                                 should_stop=lambda: bool(stopped), before_start=before_start,
                                 on_states=beside.poll if beside else None)
            except BaseException:
                if beside is not None:
                    beside.abort()
                raise
            print(summary_table(status), flush=True)
            if stopped:
                if beside is not None:
                    beside.abort()
                say(f"stopped ({stopped.by}) before the end: nothing more is fed; the stack "
                    "still runs (workers finish the samples they hold, the writer writes "
                    f"them). The same command resumes; {stop_hint(self.dir)} stops the stack.")
                return SIGNALLED
            failed: TokencapError | None = None
            if beside is not None:  # every category's rows listed, the stage to its end
                try:
                    states = beside.wait()
                except TokencapError as exc:  # said when it happened; its exit code below
                    failed = exc
                else:
                    if states is not None:
                        print(summary_table(states), flush=True)
            self._report(gen, cfg)
            say(f"results in {cfg.output_dir}; {stop_hint(self.dir)} stops the stack")
            why = nothing_usable(status, cfg.output_dir)
            if why:
                say(why)
                return SourceError.exit_code
            if failed is not None:
                raise failed
            if stopped:  # during the hidden-state stage
                return SIGNALLED
        return 0 if status.ended else 1

    def _states_beside(self, cfg: RunConfig, redis_url: str, n_workers: int,
                       stopped: StopFlag) -> StatesBeside | None:
        """The config's hidden-state stage, to run beside generation (its own workers and
        writer, as many workers as the stack's, stopped at its end); None, saying how to
        run it later, when the config has none or names no extraction server."""
        if cfg.hidden_states is None:
            return None
        urls = extraction.extract_urls(extraction.StatesStage.of(cfg))
        if not urls:
            say("[hidden_states] has no engine_url (nor TOKENCAP_EXTRACT_URL): no states "
                "extracted; `tokencap hidden-states CONFIG --extract-url URL` does it after")
            return None
        say(f"hidden states of {cfg.run}'s rows from {', '.join(urls)}: each category's as "
            "its generation ends")
        return StatesBeside(cfg, redis_url, n_workers, self.sup, say=say,
                            should_stop=lambda: bool(stopped),
                            on_progress=ProgressPrinter(tag="hidden states"))

    @staticmethod
    def _report(gen: StageRun, cfg: RunConfig) -> None:
        """Write the run's report (its hidden-state stage's with it), unless the one there is
        newer than every output file (a rerun of a finished run: drawing it again takes
        seconds of matplotlib)."""
        out, run = Path(cfg.output_dir), cfg.run
        report = out / f"{run}-report.html"
        try:
            outs = [out] + ([Path(cfg.hidden_states.output_dir)] if cfg.hidden_states else [])
            files = [p.stat().st_mtime for o in outs for p in o.glob("*/*.jsonl")]
            if report.exists() and report.stat().st_mtime >= max(files, default=0.0):
                say(f"report: {report} (no new results since it was written)")
                return
            from tokencap.reports.report import build_report

            say(f"report: {build_report(gen.budget, out, out)}")
        except Exception as exc:  # a report that cannot be drawn never fails the run
            log.warning("the run's report was not written: %s", exc)

    # -- down ----------------------------------------------------------------------------
    def down(self) -> None:
        """Stop every process of the stack (Redis last). A pid file that names no process of
        the stack any more (killed, or the node restarted) is only removed: its pid may be
        another process's now."""
        names = self.procs.names()
        if not names:
            raise NothingToStop(f"nothing to stop: no pid file of a stack in "
                                f"{(self.dir / 'pids').resolve()} (a stack started elsewhere: "
                                "`tokencap down --state-dir DIR`)")
        with self._locked(wait=True):
            # first, so that an `up` still feeding starts nothing again
            self.env_file.unlink(missing_ok=True)
            # stop Redis last: workers finishing their sample still need it
            self._stop([n for n in names if n != "redis"])
            self._stop([n for n in names if n == "redis"])

    def _stop(self, names: list[str]) -> None:
        live = self.procs.stop(names, STOP_TIMEOUT_S, POLL_S)
        for name in names:
            print(f"[down] stopped {name}" if name in live
                  else f"[down] {name} was not running (stale pid file removed)")
