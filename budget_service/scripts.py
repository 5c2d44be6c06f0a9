"""Loads the `.lua` files once and registers them with redis-py (EVALSHA, NOSCRIPT reload).

A per-category script starts with `lua/_lib.lua` (the names of its KEYS and the helpers the
scripts share: the admission rule among them) and is called with the category's keys in
`CategoryKeys` order. `init_run`, `engine_counts`, `engine_info`, `engine_trouble` and
`series` touch no category and get no prelude.
"""

from __future__ import annotations

import functools
from pathlib import Path

from redis import Redis
from redis.commands.core import Script

LUA_DIR = Path(__file__).with_name("lua")
CATEGORY_SCRIPTS = (
    "init_category", "feed", "admit", "heartbeat", "commit", "fail", "release", "requeue",
    "lease", "unpark", "set_cap", "exhausted", "reconcile", "acknowledge",
    "restore", "feed_follow", "cut", "retry", "source_size",
)  # fmt: skip
OTHER_SCRIPTS = ("init_run", "engine_counts", "engine_info", "engine_trouble", "series")
PRELUDE = "_lib.lua"


@functools.cache
def script_text(name: str) -> str:
    """The text registered for script `name` (prelude included)."""
    text = (LUA_DIR / f"{name}.lua").read_text()
    if name in CATEGORY_SCRIPTS:
        text = (LUA_DIR / PRELUDE).read_text() + text
    return text


class Scripts:
    """One registered `Script` per `.lua` file, as attributes named after the file."""

    init_category: Script
    feed: Script
    admit: Script
    heartbeat: Script
    commit: Script
    fail: Script
    release: Script
    requeue: Script
    lease: Script
    unpark: Script
    set_cap: Script
    exhausted: Script
    reconcile: Script
    acknowledge: Script
    restore: Script
    feed_follow: Script
    cut: Script
    retry: Script
    source_size: Script
    init_run: Script
    engine_counts: Script
    engine_info: Script
    engine_trouble: Script
    series: Script

    def __init__(self, redis: Redis) -> None:
        for name in CATEGORY_SCRIPTS + OTHER_SCRIPTS:
            setattr(self, name, redis.register_script(script_text(name)))
