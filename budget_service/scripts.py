"""Loads the `.lua` files once and registers them with redis-py (EVALSHA, NOSCRIPT reload)."""

from __future__ import annotations

from pathlib import Path

from redis import Redis
from redis.commands.core import Script

LUA_DIR = Path(__file__).with_name("lua")
NAMES = (
    "feed", "admit", "heartbeat", "commit", "fail", "release", "close", "reconcile", "dedup",
)
# scripts that end a sample's time in flight start with the shared `drop_inflight` helper
WITH_INFLIGHT = frozenset({"admit", "commit", "fail", "release"})


class Scripts:
    """One registered `Script` per `.lua` file, as attributes named after the file."""

    feed: Script
    admit: Script
    heartbeat: Script
    commit: Script
    fail: Script
    release: Script
    close: Script
    reconcile: Script
    dedup: Script

    def __init__(self, redis: Redis) -> None:
        prelude = (LUA_DIR / "_inflight.lua").read_text()
        for name in NAMES:
            text = (LUA_DIR / f"{name}.lua").read_text()
            if name in WITH_INFLIGHT:
                text = prelude + text
            setattr(self, name, redis.register_script(text))
