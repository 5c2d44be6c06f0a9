"""What the benchmark measures a pipeline with: Redis's counters, a process's memory, the
harness's pipeline as `tokencap run` drives it, a sampler thread, a measured window."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
from redis import Redis

from bench.sim import Sim
from producer.feeder import Producer
from testing.harness import STOP_TIMEOUT_S
from testing.harness import Pipeline as HarnessPipeline


def counters(client: Redis) -> dict[str, float]:
    """Commands, round trips (server socket writes), Redis CPU and memory right now."""
    stats, cpu, mem = (client.info(s) for s in ("stats", "cpu", "memory"))
    return {
        "commands": stats["total_commands_processed"],
        "round_trips": stats["total_writes_processed"],
        "cpu_s": cpu["used_cpu_user"] + cpu["used_cpu_sys"],
        "used_memory": mem["used_memory"],
    }


def commandstats(client: Redis) -> dict[str, int]:
    raw = client.info("commandstats")
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in raw.items()}


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0) for k in after}


def mem_mb(pid: int) -> dict[str, float]:
    """RSS, PSS and USS of one process in MB (PSS from /proc/PID/smaps via psutil)."""
    info = psutil.Process(pid).memory_full_info()
    mb = 1024 * 1024
    return {"rss_mb": info.rss / mb, "pss_mb": getattr(info, "pss", 0) / mb,
            "uss_mb": info.uss / mb}


class Pipeline(HarnessPipeline):
    """The harness's pipeline as `tokencap run` drives it: the producer's default tick,
    worker output to `log_path`, workers registered before `start_workers` returns."""

    def __init__(self, cfg: Any, redis_url: str, engine_url: str | list[str],
                 log_path: Path) -> None:
        from producer.feeder import IDLE_TICK_S

        urls = [engine_url] if isinstance(engine_url, str) else engine_url
        super().__init__(cfg, redis_url, urls, log_path=log_path, poll_s=IDLE_TICK_S)
        self.budget.feeding.init_run(cfg)

    def start_workers(self, n: int, wait: bool = True) -> Any:
        return super().start_workers(n, wait=wait)

    def start(self, workers: int, *idle: Sim) -> Producer:
        """Where a measurement starts: the producer built, the writer and `workers` workers
        started, and each simulator of `idle` with nothing left running. The producer."""
        producer = self.build()
        self.start_writer()
        self.start_workers(workers)
        for sim in idle:
            sim.wait_idle()
        return producer


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
