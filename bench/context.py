"""What every benchmark scenario shares: the log, waits, the work folder with its one private
Redis (`Bench`), result rows and the machine's description.

Nothing here is a pass/fail on absolute timings: every scenario measures a figure and its
baseline side by side in the same run, on the same Redis and simulator settings.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
from redis import Redis

from bench.sources import Cat, write_ids_source
from testing.harness import RedisServer
from testing.harness import wait_until as _wait_until

PY = sys.executable
START_TIMEOUT_S = 30.0
POLL_S = 0.02
_T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[bench {time.monotonic() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def wait_for(cond: Callable[[], Any], what: str, timeout_s: float = START_TIMEOUT_S) -> Any:
    return _wait_until(cond, timeout_s, what, POLL_S)


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
