"""A prefix cache of token ids: a radix tree with a capacity in tokens and LRU eviction, as
SGLang's radix cache keeps the KV of finished requests (python/sglang/srt/mem_cache/
radix_cache.py: `match_prefix`, `insert`, `evict`) and vLLM's automatic prefix caching keeps
blocks of it.

- `match(ids)`: the length of the longest cached prefix of a prompt, in whole pages
  (`page_tokens`: SGLang's `page_size`, 1 by default; vLLM's block size), and never the
  whole prompt (the last prompt token is always computed: SGLang's
  `Req.adjust_max_prefix_ids` keeps at least one, vLLM's scheduler too); the path is marked
  recently used (SGLang's `last_access_time`).
- `insert(ids)`: a finished request's tokens enter the tree: the server inserts its prompt
  and output but the last output token, whose KV was never computed (SGLang's
  `cache_finished_req` inserts `(origin_input_ids + output_ids)[:-1]`); an edge is split
  where a new sequence leaves it, as `_split_node` does; leaves least recently used are
  evicted while the tree holds more than `capacity_tokens` (SGLang's `evict` pops leaves by
  last access from a heap, a parent becoming a leaf joining it).

Where it simplifies: SGLang shares one KV pool between the running batch and the cache, so
the cache shrinks as the batch grows, and never evicts a node a running request holds
(`lock_ref`); here the cache has its own capacity, and a request's prefix is matched when it
arrives, not when the scheduler admits it. Only finished requests are inserted (SGLang also
inserts chunked prefills as they go: `cache_unfinished_req`). Insertion is not page-aligned
(SGLang drops the partial last page; a match is page-aligned all the same). SGLang's
scheduler orders its queue by longest prefix match (`schedule_policy`, off beyond 128 waiting
requests); the simulator serves its queue first come, first served. vLLM hashes blocks
rather than walking a tree; both give the same longest-prefix lengths.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence


class _Node:
    __slots__ = ("children", "key", "last", "parent")

    def __init__(self, key: tuple[int, ...], parent: _Node | None) -> None:
        self.key = key
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.last = 0


class RadixCache:
    """Token-id prefixes with a capacity in tokens (module docstring)."""

    def __init__(self, capacity_tokens: int, page_tokens: int = 1) -> None:
        self.capacity_tokens = capacity_tokens
        self.page_tokens = max(1, page_tokens)
        self.root = _Node((), None)
        self.tokens = 0
        self._clock = itertools.count(1)
        self.evicted_tokens = 0

    def match(self, ids: Sequence[int]) -> int:
        """The cached prefix length usable for a prompt of `ids` (module docstring)."""
        if self.capacity_tokens <= 0 or len(ids) < 2:
            return 0
        now = next(self._clock)
        node, at = self.root, 0
        while at < len(ids):
            child = node.children.get(ids[at])
            if child is None:
                break
            n = _common(child.key, ids, at)
            child.last = now
            at += n
            if n < len(child.key):
                break
            node = child
        usable = min(at, len(ids) - 1)
        return usable - usable % self.page_tokens

    def insert(self, ids: Sequence[int]) -> None:
        """Cache `ids` (a finished request's prompt and output), evicting as needed."""
        if self.capacity_tokens <= 0 or not ids:
            return
        now = next(self._clock)
        node, at = self.root, 0
        while at < len(ids):
            child = node.children.get(ids[at])
            if child is None:
                leaf = _Node(tuple(ids[at:]), node)
                leaf.last = now
                node.children[ids[at]] = leaf
                self.tokens += len(leaf.key)
                break
            n = _common(child.key, ids, at)
            if n < len(child.key):  # split the edge where the new ids leave it
                head = _Node(child.key[:n], node)
                head.last = now
                node.children[ids[at]] = head
                child.key = child.key[n:]
                child.parent = head
                head.children[child.key[0]] = child
                child = head
            child.last = now
            at += n
            node = child
        self._evict()

    def _evict(self) -> None:
        if self.tokens <= self.capacity_tokens:
            return
        heap = [(leaf.last, id(leaf), leaf) for leaf in self._leaves()]
        heapq.heapify(heap)
        while self.tokens > self.capacity_tokens and heap:
            _last, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            if parent is None or leaf.children:
                continue
            del parent.children[leaf.key[0]]
            self.tokens -= len(leaf.key)
            self.evicted_tokens += len(leaf.key)
            if parent is not self.root and not parent.children:
                heapq.heappush(heap, (parent.last, id(parent), parent))

    def _leaves(self) -> list[_Node]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if not node.children and node is not self.root:
                out.append(node)
            stack.extend(node.children.values())
        return out


def _common(key: tuple[int, ...], ids: Sequence[int], at: int) -> int:
    n = 0
    limit = min(len(key), len(ids) - at)
    while n < limit and key[n] == ids[at + n]:
        n += 1
    return n
