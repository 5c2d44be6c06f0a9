"""The draft vocabulary (`tokencap/export/vocab.py`): loss-masked token counts over the target
vocabulary, the d2t/t2d mapping both trainers build (the most frequent ids, ties to the lower
id, padded with the smallest), their coverage, their files, and the target's size."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest

from tokencap.export.vocab import (
    TokenCounts,
    VocabError,
    coverage,
    mapping,
    select,
    target_vocab_size,
    write_counts,
    write_mapping,
)

HAS_TORCH = importlib.util.find_spec("torch") is not None


def test_the_mapping_takes_the_most_frequent_ids_lower_id_first_and_pads_with_the_smallest(
        ) -> None:
    counts = np.zeros(20, dtype=np.int64)
    counts[[3, 7, 9, 15]] = [5, 2, 2, 9]
    assert select(counts, 3).tolist() == [3, 7, 15]  # 7 and 9 tie: the lower id
    assert select(counts, 6).tolist() == [0, 1, 3, 7, 9, 15]  # padded with 0 and 1
    d2t, t2d = mapping(counts, 6)
    assert d2t.dtype == np.int64 and t2d.dtype == np.bool_ and t2d.size == 20
    assert (np.nonzero(t2d)[0] == d2t + np.arange(6)).all()  # SpecForge's consistency rule
    with pytest.raises(VocabError):
        select(counts, 21)


def test_counts_refuse_an_id_outside_the_target_vocabulary() -> None:
    counts = TokenCounts(10)
    counts.add([1, 2, 12], [0, 1, 0])  # outside, but not trained on: not counted
    with pytest.raises(VocabError, match="outside the target vocabulary"):
        counts.add([1, 12], [1, 1], "a/x")
    assert counts.as_dict() == {2: 1}


def test_the_target_vocabulary_comes_from_the_flag_a_config_or_the_tokenizer(tmp_path) -> None:
    class Tok:
        def __len__(self) -> int:
            return 100

    assert target_vocab_size(128, Tok())[0] == 128
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 112}))
    assert target_vocab_size(None, Tok(), tmp_path)[0] == 112
    assert target_vocab_size(None, Tok(), tmp_path / "none")[0] == 100
    with pytest.raises(VocabError, match="smaller than the tokenizer"):
        target_vocab_size(64, Tok())


def test_the_target_vocabulary_of_a_multimodal_config_is_its_text_models(tmp_path) -> None:
    class Tok:
        def __len__(self) -> int:
            return 100

    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 120}}))
    size, origin = target_vocab_size(None, Tok(), tmp_path)
    assert size == 120 and origin.endswith("config.json vocab_size")
    with pytest.raises(VocabError, match="needs the target's vocabulary size"):
        target_vocab_size(None, None)


def test_counts_add_per_row_merge_and_give_the_coverage_of_each_draft_size() -> None:
    a, b = TokenCounts(8), TokenCounts(8)
    a.add([1, 1, 2, 3], [0, 1, 1, 1])  # the prompt's 1 is not trained on
    a.add([], [])
    b.add([1, 5, 5, 5], [1, 1, 1, 1])
    merged = a.merged([b])
    assert merged.counts.tolist() == [0, 2, 1, 1, 0, 3, 0, 0] and merged.total == 7
    assert a.counts.tolist() == [0, 1, 1, 1, 0, 0, 0, 0]  # merging leaves each as it was
    assert merged.coverage((1, 2, 8)) == {"1": 3 / 7, "2": 5 / 7, "8": 1.0}
    assert coverage(np.zeros(4, dtype=np.int64), (2,)) == {"2": None}  # nothing counted


def test_the_files_carry_the_sizes_and_hold_the_counts_and_the_mapping(tmp_path) -> None:
    counts = TokenCounts(16)
    counts.add([3, 3, 9, 12], [1, 1, 1, 1])
    freq = write_counts(tmp_path / "v", counts)
    mapped = write_mapping(tmp_path / "v", counts, 4)
    assert np.array_equal(np.load(tmp_path / "v" / "token_freq.npy"), counts.counts)
    d2t, t2d = np.load(tmp_path / "v" / "d2t-4.npy"), np.load(tmp_path / "v" / "t2d-4.npy")
    assert (d2t + np.arange(4)).tolist() == [0, 3, 9, 12]  # 3, 9, 12 seen; padded with 0
    assert np.nonzero(t2d)[0].tolist() == [0, 3, 9, 12] and t2d.size == 16
    pt = ["token_freq.pt", "vocab_mapping-16-4.pt"]
    names = sorted(p.name for p in [*freq.files, *mapped.files])
    if HAS_TORCH:
        assert names == sorted(["d2t-4.npy", "t2d-4.npy", "token_freq.npy", *pt])
    else:  # the .pt files need torch: left out, and said so
        assert names == ["d2t-4.npy", "t2d-4.npy", "token_freq.npy"]
        assert freq.missing_torch and mapped.missing_torch
        assert not any((tmp_path / "v" / name).exists() for name in pt)
