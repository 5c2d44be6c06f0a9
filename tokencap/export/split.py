"""The eval split: which side of a train/eval split a row falls on, by conversation.

A row's side is a function of its conversation id (a single sample's id is its conversation)
and the seed alone: blake2b of ``"<seed>:<conversation id>"`` read as a number in [0, 1),
below the fraction is eval. So every turn of one conversation is on one side, a resumed or
repeated run puts each row where it put it before (no shuffle of today's rows), and every
category gets the fraction in expectation (the hash does not look at the category). SpecForge
splits 5% with seed 42 by shuffling rows, speculators takes a contiguous slice of rows: either
can put one conversation's turns on both sides.
"""

from __future__ import annotations

import hashlib
from typing import Literal

Side = Literal["train", "eval"]
_SCALE = float(1 << 64)


def side(conversation_id: str, fraction: float, seed: int) -> Side:
    """The side of the rows of `conversation_id` for an eval `fraction` in [0, 1)."""
    if fraction <= 0:
        return "train"
    digest = hashlib.blake2b(f"{seed}:{conversation_id}".encode(), digest_size=8).digest()
    return "eval" if int.from_bytes(digest, "big") / _SCALE < fraction else "train"
