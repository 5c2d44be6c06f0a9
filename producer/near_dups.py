"""Near-duplicate prompts: MinHash LSH (datasketch) over the prompts a run fed, in memory.

Each prompt's text (`producer.shingles.prompt_text`, normalised, word n-grams) gets a MinHash
of NUM_PERM 32-bit values (datasketch's `MinHash`, its affine32 scheme). A MinHashLSH in
BANDS bands of ROWS values finds the earlier prompts that may be near it (the chance that a
prompt at Jaccard s is found is 1 - (1 - s^ROWS)^BANDS: 0.985 at 0.8, 0.9998 at 0.9); each
candidate is then read back from its source and its exact Jaccard computed: the prompt is
refused (`near_duplicate`, naming the kept one) only when that reaches the threshold, so the
LSH's false candidates never refuse a prompt.

What survives a producer restart is each fed prompt's record, `SIGNATURE_BYTES` bytes (its
record's position in its source, uint32, then its MinHash values), appended by the feed
script to the category's `near` string in the same call that feeds it (`FeedingLedger.feed`);
`NearDuplicates.load` rebuilds the LSH from them before anything is fed.
"""

from __future__ import annotations

import logging
import struct
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
from datasketch import LeanMinHash, MinHash, MinHashLSH
from datasketch.minhash import _fmix

from foundation.config import NearDuplicates as Settings
from producer.shingles import Shingler, word_hashes

log = logging.getLogger(__name__)

NUM_PERM = 32
BANDS, ROWS = 8, 4  # BANDS * ROWS == NUM_PERM
SEED = 45  # the permutations' seed: part of the stored signatures' meaning, never change it
SCHEME = "affine32"  # datasketch's: 32-bit values, what the ledger stores
_POS = struct.Struct("<I")
SIGNATURE_BYTES = _POS.size + 4 * NUM_PERM  # 132
LOAD_STEP = 10_000


class Kept(NamedTuple):
    """Where a fed prompt is: its category and its record's position in the source."""

    category: str
    position: int


class Verdict(NamedTuple):
    """A prompt screened: `kept` the earlier prompt it nears (None: it is new), with their
    Jaccard; `signature` the record to store when it is fed (b"" when refused or no text)."""

    kept: Kept | None
    jaccard: float
    signature: bytes


# reads back the text of a kept prompt (None: it cannot be read now)
TextOf = Callable[[Kept], "str | None"]
# whether two prompts are the same record of the same source, fed by two categories (a mix:
# another template or sampling over one source), which is no near-copy of itself
SameRecord = Callable[[Kept, Kept], bool]


