"""Helpers for tests and benchmarks: the simulator in a thread or in a subprocess.

``SimServer`` runs the aiohttp app in a background thread with its own event loop on a free
loopback port; its methods reach into that loop directly (no HTTP), and ``wait_until`` waits
on the engine's change notifications instead of polling. ``start_sim_subprocess`` runs
``python -m sglang_sim`` and polls ``/health`` until it answers or a deadline passes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import requests
from aiohttp import web

from sglang_sim.config import FaultConfig, SimConfig
from sglang_sim.server import (
    ENGINE_KEY,
    FAULTS_KEY,
    REQUESTS_KEY,
    reset_sim_stats,
    sim_stats,
    start_server,
)

LOOPBACK_HOST = "127.0.0.1"
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
HEALTH_POLL_INTERVAL_S = 0.05
HEALTH_REQUEST_TIMEOUT_S = 2.0
_PACKAGE_PARENT = str(Path(__file__).resolve().parent.parent)

T = TypeVar("T")


class SimServer:
    """The simulator on ``http://127.0.0.1:<free port>``, served from a background thread.

    Use as a context manager, or call :meth:`start` and :meth:`stop`. ``config`` defaults to
    the default profile; keyword overrides replace its fields (``SimServer(time_scale=100)``),
    and those named as a ``FaultConfig`` field replace that fault knob
    (``SimServer(flavor="vllm", hs_nan_rate=1.0)``).
    """

    def __init__(self, config: SimConfig | None = None, **overrides: Any) -> None:
        base = config if config is not None else SimConfig()
        fault_names = set(FaultConfig.__struct_fields__) - set(SimConfig.__struct_fields__)
        fault_changes = {k: overrides.pop(k) for k in list(overrides) if k in fault_names}
        if fault_changes:
            faults = msgspec.structs.replace(overrides.get("faults", base.faults),
                                             **fault_changes)
            overrides["faults"] = faults
        self.config = msgspec.structs.replace(base, **overrides) if overrides else base
        self.config.validate()
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name="sglang_sim", daemon=True)
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:41234``."""
        return f"http://{LOOPBACK_HOST}:{self.port}"

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def start(self) -> SimServer:
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(
            start_server(self.config, LOOPBACK_HOST, 0), self._loop
        )
        self._runner, self.port = future.result(START_TIMEOUT_S)
        return self

    def stop(self) -> None:
        """Abort what is in flight, stop serving and end the thread. Idempotent."""
        if self._runner is not None:
            runner, self._runner = self._runner, None
            asyncio.run_coroutine_threadsafe(runner.cleanup(), self._loop).result(STOP_TIMEOUT_S)
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(STOP_TIMEOUT_S)
        if not self._loop.is_closed() and not self._loop.is_running():
            self._loop.close()

    def __enter__(self) -> SimServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _app(self) -> web.Application:
        if self._runner is None:
            raise RuntimeError("SimServer is not running")
        return self._runner.app

    def call(self, fn: Callable[[web.Application], T], timeout_s: float = STOP_TIMEOUT_S) -> T:
        """Run ``fn(app)`` on the server's event loop and return its result."""
        app = self._app()

        async def _run() -> T:
            return fn(app)

        return asyncio.run_coroutine_threadsafe(_run(), self._loop).result(timeout_s)

    def stats(self) -> dict[str, Any]:
        """What ``GET /_sim/stats`` returns."""
        return self.call(sim_stats)

    def requests(self) -> list[dict[str, Any]]:
        """The sampling params of the last requests, as ``GET /_sim/requests``."""
        def read(app: web.Application) -> list[dict[str, Any]]:
            log: deque[dict[str, Any]] = app[REQUESTS_KEY]
            return list(log)

        return self.call(read)

    def reset_stats(self) -> None:
        """Zero every counter, as ``POST /_sim/reset_stats``."""
        self.call(reset_sim_stats)

    def pause(self) -> None:
        """Freeze the simulated clock (``POST /_sim/pause``)."""
        self.call(lambda app: app[ENGINE_KEY].pause())

    def resume(self) -> None:
        """Restart the simulated clock (``POST /_sim/resume``)."""
        self.call(lambda app: app[ENGINE_KEY].resume())

    def set_faults(self, **changes: Any) -> dict[str, Any]:
        """Change the named fault knobs (as ``POST /_sim/faults``); return all of them."""
        return self.call(lambda app: msgspec.to_builtins(app[FAULTS_KEY].update(changes)))

    def faults(self) -> dict[str, Any]:
        return self.call(lambda app: msgspec.to_builtins(app[FAULTS_KEY].config))

    def abort(self, rid: str = "", *, abort_all: bool = False) -> int:
        """Abort by rid prefix, like ``POST /abort_request``; return how many matched."""
        return self.call(lambda app: app[ENGINE_KEY].abort(rid, abort_all=abort_all))

    def wait_until(
        self, predicate: Callable[[dict[str, Any]], bool], timeout_s: float = 10.0
    ) -> dict[str, Any]:
        """Block until ``predicate(engine stats)`` holds (no polling); TimeoutError after."""
        engine = self._app()[ENGINE_KEY]
        future = asyncio.run_coroutine_threadsafe(
            engine.wait_until(predicate, timeout_s), self._loop
        )
        return future.result(timeout_s + STOP_TIMEOUT_S)


