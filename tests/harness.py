"""A whole pipeline for tests: real Redis, the simulator, real worker processes, the real
producer and writer. Only the GPU server is simulated."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rq import Queue, Worker

from budget_service.budget import Budget
from budget_service.keys import Keys
from consumers.writer import Writer
from producer.feeder import Producer
from producer.run import build_producer
from tokencap.config import RunConfig, load_config
from tokencap.redisconn import connect

ROOT = Path(__file__).resolve().parents[1]


def write_config(tmp: Path, body: str, name: str = "run.toml") -> RunConfig:
    path = tmp / name
    path.write_text(body)
    return load_config(path)


class Pipeline:
    def __init__(self, cfg: RunConfig, redis_url: str, engine_urls: list[str]) -> None:
        self.cfg = cfg
        self.redis_url = redis_url
        self.engines = engine_urls
        self.redis = connect(redis_url)
        self.keys = Keys(cfg.key_prefix, cfg.run)
        self.budget = Budget(self.redis, self.keys)
        self.workers: list[subprocess.Popen] = []
        self.writer: Writer | None = None
        self._writer_thread: threading.Thread | None = None
        self.producer: Producer | None = None

    # -- processes ---------------------------------------------------------------------
    def env(self) -> dict[str, str]:
        return {**os.environ, "REDIS_URL": self.redis_url, "SGLANG_URL": ",".join(self.engines),
                "TOKENCAP_RUN": self.cfg.run, "TOKENCAP_PREFIX": self.cfg.key_prefix,
                "TOKENCAP_LOG_LEVEL": "WARNING", "PYTHONPATH": str(ROOT)}

    def start_workers(self, n: int) -> list[subprocess.Popen]:
        self.budget.init_run(self.cfg)
        new = [subprocess.Popen([sys.executable, "-m", "tokencap.cli", "worker"], env=self.env(),
                                stdin=subprocess.DEVNULL, start_new_session=True)
               for _ in range(n)]
        self.workers.extend(new)
        return new

    def start_writer(self) -> Writer:
        self.budget.init_run(self.cfg)
        self.writer = Writer(self.redis, self.keys, [c.name for c in self.cfg.category],
                             Path(self.cfg.output_dir))
        self._writer_thread = threading.Thread(target=self.writer.run, daemon=True)
        self._writer_thread.start()
        return self.writer

    def stop_writer(self) -> None:
        if self.writer and self._writer_thread:
            self.writer.stop_event.set()
            self._writer_thread.join(10)
            self.writer.close()
            self.writer = None

    def build(self) -> Producer:
        self.producer = build_producer(self.cfg, self.redis, self.cfg.context_length)
        return self.producer

    def run(self, should_stop: Callable[[], bool] = lambda: False) -> dict[str, Any]:
        producer = self.producer or self.build()
        return producer.run(poll_s=0.02, progress_s=3600, should_stop=should_stop)

    def kill_workers(self, sig: int = signal.SIGKILL) -> None:
        for p in self.workers:
            if p.poll() is None:
                os.killpg(p.pid, sig)
        for p in self.workers:
            p.wait(30)
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
                p.wait(30)
        self.workers = [p for p in self.workers if p.pid != pid]

    def close(self) -> None:
        self.kill_workers(signal.SIGKILL)
        self.stop_writer()

    # -- checks ------------------------------------------------------------------------
    def records(self, category: str) -> list[dict[str, Any]]:
        out = []
        for part in sorted((Path(self.cfg.output_dir) / category).glob("part-*.jsonl")):
            out.extend(json.loads(line) for line in part.read_text().splitlines() if line)
        return out

    def dead_letters(self, category: str) -> list[dict[str, Any]]:
        path = Path(self.cfg.output_dir) / category / "dead-letter.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line]

    def check_invariants(self, status: dict[str, Any]) -> None:
        """Every fed sample has exactly one terminal state; used == sum of files; no dup ids;
        nothing pending; fed samples are a prefix of the shuffled order (no gaps)."""
        for cat in self.cfg.category:
            st = status["categories"][cat.name]
            recs = self.records(cat.name)
            ids = [r["id"] for r in recs]
            assert len(ids) == len(set(ids)), f"{cat.name}: duplicate ids in output"
            assert st["used"] == sum(r["counted_tokens"] for r in recs), cat.name
            assert st["samples"] == len(recs), cat.name
            assert st["pending"] == 0 and st["reserved"] == 0 and st["in_flight"] == 0
            assert st["state"] in ("closed", "exhausted"), (cat.name, st)
            ck = self.keys.cat(cat.name)
            final = {k.decode(): v.decode() for k, v in self.redis.hgetall(ck.final).items()}
            committed = {k for k, v in final.items() if v.startswith("c:")}
            assert committed == set(ids), f"{cat.name}: Redis and files disagree"
            dead = {d["id"] for d in self.dead_letters(cat.name)}
            assert dead == {k for k, v in final.items() if v[0] in "rd"}, cat.name
            assert st["skipped"] == sum(1 for v in final.values() if v == "s")
            queue = Queue(self.keys.queue_name(cat.name), connection=self.redis)
            assert self.redis.zcard(queue.started_job_registry.key) == 0, "started registry"
            assert self.redis.llen(queue.intermediate_queue_key) == 0, "intermediate queue"
            feed = self.producer.feeds[cat.name] if self.producer else None
            if feed is not None:
                from producer.readers import sample_id

                fed = {sample_id(feed.index, feed.order[i]) for i in range(feed.cursor)}
                assert fed <= set(final), f"{cat.name}: a fed sample has no terminal state"


@contextlib.contextmanager
def started(cfg: RunConfig, redis_url: str, engines: list[str], workers: int) -> Iterator[Pipeline]:
    """A built pipeline with its writer and `workers` worker processes, closed on exit."""
    pipe = Pipeline(cfg, redis_url, engines)
    try:
        pipe.build()
        pipe.start_writer()
        pipe.start_workers(workers)
        yield pipe
    finally:
        pipe.close()
