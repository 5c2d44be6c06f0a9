"""`producer/readers/scan.py`: the build pass of a `SourceIndex`. JSONL and JSON arrays scanned
in chunks of any size (strings, escapes and brackets across chunk edges, blank lines, a BOM,
a `.json` of objects), each record's byte range and start line; a broken array, a missing
file or an unknown type refused naming the path; `.gz` and `.zst` files decompressed once
into the source cache (`source_cache`), again when the file changes, a corrupt one refused.
Random access to the records: test_index.py."""

from __future__ import annotations

import gzip
import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from foundation.errors import SourceError
from producer.formats.records import Rejected
from producer.readers import scan as readers_scan
from producer.readers.index import SourceIndex, read_sample, sample_id
from producer.readers.scan import index_file, source_cache
from tests.conftest import DATASETS


def test_json_array_lines_point_at_element_starts() -> None:
    path = DATASETS / "sharegpt/fastchat_dummy_conversation.json"
    lines = path.read_text(encoding="utf-8").splitlines()
    with SourceIndex.build([path]) as index:
        for i in (0, 1, 250, len(index) - 1):
            ref = index.ref(i)
            assert lines[ref.line - 1].strip() == "{"
            assert index.where(i) == f"{path}:{ref.line}"
        sample = read_sample(index, 0, "auto", "first", None)
    assert sample.source_id == "identity_0"
    assert sample.sample_id == f"fastchat_dummy_conversation:{index.ref(0).line}"


def test_blank_lines_bom_and_json_extension_with_objects(tmp_path: Path) -> None:
    path = tmp_path / "objects.json"
    path.write_bytes(b'\xef\xbb\xbf{"question": "a"}\n\n  \r\n{"question": "b"}')
    with SourceIndex.build([path]) as index:
        assert len(index) == 2
        assert [index.read(i)["question"] for i in range(2)] == ["a", "b"]
        assert [index.ref(i).line for i in range(2)] == [1, 4]
        assert sample_id(index, 1) == "objects:4"


TRICKY_ARRAY = r"""[
  {"a": "x]}[{\"", "b": [1, {"c": "\\"}], "d": "\\\"]"},
  {"e": "line\nbreak ] , {", "f": {"g": [[], {}]}},
    3.5e2 , "str,]", null, true,
  {"h": "caf\u00e9 ☕", "i": []}
]
"""


@pytest.mark.parametrize("chunk_bytes", [1, 2, 3, 7, 1024 * 1024])
def test_json_array_scanner_handles_strings_escapes_and_brackets(
    tmp_path: Path, monkeypatch, chunk_bytes: int
) -> None:
    path = tmp_path / "tricky.json"
    path.write_text(TRICKY_ARRAY, encoding="utf-8")
    monkeypatch.setattr(readers_scan, "SCAN_CHUNK_BYTES", chunk_bytes)
    expected = json.loads(TRICKY_ARRAY)
    with SourceIndex.build([path]) as index:
        assert len(index) == len(expected)
        assert [index.ref(i).line for i in range(len(index))] == [2, 3, 4, 4, 4, 4, 5]
        for i, value in enumerate(expected):
            if isinstance(value, dict):
                assert index.read(i) == value
            else:
                with pytest.raises(Rejected, match="not_an_object"):
                    index.read(i)


@pytest.mark.parametrize("text", ["[{}", '[{"a": 1},, {}]', "[{}] {}", '["unclosed]'])
def test_broken_json_array_fails_at_build(tmp_path: Path, text: str) -> None:
    path = tmp_path / "broken.json"
    path.write_text(text)
    with pytest.raises(SourceError, match="broken.json"):
        SourceIndex.build([path])


def test_missing_file_and_unknown_type_name_the_path(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="nowhere.jsonl: cannot read: No such file"):
        SourceIndex.build([tmp_path / "nowhere.jsonl"])
    with pytest.raises(SourceError, match="nowhere.parquet"):
        SourceIndex.build([tmp_path / "nowhere.parquet"])
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(SourceError, match="junk.parquet"):
        SourceIndex.build([tmp_path / "junk.parquet"])
    (tmp_path / "data.xml").write_text("<a/>\n")
    with pytest.raises(SourceError, match="data.xml"):
        SourceIndex.build([tmp_path / "data.xml"])


