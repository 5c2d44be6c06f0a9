"""Redis connections: URL handling with redacted passwords, and the safety checks.

The tools refuse a Redis whose `maxmemory-policy` evicts keys: eviction would silently drop
counters, done-marks or queued jobs. Passwords never reach logs, status or error messages.
"""

from __future__ import annotations

import re

import redis
from redis import Redis

from foundation.errors import RedisRefused, RedisUnavailable

SAFE_POLICIES = ("noeviction",)
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
SOCKET_TIMEOUT_S = 30.0
CONNECT_TIMEOUT_S = 5.0
HEALTH_CHECK_INTERVAL_S = 15

_CRED_RE = re.compile(r"(?P<scheme>rediss?|unix)://(?P<user>[^:@/]*)(?::(?P<pw>[^@/]*))?@")


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
    """Open a client for `url` (redis://, rediss://, unix://), ping it and check its policy."""
    try:
        client = Redis.from_url(
            url,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=CONNECT_TIMEOUT_S,
            health_check_interval=HEALTH_CHECK_INTERVAL_S,
        )
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
