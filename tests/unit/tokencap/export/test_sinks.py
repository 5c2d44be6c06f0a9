"""The export's sinks (`tokencap/export/sinks.py`): each file (or speculators' folder) written
under a temporary name and published whole by a rename over what was there, or discarded
leaving what was there and no temporary; SpecForge's rows and their two loss masks; the
Parquet row groups; speculators' saved dataset; the per-category counts added up."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.helpers import row_result
from tokencap.export.sinks import (
    PARQUET_ROW_GROUP_ROWS,
    SPECULATORS_SHARD,
    CategoryStats,
    JsonlSink,
    ParquetSink,
    SpecforgeSink,
    SpeculatorsSink,
    TrainingRow,
    specforge_row,
)


def training_row(i: int) -> TrainingRow:
    res = row_result("a", f"s{i}", [1, 2, i], [7, i + 100])
    row = specforge_row(res, f"a/s{i}")
    return TrainingRow(row.id, row.input_ids, row.loss_mask, res)


def temporaries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob(".*"))


def test_specforge_rows_put_the_loss_on_the_generated_ids_or_one_to_the_left() -> None:
    res = row_result("a", "s", [1, 2, 3], [7, 8])
    row = specforge_row(res, "a/s")
    assert (row.id, row.input_ids, row.loss_mask) == ("a/s", [1, 2, 3, 7, 8], [0, 0, 0, 1, 1])
    assert specforge_row(res, "s", "shifted").loss_mask == [0, 0, 1, 1, 0]
    # no prompt: nothing to shift onto, the generated span stays where it is
    assert specforge_row(row_result("a", "t", [], [7, 8]), "t", "shifted").loss_mask == [1, 1]


def test_a_jsonl_file_appears_whole_at_publish_and_a_discard_leaves_the_old_one(
        tmp_path) -> None:
    path = tmp_path / "d" / "a" / "specforge.jsonl"
    sink = SpecforgeSink(path)
    for i in range(3):
        sink.write_row(training_row(i))
    sink.finish()
    assert not path.exists() and temporaries(path.parent) == [sink.tmp.name]
    sink.publish()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["a/s0", "a/s1", "a/s2"]
    assert rows[2] == {"id": "a/s2", "input_ids": [1, 2, 2, 7, 102], "loss_mask": [0, 0, 0, 1, 1]}
    assert temporaries(path.parent) == []
    # a second export that fails: the first one's file stays, no temporary is left
    again = JsonlSink(path, lambda r, i: {"id": i})
    again.write(row_result("a", "x", [1], [2]), "x")
    again.discard()
    assert [json.loads(line)["id"] for line in path.read_text().splitlines()] == [
        "a/s0", "a/s1", "a/s2"]
    assert temporaries(path.parent) == []


def test_parquet_rows_are_written_in_row_groups_and_published_whole(tmp_path) -> None:
    path = tmp_path / "specforge.parquet"
    n = PARQUET_ROW_GROUP_ROWS * 2 + 5
    sink = ParquetSink(path)
    for i in range(n):
        sink.write_row(training_row(i))
    sink.finish()
    assert not path.exists()
    sink.publish()
    table = pq.ParquetFile(path)
    assert table.metadata.num_row_groups == 3 and table.metadata.num_rows == n
    rows = table.read().to_pylist()
    assert [r["id"] for r in rows] == [f"a/s{i}" for i in range(n)]
    assert rows[-1] == {"id": f"a/s{n - 1}", "category": "a",
                        "input_ids": [1, 2, n - 1, 7, n + 99], "loss_mask": [0, 0, 0, 1, 1],
                        "finish_reason": "stop", "counted_tokens": 2}
    failed = ParquetSink(tmp_path / "other.parquet")
    failed.write_row(training_row(0))
    failed.discard()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["specforge.parquet"]


def test_the_speculators_folder_is_a_saved_dataset_swapped_in_whole(tmp_path) -> None:
    folder = tmp_path / "speculators"
    folder.mkdir()
    (folder / "from-an-earlier-export").write_text("old")
    seen: list[tuple[Path, int, str]] = []
    sink = SpeculatorsSink(folder, on_row=lambda f, i, row: seen.append((f, i, row.id)))
    n = PARQUET_ROW_GROUP_ROWS + 3
    for i in range(n):
        sink.write_row(training_row(i))
    sink.finish()
    assert (folder / "from-an-earlier-export").exists()  # nothing replaced before publish
    sink.publish()
    # each row was handed over with its index, in the folder's temporary name
    assert [(i, rid) for _, i, rid in seen] == [(i, f"a/s{i}") for i in range(n)]
    assert {f for f, _, _ in seen} == {sink.tmp}
    assert sorted(p.name for p in folder.iterdir()) == [
        SPECULATORS_SHARD, "dataset_info.json", "state.json"]
    assert [p.name for p in tmp_path.iterdir()] == ["speculators"]  # no temporary, no old
    state = json.loads((folder / "state.json").read_text())
    assert state["_data_files"] == [{"filename": SPECULATORS_SHARD}]
    assert state["_format_type"] == "torch"
    info = json.loads((folder / "dataset_info.json").read_text())
    assert set(info["features"]) == {"id", "input_ids", "loss_mask", "seq_len", "metadata"}
    with pa.ipc.open_stream(str(folder / SPECULATORS_SHARD)) as reader:
        table = reader.read_all()
    assert table.column("id").to_pylist() == [f"a/s{i}" for i in range(n)]
    assert table.column("seq_len").to_pylist() == [5] * n
    assert table.schema.field("loss_mask").type == pa.list_(pa.int64())
    assert json.loads(table.schema.metadata[b"huggingface"])["info"]["features"] == \
        info["features"]


def test_a_discarded_speculators_folder_leaves_the_published_one(tmp_path) -> None:
    folder = tmp_path / "speculators"
    first = SpeculatorsSink(folder)
    first.write_row(training_row(0))
    first.finish()
    first.publish()
    before = (folder / SPECULATORS_SHARD).read_bytes()
    second = SpeculatorsSink(folder)
    second.write_row(training_row(1))
    second.discard()
    assert (folder / SPECULATORS_SHARD).read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["speculators"]


def test_category_counts_add_up_and_name_every_manifest_once() -> None:
    a = CategoryStats(rows=2, tokens=10, loss_tokens=4, duplicates=1, made_by=["r@1"])
    b = CategoryStats(rows=3, tokens=7, eval_rows=1, made_by=["r@2", "r@1"],
                      bad=[{"where": "x:1"}])
    a.add(b)
    assert (a.rows, a.tokens, a.loss_tokens, a.duplicates, a.eval_rows) == (5, 17, 4, 1, 1)
    assert a.made_by == ["r@1", "r@2"]
    assert a.bad == []  # the examples of bad lines stay with their category


@pytest.mark.parametrize("sink", [SpecforgeSink, ParquetSink])
def test_a_file_sink_makes_its_folder(tmp_path, sink) -> None:
    s = sink(tmp_path / "new" / "deep" / "rows")
    s.finish()
    s.publish()
    assert (tmp_path / "new" / "deep" / "rows").is_file()
