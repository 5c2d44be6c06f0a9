"""The draft vocabulary: token frequencies of what the draft trains on, and the d2t / t2d
mapping of an EAGLE-3 draft, made from the exported rows instead of in a GPU pass.

Frequencies count the loss-masked tokens of the training rows (the train side of a split),
within the length limit (`tokencap.export.length`), per category and merged. The mapping
selects `draft_size` ids: the most frequent first, ties broken by the lower id (speculators'
rule; SpecForge's `Counter.most_common` keeps first appearance in its shuffled row order,
which no export can reproduce: on tie-free data the two agree), then, when fewer distinct
ids were seen, the smallest unused ids (both trainers pad so). ``d2t[i] = id_i - i`` over
the selected ids in ascending order (int64), ``t2d`` a bool mask over the target
vocabulary, exactly as both trainers build and check them.

Files, beside the export (names carry the sizes, so that a mismatch cannot load silently):

==========================================  ==============================================
``token_freq.npy``                          int64 [target vocabulary]: counts (no torch)
``token_freq.pt``                           speculators' ``{id: count}`` (torch)
``d2t-<draft>.npy``, ``t2d-<draft>.npy``    speculators' mapping (``--data-path`` reads them)
``vocab_mapping-<target>-<draft>.pt``       SpecForge's ``{"d2t", "t2d"}`` (torch;
                                            ``model.vocab_mapping_path``)
==========================================  ==============================================

Without torch everything but the ``.pt`` files is written, and one line says how to get
them (`Written.missing_torch`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from foundation.errors import TokencapError

COVERAGE_SIZES = (16_384, 32_768, 65_536)
TORCH_HINT = ("the .pt files need torch: pip install 'tokencap[train]' (or torch), then "
              "export again; the .npy files hold the same numbers")


class VocabError(TokencapError):
    """The target vocabulary does not fit the rows or the tokenizer."""


class TokenCounts:
    """Counts of loss-masked token ids over a target vocabulary, added row by row."""

    def __init__(self, target_vocab: int) -> None:
        self.target_vocab = target_vocab
        self.counts = np.zeros(target_vocab, dtype=np.int64)

    def add(self, ids: list[int], mask: list[int], where: str = "") -> None:
        arr = np.asarray(ids, dtype=np.int64)[np.asarray(mask, dtype=bool)]
        if arr.size == 0:
            return
        top = int(arr.max())
        if top >= self.target_vocab or int(arr.min()) < 0:
            raise VocabError(f"{where}: token id {top} lies outside the target vocabulary "
                             f"of {self.target_vocab:,} ids (--target-vocab-size)")
        self.counts += np.bincount(arr, minlength=self.target_vocab)

    def merged(self, others: Iterable[TokenCounts]) -> TokenCounts:
        out = TokenCounts(self.target_vocab)
        out.counts = self.counts.copy()
        for other in others:
            out.counts += other.counts
        return out

    @property
    def total(self) -> int:
        return int(self.counts.sum())

    def coverage(self, sizes: Iterable[int] = COVERAGE_SIZES) -> dict[str, float | None]:
        return coverage(self.counts, sizes)

    def as_dict(self) -> dict[int, int]:
        """``{id: count}`` of the ids seen (speculators' token_freq)."""
        seen = np.nonzero(self.counts)[0]
        return {int(i): int(self.counts[i]) for i in seen}


def coverage(counts: np.ndarray, sizes: Iterable[int] = COVERAGE_SIZES
             ) -> dict[str, float | None]:
    """Share of the counted tokens inside the `size` most frequent ids, per size (None when
    nothing was counted): what a draft vocabulary of that size can predict."""
    ranked = np.sort(counts)[::-1]
    total = int(ranked.sum())
    return {str(k): (float(ranked[:k].sum()) / total if total else None) for k in sizes}


def select(counts: np.ndarray, draft_size: int) -> np.ndarray:
    """The draft's ids, ascending: the `draft_size` most frequent (ties: lower id first),
    padded with the smallest ids not selected when fewer were seen."""
    if draft_size > counts.size:
        raise VocabError(f"draft vocabulary {draft_size:,} is larger than the target "
                         f"vocabulary {counts.size:,}")
    seen = np.nonzero(counts)[0]
    ranked = seen[np.lexsort((seen, -counts[seen]))][:draft_size]
    if ranked.size < draft_size:
        unused = np.setdiff1d(np.arange(draft_size), ranked, assume_unique=True)
        ranked = np.concatenate([ranked, unused[:draft_size - ranked.size]])
    return np.sort(ranked)


def mapping(counts: np.ndarray, draft_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(d2t int64 [draft], t2d bool [target]) from counts over the target vocabulary."""
    ids = select(counts, draft_size)
    d2t = ids - np.arange(draft_size, dtype=np.int64)
    t2d = np.zeros(counts.size, dtype=bool)
    t2d[ids] = True
    return d2t.astype(np.int64), t2d


class Written(NamedTuple):
    files: list[Path]
    missing_torch: bool


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        return None
    return torch


def write_counts(folder: Path, counts: TokenCounts) -> Written:
    """``token_freq.npy``, and ``token_freq.pt`` when torch is there."""
    folder.mkdir(parents=True, exist_ok=True)
    files = [folder / "token_freq.npy"]
    np.save(files[0], counts.counts)
    torch = _torch()
    if torch is not None:
        files.append(folder / "token_freq.pt")
        torch.save(counts.as_dict(), files[-1])
    return Written(files, torch is None)


def write_mapping(folder: Path, counts: TokenCounts, draft_size: int) -> Written:
    """The mapping for `draft_size` in both trainers' files."""
    d2t, t2d = mapping(counts.counts, draft_size)
    folder.mkdir(parents=True, exist_ok=True)
    files = [folder / f"d2t-{draft_size}.npy", folder / f"t2d-{draft_size}.npy"]
    np.save(files[0], d2t)
    np.save(files[1], t2d)
    torch = _torch()
    if torch is not None:
        files.append(folder / f"vocab_mapping-{counts.target_vocab}-{draft_size}.pt")
        torch.save({"d2t": torch.from_numpy(d2t), "t2d": torch.from_numpy(t2d)}, files[-1])
    return Written(files, torch is None)


def target_vocab_size(explicit: int | None, tokenizer: Any | None,
                      tokenizer_dir: Path | None = None) -> tuple[int, str]:
    """The target model's vocabulary size and where it came from: `explicit`
    (--target-vocab-size), else the ``vocab_size`` of a ``config.json`` beside the tokenizer,
    else the tokenizer's length (a model's embedding is often larger: Qwen2.5's 151,936 rows
    for 151,665 tokens; pass --target-vocab-size then). Refused when smaller than the
    tokenizer."""
    n_tok = len(tokenizer) if tokenizer is not None else None
    if explicit is not None:
        size, origin = explicit, "--target-vocab-size"
    else:
        size, origin = 0, ""
        cfg = tokenizer_dir / "config.json" if tokenizer_dir else None
        if cfg is not None and cfg.is_file():
            import json

            doc: Mapping[str, Any] = json.loads(cfg.read_text())
            text = doc.get("text_config") or {}
            found = doc.get("vocab_size") or text.get("vocab_size")
            if isinstance(found, int):
                size, origin = found, f"{cfg} vocab_size"
        if not size:
            if n_tok is None:
                raise VocabError("the draft vocabulary needs the target's vocabulary size: "
                                 "pass --target-vocab-size (the model config's vocab_size) "
                                 "or a tokenizer")
            size, origin = n_tok, "the tokenizer's length (pass --target-vocab-size if the "\
                "model's embedding is larger)"
    if n_tok is not None and size < n_tok:
        raise VocabError(f"target vocabulary {size:,} ({origin}) is smaller than the "
                         f"tokenizer's {n_tok:,} tokens: not this tokenizer's model")
    return size, origin
