"""`producer/readers/index.py`: random access to a source's records (`SourceIndex`). Every
fixture dataset indexed and read back record by record; ids (`sample_id`: stems, shared
stems, ranks on a minified array's line) and `locate`, their inverse; Parquet row groups; a
seeded `shuffled_order`; `read_sample`: a malformed record refused naming its file:line and
id while reading goes on, one over the size limit `line_too_long`. The build pass (each
file scanned, compressed ones decompressed): test_scan.py."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from producer.formats.records import Rejected, detect_format
from producer.readers import index as readers
from producer.readers.index import SourceIndex, read_sample, sample_id, shuffled_order
from tests.conftest import DATASETS

# (file, records, detected format)
FIXTURE_FILES = [
    ("alpaca/llamafactory_alpaca_en_demo.json", 999, "alpaca"),
    ("messages/xtuner_mllm_sft_text_example_data.jsonl", 200, "messages"),
    ("question_answer/gsm8k_test_first200.jsonl", 200, "question_answer"),
    ("problem_solution/qwen25math_minerva_math_test.jsonl", 272, "problem_solution"),
    ("sharegpt/fastchat_dummy_conversation.json", 500, "sharegpt"),
    ("sharegpt/torchtune_chat_tiny.json", 1, "sharegpt"),
]


def _expected_records(path: Path) -> list[dict]:
    text = path.read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


@pytest.mark.parametrize(("name", "count", "fmt"), FIXTURE_FILES)
def test_fixture_indexes_reads_and_detects(name: str, count: int, fmt: str) -> None:
    path = DATASETS / name
    with SourceIndex.build([path]) as index:
        assert len(index) == count
        records = [index.read(i) for i in range(count)]
        assert records == _expected_records(path)
        assert {detect_format(r) for r in records} == {fmt}
        ids = [sample_id(index, i) for i in range(count)]
        assert len(set(ids)) == count
        assert all(s.startswith(f"{path.stem}:") for s in ids)
        for i in range(count):
            sample = read_sample(index, i, "auto", "last", None)
            assert sample.prompt[-1]["role"] == "user"
            assert sample.where == index.where(i)


# (line bytes, format, reason, field); None means the line reads as a good sample.
MALFORMED = [
    (b'{"question": "fine 1"}', "auto", None, None),
    (b'{"messages": [', "auto", "invalid_json", None),
    (b"[1, 2]", "auto", "not_an_object", None),
    (b'{"id": 7, "conversation": []}', "sharegpt", "missing_field", "conversations"),
    (
        b'{"conversations": [{"from": "robot", "value": "x"}]}',
        "auto",
        "unknown_role",
        "conversations[0].from",
    ),
    (
        b'{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": " "}]}',
        "auto",
        "empty_turn",
        "messages[1].content",
    ),
    (b'{"question": "caf\xe9"}', "auto", "invalid_utf8", None),
    (b'{"input_ids": [1, "2", 3]}', "auto", "wrong_type", "input_ids[1]"),
    (b'{"conversations": [{"from": "gpt", "value": "hello"}]}', "auto", "no_user_turn", None),
    (b'{"foo": 1}', "auto", "unknown_format", None),
    (b'{"question": "fine 2"}', "auto", None, None),
]


def test_malformed_records_are_rejected_and_reading_continues(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"\n".join(line for line, *_ in MALFORMED) + b"\n")
    with SourceIndex.build([path]) as index:
        assert len(index) == len(MALFORMED)
        for i, (_, fmt, reason, field) in enumerate(MALFORMED):
            if reason is None:
                assert read_sample(index, i, fmt, "first", None).prompt[0]["role"] == "user"
                continue
            with pytest.raises(Rejected) as info:
                read_sample(index, i, fmt, "first", None)
            assert (info.value.reason, info.value.field) == (reason, field), i
            assert info.value.where == f"{path}:{i + 1}"
            assert info.value.sample_id == f"bad:{i + 1}"
            if field is not None:
                assert str(info.value).startswith(f"{reason} ({field}): ")


def test_record_over_the_size_limit_is_line_too_long(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "long.jsonl"
    path.write_text('{"question": "short"}\n{"question": "' + "x" * 100 + '"}\n')
    monkeypatch.setattr(readers, "MAX_RECORD_BYTES", 64)
    with SourceIndex.build([path]) as index:
        assert index.read(0) == {"question": "short"}
        with pytest.raises(Rejected) as info:
            index.read(1)
    assert info.value.reason == "line_too_long"


def test_minified_array_ids_are_unique_per_element(tmp_path: Path) -> None:
    path = tmp_path / "mini.json"
    path.write_text(json.dumps([{"question": str(k)} for k in range(5)]))
    with SourceIndex.build([path]) as index:
        ids = [sample_id(index, i) for i in range(len(index))]
    assert ids == [f"mini:1.{k}" for k in range(5)]


def test_several_files_and_shared_stems(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first, second = tmp_path / "a" / "train.jsonl", tmp_path / "b" / "train.jsonl"
    first.write_text('{"question": "a1"}\n{"question": "a2"}\n')
    second.write_text('{"question": "b1"}\n')
    with SourceIndex.build([first, second]) as index:
        assert len(index) == 3
        assert [sample_id(index, i) for i in range(3)] == ["train.0:1", "train.0:2", "train.1:1"]
        assert index.read(2) == {"question": "b1"}
        assert index.where(2) == f"{second}:1"


def test_parquet_reads_in_shuffled_order(tmp_path: Path) -> None:
    rows = [
        {"id": f"r{k}", "conversations": [{"from": "human", "value": f"q{k}"}]} for k in range(25)
    ]
    path = tmp_path / "part.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=10)
    assert pq.ParquetFile(path).metadata.num_row_groups == 3
    with SourceIndex.build([path]) as index:
        assert len(index) == 25
        assert index.ref(13) == readers.SourceRef(0, 1, 3, 14)
        order = shuffled_order(len(index), seed=3)
        samples = [read_sample(index, i, "auto", "first", None) for i in order]
    assert [s.source_id for s in samples] == [f"r{i}" for i in order]
    assert [s.prompt for s in samples] == [[{"role": "user", "content": f"q{i}"}] for i in order]
    assert {s.sample_id for s in samples} == {f"part:{k + 1}" for k in range(25)}


def test_shuffled_order_is_a_seeded_permutation() -> None:
    order = shuffled_order(10_000, seed=7)
    assert order.typecode == "q"
    assert sorted(order) == list(range(10_000))
    assert order == shuffled_order(10_000, seed=7)
    assert order != shuffled_order(10_000, seed=8)
    assert list(order) != list(range(10_000))
    assert len(shuffled_order(0, seed=1)) == 0


def test_locate_finds_every_record_by_its_id(tmp_path: Path) -> None:
    # a minified array (ranks on one line), a JSONL with blank lines, Parquet, a shared stem
    (tmp_path / "m.json").write_text(json.dumps([{"prompt": str(i)} for i in range(5)]))
    (tmp_path / "l.jsonl").write_text('{"prompt": "a"}\n\n{"prompt": "b"}\n')
    pq.write_table(pa.table({"prompt": ["x", "y", "z"]}), tmp_path / "p.parquet")
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "l.jsonl").write_text('{"prompt": "c"}\n')
    index = SourceIndex.build([tmp_path / "m.json", tmp_path / "l.jsonl",
                               tmp_path / "p.parquet", sub / "l.jsonl"])
    for i in range(len(index)):
        assert index.locate(sample_id(index, i)) == i
    for gone in ("m:2", "m:1.9", "l.1:2", "p:4", "nope:1", "l.1:x", "p:1.0.1"):
        assert index.locate(gone) is None, gone
