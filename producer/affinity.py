"""Affinity keys: which prompts the engines should serve on one engine.

Prompts whose first AFFINITY_PREFIX_TOKENS ids agree share an affinity key
(`Pending.affinity`): the workers send them to one engine (`consumers.routing`), whose
prefix cache then holds that prefix once (a tool schema, a long system prompt). A shorter
shared prefix is cheap for every engine to hold, so a shorter prompt has no key. A prompt
gets its key only once another prompt had it: a unique prompt has nothing to share and goes
to the least loaded engine, as without affinity. The keys seen are kept in a bounded
least-recently-seen order (AFFINITY_KEYS_KEPT).

A conversation's later turns are sent to the engine that served the turn before
(`Pending.prefer_engine`); the key is for prompts that start alike.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

AFFINITY_PREFIX_TOKENS = 256
AFFINITY_KEYS_KEPT = 1 << 16


def affinity_key(ids: list[int]) -> str:
    """The affinity key of a prompt: a digest of its first AFFINITY_PREFIX_TOKENS ids ("" for
    a shorter prompt: nothing long to share)."""
    if len(ids) <= AFFINITY_PREFIX_TOKENS:
        return ""
    head = array("i", ids[:AFFINITY_PREFIX_TOKENS]).tobytes()
    return hashlib.blake2b(head, digest_size=8).hexdigest()


class SharedKeys:
    """The affinity keys one producer has seen, the last AFFINITY_KEYS_KEPT of them."""

    def __init__(self, kept: int = AFFINITY_KEYS_KEPT) -> None:
        self.kept = kept
        self._seen: OrderedDict[str, None] = OrderedDict()  # least recently seen first

    def __call__(self, ids: list[int]) -> str:
        """The prompt's affinity key if an earlier prompt had it ("" otherwise, and for a
        prompt too short to have one)."""
        key = affinity_key(ids)
        if not key:
            return ""
        seen = self._seen
        if key in seen:
            seen.move_to_end(key)
            return key
        seen[key] = None
        if len(seen) > self.kept:
            seen.popitem(last=False)
        return ""
