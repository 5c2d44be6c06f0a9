"""Near-duplicates and contamination refused at intake, through the real producer, the real
Qwen2.5 tokenizer and the simulator (docs/MIX.md).

The prompts are real public ones (`testing.near_copies`): GSM8K's first 200 test questions
and the 272 MATH-Minerva problems, 472 in all, of which two pairs are near copies already
(MATH-Minerva's subproblem chains, Jaccard 0.83 and 0.86 of word 5-grams): 470 distinct.
The edited copies are made from the 40 longest distinct ones: each copied three ways
(whitespace changed, list numbering added, one name changed)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from producer.contamination import shipped_items
from sglang_sim.testing import SimServer
from testing.harness import started
from testing.near_copies import edited, longest_distinct, near_pairs, real_prompts
from tests.conftest import QWEN, write_config

SIM_TIME_SCALE = 400.0
EDITED = 40


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
    prompts = real_prompts()
    assert len(set(prompts)) == 472
    pairs = near_pairs(prompts)
    assert len(pairs) == 2
    src = tmp_path / "prompts.jsonl"
    write(src, prompts)
    cfg = config(tmp_path, src)
    with SimServer(time_scale=SIM_TIME_SCALE) as sim:
        with started(cfg, redis_url, [sim.url], 4) as pipe:
            status = pipe.run()
            pipe.check_invariants(status)
        # Then one of each pair is refused as a near-duplicate of the other, none else
        first = {int(d.id.split(":")[1]) - 1 for d in letters(pipe, "near_duplicate")}
        assert len(first) == 2 and all(len(first & set(pair)) == 1 for pair in pairs)
        assert status["categories"]["a"]["samples"] == 470
        # When the source grows by edited copies of the 40 longest, and the producer starts
        # again (its index rebuilt from Redis)
        longest = longest_distinct(prompts, EDITED)
        copies = {c: i for k, i in enumerate(longest) for c in edited(prompts[i], k)}
        write(src, prompts + list(copies))
        with started(cfg, redis_url, [sim.url], 4) as pipe:
            status = pipe.run()
            pipe.check_invariants(status)
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
    gsm = real_prompts()[:200]
    mt = [text for item, text in shipped_items("mt_bench") if item.endswith(".turn1")][:20]
    he = [text for _item, text in shipped_items("humaneval")][:20]
    own = tmp_path / "my_eval.jsonl"
    own.write_text(json.dumps({"id": "mine-1", "question": "Describe the migration of the "
                               "arctic tern from pole to pole in five short sentences."}) + "\n")
    paraphrase = ("Janet has ducks that give her sixteen eggs daily; three she eats at "
                  "breakfast, four go into muffins, and she sells the rest for two dollars "
                  "apiece. What does she earn each day?")
    mine = "Please describe the migration of the arctic tern from pole to pole in five " \
           "short sentences, for children."
    src = tmp_path / "prompts.jsonl"
    write(src, gsm + mt + he + [paraphrase, mine])
    cfg = config(tmp_path, src, f'decontaminate = ["gsm8k", "mt_bench", "humaneval", "{own}"]\n'
                 "[near_duplicates]\nenabled = false\n")
    with SimServer(time_scale=SIM_TIME_SCALE) as sim, \
            started(cfg, redis_url, [sim.url], 4) as pipe:
        status = pipe.run()
        pipe.check_invariants(status)
    # Then every benchmark item is refused as contaminated, naming its benchmark and item
    refused = {int(d.id.split(":")[1]): d.message for d in letters(pipe, "contaminated")}
    for k in range(1, 201):
        assert refused[k].startswith(f"gsm8k item test:{k}:"), refused.get(k)
    for k in range(20):
        assert refused[201 + k].startswith(f"mt_bench item {81 + k}.turn1:"), refused.get(201 + k)
    for k in range(20):
        assert refused[221 + k].startswith(f"humaneval item HumanEval/{k}:"), refused.get(221 + k)
    assert refused[242].startswith("my_eval item mine-1:")
    # and the paraphrase, sharing no 13-word run, passes
    assert 241 not in refused
    assert len(refused) == 241
    assert status["categories"]["a"]["samples"] == 1
    assert status["categories"]["a"]["reasons"]["contaminated"] == 241
