"""A small TCP proxy for fault injection between a client and Redis or SGLang.

Knobs: `latency_s` (delay added before forwarding each chunk, both ways), `cut()` (close
every open connection now), `blackhole` (accept connections but forward nothing).
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading

CHUNK_BYTES = 65536
SELECT_S = 0.05


class Proxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.latency_s = 0.0
        self.blackhole = False
        self.refuse = False  # close each new connection at once: the far end is away
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._conns: list[tuple[socket.socket, socket.socket]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)

    @property
    def url_host_port(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> Proxy:
        self._thread.start()
        return self

    def _accept(self) -> None:
        self._listener.settimeout(SELECT_S)
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except (TimeoutError, OSError):
                continue
            if self.refuse:
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns.append((client, upstream))
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        peers = {a: b, b: a}
        try:
            while not self._stop.is_set():
                ready, _, _ = select.select([a, b], [], [], SELECT_S)
                for s in ready:
                    data = s.recv(CHUNK_BYTES)
                    if not data:
                        return
                    if self.blackhole:
                        continue
                    if self.latency_s:
                        self._stop.wait(self.latency_s)  # the injected latency
                    peers[s].sendall(data)
        except (OSError, ValueError):  # ValueError: `cut` closed a socket while we selected
            return
        finally:
            for s in (a, b):
                with contextlib.suppress(OSError):
                    s.close()

    def cut(self) -> int:
        """Close every open connection (clients see a reset / EOF)."""
        with self._lock:
            conns, self._conns = self._conns, []
        for a, b in conns:
            for s in (a, b):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                    s.close()
        return len(conns)

    def stop(self) -> None:
        self._stop.set()
        self.cut()
        self._listener.close()
        self._thread.join(5)