def free_port(host: str = LOOPBACK_HOST) -> int:
    """A port free right now on ``host`` (another process may still take it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def start_sim_subprocess(
    args: Sequence[str] = (),
    *,
    host: str = LOOPBACK_HOST,
    port: int | None = None,
    timeout_s: float = START_TIMEOUT_S,
    env: dict[str, str] | None = None,
) -> tuple[subprocess.Popen[bytes], str]:
    """Start ``python -m sglang_sim ARGS`` and wait until ``/health`` answers 200.

    Returns the process and its base URL. The caller stops it (``proc.terminate()`` then
    ``proc.wait()``). Raises RuntimeError if it exits or is not healthy within ``timeout_s``.
    """
    port = port if port is not None else free_port(host)
    child_env = dict(os.environ if env is None else env)
    child_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (_PACKAGE_PARENT, child_env.get("PYTHONPATH", "")) if p
    )
    cmd = [sys.executable, "-m", "sglang_sim", "--host", host, "--port", str(port), *args]
    proc = subprocess.Popen(cmd, env=child_env)
    url = f"http://{host}:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"sglang_sim exited with {proc.returncode}: {cmd}")
        with contextlib.suppress(requests.RequestException):
            if requests.get(f"{url}/health", timeout=HEALTH_REQUEST_TIMEOUT_S).ok:
                return proc, url
        time.sleep(HEALTH_POLL_INTERVAL_S)
    proc.terminate()
    proc.wait()
    raise RuntimeError(f"sglang_sim not healthy after {timeout_s} s: {cmd}")


def time_fraction_below(
    stats: dict[str, Any], threshold: int, *, include_idle: bool = False
) -> float:
    """Fraction of simulated time the running batch held fewer than ``threshold`` requests.

    Reads ``batch_size_sim_s`` from ``/_sim/stats``; idle time (batch 0) counts only when
    ``include_idle``. Returns 0.0 when no time was recorded.
    """
    hist = {int(b): s for b, s in stats["batch_size_sim_s"].items()}
    if not include_idle:
        hist.pop(0, None)
    total = sum(hist.values())
    below = sum(s for b, s in hist.items() if b < threshold)
    return below / total if total > 0 else 0.0


def throughput_at_batch(stats: dict[str, Any], batch: int) -> float:
    """Output tokens per simulated second while exactly ``batch`` requests were running."""
    seconds = stats["batch_size_sim_s"].get(str(batch), 0.0)
    tokens = stats["batch_size_tokens"].get(str(batch), 0)
    return tokens / seconds if seconds > 0 else 0.0


def busy_throughput(stats: dict[str, Any]) -> float:
    """Output tokens per simulated second over the time the engine was not idle."""
    busy_s = stats["busy_sim_s"]
    return stats["generated_tokens_total"] / busy_s if busy_s > 0 else 0.0
