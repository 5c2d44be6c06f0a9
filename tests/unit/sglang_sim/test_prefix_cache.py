"""The simulator's prefix cache (`sglang_sim.prefix_cache`): the longest cached prefix in
whole pages, never the whole prompt, LRU eviction within a capacity; and the server reports
what it matched where SGLang and vLLM do (`meta_info.cached_tokens`,
`usage.prompt_tokens_details.cached_tokens`, vLLM's prefix-cache counters)."""

from __future__ import annotations

import requests
from hypothesis import given, settings
from hypothesis import strategies as st

from foundation.engine.load import parse_metrics
from sglang_sim.prefix_cache import RadixCache
from sglang_sim.testing import SimServer

TIMEOUT_S = 30.0


def test_match_is_the_longest_cached_prefix_short_of_the_whole_prompt() -> None:
    cache = RadixCache(1000)
    assert cache.match([1, 2, 3]) == 0
    cache.insert([1, 2, 3, 4, 5])
    assert cache.match([1, 2, 3, 9]) == 3
    assert cache.match([1, 2, 3, 4, 5]) == 4  # the last prompt token is always computed
    assert cache.match([7, 1, 2]) == 0
    cache.insert([1, 2, 8])  # splits the edge 1 2 | 3 4 5
    assert (cache.match([1, 2, 8, 0]), cache.match([1, 2, 3, 4, 0]), cache.tokens) == (3, 4, 6)


def test_a_match_is_whole_pages() -> None:
    cache = RadixCache(1000, page_tokens=16)
    cache.insert(list(range(100)))
    assert cache.match(list(range(40))) == 32
    assert cache.match([*range(15), 999]) == 0


def test_eviction_drops_the_least_recently_used_leaves_within_capacity() -> None:
    cache = RadixCache(10)
    cache.insert([1, 2, 3, 4])
    cache.insert([5, 6, 7, 8])
    assert cache.match([1, 2, 3, 4, 0]) == 4  # [1..4] is now the more recently used
    cache.insert([9, 10, 11, 12])
    assert cache.tokens <= 10 and cache.evicted_tokens == 4
    assert (cache.match([1, 2, 3, 4, 0]), cache.match([5, 6, 7, 8, 0])) == (4, 0)


def test_no_capacity_caches_nothing() -> None:
    cache = RadixCache(0)
    cache.insert([1, 2, 3])
    assert cache.match([1, 2, 3, 4]) == 0 and cache.tokens == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), min_size=1, max_size=12),
       st.lists(st.integers(0, 3), min_size=0, max_size=14))
def test_match_agrees_with_the_inserted_sequences(seqs: list[list[int]], probe: list[int]) -> None:
    cache = RadixCache(10**6)
    for s in seqs:
        cache.insert(s)

    def common(a: list[int], b: list[int]) -> int:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    best = max(common(s, probe) for s in seqs)
    assert cache.match(probe) == (min(best, len(probe) - 1) if len(probe) >= 2 else 0)
    distinct = {tuple(s[:k]) for s in seqs for k in range(1, len(s) + 1)}
    assert cache.tokens == len(distinct)  # the tree holds each distinct prefix once


def test_sglang_replies_report_the_cached_prefix() -> None:
    prompt = list(range(1000, 1300))
    with SimServer(time_scale=1000.0) as sim:
        def cached() -> int:
            r = requests.post(f"{sim.url}/generate", timeout=TIMEOUT_S, json={
                "input_ids": prompt, "sampling_params": {"max_new_tokens": 4}})
            return int(r.json()["meta_info"]["cached_tokens"])
        # the prompt and the output but its last token were cached: the prompt, bar its last
        assert (cached(), cached()) == (0, 299)


def test_vllm_replies_and_counters_report_the_cached_blocks() -> None:
    prompt = list(range(1000, 1300))
    with SimServer(time_scale=1000.0, flavor="vllm", context_length=4096) as sim:
        got = []
        for _ in range(2):
            r = requests.post(f"{sim.url}/v1/completions", timeout=TIMEOUT_S, json={
                "model": sim.config.model_path, "prompt": prompt, "max_tokens": 4,
                "return_token_ids": True})
            got.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        page = requests.get(f"{sim.url}/metrics", timeout=TIMEOUT_S).text
    assert got == [0, 288]  # whole 16-token blocks of the 299 that may be reused
    hits = sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
               if line.startswith("vllm:prefix_cache_hits_total"))
    assert hits == 288 and parse_metrics(page)["running"] is not None
