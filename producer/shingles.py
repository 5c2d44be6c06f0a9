"""A prompt's text as the intake screens compare it: normalised words and their n-grams.

Near-duplicates (`producer.near_dups`) and decontamination (`producer.contamination`) read a
record the same way:

1. `prompt_text`: the text of the user turns the record sends (every user turn of its
   conversation as the category reads it: with `turns = "first"` the first, with "last" or
   "all" each one up to the last), joined by newlines. System prompts, tool schemas and
   assistant turns are left out (a system prompt shared by a whole source would make every
   record look alike). A pre-tokenized record has no text: it is not screened.
2. `words`: NFKC, casefolded, the text's leading list numbering dropped ("1.", "2)",
   "Q3:", "Question 4:", "- ", "* "), punctuation and symbols made spaces, whitespace
   collapsed.
3. `ngram_hashes`: the 64-bit hash of each run of n consecutive words (a text under n words
   is one n-gram: all its words), computed from the words' hashes, which are kept (a
   source's vocabulary repeats) and stable across processes (BLAKE2b, not Python's `hash`).
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from collections.abc import Sequence
from typing import Any

import numpy as np

# the text's leading list numbering: "1.", "12)", "(3)", "Q3:", "Question 4:", "Problem 2.",
# "- ", "* ", "• " (only at its start: a number that begins a line inside it stays a word,
# whatever the line breaks)
_NUMBERING = re.compile(
    r"^\s*(?:(?:q|question|problem|exercise|task)?\s*\(?\d{1,4}[.):]|[-*•])\s*")
# what is not a letter, digit or mark of a word (punctuation, symbols, "_") becomes a space
_PUNCT = re.compile(r"[\W_]+")
_WORD_CACHE_MAX = 1 << 20  # word hashes kept before the cache starts again
_MIX = np.uint64(0x9E3779B97F4A7C15)  # odd: combines word hashes position by position


def prompt_text(prompt: list[dict] | list[int], conversation: Any = None) -> str | None:
    """The user turns of a record, joined by newlines (None: a pre-tokenized prompt).
    `conversation` (`producer.formats.conversation.Conversation`, or None) gives every user
    turn up to its last generation point; else the user turns of `prompt`."""
    if conversation is not None:
        messages = conversation.messages[: max(conversation.points, default=0)]
    elif prompt and isinstance(prompt[0], dict):
        messages = prompt
    else:
        return None
    return "\n".join(_content(m.get("content")) for m in messages
                     if isinstance(m, dict) and m.get("role") == "user")


def _content(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # parts: the text ones
        return " ".join(p.get("text", "") for p in content
                        if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def words(text: str) -> list[str]:
    """The text's words after normalisation (module docstring)."""
    text = _NUMBERING.sub("", unicodedata.normalize("NFKC", text).casefold())
    return _PUNCT.sub(" ", text).split()


class Shingler:
    """Word n-gram hashes of normalised text; keeps the hashes of the words it has seen."""

    def __init__(self) -> None:
        self._cache: dict[str, int] = {}

    def word_hashes(self, ws: Sequence[str]) -> np.ndarray:
        cache = self._cache
        if len(cache) > _WORD_CACHE_MAX:
            cache.clear()
        out = np.empty(len(ws), dtype=np.uint64)
        for k, w in enumerate(ws):
            h = cache.get(w)
            if h is None:
                h = int.from_bytes(hashlib.blake2b(w.encode(), digest_size=8).digest(), "little")
                cache[w] = h
            out[k] = h
        return out

    def ngram_hashes(self, ws: Sequence[str], n: int) -> np.ndarray:
        """The 64-bit hash of each word n-gram, in order (one for a text under n words, none
        for no words)."""
        if not ws:
            return np.empty(0, dtype=np.uint64)
        wh = self.word_hashes(ws)
        if len(wh) <= n:
            return _combine(wh[None, :])
        windows = np.lib.stride_tricks.sliding_window_view(wh, n)
        return _combine(windows)

    def ngrams(self, text: str, n: int) -> np.ndarray:
        return self.ngram_hashes(words(text), n)


def _combine(windows: np.ndarray) -> np.ndarray:
    """One hash per row of word hashes: h = sum(w_k * MIX^(k+1)) mod 2^64, then rotated."""
    acc = np.zeros(windows.shape[0], dtype=np.uint64)
    with np.errstate(over="ignore"):
        for k in range(windows.shape[1]):
            acc = (acc + windows[:, k]) * _MIX
        return acc ^ (acc >> np.uint64(29))
