"""`producer/near_dups.py`: near copies found, checked by exact Jaccard, and the index rebuilt
from the records the ledger keeps."""

from __future__ import annotations

import random

import numpy as np
from datasketch import MinHash

from foundation.config import NearDuplicates as Settings
from producer.near_dups import SCHEME, SEED, SIGNATURE_BYTES, Kept, NearDuplicates, jaccard

RNG = random.Random(45)
VOCAB = [f"w{k}" for k in range(3000)]
TEXTS = {k: " ".join(RNG.choice(VOCAB) for _ in range(120)) for k in range(200)}


def index(texts: dict[tuple[str, int], str]) -> NearDuplicates:
    return NearDuplicates(Settings(), ["a", "b"], lambda kept: texts.get(tuple(kept)))


def test_a_near_copy_is_refused_naming_the_kept_prompt_and_a_distinct_one_passes() -> None:
    texts = {("a", k): t for k, t in TEXTS.items()}
    nd = index(texts)
    for k, t in TEXTS.items():
        v = nd.screen(Kept("a", k), t)
        assert v.kept is None and len(v.signature) == SIGNATURE_BYTES
    words = TEXTS[7].split()
    words[60] = "Zanzibar"
    v = nd.screen(Kept("b", 0), " ".join(words))
    assert v.kept == Kept("a", 7) and 0.9 < v.jaccard < 1 and v.signature == b""
    # half of a prompt (Jaccard under 0.5) is not a near copy
    half = " ".join(TEXTS[9].split()[:60])
    assert nd.screen(Kept("b", 1), half).kept is None


def test_a_candidate_under_the_threshold_is_not_refused() -> None:
    # Given two prompts at Jaccard 0.7 of their 5-grams: the LSH may pair them, the exact
    # check must not refuse the second
    base = TEXTS[3].split()
    other = base[:]
    for k in range(0, 120, 12):
        other[k] = f"x{k}"
    texts = {("a", 0): " ".join(base), ("a", 1): " ".join(other)}
    nd = index(texts)
    assert nd.screen(Kept("a", 0), texts[("a", 0)]).kept is None
    assert nd.screen(Kept("a", 1), texts[("a", 1)]).kept is None


def test_the_index_is_rebuilt_from_the_records() -> None:
    texts = {("a", k): t for k, t in TEXTS.items()}
    first = index(texts)
    records = b"".join(first.screen(Kept("a", k), t).signature for k, t in TEXTS.items())
    assert len(records) == SIGNATURE_BYTES * len(TEXTS)
    # When a new index loads them (a producer started again)
    again = index(texts)
    calls: list[int] = []
    assert again.load("a", records, lambda: calls.append(1)) == len(TEXTS)
    assert calls  # the producer's lease is renewed while it loads
    assert again.load("a", records) == 0
    # Then a copy is refused, and a record fed again is new (its own key)
    assert again.screen(Kept("b", 5), "1. " + TEXTS[11]).kept == Kept("a", 11)
    assert again.screen(Kept("a", 11), TEXTS[11]).kept is None


def test_the_minhash_is_datasketchs_update_batch() -> None:
    # The index applies datasketch's pre-mix and permutations to the array at once: the
    # values must be those datasketch's own update gives (a change of datasketch shows here)
    nd = index({})
    rng = np.random.default_rng(45)
    for size in (1, 5, 2000):
        hashes = rng.integers(0, 2**64, size=size, dtype=np.uint64)
        ours = nd.minhash(hashes)
        theirs = MinHash(num_perm=32, seed=SEED, hashfunc=int, scheme=SCHEME)
        theirs.update_batch([int(h ^ (h >> np.uint64(32))) & 0xFFFFFFFF for h in hashes])
        assert np.array_equal(ours.hashvalues, theirs.hashvalues)
        assert ours.hashvalues.dtype == theirs.hashvalues.dtype


def test_jaccard_of_sorted_unique_hashes() -> None:
    a, b = np.array([1, 2, 3, 4], np.uint64), np.array([3, 4, 5], np.uint64)
    assert jaccard(a, b) == 2 / 5
    assert jaccard(a, a) == 1.0 and jaccard(a, b[2:]) == 0.0
    assert jaccard(a[:0], b[:0]) == 1.0
