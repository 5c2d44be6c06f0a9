"""Decontamination: a prompt sharing a word n-gram with a benchmark item is refused.

`decontaminate = ["mt_bench", "humaneval", "gsm8k", "path/to/my_eval.jsonl"]` names the
benchmarks; `decontaminate_ngram` (13 by default, the convention of GPT-3's and Llama's
reports) is n. The three named sets ship in `producer/benchmarks/` (PROVENANCE.md there):
MT-bench's 80 questions (both turns, each turn an item), HumanEval's 164 prompts, GSM8K's
1,319 test questions. A user's own file is read as a source is (`producer.readers`, format
told from the records): each record's user turns are its item, its id the record's `id` or
``stem:line``.

Items and prompts are read the same way (`producer.shingles`: normalised words, n-grams).
An item of at least n words contributes its n-grams; an item of MIN_ITEM_WORDS to n-1
words is one n-gram of its own length, matched when the prompt holds it whole (found where
the prompt holds its first MIN_ITEM_WORDS words, then compared word by word); a shorter
item (MT-bench's second turns such as "Does it always work?") is not used: such a phrase in
a prompt says nothing of contamination. The first benchmark in the config's order that a
prompt shares an n-gram with, and its item, are named in the refusal.
"""

from __future__ import annotations

import gzip
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np

from foundation.config import BENCHMARKS
from foundation.errors import ConfigError, SourceError
from producer.formats.records import Rejected
from producer.readers.index import SourceIndex, read_sample
from producer.shingles import Shingler, prompt_text, word_hashes

log = logging.getLogger(__name__)

MIN_ITEM_WORDS = 8
DATA = Path(__file__).resolve().parent / "benchmarks"


class Hit(NamedTuple):
    """The benchmark item a prompt shares an n-gram with."""

    benchmark: str
    item: str


def shipped_items(name: str) -> Iterator[tuple[str, str]]:
    """(item id, text) of a benchmark tokencap ships."""
    if name == "mt_bench":
        for line in (DATA / "mt_bench.jsonl").read_text(encoding="utf-8").splitlines():
            q = json.loads(line)
            for t, turn in enumerate(q["turns"], 1):
                yield f"{q['question_id']}.turn{t}", turn
    elif name == "humaneval":
        with gzip.open(DATA / "HumanEval.jsonl.gz", "rt", encoding="utf-8") as f:
            for line in f:
                q = json.loads(line)
                yield q["task_id"], q["prompt"]
    elif name == "gsm8k":
        lines = (DATA / "gsm8k_test.jsonl").read_text(encoding="utf-8").splitlines()
        for k, line in enumerate(lines, 1):
            yield f"test:{k}", json.loads(line)["question"]
    else:
        raise ValueError(f"no shipped benchmark {name!r}")


def file_items(path: str, field: str) -> Iterator[tuple[str, str]]:
    """(item id, text) of a user's benchmark file, read as a source is (its user turns)."""
    try:
        index = SourceIndex.build([Path(path)])
    except SourceError as exc:
        raise ConfigError(field, str(exc)) from None
    try:
        for i in range(len(index)):
            try:
                s = read_sample(index, i, "auto", "all", None)
            except Rejected as exc:
                raise ConfigError(field, f"{exc.where or path}: {exc}") from None
            text = prompt_text(s.prompt, s.conversation)
            if text is None:
                raise ConfigError(field, f"{s.where}: token ids, not text: a benchmark "
                                  "file needs text")
            yield s.source_id or s.sample_id, text
    finally:
        index.close()


def benchmark_name(entry: str) -> str:
    """How a `decontaminate` entry is named in refusals: a shipped benchmark's name, or a
    file's stem."""
    return entry if entry in BENCHMARKS else Path(entry).name.split(".")[0]


class Benchmarks:
    """The n-grams of the configured benchmarks' items, each to its first item."""

    def __init__(self, entries: list[str], n: int) -> None:
        self.n = n
        self.names = [benchmark_name(e) for e in entries]
        self.shingler = Shingler()
        self._grams: dict[int, int] = {}  # n-gram hash -> item number
        # an item under n words: the hash of its first MIN_ITEM_WORDS words -> (its item
        # number, its words' hashes), the whole item checked where a prompt holds that start
        self._short: dict[int, list[tuple[int, np.ndarray]]] = {}
        self._items: list[Hit] = []
        self.items = dict.fromkeys(self.names, 0)
        self.unused = dict.fromkeys(self.names, 0)  # items under MIN_ITEM_WORDS words
        for k, entry in enumerate(entries):
            field = f"$.decontaminate[{k}]"
            items = shipped_items(entry) if entry in BENCHMARKS else file_items(entry, field)
            for item, text in items:
                self._add(self.names[k], item, text)
        self._keys, self._numbers = _frozen(self._grams)
        anchors = {h: k for k, h in enumerate(self._short)}
        self._anchors = _frozen(anchors)
        self._anchored = list(self._short.values())
        log.info("decontaminating against %s", ", ".join(
            f"{name} ({self.items[name]} items)" for name in self.names) or "nothing")

    def __bool__(self) -> bool:
        return bool(self._items)

    def _add(self, name: str, item: str, text: str) -> None:
        ws = word_hashes(text)
        if len(ws) < min(MIN_ITEM_WORDS, self.n):
            self.unused[name] += 1
            return
        self.items[name] += 1
        number = len(self._items)
        self._items.append(Hit(name, item))
        if len(ws) < self.n:
            anchor = int(self.shingler.ngram_hashes(ws[:MIN_ITEM_WORDS], MIN_ITEM_WORDS)[0])
            self._short.setdefault(anchor, []).append((number, ws))
            return
        for h in self.shingler.ngram_hashes(ws, self.n).tolist():
            self._grams.setdefault(h, number)

    def hit(self, text: str | None, wh: np.ndarray | None = None) -> Hit | None:
        """The first item (in the config's order, then the file's) whose n-gram the text
        holds, or None (`wh`: the text's `word_hashes`, when they are at hand)."""
        if text is None or not self._items:
            return None
        ws = word_hashes(text) if wh is None else wh
        found = _lookup(self._keys, self._numbers, self.shingler.ngram_hashes(ws, self.n)) \
            if len(ws) >= self.n else []
        if self._anchored and len(ws) >= MIN_ITEM_WORDS:
            starts = self.shingler.ngram_hashes(ws, MIN_ITEM_WORDS)
            keys, anchored = self._anchors
            at = np.minimum(np.searchsorted(keys, starts), keys.size - 1)
            for pos in np.flatnonzero(keys[at] == starts).tolist():
                for number, item in self._anchored[int(anchored[at[pos]])]:
                    if np.array_equal(ws[pos:pos + item.size], item):
                        found.append(number)
        return self._items[min(found)] if found else None


def _lookup(keys: np.ndarray, numbers: np.ndarray, hashes: np.ndarray) -> list[int]:
    """The numbers of the `hashes` found among `keys` (sorted: `searchsorted`, in C)."""
    if keys.size == 0:
        return []
    at = np.minimum(np.searchsorted(keys, hashes), keys.size - 1)
    return numbers[at[keys[at] == hashes]].tolist()


def _frozen(table: dict[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """A table as sorted keys and their items (looked up with `searchsorted`, in C)."""
    keys = np.fromiter(table.keys(), dtype=np.uint64, count=len(table))
    items = np.fromiter(table.values(), dtype=np.int64, count=len(table))
    order = np.argsort(keys)
    return keys[order], items[order]
