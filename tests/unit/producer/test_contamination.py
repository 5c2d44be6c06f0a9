"""`producer/contamination.py`: the shipped benchmarks' own items are found, a paraphrase is
not, a user's file reads as a source does."""

from __future__ import annotations

import json

import pytest

from foundation.config import BENCHMARKS
from foundation.errors import ConfigError
from producer.contamination import MIN_ITEM_WORDS, Benchmarks, shipped_items
from producer.shingles import words

SIZES = {"mt_bench": 160, "humaneval": 164, "gsm8k": 1319}


@pytest.mark.parametrize("name", BENCHMARKS)
def test_every_item_of_a_shipped_benchmark_is_found_in_itself(name: str) -> None:
    items = list(shipped_items(name))
    assert len(items) == SIZES[name]
    bench = Benchmarks([name], 13)
    long_enough = [(i, t) for i, t in items if len(words(t)) >= MIN_ITEM_WORDS]
    assert bench.items[name] == len(long_enough)
    assert bench.unused[name] == len(items) - len(long_enough)
    texts = {i: t for i, t in items}
    for item, text in long_enough:
        hit = bench.hit("Please help me with this.\n" + text)
        assert hit is not None and hit.benchmark == name
        # the item found is this one, or an earlier one holding the same run of words
        assert hit.item == item or set(words(texts[hit.item])) & set(words(text))


def test_a_paraphrase_sharing_no_13_gram_passes() -> None:
    bench = Benchmarks(["gsm8k"], 13)
    assert bench.hit("Janet's ducks lay 16 eggs per day. She eats three for breakfast every "
                     "morning and bakes muffins for her friends every day with four.") \
        == ("gsm8k", "test:1")
    assert bench.hit("Janet has ducks that give her sixteen eggs daily; three she eats at "
                     "breakfast, four go into muffins, and she sells the rest.") is None


def test_a_short_item_is_matched_whole_and_a_very_short_one_not_used(tmp_path) -> None:
    own = tmp_path / "evals.jsonl"
    own.write_text("".join(json.dumps(r) + "\n" for r in [
        {"id": "s1", "messages": [{"role": "user", "content": "Name three rivers of Europe "
                                   "that flow into the Black Sea."}]},
        {"question": "Is it true?"}]))
    bench = Benchmarks([str(own)], 13)
    assert bench.items == {"evals": 1} and bench.unused == {"evals": 1}
    assert bench.hit("First: name three rivers of Europe that flow into the black sea!") \
        == ("evals", "s1")
    assert bench.hit("Name three rivers of Europe.") is None
    assert bench.hit("Is it true? Tell me.") is None


def test_a_file_that_cannot_be_read_is_a_config_error(tmp_path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"colour": "blue"}\n')
    with pytest.raises(ConfigError, match=r"\$\.decontaminate\[0\]"):
        Benchmarks([str(bad)], 13)
