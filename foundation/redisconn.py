"""Redis connections: URL handling with redacted passwords, and the safety checks.

The tools refuse a Redis whose `maxmemory-policy` evicts keys: eviction would silently drop
counters, done-marks or queued jobs. Passwords never reach logs, status or error messages.

Besides redis://, rediss:// and unix:// URLs, a Redis watched by Sentinel is named by its
sentinels and its master's name, as rq's SENTINEL settings and redis-py's `Sentinel` take
them: `redis+sentinel://[:PASSWORD@]HOST:PORT[,HOST:PORT...]/MASTER_NAME[/DB]` (PASSWORD is
the master's; the sentinels are asked without one). The client asks the sentinels for the
current master on every new connection, so after a failover it follows the promoted replica.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple
from urllib.parse import unquote

import redis
from redis import Redis
from redis.sentinel import Sentinel

from foundation.errors import RedisRefused, RedisUnavailable

SAFE_POLICIES = ("noeviction",)
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
SOCKET_TIMEOUT_S = 30.0
CONNECT_TIMEOUT_S = 5.0
HEALTH_CHECK_INTERVAL_S = 15

_CRED_RE = re.compile(r"(?P<scheme>rediss?|unix|redis\+sentinel)://(?P<user>[^:@/]*)"
                      r"(?::(?P<pw>[^@/]*))?@")
SENTINEL_SCHEME = "redis+sentinel://"


class SentinelURL(NamedTuple):
    """A `redis+sentinel://` URL, read (`parse_sentinel_url`)."""

    sentinels: list[tuple[str, int]]
    master: str
    db: int
    password: str | None


def parse_sentinel_url(url: str) -> SentinelURL:
    """Read `redis+sentinel://[:PASSWORD@]HOST:PORT[,HOST:PORT...]/MASTER_NAME[/DB]`;
    ValueError naming what is wrong."""
    rest = url[len(SENTINEL_SCHEME):]
    creds, _, rest = rest.rpartition("@")
    password = unquote(creds.partition(":")[2]) or None if creds else None
    hosts, _, path = rest.partition("/")
    parts = [p for p in path.split("/") if p]
    if not hosts or not parts or len(parts) > 2:
        raise ValueError(f"{redact(url)}: expected redis+sentinel://HOST:PORT[,HOST:PORT...]"
                         "/MASTER_NAME[/DB]")
    sentinels = []
    for item in hosts.split(","):
        host, _, port = item.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"{redact(url)}: sentinel {item!r} is not HOST:PORT")
        sentinels.append((host, int(port)))
    if len(parts) == 2 and not parts[1].isdigit():
        raise ValueError(f"{redact(url)}: the database {parts[1]!r} is not a number")
    return SentinelURL(sentinels, unquote(parts[0]), int(parts[1]) if len(parts) == 2 else 0,
                       password)


def client_for(url: str, socket_timeout_s: float = SOCKET_TIMEOUT_S) -> Redis:
    """A client for `url` (not yet connected): a plain one, or the Sentinel master's."""
    opts = {"socket_timeout": socket_timeout_s, "socket_connect_timeout": CONNECT_TIMEOUT_S,
            "health_check_interval": HEALTH_CHECK_INTERVAL_S}
    if url.startswith(SENTINEL_SCHEME):
        s = parse_sentinel_url(url)
        # untyped before redis-py 8, typed (with narrower keyword types) from 8 on
        sentinel_class: Any = Sentinel
        sentinel = sentinel_class(s.sentinels, sentinel_kwargs={
            "socket_timeout": CONNECT_TIMEOUT_S, "socket_connect_timeout": CONNECT_TIMEOUT_S},
            **opts)
        master: Redis = sentinel.master_for(s.master, db=s.db, password=s.password)
        return master
    return Redis.from_url(url, **opts)


def redact(url: str) -> str:
    """Hide the password in a Redis URL: redis://:secret@h -> redis://:***@h."""

    def sub(m: re.Match[str]) -> str:
        pw = ":***" if m.group("pw") is not None else ""
        return f"{m.group('scheme')}://{m.group('user')}{pw}@"

    return _CRED_RE.sub(sub, url)


def scrub(text: str, url: str) -> str:
    """Remove the URL's password from any text (for exception messages)."""
    m = _CRED_RE.search(url)
    if m and m.group("pw"):
        text = text.replace(m.group("pw"), "***")
    return text.replace(url, redact(url))


def connect(url: str, *, check: bool = True, socket_timeout_s: float = SOCKET_TIMEOUT_S) -> Redis:
    """Open a client for `url` (redis://, rediss://, unix://, redis+sentinel://), ping it and
    check its policy."""
    try:
        client = client_for(url, socket_timeout_s)
        client.ping()
    except (redis.RedisError, ValueError, OSError) as exc:
        msg = scrub(str(exc), url)
        raise RedisUnavailable(f"cannot reach Redis at {redact(url)}: {msg}") from None
    if check:
        check_policy(client, url)
    return client


def check_policy(client: Redis, url: str = "") -> None:
    """Refuse an evicting Redis. Some managed Redis forbid CONFIG: then trust INFO."""
    try:
        policy = client.info("memory").get("maxmemory_policy")
        if policy is None:
            policy = client.config_get("maxmemory-policy").get("maxmemory-policy")
    except redis.RedisError as exc:
        raise RedisUnavailable(f"cannot read Redis settings at {redact(url)}: {exc}") from None
    if isinstance(policy, bytes):
        policy = policy.decode()
    if policy not in SAFE_POLICIES:
        raise RedisRefused(
            f"Redis at {redact(url)} has maxmemory-policy={policy}; tokencap needs 'noeviction' "
            "(an evicting Redis can silently drop counters, done-marks and queued jobs). "
            "Run: redis-cli CONFIG SET maxmemory-policy noeviction"
        )
