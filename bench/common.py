"""Shared pieces of the benchmark: the harness (`testing.harness`: a private redis-server and
a whole pipeline, as the tests use them), the simulator in a subprocess, prompt sources,
result rows.

Nothing here is a pass/fail on absolute timings: every scenario measures a figure and its
baseline side by side in the same run, on the same Redis and simulator settings.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import msgspec
import psutil
from redis import Redis

from testing.harness import (
    ROOT,
    STOP_TIMEOUT_S,
    RedisServer,
    child_env,
    free_port,
)
from testing.harness import Pipeline as HarnessPipeline
from testing.harness import wait_until as _wait_until

FIXTURES = ROOT / "tests" / "fixtures"
QWEN = FIXTURES / "tokenizers" / "qwen2.5-instruct"
SHAREGPT = FIXTURES / "datasets" / "sharegpt" / "fastchat_dummy_conversation.json"
PY = sys.executable
START_TIMEOUT_S = 30.0
POLL_S = 0.02
VOCAB = 150_000
_T0 = time.monotonic()

__all__ = ["ROOT", "STOP_TIMEOUT_S", "RedisServer", "child_env", "free_port"]


def log(msg: str) -> None:
    print(f"[bench {time.monotonic() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def wait_for(cond: Callable[[], Any], what: str, timeout_s: float = START_TIMEOUT_S) -> Any:
    return _wait_until(cond, timeout_s, what, POLL_S)


# -- Redis ---------------------------------------------------------------------------------
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
    """The prompts of an input_ids source in the producer's seeded shuffled order, read as
    the producer reads them (`CategorySource`)."""
    from producer.source import CategorySource

    body = "\n".join([
        'run = "order"', f"output_dir = {json.dumps(str(path.parent))}", f"seed = {seed}",
        'sampling_defaults = "engine"', "[[category]]", 'name = "c"',
        f"source = {json.dumps(str(path))}", 'format = "input_ids"', 'cap_tokens = "none"',
        "sampling = { max_new_tokens = 1 }"]) + "\n"
    cfg = load_run_config(path.with_suffix(".order.toml"), body)
    with CategorySource.open(cfg, cfg.category[0]) as source:
        return [cast(list[int], source.read(i).prompt) for i in source.order]


def config_toml(run: str, out: Path, cats: list[Cat], sources: dict[str, Path],
                **top: Any) -> str:
    # token-id prompts, no tokenizer and no generation config: the engine's sampling
    lines = [f'run = "{run}"', f'output_dir = "{out}"', 'sampling_defaults = "engine"']
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


# -- memory --------------------------------------------------------------------------------
def mem_mb(pid: int) -> dict[str, float]:
    """RSS, PSS and USS of one process in MB (PSS from /proc/PID/smaps via psutil)."""
    info = psutil.Process(pid).memory_full_info()
    mb = 1024 * 1024
    return {"rss_mb": info.rss / mb, "pss_mb": getattr(info, "pss", 0) / mb,
            "uss_mb": info.uss / mb}


# -- the pipeline -------------------------------------------------------------------------
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

