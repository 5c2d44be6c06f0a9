"""`producer/intake.py`: the screens on a batch, in their order, and what they leave to the
feed script."""

from __future__ import annotations

import msgspec
import pytest

from budget_service.feeding import Seen
from budget_service.ledger import prompt_digest
from foundation.wire import CONTAMINATED, NEAR_DUPLICATE, contaminated_by
from producer.intake import Intake
from producer.readers.index import Sample
from tests.helpers import make_cfg, pending

GSM1 = ("Janet's ducks lay 16 eggs per day. She eats three for breakfast every morning and "
        "bakes muffins for her friends every day with four.")
LONG = ("Write a short story about a lighthouse keeper who finds a message in a bottle "
        "that was written by her grandmother sixty years ago, and tell it in five parts.")


def unseen(prepared: list) -> Seen:
    """A batch no sample fed before."""
    return Seen([prompt_digest(p.prompt_ids) for p in prepared], [None] * len(prepared))


class Source:
    """What the intake asks of a category's source."""

    def __init__(self, texts: list[str]) -> None:
        self.samples = [Sample(f"s:{k + 1}", k, f"s.jsonl:{k + 1}", None,
                               [{"role": "user", "content": t}]) for k, t in enumerate(texts)]

    def first_id(self, s: Sample) -> str:
        return s.sample_id

    def first_id_of(self, sid: str) -> str:
        return sid

    def sample_id_at(self, pos: int) -> str:
        return self.samples[pos].sample_id

    def read(self, pos: int) -> Sample:
        return self.samples[pos]


def test_screens_refuse_contaminated_then_near_copies_and_leave_exact_copies() -> None:
    texts = [LONG, GSM1, "2. " + LONG, LONG, "An unrelated question about tides?"]
    source = Source(texts)
    cfg = msgspec.structs.replace(make_cfg(), decontaminate=["gsm8k"])
    intake = Intake(cfg, lambda name: source)  # type: ignore[arg-type,return-value]
    prepared = [pending(s.sample_id, (k, k)) for k, s in enumerate(source.samples)]
    prepared[3] = pending("s:4", (0, 0))  # the same prompt ids as s:1
    out = intake.screen("code", source.samples, prepared, unseen(prepared))
    assert [p.sample_id for p in out.samples] == ["s:1", "s:4", "s:5"]
    # the exact copy is left to the feed script (duplicate_prompt), with no record
    assert [len(r) for r in out.near] == [132, 0, 132]
    # what the ledger knew of each prompt goes on with it to the feed, asked once
    assert out.seen == unseen(out.samples)
    got = {d.id: d for d in out.refused}
    assert got["s:2"].reason == CONTAMINATED and contaminated_by(got["s:2"]) == "gsm8k"
    assert got["s:2"].message.startswith("gsm8k item test:1:")
    assert got["s:3"].reason == NEAR_DUPLICATE and "near-duplicate of code/s:1 " in \
        got["s:3"].message


def test_nothing_is_screened_when_both_are_off() -> None:
    cfg = make_cfg()
    cfg = msgspec.structs.replace(cfg, near_duplicates=msgspec.structs.replace(
        cfg.near_duplicates, enabled=False))
    intake = Intake(cfg, lambda name: None)
    assert not intake.active
    out = intake.screen("code", [], [pending("a")], unseen([pending("a")]))
    assert [p.sample_id for p in out.samples] == ["a"] and out.refused == []


def test_one_record_fed_by_two_categories_is_no_near_copy_of_itself() -> None:
    # Given two categories over the same source (a mix: another template), the first fed
    texts = [LONG, "An unrelated question about tides and the moon?", "3. " + LONG]
    source = Source(texts)
    cfg = make_cfg(cats=("think", "fast"))
    intake = Intake(cfg, lambda name: source)  # type: ignore[arg-type,return-value]
    batch = [pending("s:1", (1,)), pending("s:2", (2,))]
    first = intake.screen("think", source.samples[:2], batch, unseen(batch))
    assert first.refused == []
    # When the second category feeds the same records (other ids: another template), and the
    # near-copy record s:3
    batch = [pending(s.sample_id, (9, k)) for k, s in enumerate(source.samples)]
    out = intake.screen("fast", source.samples, batch, unseen(batch))
    # Then its own records pass, and the near-copy is refused naming the first category's
    assert [p.sample_id for p in out.samples] == ["s:1", "s:2"]
    [letter] = out.refused
    assert letter.id == "s:3" and "near-duplicate of think/s:1 " in letter.message


def test_an_index_load_that_fails_is_not_loaded_and_the_next_one_is() -> None:
    class Budget:
        """A ledger whose first read of the index fails (Redis went away)."""

        def __init__(self) -> None:
            self.feeding = self
            self.reads = 0

        def near_records(self, name: str) -> bytes:
            self.reads += 1
            if self.reads == 1:
                raise ConnectionError("Redis went away")
            return b""

    budget = Budget()
    intake = Intake(make_cfg(), lambda name: None)
    assert intake.near is not None and not intake.loaded
    with pytest.raises(ConnectionError):
        intake.load(budget)  # type: ignore[arg-type]
    assert not intake.loaded  # the producer's next screen loads it again
    intake.load(budget)  # type: ignore[arg-type]
    assert intake.loaded and budget.reads == 2
