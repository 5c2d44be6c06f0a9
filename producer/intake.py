"""The intake screens the producer runs on each batch before feeding it: contamination, then
near-duplicates (`producer.contamination`, `producer.near_dups`; docs/MIX.md).

A prompt refused is a final dead letter (rejected): `contaminated` (its message names the
benchmark and the item: `contamination_message`) or `near_duplicate` (naming the kept prompt
as "category/sample id"). A prompt whose token ids another sample fed already is left to the
feed script, which refuses it as `duplicate_prompt` as before. What the near-duplicate index
holds survives a restart: `Intake.load` rebuilds it from the ledger.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

from budget_service.budget import Budget
from budget_service.feeding import Seen
from foundation.config import RunConfig
from foundation.wire import CONTAMINATED, NEAR_DUPLICATE, DeadLetter, Outcome, Pending
from producer.contamination import Benchmarks
from producer.formats.records import Rejected
from producer.near_dups import Kept, NearDuplicates
from producer.readers.index import Sample
from producer.shingles import prompt_text, word_hashes
from producer.source import CategorySource

log = logging.getLogger(__name__)


class Screened(NamedTuple):
    """A batch screened: the samples to feed with their near-duplicate records (empty: none)
    and what the ledger knows of their prompts (`Seen`), and the dead letters of those
    refused."""

    samples: list[Pending]
    near: list[bytes]
    refused: list[DeadLetter]
    seen: Seen


def contamination_message(benchmark: str, item: str, n: int) -> str:
    """A `contaminated` refusal's message (`foundation.wire.contaminated_by` reads it)."""
    return f"{benchmark} item {item}: shares a {n}-word run with this prompt"


def sample_text(sample: Sample) -> str | None:
    return prompt_text(sample.prompt, sample.conversation)


class Intake:
    """The screens of one run. `sources(category)` gives a category's open source (None when
    it is not open): the near-duplicate check reads the kept prompt back from it."""

    def __init__(self, cfg: RunConfig,
                 sources: Callable[[str], CategorySource | None]) -> None:
        self.cfg = cfg
        self.sources = sources
        on = cfg.stage == "generate"
        self.benchmarks = Benchmarks(cfg.decontaminate if on else [], cfg.decontaminate_ngram)
        self.near = (NearDuplicates(cfg.near_duplicates, [c.name for c in cfg.category],
                                    self._text_of, self._same_record)
                     if on and cfg.near_duplicates.enabled else None)
        self.loaded = False  # the near-duplicate index rebuilt from the ledger (`load`)

    @property
    def active(self) -> bool:
        """Whether any screen runs."""
        return self.near is not None or bool(self.benchmarks)

    def _text_of(self, kept: Kept) -> str | None:
        source = self.sources(kept.category)
        if source is None:
            return None
        try:
            return sample_text(source.read(kept.position))
        except (Rejected, OSError):  # a record that cannot be read now is no evidence
            return None

    def _same_record(self, a: Kept, b: Kept) -> bool:
        """Two categories over the same source files, at the same record: one record fed
        twice (a mix: another template or sampling), which is no near-copy of itself."""
        return a.position == b.position and a.category != b.category and \
            self.cfg.by_name(a.category).paths == self.cfg.by_name(b.category).paths

    def load(self, budget: Budget, keep_alive: Callable[[], None] | None = None) -> None:
        """Rebuild the near-duplicate index from the ledger (once, before the first screen;
        `keep_alive()` now and then while it takes: the producer's lease renewed). One that
        fails (Redis went away) is not `loaded`: the next screen loads it again."""
        if self.near is not None:
            for cat in self.cfg.category:
                self.near.load(cat.name, budget.feeding.near_records(cat.name), keep_alive)
        self.loaded = True

    def screen(self, category: str, samples: Sequence[Sample], prepared: Sequence[Pending],
               seen: Seen) -> Screened:
        """Screen `prepared` (made from `samples`; `seen`: their prompt digests and the
        sample that fed the same prompt ids already, `FeedingLedger.seen`)."""
        if not self.active:
            return Screened(list(prepared), [], [], seen)
        source = self.sources(category)
        by_id: Mapping[str, Sample] = (
            {source.first_id(s): s for s in samples} if source else {})
        keep: list[Pending] = []
        kept: list[bool] = []
        near: list[bytes] = []
        refused: list[DeadLetter] = []
        digests: set[str] = set()
        for p, digest, owner in zip(prepared, seen.digests, seen.owners, strict=True):
            s = by_id.get(p.sample_id)
            exact = (owner is not None and owner != f"{category}/{p.sample_id}") \
                or digest in digests
            digests.add(digest)
            letter, record = (None, b"") if s is None or exact else self._check(category, p, s)
            kept.append(letter is None)  # the feed script refuses the exact copy
            if letter is not None:
                refused.append(letter)
                continue
            keep.append(p)
            near.append(record)
        return Screened(keep, near, refused, seen.keep(kept))

    def _check(self, category: str, p: Pending, s: Sample) -> tuple[DeadLetter | None, bytes]:
        """The prompt's refusal (None: it passes), and its near-duplicate record."""
        text = sample_text(s)
        wh = None if text is None else word_hashes(text)
        hit = self.benchmarks.hit(text, wh)
        if hit is not None:
            return self._letter(category, p, CONTAMINATED, contamination_message(
                hit.benchmark, hit.item, self.benchmarks.n)), b""
        if self.near is None:
            return None, b""
        v = self.near.screen(Kept(category, s.ordinal), text, wh)
        if v.kept is None:
            return None, v.signature
        kept = self.sources(v.kept.category)
        name = kept.first_id_of(kept.sample_id_at(v.kept.position)) if kept else "?"
        return self._letter(category, p, NEAR_DUPLICATE, (
            f"near-duplicate of {v.kept.category}/{name} (Jaccard {v.jaccard:.2f} of word "
            f"{self.near.n}-grams, threshold {self.near.threshold})")), b""

    def _letter(self, category: str, p: Pending, reason: str, message: str) -> DeadLetter:
        log.info("%s: refused %s at %s: %s: %s", category, p.sample_id, p.where, reason,
                 message)
        return DeadLetter.of(p, category, Outcome.REJECTED, reason, message)
