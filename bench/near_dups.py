"""Near-duplicate prompts and decontamination at intake (`producer.intake`): their CPU per
prompt and the Redis bytes per prompt at 1M prompts, beside today's exact dedup; recall and
false refusals on real prompts.

- **CPU per prompt**: the real prompts of tests/fixtures/datasets (every dataset sample's
  user turns: 2,288 prompts, most of them short), and 200 prompts of about 2,000 words made
  of them, joined in a seeded random order (3.5K tokens; the motivating run's prompts were
  1.5K to 8K tokens), screened
  by `NearDuplicates.screen` (words, 5-grams, MinHash, LSH query, the exact check of any
  candidate, the insert) into an index already holding PRELOAD signatures (a large run's:
  its LSH buckets that full), and by `Benchmarks.hit` with MT-bench, HumanEval and GSM8K
  (each screen on its own: the producer computes the word hashes once for both); against
  the exact dedup's own work per prompt, `prompt_digest` of its token ids (the Qwen2.5
  tokenizer's, encoded beforehand). Process CPU time, not wall time; the least of 3 rounds
  (the index put back as it was between them), the machine being shared.
- **Redis bytes per prompt at 1M**: 1,000,000 near-duplicate records (132 bytes each)
  appended to one category's `near` string as the feed script appends them (APPEND, a batch
  of them per pipeline), `used_memory` before and after; against the exact dedup's
  prompt-digest hash (digest -> sample id) for the same 1M prompts.
- **Restart**: seconds to rebuild the index from PRELOAD records (`NearDuplicates.load`),
  per prompt, and the producer's memory for it (RSS before and after).
- **Recall and false refusals**: `testing.near_copies`: 472 real prompts (470 distinct at
  Jaccard 0.8: two pairs are near copies) and three edited copies of the 40 longest distinct
  ones; every prompt screened in order, as one category fed in that order would be.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from typing import Any

import numpy as np
import psutil

from bench.context import Bench, log, row
from budget_service.ledger import prompt_digest
from foundation.config import NearDuplicates as Settings
from producer.contamination import Benchmarks
from producer.near_dups import NUM_PERM, SIGNATURE_BYTES, Kept, NearDuplicates
from producer.shingles import prompt_text
from testing.harness import ROOT
from testing.near_copies import edited, longest_distinct, near_pairs, real_prompts

NAME = "near_dups"
DATASETS = ROOT / "tests" / "fixtures" / "datasets"
TOKENIZER = ROOT / "tests" / "fixtures" / "tokenizers" / "qwen2.5-instruct"
PRELOAD = 200_000  # signatures in the index before the CPU is measured
LONG_WORDS = 2_000  # the joined prompts' size: 3.5K tokens; the motivating run's: 1.5K-8K
LONG_PROMPTS = 200
ROUNDS = 3
REDIS_PROMPTS = 1_000_000
REDIS_BATCH = 10_000
EDITED = 40
TARGET_CPU_MS = 1.0
TARGET_BYTES = 200.0


def fixture_prompts() -> list[str]:
    """Every prompt of the dataset samples: the user turns of each record, read as the
    producer reads a source (format told from its keys)."""
    from producer.formats.records import Rejected
    from producer.readers.index import SourceIndex, read_sample

    out: list[str] = []
    files = sorted(p for p in DATASETS.rglob("*") if p.suffix in (".json", ".jsonl"))
    for path in files:
        index = SourceIndex.build([path])
        try:
            for i in range(len(index)):
                try:
                    s = read_sample(index, i, "auto", "all", None)
                except Rejected:  # a record the producer would refuse
                    continue
                text = prompt_text(s.prompt, s.conversation)
                if text and text.strip():
                    out.append(text)
        finally:
            index.close()
    return out


def _random_records(n: int, seed: int = 45) -> bytes:
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, 2**32, size=(n, 1 + NUM_PERM), dtype=np.uint64).astype("<u4")
    rows[:, 0] = np.arange(n, dtype="<u4")
    return rows.tobytes()


def joined(prompts: list[str], words: int, count: int) -> list[str]:
    """`count` prompts of about `words` words each: the prompts in a seeded random order,
    joined in turn (a new order each time they run out)."""
    rng = random.Random(45)
    out: list[str] = []
    cur: list[str] = []
    n = 0
    while len(out) < count:
        order = prompts[:]
        rng.shuffle(order)
        for p in order:
            cur.append(p)
            n += len(p.split())
            if n >= words:
                out.append("\n".join(cur))
                cur, n = [], 0
                if len(out) == count:
                    break
    return out


def cpu(sets: dict[str, list[str]]) -> dict[str, Any]:
    """Per set of prompts: the CPU per prompt of each screen and of the exact dedup's digest,
    all screened into one index preloaded with PRELOAD signatures."""
    from transformers import AutoTokenizer

    texts: dict[tuple[str, int], str] = {}
    nd = NearDuplicates(Settings(), ["bulk", *sets], lambda k: texts.get(tuple(k)))
    rss0 = psutil.Process(os.getpid()).memory_info().rss
    t = time.perf_counter()
    nd.load("bulk", _random_records(PRELOAD))
    load_s = time.perf_counter() - t
    rss1 = psutil.Process(os.getpid()).memory_info().rss
    bench = Benchmarks(["mt_bench", "humaneval", "gsm8k"], 13)
    tok = AutoTokenizer.from_pretrained(str(TOKENIZER))
    out: dict[str, Any] = {"preload": PRELOAD, "load_s": load_s,
                           "load_us_per_prompt": load_s / PRELOAD * 1e6,
                           "index_bytes_per_prompt": (rss1 - rss0) / PRELOAD}
    for name, prompts in sets.items():
        for k, p in enumerate(prompts):
            texts[(name, k)] = p
        ids = [tok.encode(p) for p in prompts]
        near_s = decon_s = digest_s = math.inf
        for _ in range(ROUNDS):  # the least of ROUNDS: the machine is shared
            t = time.process_time()
            refused = sum(nd.screen(Kept(name, k), p).kept is not None
                          for k, p in enumerate(prompts))
            near_s = min(near_s, time.process_time() - t)
            for k in range(len(prompts)):  # the index as it was, for the next round
                if Kept(name, k) in nd:
                    nd._lsh.remove(name_key(nd, name, k))
            t = time.process_time()
            hits = sum(bench.hit(p) is not None for p in prompts)
            decon_s = min(decon_s, time.process_time() - t)
            t = time.process_time()
            for x in ids:
                prompt_digest(x)
            digest_s = min(digest_s, time.process_time() - t)
        words = [len(p.split()) for p in prompts]
        n = len(prompts)
        out[name] = {"prompts": n, "mean_words": sum(words) / n, "max_words": max(words),
                     "mean_tokens": sum(map(len, ids)) / n, "near_ms": near_s / n * 1e3,
                     "decon_ms": decon_s / n * 1e3, "digest_ms": digest_s / n * 1e3,
                     "near_refused": refused, "contaminated": hits}
    return out


def name_key(nd: NearDuplicates, category: str, position: int) -> int:
    return nd._key(Kept(category, position))


def redis_bytes(bench: Bench) -> dict[str, Any]:
    redis = bench.fresh_redis()
    record = _random_records(REDIS_BATCH)
    key = "bench:{c}:near"
    before = int(redis.info("memory")["used_memory"])
    for _ in range(0, REDIS_PROMPTS, REDIS_BATCH):
        pipe = redis.pipeline(transaction=False)
        for k in range(REDIS_BATCH):
            pipe.append(key, record[k * SIGNATURE_BYTES:(k + 1) * SIGNATURE_BYTES])
        pipe.execute()
    after = int(redis.info("memory")["used_memory"])
    usage = int(redis.memory_usage(key) or 0)
    assert redis.strlen(key) == REDIS_PROMPTS * SIGNATURE_BYTES
    redis.delete(key)
    key = "bench:{c}:prompts"
    base0 = int(redis.info("memory")["used_memory"])
    for start in range(0, REDIS_PROMPTS, REDIS_BATCH):
        redis.hset(key, mapping={prompt_digest([i, 21, 22, 23]): f"ids:{i}"
                                 for i in range(start, start + REDIS_BATCH)})
    base1 = int(redis.info("memory")["used_memory"])
    redis.delete(key)
    return {"prompts": REDIS_PROMPTS, "near_bytes_per_prompt": (after - before) / REDIS_PROMPTS,
            "near_memory_usage_per_prompt": usage / REDIS_PROMPTS,
            "digest_bytes_per_prompt": (base1 - base0) / REDIS_PROMPTS}


def recall() -> dict[str, Any]:
    prompts = real_prompts()
    pairs = near_pairs(prompts)
    longest = longest_distinct(prompts, EDITED)
    copies = [c for k, i in enumerate(longest) for c in edited(prompts[i], k)]
    texts = prompts + copies
    nd = NearDuplicates(Settings(), ["a"], lambda k: texts[k.position])
    refused = [k for k, t in enumerate(texts) if nd.screen(Kept("a", k), t).kept is not None]
    originals = [k for k in refused if k < len(prompts)]
    later_of_pairs = {max(pair) for pair in pairs}
    return {"prompts": len(prompts), "distinct": len(prompts) - len(pairs),
            "pairs": [list(p) for p in pairs], "copies": len(copies),
            "copies_refused": sum(k >= len(prompts) for k in refused),
            "false_refusals": len(set(originals) - later_of_pairs),
            "pairs_refused": len(set(originals) & later_of_pairs)}


def run(bench: Bench) -> dict[str, Any]:
    log(f"{NAME}: recall on edited copies of real prompts")
    rec = recall()
    log(f"{NAME}: CPU per prompt on the fixtures' prompts, {PRELOAD:,} signatures loaded")
    prompts = fixture_prompts()
    c = cpu({"real": prompts, "long": joined(prompts, LONG_WORDS, LONG_PROMPTS)})
    log(f"{NAME}: Redis bytes per prompt at {REDIS_PROMPTS:,} prompts")
    r = redis_bytes(bench)
    rows = []
    for name, what in (("real", "real prompts"), ("long", "of real prompts joined")):
        f = c[name]
        rows += [
            row(NAME, f"near-dup CPU per prompt ({f['prompts']:,} {what}, "
                f"{f['mean_tokens']:,.0f} tokens mean) vs exact dedup's digest",
                f["near_ms"], f["digest_ms"], "ms", f"< {TARGET_CPU_MS:g} ms",
                f["near_ms"] < TARGET_CPU_MS),
            row(NAME, f"decontamination CPU per prompt ({what}; MT-bench, HumanEval, GSM8K) "
                "vs the digest", f["decon_ms"], f["digest_ms"], "ms")]
    rows += [
        row(NAME, f"near-dup Redis bytes per prompt at {REDIS_PROMPTS // 10**6}M vs the "
            "exact dedup's digest hash", r["near_bytes_per_prompt"],
            r["digest_bytes_per_prompt"], "B", f"< {TARGET_BYTES:g} B",
            r["near_bytes_per_prompt"] < TARGET_BYTES),
        row(NAME, f"restart: index rebuilt per prompt ({PRELOAD:,} records)",
            c["load_us_per_prompt"], None, "us"),
        row(NAME, "producer memory per prompt in the index", c["index_bytes_per_prompt"], None,
            "B"),
        row(NAME, f"edited copies refused, of {rec['copies']}", rec["copies_refused"],
            rec["copies"], "prompts", "all", rec["copies_refused"] == rec["copies"]),
        row(NAME, f"distinct prompts refused, of {rec['distinct']}", rec["false_refusals"],
            None, "prompts", "0", rec["false_refusals"] == 0),
    ]
    return {"figures": {"cpu": c, "redis": r, "recall": rec}, "rows": rows}


if __name__ == "__main__":  # a quick look without the whole bench
    print(json.dumps(recall(), indent=1))