JSON_SCALARS = st.none() | st.booleans() | st.integers() | st.text() | st.floats(allow_nan=False)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)
RECORDS = st.lists(st.dictionaries(st.text(), JSON_VALUES, max_size=5), max_size=8)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    records=RECORDS,
    indent=st.sampled_from([None, 0, 2]),
    separator=st.sampled_from([",", ",\n", " ,\n\n  "]),
    ascii_only=st.booleans(),
    chunk_bytes=st.sampled_from([1, 5, 64, 1 << 20]),
)
def test_jsonl_and_json_array_index_to_the_same_records(
    tmp_path_factory: pytest.TempPathFactory,
    records: list[dict],
    indent: int | None,
    separator: str,
    ascii_only: bool,
    chunk_bytes: int,
) -> None:
    folder = tmp_path_factory.mktemp("hyp")
    jsonl, array_file = folder / "r.jsonl", folder / "r.json"
    lines = [json.dumps(r, ensure_ascii=ascii_only) for r in records]
    jsonl.write_text("\n\n".join(lines) + "\n", encoding="utf-8")
    elements = [json.dumps(r, indent=indent, ensure_ascii=ascii_only) for r in records]
    array_text = "[\n" + separator.join(elements) + "\n]\n"
    array_file.write_text(array_text, encoding="utf-8")
    starts, line = [], 2  # line of each element's first byte
    for element in elements:
        starts.append(line)
        line += element.count("\n") + separator.count("\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(readers_scan, "SCAN_CHUNK_BYTES", chunk_bytes)
        with SourceIndex.build([jsonl]) as a, SourceIndex.build([array_file]) as b:
            assert len(a) == len(b) == len(records)
            assert [a.read(i) for i in range(len(a))] == records
            assert [b.read(i) for i in range(len(b))] == records
            assert [a.ref(i).line for i in range(len(a))] == [2 * k + 1 for k in range(len(a))]
            assert [b.ref(i).line for i in range(len(b))] == starts
            assert len({sample_id(b, i) for i in range(len(b))}) == len(records)


# -- compressed sources ---------------------------------------------------------------------

ROWS = [{"question": f"q{k}", "id": k} for k in range(4)]


def _jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A source cache of this test's own."""
    folder = tmp_path / "cache"
    monkeypatch.setenv(readers_scan.SOURCE_CACHE_ENV, str(folder))
    return folder


def _gz_jsonl(rows: list[dict]) -> bytes:
    return gzip.compress(_jsonl(rows))


def _zst_jsonl(rows: list[dict]) -> bytes:
    return zstandard.ZstdCompressor().compress(_jsonl(rows))


def _gz_array(rows: list[dict]) -> bytes:
    return gzip.compress(json.dumps(rows, indent=1).encode())


@pytest.mark.parametrize(("name", "pack"), [
    ("rows.jsonl.gz", _gz_jsonl), ("rows.jsonl.zst", _zst_jsonl), ("rows.json.gz", _gz_array)],
    ids=["jsonl.gz", "jsonl.zst", "json.gz"])
def test_a_compressed_file_is_decompressed_once_into_the_cache(
        tmp_path: Path, cache: Path, name: str, pack: Callable[[list[dict]], bytes]) -> None:
    path = tmp_path / name
    path.write_bytes(pack(ROWS))
    # Given a first build: the file is decompressed into the cache and indexed there
    seg = index_file(path, 0)
    assert seg.name == path and seg.path.parent == cache
    assert seg.path.name.endswith("-" + name.rsplit(".", 1)[0])
    assert seg.span is not None and len(seg.span) == len(ROWS)
    with SourceIndex.build([path]) as index:
        assert [index.read(i) for i in range(len(index))] == ROWS
        # the records keep the compressed file's name
        assert index.where(0).startswith(f"{path}:") and sample_id(index, 0).startswith("rows:")
    copy = seg.path.stat().st_mtime_ns
    # When it is built again, the copy is reused; no temporary file is left
    assert index_file(path, 0).path == seg.path and seg.path.stat().st_mtime_ns == copy
    assert sorted(p.name for p in cache.iterdir()) == [seg.path.name]
    # When the file changes, it is decompressed again into a copy of its own
    path.write_bytes(pack(ROWS[:2]))
    again = index_file(path, 0)
    assert again.path != seg.path and again.span is not None and len(again.span) == 2


@pytest.mark.parametrize(("name", "data"), [
    ("bad.jsonl.gz", b"\x1f\x8b not really gzip"),
    ("cut.jsonl.gz", gzip.compress(_jsonl(ROWS), mtime=0)[:-12]),
    ("bad.jsonl.zst", b"not zstd at all"),
], ids=["not-gzip", "cut-gzip", "not-zstd"])  # fmt: skip
def test_a_corrupt_compressed_file_is_refused_naming_it_and_leaves_nothing(
        tmp_path: Path, cache: Path, name: str, data: bytes) -> None:
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(SourceError, match=f"^{re.escape(str(path))}: cannot decompress: "):
        SourceIndex.build([path])
    assert not cache.exists() or list(cache.iterdir()) == []


def test_an_unsupported_compression_is_refused_naming_the_types_read() -> None:
    with pytest.raises(SourceError, match=r"x\.jsonl\.bz2: unsupported file type "
                                          r"'\.jsonl\.bz2' \(use "):
        index_file(Path("x.jsonl.bz2"), 0)


def test_the_source_cache_is_the_setting_else_the_users_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(readers_scan.SOURCE_CACHE_ENV, str(tmp_path / "given"))
    assert source_cache() == tmp_path / "given"
    monkeypatch.delenv(readers_scan.SOURCE_CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert source_cache() == tmp_path / "xdg" / "tokencap" / "sources"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert source_cache() == tmp_path / "home" / ".cache" / "tokencap" / "sources"


def test_a_csv_or_tsv_is_read_a_record_a_row_each_at_its_own_line(tmp_path: Path) -> None:
    """A header row, then a record a row; a quoted value may hold line breaks, so a record
    says the line of the table it starts on; a row that does not fit the header is a
    rejected record there; compressed tables are read too."""
    import gzip

    from producer.formats.records import Rejected

    csv = tmp_path / "prompts.csv"
    csv.write_text('prompt,category\n"Write a poem\nabout the sea",creative\n'
                   "What is 2+2?,math\nbad,row,extra\n\nLast one,misc\n")
    tsv = tmp_path / "qa.tsv.gz"
    tsv.write_bytes(gzip.compress(b"question\tanswer\nCapital of France?\tParis\n",
                                  mtime=0))
    with SourceIndex.build([csv, tsv]) as index:
        assert len(index) == 5
        assert index.read(0) == {"prompt": "Write a poem\nabout the sea", "category": "creative"}
        assert [index.where(i).rsplit(":", 1)[1] for i in range(4)] == ["2", "4", "5", "7"]
        with pytest.raises(Rejected, match="bad_table_row: 3 values, the header names 2"):
            index.read(2)
        assert index.read(4) == {"question": "Capital of France?", "answer": "Paris"}
        assert index.where(4) == f"{tsv}:2"


@pytest.mark.parametrize(("body", "why"), [
    (b"a,a\n1,2\n", "name every column once"), (b",b\n1,2\n", "name every column once"),
    (b"a,b\n\xff,2\n", "not UTF-8")])
def test_a_table_without_a_header_or_not_utf8_is_refused_naming_it(tmp_path: Path, body: bytes,
                                                                  why: str) -> None:
    path = tmp_path / "t.csv"
    path.write_bytes(body)
    with pytest.raises(SourceError, match=f"t.csv.*{why}"):
        SourceIndex.build([path])
