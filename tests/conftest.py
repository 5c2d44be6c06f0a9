"""Shared fixtures: a private redis-server per test session, fixture paths, configs.

The server is started by us on a free loopback port (never the machine's 6379), so
`flushdb` between tests only touches our own instance. Everything else of the harness
(`RedisServer`, `Pipeline`, `wait_until`) is `testing.harness`, shared with the benchmark
and the GPU check.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from redis import Redis

from foundation.config import RunConfig, load_config
from testing.harness import ROOT, RedisServer, find_redis_server
from tokencap.stack.processes import die_with_parent

FIXTURES = ROOT / "tests" / "fixtures"
QWEN = FIXTURES / "tokenizers" / "qwen2.5-instruct"
DATASETS = FIXTURES / "datasets"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Commands take what they are not given from the run file of a stack `tokencap up` started
# (`tokencap.stack.runfile`): tests, and the processes they start, see none but their own.
os.environ["TOKENCAP_STATE_DIR"] = tempfile.mkdtemp(prefix="tokencap-no-stack-")
# Compressed sources are decompressed into a cache: a private one, not the user's.
os.environ["TOKENCAP_SOURCE_CACHE"] = tempfile.mkdtemp(prefix="tokencap-source-cache-")
# A budget service a test starts (`tokencap up`, `tokencap serve`) takes any free port, never
# 8321, where a stack `make up` started may be serving (tests/pipeline/test_isolation.py).
os.environ["BUDGET_PORT"] = "0"
os.environ["TOKENCAP_PORT"] = "0"
# The Hugging Face cache (hub snapshots, the modules of trust_remote_code tokenizers): a
# private, empty one; a test that needs entries there makes them.
os.environ["HF_HOME"] = tempfile.mkdtemp(prefix="tokencap-hf-home-")
os.environ.pop("HF_HUB_CACHE", None)
os.environ.pop("HF_MODULES_CACHE", None)


_POPEN_INIT = subprocess.Popen.__init__


def _dies_with_the_tests(self: subprocess.Popen[Any], *args: Any, **kwargs: Any) -> None:
    """Every process a test starts (from the main thread, with no preexec_fn of its own)
    dies with the test session (Linux's parent-death signal): `make test` interrupted, or a
    pytest process killed, leaves none of them behind, not even a worker retrying a dead
    Redis. (A process started in another thread would die with that thread: left alone.)"""
    if kwargs.get("preexec_fn") is None and threading.current_thread() is threading.main_thread():
        kwargs["preexec_fn"] = die_with_parent
    _POPEN_INIT(self, *args, **kwargs)


subprocess.Popen.__init__ = _dies_with_the_tests  # type: ignore[method-assign]


def write_config(tmp: Path, body: str, name: str = "run.toml") -> RunConfig:
    path = tmp / name
    path.write_text(body)
    return load_config(path)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    if find_redis_server() is None:
        pytest.skip("no redis-server binary available")
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


# the files that take longest (make test's --durations): 150 s and 125 s of about 760 s
LONGEST_FIRST = ("test_isolation.py", "test_families.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tests that start a stack (`starts_stack`) run inside tests/pipeline/test_isolation.py,
    beside a stack on the default port, when it is part of the session: not twice. The tests
    of a real engine (`real_engine`) run only when there is one (`make test-engine`, or
    TOKENCAP_ENGINE_URL), and those of the trainers' own code (`trainers`) only with their
    venv (`make test-engine` makes it: TOKENCAP_TRAINERS_PYTHON)."""
    engine = bool(os.environ.get("TOKENCAP_ENGINE_URL") or
                  os.environ.get("TOKENCAP_ENGINE_REQUIRED"))
    trainers = bool(os.environ.get("TOKENCAP_TRAINERS_PYTHON"))
    isolation = any(item.path.name == "test_isolation.py" for item in items)

    def dropped(item: pytest.Item) -> bool:
        return (isolation and item.get_closest_marker("starts_stack") is not None) or (
            not engine and item.get_closest_marker("real_engine") is not None) or (
            not trainers and item.get_closest_marker("trainers") is not None)

    gone = [i for i in items if dropped(i)]
    if gone:
        config.hook.pytest_deselected(items=gone)
        items[:] = [i for i in items if not dropped(i)]
    # `make test` runs the files on two processes (pytest-xdist, --dist loadfile,
    # --no-loadscope-reorder: each file whole on one, in this order): the longest first, so
    # neither is left with one of them at the end
    items.sort(key=lambda i: LONGEST_FIRST.index(i.path.name)
               if i.path.name in LONGEST_FIRST else len(LONGEST_FIRST))
