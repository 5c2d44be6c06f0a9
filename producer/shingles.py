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
3. `Shingler.ngrams`: the 64-bit hash of each run of n consecutive words (a text under n
   words is one n-gram: all its words), computed from the words' hashes (`word_hashes`), all
   at once in numpy, the same in every process (no Python `hash`).
"""

from __future__ import annotations

import re
import unicodedata
from typing import Any

import numpy as np

# the text's leading list numbering: "1.", "12)", "(3)", "Q3:", "Question 4:", "Problem 2.",
# "- ", "* ", "• " (only at its start: a number that begins a line inside it stays a word,
# whatever the line breaks)
_NUMBERING = re.compile(
    r"^\s*(?:(?:q|question|problem|exercise|task)?\s*\(?\d{1,4}[.):]|[-*•])\s*", re.IGNORECASE)
# bytes made spaces: every ASCII byte but a letter or digit (UTF-8's bytes past ASCII are
# kept: a non-ASCII character that is no letter or digit is replaced whole, `_odd`)
_SPACES = bytes(b if chr(b).isalnum() else 32 for b in range(128)) + bytes(range(128, 256))
_ASCII_RUNS = re.compile(r"[\x00-\x7f]+")
_ODD: dict[str, bool] = {}  # non-ASCII character -> is it no letter or digit
_SPACE = np.uint8(32)
_P = np.uint64(0x100000001B3)  # odd: invertible modulo 2^64
_P_INV = np.uint64(pow(int(_P), -1, 1 << 64))
_FMIX = np.uint64(0xFF51AFD7ED558CCD)
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
    return [w.decode() for w in tokens(text)]


def tokens(text: str) -> list[bytes]:
    """`words` as UTF-8 bytes."""
    return _spaced(text).split()


def _spaced(text: str) -> bytes:
    """The normalised text as UTF-8 with every byte of what is no letter or digit a space
    (at C speed: `bytes.translate`, and a replace per non-ASCII character that is no letter
    or digit)."""
    if text.isascii():
        return _NUMBERING.sub("", text).encode().lower().translate(_SPACES)
    if not unicodedata.is_normalized("NFKC", text):  # the check is ~10x cheaper
        text = _nfkc(text)
    text = _NUMBERING.sub("", text.casefold())
    raw = text.encode()
    for ch in set(_ASCII_RUNS.sub("", text)):  # the non-ASCII characters, each once
        odd = _ODD.get(ch)
        if odd is None:
            odd = _ODD[ch] = not ch.isalnum()
        if odd:
            raw = raw.replace(ch.encode(), b" ")
    return raw.translate(_SPACES)


def _nfkc(text: str) -> str:
    """NFKC, line by line, each line only if it needs it: the same as the whole text's (a
    line break composes with nothing), at a fraction of the cost when few lines need it."""
    norm, ok = unicodedata.normalize, unicodedata.is_normalized
    return "\n".join(line if ok("NFKC", line) else norm("NFKC", line)
                     for line in text.split("\n"))


_POWERS: list[np.ndarray] = []  # P^i and P^-i for i < their length, grown as needed


def _powers(n: int) -> tuple[np.ndarray, np.ndarray]:
    if not _POWERS or _POWERS[0].size < n:
        size = max(n, 2 * _POWERS[0].size if _POWERS else 4096)
        with np.errstate(over="ignore"):
            _POWERS[:] = [np.cumprod(np.full(size, p, dtype=np.uint64)) * q
                          for p, q in ((_P, _P_INV), (_P_INV, _P))]
    return _POWERS[0][:n], _POWERS[1][:n]


def word_hashes(text: str) -> np.ndarray:
    """The 64-bit hash of each word of the normalised text, in order, computed for all words
    at once (a polynomial hash over the bytes from prefix sums, then mixed): no Python work
    per word."""
    raw = np.frombuffer(b" " + _spaced(text) + b" ", dtype=np.uint8)
    inside = raw != _SPACE
    edges = np.flatnonzero(inside[1:] != inside[:-1]) + 1
    starts, ends = edges[0::2], edges[1::2]
    if starts.size == 0:
        return np.empty(0, dtype=np.uint64)
    powers, inverse = _powers(raw.size)
    with np.errstate(over="ignore"):
        terms = (raw.astype(np.uint64) + np.uint64(1)) * powers
        prefix = np.concatenate(([np.uint64(0)], np.cumsum(terms, dtype=np.uint64)))
        h = (prefix[ends] - prefix[starts]) * inverse[starts]
        h ^= h >> np.uint64(33)
        h *= _FMIX
        return h ^ (h >> np.uint64(29))


class Shingler:
    """Word n-gram hashes of normalised text."""

    def ngram_hashes(self, wh: np.ndarray, n: int) -> np.ndarray:
        """The 64-bit hash of each word n-gram of the word hashes `wh`, in order (one for a
        text under n words, none for no words)."""
        if wh.size == 0:
            return np.empty(0, dtype=np.uint64)
        if wh.size <= n:
            return _combine(wh[None, :])
        return _combine(np.lib.stride_tricks.sliding_window_view(wh, n))

    def ngrams(self, text: str, n: int) -> np.ndarray:
        return self.ngram_hashes(word_hashes(text), n)


def _combine(windows: np.ndarray) -> np.ndarray:
    """One hash per row of word hashes: h = sum(w_k * MIX^(k+1)) mod 2^64, then rotated."""
    acc = np.zeros(windows.shape[0], dtype=np.uint64)
    with np.errstate(over="ignore"):
        for k in range(windows.shape[1]):
            acc = (acc + windows[:, k]) * _MIX
        return acc ^ (acc >> np.uint64(29))
