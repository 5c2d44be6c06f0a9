"""Deterministic synthetic outputs: prompt tokens, output lengths, output ids and text.

Nothing here is a language model. A request's output is a pure function of its prompt token
ids, ``sampling_params.sampling_seed`` and the simulator seed (hashed with SHA-256, never
Python's salted ``hash()``), so a retried request gets the same answer:

- its *natural* length L is drawn from the category's lognormal (``LengthDist``; at least 1);
- its natural sequence is L-1 pseudo-random ids below ``vocab_size`` that are never the EOS id,
  then the EOS id. With ``ignore_eos`` the sequence has no EOS and goes on without end;
- the reply holds the first ``min(L, max_new_tokens)`` ids of that sequence, so a smaller
  ``max_new_tokens`` returns a prefix of what a larger one returns.

``text`` is a rendering of the ids, `` t<id>`` per token with the EOS token left out (as
SGLang drops a matched stop token from the text); it is not natural language. A ``text``
prompt is "tokenized" crudely: one token per whitespace-separated word, each word's id derived
from its SHA-256.
"""

from __future__ import annotations

import hashlib
import json
import math
import random

from sglang_sim.config import LengthDist

SEED_BYTES = 8
WORD_ID_BYTES = 4
_LENGTH_STREAM = b"length"
_IDS_STREAM = b"ids"


def _digest_int(*parts: bytes, nbytes: int = SEED_BYTES) -> int:
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(SEED_BYTES, "big"))
        h.update(part)
    return int.from_bytes(h.digest()[:nbytes], "big")


def _non_eos_id(raw: int, vocab_size: int, eos_token_id: int) -> int:
    """Map ``raw`` in [0, vocab_size - 1) onto [0, vocab_size) without the EOS id."""
    return raw + 1 if raw >= eos_token_id else raw


def tokenize_text(text: str, vocab_size: int, eos_token_id: int) -> list[int]:
    """One token per whitespace-separated word; ids derived from each word's SHA-256."""
    return [
        _non_eos_id(
            _digest_int(word.encode(), nbytes=WORD_ID_BYTES) % (vocab_size - 1),
            vocab_size,
            eos_token_id,
        )
        for word in text.split()
    ]


def request_seed(input_ids: list[int], sampling_seed: int | None, sim_seed: int) -> int:
    """The seed of one request's output: SHA-256 of prompt ids, sampling seed, sim seed."""
    payload = json.dumps([input_ids, sampling_seed, sim_seed], separators=(",", ":"))
    return _digest_int(payload.encode())


def natural_length(seed: int, dist: LengthDist) -> int:
    """Output length the request would have without a cap: lognormal with mean and sigma."""
    rng = random.Random(_digest_int(seed.to_bytes(SEED_BYTES, "big"), _LENGTH_STREAM))
    mu = math.log(dist.mean_tokens) - dist.sigma * dist.sigma / 2.0
    return max(1, round(rng.lognormvariate(mu, dist.sigma)))


def output_ids(
    seed: int,
    count: int,
    natural_len: int,
    *,
    vocab_size: int,
    eos_token_id: int,
    ignore_eos: bool,
) -> list[int]:
    """The first ``count`` ids of the request's natural sequence (see module docstring)."""
    rng = random.Random(_digest_int(seed.to_bytes(SEED_BYTES, "big"), _IDS_STREAM))
    span = vocab_size - 1
    ids = [_non_eos_id(rng.randrange(span), vocab_size, eos_token_id) for _ in range(count)]
    if not ignore_eos and count >= natural_len > 0:
        ids[natural_len - 1] = eos_token_id
    return ids


def render_text(ids: list[int], eos_token_id: int) -> str:
    """`` t<id>`` per token, EOS left out. Not real text."""
    return "".join(f" t{token}" for token in ids if token != eos_token_id)
