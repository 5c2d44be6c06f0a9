"""Near-duplicates and contamination refused at intake, through the real producer, the real
Qwen2.5 tokenizer and the simulator (docs/MIX.md).

The distinct prompts are real public ones (tests/fixtures/PROVENANCE.md): GSM8K's first 200
test questions and the 272 MATH-Minerva problems, 472 in all, of which two pairs are near
copies already (MATH-Minerva's subproblem chains, Jaccard 0.83 and 0.86 of word 5-grams;
`near_pairs` finds them by brute force): 470 distinct. The edited copies are made here from
the 40 longest distinct ones: each copied three ways (whitespace changed, list numbering
added, one name changed)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from producer.shingles import Shingler
from sglang_sim.testing import SimServer
from testing.harness import started
from tests.conftest import DATASETS, QWEN, write_config

SIM_TIME_SCALE = 400.0
EDITED = 40


def distinct_prompts() -> list[str]:
    gsm = [json.loads(line)["question"] for line in
           (DATASETS / "question_answer" / "gsm8k_test_first200.jsonl").open()]
    math = [json.loads(line)["problem"] for line in
            (DATASETS / "problem_solution" / "qwen25math_minerva_math_test.jsonl").open()]
    return gsm + math


def near_pairs(prompts: list[str], threshold: float = 0.8) -> list[tuple[int, int]]:
    """Every pair (i, j), j < i, at exact Jaccard >= threshold (all pairs compared)."""
    sh = Shingler()
    sets = [set(sh.ngrams(p, 5).tolist()) for p in prompts]
    return [(i, j) for i in range(len(sets)) for j in range(i)
            if len(sets[i] & sets[j]) >= threshold * len(sets[i] | sets[j])]


def renamed(text: str) -> str:
    """One word changed: the first capitalised word after the first sentence (a name, a
    place), else the longest word."""
    words = re.findall(r"\b[A-Z][a-z]{2,}\b", text)[1:] or [max(text.split(), key=len)]
    return text.replace(words[0], "Zanzibar", 1)


def edited(text: str, k: int) -> list[str]:
    return ["  " + re.sub(r"\s+", "   \n ", text) + " \n",
            f"{k + 1}. " + text,
            renamed(text)]


def write(path: Path, prompts: list[str]) -> None:
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": p}]}) + "\n"
                            for p in prompts))


def config(tmp_path: Path, src: Path, extra: str = "") -> object:
    return write_config(tmp_path, f"""
run = "screens"
output_dir = "{tmp_path / 'out'}"
tokenizer = "{QWEN}"
cap_tokens = "none"
seed = 3
{extra}
[[category]]
name = "a"
source = "{src}"
sampling = {{ max_new_tokens = 8 }}
""")


def letters(pipe, reason: str) -> list:
    return [d for d in pipe.dead("a") if d.reason == reason]


def test_edited_copies_refused_after_a_restart_distinct_kept(tmp_path, redis_url) -> None:
    # Given 472 real prompts, two pairs of them near copies, run to the end
    prompts = distinct_prompts()
    assert len(set(prompts)) == 472
    pairs = near_pairs(prompts)
    assert len(pairs) == 2
    paired = {k for pair in pairs for k in pair}
    src = tmp_path / "prompts.jsonl"
    write(src, prompts)
    cfg = config(tmp_path, src)
    with SimServer(time_scale=SIM_TIME_SCALE) as sim:
        with started(cfg, redis_url, [sim.url], 4) as pipe:
            status = pipe.run()
        # Then one of each pair is refused as a near-duplicate of the other, none else
        first = {int(d.id.split(":")[1]) - 1 for d in letters(pipe, "near_duplicate")}
        assert len(first) == 2 and all(len(first & set(pair)) == 1 for pair in pairs)
        assert status["categories"]["a"]["samples"] == 470
        # When the source grows by edited copies of the 40 longest, and the producer starts
        # again (its index rebuilt from Redis)
        longest = sorted(set(range(len(prompts))) - paired,
                         key=lambda i: -len(prompts[i].split()))[:EDITED]
        copies = {c: i for k, i in enumerate(longest) for c in edited(prompts[i], k)}
        write(src, prompts + list(copies))
        with started(cfg, redis_url, [sim.url], 4) as pipe:
            status = pipe.run()
    # Then every edited copy is refused, naming the prompt it copies, and nothing else
    near = [d for d in letters(pipe, "near_duplicate") if int(d.id.split(":")[1]) > 472]
    assert len(near) == 3 * EDITED
    lines = {f"prompts:{i + 1}" for i in longest}
    for d in near:
        assert int(d.id.split(":")[1]) > 472
        kept = re.search(r"near-duplicate of a/(\S+) ", d.message)
        assert kept is not None and kept.group(1) in lines, d.message
    assert status["categories"]["a"]["samples"] == 470
    assert status["categories"]["a"]["reasons"].get("near_duplicate") == 3 * EDITED + 2


def test_benchmark_items_refused_paraphrase_passes(tmp_path, redis_url) -> None:
    # Given GSM8K's first 200 test questions, a paraphrase of one, 20 MT-bench and 20
    # HumanEval items, and a user's own benchmark file
    gsm = distinct_prompts()[:200]
    mt = [json.loads(line)["turns"][0] for line in
          (Path("producer/benchmarks/mt_bench.jsonl")).open()][:20]
    own = tmp_path / "my_eval.jsonl"
    own.write_text(json.dumps({"id": "mine-1", "question": "Describe the migration of the "
                               "arctic tern from pole to pole in five short sentences."}) + "\n")
    paraphrase = ("Janet has ducks that give her sixteen eggs daily; three she eats at "
                  "breakfast, four go into muffins, and she sells the rest for two dollars "
                  "apiece. What does she earn each day?")
    mine = "Please describe the migration of the arctic tern from pole to pole in five " \
           "short sentences, for children."
    src = tmp_path / "prompts.jsonl"
    write(src, gsm + mt + [paraphrase, mine])
    cfg = config(tmp_path, src, f'decontaminate = ["gsm8k", "mt_bench", "{own}"]\n'
                 "[near_duplicates]\nenabled = false\n")
    with SimServer(time_scale=SIM_TIME_SCALE) as sim, \
            started(cfg, redis_url, [sim.url], 4) as pipe:
        status = pipe.run()
    # Then every benchmark item is refused as contaminated, naming its benchmark and item
    refused = {int(d.id.split(":")[1]): d.message for d in letters(pipe, "contaminated")}
    for k in range(1, 201):
        assert refused[k].startswith(f"gsm8k item test:{k}:"), refused.get(k)
    for k in range(20):
        assert refused[201 + k].startswith(f"mt_bench item {81 + k}.turn1:"), refused.get(201 + k)
    assert refused[222].startswith("my_eval item mine-1:")
    # and the paraphrase, sharing no 13-word run, passes
    assert 221 not in refused
    assert len(refused) == 221
    assert status["categories"]["a"]["samples"] == 1
    assert status["categories"]["a"]["reasons"]["contaminated"] == 221
