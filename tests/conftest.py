"""Shared fixtures: a private redis-server per test session, fixture paths, configs.

The server is started by us on a free loopback port (never the machine's 6379), so
`flushdb` between tests only touches our own instance.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis import Redis

from tokencap.launcher import find_redis_server, free_port

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
QWEN = FIXTURES / "tokenizers" / "qwen2.5-instruct"
DATASETS = FIXTURES / "datasets"
START_TIMEOUT_S = 20.0

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


class RedisServer:
    """A redis-server process of our own, on a free port, optionally with AOF in `data_dir`."""

    def __init__(self, data_dir: Path, aof: bool = False, port: int | None = None,
                 extra: list[str] | None = None, password: str | None = None,
                 tls_cert_dir: Path | None = None) -> None:
        self.binary = find_redis_server()
        if self.binary is None:
            pytest.skip("no redis-server binary available")
        self.data_dir = data_dir
        self.aof = aof
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None
        self.extra = list(extra or [])
        self.password = password
        self.tls = tls_cert_dir

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
                "--maxmemory-policy", "noeviction",
                "--appendonly", "yes" if self.aof else "no", "--appendfsync", "everysec",
                *(["--requirepass", self.password] if self.password else []), *self.extra]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = Redis.from_url(self.url)

        def up() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            try:
                return bool(client.ping())
            except Exception:
                return False

        wait_until(up, START_TIMEOUT_S, f"redis-server on port {self.port}")
        client.close()
        return self

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def redis(redis_server: RedisServer) -> Iterator[Redis]:
    client = Redis.from_url(redis_server.url)
    client.flushdb()  # our own private server, never the shared one
    yield client
    client.close()


@pytest.fixture
def redis_url(redis_server: RedisServer, redis: Redis) -> str:
    return redis_server.url


def wait_until(cond, timeout_s: float = 30.0, what: str = "condition", interval_s: float = 0.02):
    """Poll `cond` until true or fail after the deadline (no fixed sleeps)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)