class NearDuplicates:
    """The run's near-duplicate index: every category's fed prompts, one LSH."""

    def __init__(self, settings: Settings, categories: Sequence[str], text_of: TextOf,
                 same_record: SameRecord | None = None) -> None:
        self.threshold = settings.threshold
        self.n = settings.ngram
        self.categories = list(categories)
        self._cat_no = {c: k for k, c in enumerate(self.categories)}
        self.text_of = text_of
        self.same_record = same_record
        self.shingler = Shingler()
        self._lsh = MinHashLSH(num_perm=NUM_PERM, params=(BANDS, ROWS))
        self._template = MinHash(num_perm=NUM_PERM, seed=SEED, hashfunc=int,
                                 scheme=SCHEME)
        self.size = 0

    # -- keys ---------------------------------------------------------------------------
    def _key(self, kept: Kept) -> int:
        return self._cat_no[kept.category] << 32 | kept.position

    def _kept(self, key: int) -> Kept:
        return Kept(self.categories[key >> 32], key & 0xFFFFFFFF)

    def __contains__(self, kept: Kept) -> bool:
        return self._key(kept) in self._lsh

    # -- restart --------------------------------------------------------------------------
    def load(self, category: str, records: bytes,
             keep_alive: Callable[[], None] | None = None) -> int:
        """Add the signatures the ledger holds for `category` (the `near` string); returns
        how many were added (one already in is skipped). `keep_alive()` is called every
        LOAD_STEP records (a million take ~40 s: the producer's lease is renewed)."""
        whole = len(records) // SIGNATURE_BYTES * SIGNATURE_BYTES
        if whole != len(records):
            log.warning("%s: near-duplicate records end in a partial one (%d bytes): ignored",
                        category, len(records) - whole)
        rows = np.frombuffer(records[:whole], dtype="<u4").reshape(-1, 1 + NUM_PERM)
        added = 0
        t0 = time.monotonic()
        with self._lsh.insertion_session() as session:
            for k, row in enumerate(rows):
                if keep_alive is not None and k % LOAD_STEP == 0:
                    keep_alive()
                key = self._cat_no[category] << 32 | int(row[0])
                if key in self._lsh:
                    continue
                session.insert(key, LeanMinHash(seed=SEED, hashvalues=row[1:], scheme=SCHEME),
                               check_duplication=False)
                added += 1
        self.size += added
        log.info("%s: %d near-duplicate signatures loaded in %.1f s", category, added,
                 time.monotonic() - t0)
        return added

    # -- screening -------------------------------------------------------------------------
    def minhash(self, hashes: np.ndarray) -> MinHash:
        """The MinHash of the n-gram hashes (folded to 32 bits): what datasketch's
        `update_batch` gives, its own pre-mix (`_fmix`) and permutations applied to the
        array at once (`update_batch` first passes each value through a Python `hashfunc`
        call, two thirds of its cost at 2,000 values; `test_near_dups` holds the two equal)."""
        m = self._template.copy()
        folded = ((hashes ^ (hashes >> np.uint64(32))) & np.uint64(0xFFFFFFFF)).astype(np.uint32)
        a, b = m.permutations
        with np.errstate(over="ignore"):
            permuted = _fmix(folded.reshape(-1, 1), 32) * a + b
        m.hashvalues = np.minimum(m.hashvalues, permuted.min(axis=0))
        return m

    def screen(self, kept: Kept, text: str | None, wh: np.ndarray | None = None) -> Verdict:
        """Whether the prompt of `kept` nears one fed before; a new one is added to the index
        (so that the next prompts are screened against it). A prompt already in the index
        (fed before a restart, or fed again after Redis lost a feed) is new, and its
        signature is given again. `wh`: the text's `word_hashes`, when they are at hand."""
        if text is None:
            return Verdict(None, 0.0, b"")
        hashes = self.shingler.ngram_hashes(word_hashes(text) if wh is None else wh, self.n)
        if hashes.size == 0:
            return Verdict(None, 0.0, b"")
        m = self.minhash(hashes)
        key = self._key(kept)
        if key not in self._lsh:
            best = self._nearest(hashes, m, key)
            if best is not None:
                return Verdict(best[0], best[1], b"")
            self._lsh.insert(key, m, check_duplication=False)
            self.size += 1
        return Verdict(None, 0.0, _POS.pack(kept.position)
                       + m.hashvalues.astype("<u4", copy=False).tobytes())

    def _nearest(self, hashes: np.ndarray, m: MinHash, key: int) -> tuple[Kept, float] | None:
        """The first candidate, in a stable order (category in the config's order, then
        record position), whose exact Jaccard with the prompt's n-grams reaches the
        threshold; the prompt's own record fed by another category is not one."""
        mine: np.ndarray | None = None  # made only when there is a candidate
        for other in sorted(self._lsh.query(m)):
            kept = self._kept(other)
            if other == key or (self.same_record and self.same_record(self._kept(key), kept)):
                continue
            if mine is None:
                mine = np.unique(hashes)
            text = self.text_of(kept)
            if text is None:
                continue
            j = jaccard(mine, np.unique(self.shingler.ngrams(text, self.n)))
            if j >= self.threshold:
                return kept, j
        return None


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """The Jaccard of two sets of hashes, each given as a sorted array of unique values."""
    if a.size == 0 and b.size == 0:
        return 1.0
    common = np.intersect1d(a, b, assume_unique=True).size
    return common / (a.size + b.size - common)
