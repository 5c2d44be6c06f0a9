"""Direct asyncio clients of the engine: the shape of the old one-script tool.

`saturate` keeps N requests in flight (round robin over the categories) and measures a
steady window; `stop_after_passing` keeps N in flight and stops feeding a category once the
tokens counted after each response pass its cap (everything in flight still counts).
Both send exactly what a tokencap worker sends: `input_ids`, `sampling_params` with
`max_new_tokens`, a fresh `rid`, and the `X-Tokencap-Category` header.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from typing import Any

import aiohttp
import msgspec

from bench.sources import Cat

CATEGORY_HEADER = "X-Tokencap-Category"
_enc = msgspec.json.Encoder()


class _Meta(msgspec.Struct):
    completion_tokens: int
    finish_reason: dict[str, Any]


class _Reply(msgspec.Struct):
    meta_info: _Meta
    output_ids: list[int]


_dec = msgspec.json.Decoder(_Reply)


class Feed:
    """One category's prompts in the producer's order, and what was counted for it."""

    def __init__(self, cat: Cat, prompts: list[list[int]]) -> None:
        self.cat = cat
        self.prompts = prompts
        self.pos = 0
        self.open = True
        self.counted = 0
        self.samples = 0

    def take(self) -> list[int] | None:
        if self.pos >= len(self.prompts):
            return None
        self.pos += 1
        return self.prompts[self.pos - 1]


async def _post(session: aiohttp.ClientSession, url: str, cat: Cat, ids: list[int]) -> _Reply:
    body = _enc.encode({"input_ids": ids, "sampling_params": {"max_new_tokens": cat.max_new},
                        "rid": uuid.uuid4().hex})
    headers = {"Content-Type": "application/json", CATEGORY_HEADER: cat.name}
    async with session.post(f"{url}/generate", data=body, headers=headers) as resp:
        raw = await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status} from the simulator: {raw[:200]!r}")
    reply = _dec.decode(raw)
    if len(reply.output_ids) != reply.meta_info.completion_tokens:
        raise RuntimeError("completion_tokens != len(output_ids)")
    return reply


def _session(n: int) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=n),
                                 timeout=aiohttp.ClientTimeout(total=None))


def saturate(url: str, feeds: list[Feed], n: int, warm_s: float, window_s: float,
             snapshot: Callable[[], dict[str, Any]]) -> tuple[dict, dict, float]:
    """Keep `n` requests in flight for `warm_s + window_s`; return the two snapshots taken
    at the window's ends (`snapshot()` runs in a thread) and the window's wall seconds."""

    async def main() -> tuple[dict, dict, float]:
        loop = asyncio.get_running_loop()
        turn = 0
        async with _session(n) as session:

            async def slot() -> None:
                nonlocal turn
                while True:
                    feed = feeds[turn % len(feeds)]
                    turn += 1
                    ids = feed.take()
                    if ids is None:
                        raise RuntimeError(f"{feed.cat.name}: out of prompts; raise prompts")
                    await _post(session, url, feed.cat, ids)

            tasks = [asyncio.create_task(slot()) for _ in range(n)]
            await asyncio.sleep(warm_s)
            t_a = time.monotonic()
            a = await loop.run_in_executor(None, snapshot)
            await asyncio.sleep(window_s - (time.monotonic() - t_a))
            t_b = time.monotonic()
            b = await loop.run_in_executor(None, snapshot)
            for t in tasks:
                if t.done() and t.exception():
                    raise t.exception()  # type: ignore[misc]
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return a, b, t_b - t_a

    return asyncio.run(main())


def stop_after_passing(url: str, feeds: list[Feed], n: int) -> float:
    """Run every category to its cap the old tool's way; returns the wall seconds taken.

    Round robin over the open categories; after each response its tokens are counted and
    the category stops being fed once `counted >= cap`; responses still in flight count.
    """

    async def main() -> None:
        turn = 0

        def pick() -> tuple[Feed, list[int]] | None:
            nonlocal turn
            for _ in range(len(feeds)):
                feed = feeds[turn % len(feeds)]
                turn += 1
                if feed.open:
                    ids = feed.take()
                    if ids is not None:
                        return feed, ids
                    feed.open = False
            return None

        async with _session(n) as session:

            async def slot() -> None:
                while (got := pick()) is not None:
                    feed, ids = got
                    reply = await _post(session, url, feed.cat, ids)
                    feed.counted += reply.meta_info.completion_tokens
                    feed.samples += 1
                    if feed.counted >= feed.cat.cap:
                        feed.open = False

            await asyncio.gather(*(slot() for _ in range(n)))

    t0 = time.monotonic()
    asyncio.run(main())
    return time.monotonic() - t0
