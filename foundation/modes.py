"""A category's decode modes: which mode each conversation is made in, and what it sends.

A category with `modes` (`foundation.config.Mode`) draws each conversation's mode from a
seeded hash of the run's seed, the category's name and the conversation's id (`draw`): every
turn of a conversation is made in one mode, a resumed run draws the same, and no two
categories or runs of other seeds share a sequence. The draw is a point of [0, 1) placed
against the modes' cumulative weights, so each mode takes its weight's share of the
conversations (independently per conversation: no lock-step cycle to align with an order).

A mode's chat-template kwargs merge over the category's (over the run's), its sampling over
the category's resolved sampling (`template_kwargs`, `sampling`). With `share = "tokens"` a
category runs as one category per mode (`foundation.config.split_by_mode`),
`<category>.<mode>`, capped at the mode's weight of the cap: each is a budget of its own
(admitted, counted and closed exactly once as any category), fed only the conversations
drawn to its mode from the shared source (`feeds`).
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec

from foundation.config import Category, Mode, RunConfig, SamplingParams, mode_shares, split_by_mode

__all__ = ["by_name", "draw", "family", "feeds", "fraction", "mode_shares",
           "most_new_tokens", "pick", "sampling", "split_by_mode", "template_kwargs"]

# the draw's hash: 8 bytes of BLAKE2b, as a fraction of 2**64
_DRAW_BYTES = 8
_DRAW_SPAN = float(1 << (8 * _DRAW_BYTES))


def family(cat: Category) -> str:
    """The name of the category a mode's conversations are drawn in: the category itself,
    or the one a `share = "tokens"` category was split from."""
    return cat.split_of or cat.name


def fraction(seed: int, category: str, conversation_id: str) -> float:
    """A conversation's point in [0, 1): BLAKE2b of ``seed:category:conversation id``."""
    digest = hashlib.blake2b(f"{seed}:{category}:{conversation_id}".encode(),
                             digest_size=_DRAW_BYTES).digest()
    return int.from_bytes(digest, "big") / _DRAW_SPAN


def pick(modes: list[Mode], u: float) -> Mode:
    """The mode whose slice of the cumulative weights holds `u` (in [0, 1))."""
    total = sum(m.weight for m in modes)
    edge = 0.0
    for mode in modes:
        edge += mode.weight / total
        if u < edge:
            return mode
    return modes[-1]  # u within rounding of 1


def draw(cfg: RunConfig, cat: Category, conversation_id: str) -> Mode | None:
    """The mode conversation `conversation_id` of `cat` is made in (None: no modes)."""
    if not cat.modes:
        return None
    return pick(cat.modes, fraction(cfg.seed, family(cat), conversation_id))


def template_kwargs(cfg: RunConfig, cat: Category, mode: Mode | None = None) -> dict[str, Any]:
    """The chat-template keyword arguments: the mode's over the category's over the run's."""
    return {**cfg.chat_template_kwargs, **cat.chat_template_kwargs,
            **(mode.chat_template_kwargs if mode else {})}


def sampling(cat: Category, mode: Mode | None = None) -> SamplingParams:
    """The sampling params sent: the mode's over the category's (resolved) sampling."""
    if mode is None or not mode.sampling:
        return cat.sampling
    return msgspec.convert({**msgspec.to_builtins(cat.sampling), **mode.sampling},
                           SamplingParams)


def most_new_tokens(cat: Category) -> int:
    """The most tokens a sample of `cat` may generate: its `max_new_tokens`, or its modes'
    largest (what a hard cap guards against, and where its length model ends)."""
    return max([cat.sampling.max_new_tokens,
                *(sampling(cat, m).max_new_tokens for m in cat.modes)])


def by_name(cat: Category, name: str) -> Mode:
    """`cat`'s mode `name` (KeyError naming the modes when it has none of that name)."""
    for mode in cat.modes:
        if mode.name == name:
            return mode
    raise KeyError(f"category {cat.name!r} has no mode {name!r} (its modes: "
                   f"{', '.join(m.name for m in cat.modes) or 'none'})")


def feeds(cfg: RunConfig, cat: Category, conversation_id: str) -> bool:
    """Whether `cat` feeds this conversation: any, unless it is one mode's budget of a
    `share = "tokens"` category, which feeds those drawn to its mode."""
    if cat.only_mode is None:
        return True
    mode = draw(cfg, cat, conversation_id)
    return mode is not None and mode.name == cat.only_mode
