"""Real public prompts and edited copies of them: what the near-duplicate tests and the
`near_dups` benchmark feed (docs/MIX.md).

`real_prompts`: GSM8K's first 200 test questions and the 272 MATH-Minerva problems of
tests/fixtures/datasets (provenance in tests/fixtures/PROVENANCE.md), 472 prompts, of which
two pairs are near copies already (MATH-Minerva's subproblem chains: `near_pairs` finds
them, comparing every pair). `edited(text, k)`: a prompt copied three ways: whitespace
changed (a line break between every word), list numbering added, one name changed.
"""

from __future__ import annotations

import json
import re

from producer.shingles import Shingler
from testing.harness import ROOT

DATASETS = ROOT / "tests" / "fixtures" / "datasets"


def real_prompts() -> list[str]:
    gsm = [json.loads(line)["question"] for line in
           (DATASETS / "question_answer" / "gsm8k_test_first200.jsonl").open()]
    math = [json.loads(line)["problem"] for line in
            (DATASETS / "problem_solution" / "qwen25math_minerva_math_test.jsonl").open()]
    return gsm + math


def near_pairs(prompts: list[str], threshold: float = 0.8, n: int = 5
               ) -> list[tuple[int, int]]:
    """Every pair (i, j), j < i, at exact Jaccard >= threshold of word n-grams (all pairs
    compared, no LSH)."""
    sh = Shingler()
    sets = [set(sh.ngrams(p, n).tolist()) for p in prompts]
    return [(i, j) for i in range(len(sets)) for j in range(i)
            if len(sets[i] & sets[j]) >= threshold * len(sets[i] | sets[j])]


def renamed(text: str) -> str:
    """One word changed: the first capitalised word after the first sentence (a name, a
    place), else the longest word."""
    words = re.findall(r"\b[A-Z][a-z]{2,}\b", text)[1:] or [max(text.split(), key=len)]
    return text.replace(words[0], "Zanzibar", 1)


def edited(text: str, k: int) -> list[str]:
    """Three edited copies of `text` (the k-th prompt edited: its list number)."""
    return ["  " + re.sub(r"\s+", "   \n ", text) + " \n",
            f"{k + 1}. " + text,
            renamed(text)]


def longest_distinct(prompts: list[str], count: int) -> list[int]:
    """The `count` longest prompts (in words) that are in no near pair."""
    paired = {k for pair in near_pairs(prompts) for k in pair}
    return sorted(set(range(len(prompts))) - paired,
                  key=lambda i: -len(prompts[i].split()))[:count]
