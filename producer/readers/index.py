"""Random-access index over the records of a prompt source (JSONL, JSON array, Parquet).

`SourceIndex.build` makes one streaming pass over the files and keeps only where each
record lies: byte offset, byte length and line number in `array('q')`s for JSON files
(24 bytes a record), the row-group layout for Parquet (nothing per row). Records are read
back one at a time by seeking, so memory stays flat however large the source is, and a
seeded `shuffled_order` can visit them in any order.

Containers, by extension: ``.jsonl`` is one JSON object per non-blank line; ``.csv`` and
``.tsv`` are a header row then a record a row (copied once into the source cache as JSONL,
each record keeping the table line it starts on); ``.json`` is
a JSON array when its first non-space byte is ``[`` and JSONL when it is ``{``;
``.parquet`` is read through pyarrow. A ``.gz`` or ``.zst`` JSON file is decompressed once,
streaming, into the source cache (`source_cache`; reused while the file is unchanged) and
indexed there; its records keep the compressed file's name in `where` and ids. An index is
not thread-safe: give each thread its own. The build pass (the scan of each file, the
decompression) is `producer/readers/scan.py`.
"""

from __future__ import annotations

import json
import logging
import random
from array import array
from bisect import bisect_left, bisect_right
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any, NamedTuple, Self

from foundation.errors import SourceError
from foundation.sources import logical_stem
from producer.formats.conversation import Conversation
from producer.formats.records import Rejected, unread_keys
from producer.formats.turns import to_conversation
from producer.readers.scan import CSV_ERROR, Segment, index_file

log = logging.getLogger(__name__)

MAX_RECORD_BYTES = 64 * 1024 * 1024  # a longer record is rejected as line_too_long
MAX_OPEN_FILES = 16  # file handles kept open for random reads


class SourceRef(NamedTuple):
    """Where a record lies: for Parquet, offset is the row group, length the row in it."""

    file_no: int
    offset: int
    length: int
    line: int


class Sample(NamedTuple):
    """One record normalised into a prompt, with its ids and location.

    `prompt` is the first (or only) prompt's messages, or token ids; `conversation` the
    whole normalised record (None for token ids), with its tools and generation points."""

    sample_id: str
    ordinal: int
    where: str
    source_id: str | None
    prompt: list[dict] | list[int]
    conversation: Conversation | None = None
    unread: tuple[str, ...] = ()  # keys with text its format or field_map never reads

    @property
    def tools(self) -> list[dict] | None:
        return self.conversation.tools if self.conversation else None


def _rows(seg: Segment) -> list[int]:
    """A Parquet segment's row-group starts (then its row count)."""
    assert seg.row_group_starts is not None, f"{seg.path} is not a Parquet segment"
    return seg.row_group_starts


class SourceIndex:
    """Positions of every record of a source's files; `read(i)` decodes record i."""

    def __init__(self, segments: list[Segment], total: int) -> None:
        self._segments = segments
        self._starts = [seg.start for seg in segments]
        self._total = total
        stems = [logical_stem(seg.name) for seg in segments]
        counts = Counter(stems)
        self._id_prefixes = [
            stem if counts[stem] == 1 else f"{stem}.{no}" for no, stem in enumerate(stems)
        ]
        self._handles: dict[int, IO[bytes]] = {}
        self._parquet: dict[int, Any] = {}
        self._row_group: tuple[int, int, Any] | None = None  # (file_no, group, table)

    @classmethod
    def build(cls, paths: Iterable[Path | str]) -> SourceIndex:
        """Index `paths` in one streaming pass; no record is kept in memory.

        Raises `SourceError` naming the path of a file that cannot be opened, of a file of
        unknown type, or of a JSON array whose brackets do not balance.
        """
        segments: list[Segment] = []
        total = 0
        for raw in paths:
            path = Path(raw)
            try:
                seg = index_file(path, total)
            except OSError as exc:
                raise SourceError(f"{path}: cannot read: {exc.strerror or exc}") from None
            segments.append(seg)
            count = len(seg.span) if seg.span is not None else _rows(seg)[-1]
            log.debug("indexed %s: %d records", path, count)
            total += count
        return cls(segments, total)

    def __len__(self) -> int:
        return self._total

    @property
    def paths(self) -> list[Path]:
        """The indexed files as configured, in file_no order."""
        return [seg.name for seg in self._segments]

    def ref(self, i: int) -> SourceRef:
        """Location of record `i` (0 <= i < len)."""
        file_no, j = self._locate(i)
        seg = self._segments[file_no]
        if seg.span is not None:
            return SourceRef(file_no, seg.span.offsets[j], seg.span.lengths[j], seg.span.lines[j])
        starts = _rows(seg)
        group = bisect_right(starts, j) - 1
        return SourceRef(file_no, group, j - starts[group], j + 1)

    def where(self, i: int) -> str:
        """``path:line`` of record `i` (for Parquet the line is the row number + 1)."""
        ref = self.ref(i)
        return f"{self._segments[ref.file_no].name}:{ref.line}"

    def id_prefix(self, file_no: int) -> str:
        """The sample-id prefix of a file: its stem, plus ``.file_no`` if stems clash."""
        return self._id_prefixes[file_no]

    def line_rank(self, i: int) -> int | None:
        """Rank of record `i` among records starting on the same line, or None if alone."""
        file_no, j = self._locate(i)
        span = self._segments[file_no].span
        if span is None:
            return None
        line = span.lines[j]
        first = bisect_left(span.lines, line, 0, j)
        if first == j and (j + 1 >= len(span) or span.lines[j + 1] != line):
            return None
        return j - first

    def locate(self, sid: str) -> int | None:
        """The record whose `sample_id` is `sid`, or None (no such record any more)."""
        prefix, _, at = sid.rpartition(":")
        line_text, _, rank_text = at.partition(".")
        if prefix not in self._id_prefixes or not line_text.isdigit() or (
                rank_text and not rank_text.isdigit()):
            return None
        file_no, line = self._id_prefixes.index(prefix), int(line_text)
        seg = self._segments[file_no]
        count = len(seg.span) if seg.span is not None else _rows(seg)[-1]
        j = line - 1 if seg.span is None else bisect_left(seg.span.lines, line) + int(
            rank_text or 0)
        if not 0 <= j < count:
            return None
        i = seg.start + j
        return i if sample_id(self, i) == sid else None

    def read(self, i: int) -> dict:
        """Decode record `i`; raises `Rejected` for bytes that are not a JSON object."""
        ref = self.ref(i)
        seg = self._segments[ref.file_no]
        if seg.span is None:
            return self._read_parquet(ref)
        if ref.length > MAX_RECORD_BYTES:
            raise Rejected(
                "line_too_long", f"record is {ref.length} bytes, over {MAX_RECORD_BYTES}"
            )
        handle = self._handle(ref.file_no)
        handle.seek(ref.offset)
        raw = handle.read(ref.length)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise Rejected("invalid_utf8", f"{exc.reason} at byte {exc.start}") from None
        try:
            record = json.loads(text)
        except json.JSONDecodeError as exc:
            raise Rejected("invalid_json", str(exc)) from None
        except RecursionError:
            raise Rejected("invalid_json", "nested too deeply") from None
        if not isinstance(record, dict):
            raise Rejected("not_an_object", f"expected a JSON object, got {_json_kind(record)}")
        if CSV_ERROR in record:
            raise Rejected("bad_table_row", str(record[CSV_ERROR]))
        return record

    def close(self) -> None:
        """Close the open file handles and drop the cached row group."""
        for handle in self._handles.values():
            handle.close()
        self._handles.clear()
        self._parquet.clear()
        self._row_group = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _locate(self, i: int) -> tuple[int, int]:
        if not 0 <= i < self._total:
            raise IndexError(f"record {i} out of range 0..{self._total - 1}")
        file_no = bisect_right(self._starts, i) - 1
        return file_no, i - self._starts[file_no]

    def _handle(self, file_no: int) -> IO[bytes]:
        handle = self._handles.get(file_no)
        if handle is None:
            if len(self._handles) >= MAX_OPEN_FILES:
                self._handles.pop(next(iter(self._handles))).close()
            handle = open(self._segments[file_no].path, "rb")  # kept open
            self._handles[file_no] = handle
        return handle

    def _read_parquet(self, ref: SourceRef) -> dict:
        cached = self._row_group
        if cached is None or cached[:2] != (ref.file_no, ref.offset):
            pf = self._parquet.get(ref.file_no)
            if pf is None:
                import pyarrow.parquet as pq

                self._parquet.clear()
                pf = self._parquet[ref.file_no] = pq.ParquetFile(self._segments[ref.file_no].path)
            cached = self._row_group = (ref.file_no, ref.offset, pf.read_row_group(ref.offset))
        return cached[2].slice(ref.length, 1).to_pylist()[0]


def sample_id(index: SourceIndex, i: int) -> str:
    """Stable positional id ``stem:line`` of record `i`.

    The stem is the file name without its extension, followed by ``.file_no`` when two
    files of the source share a stem. When several records of a JSON array start on the
    same line (a minified array) the id adds their rank on it: ``stem:line.rank``. Ids stay
    the same while the files are unchanged.
    """
    ref = index.ref(i)
    rank = index.line_rank(i)
    suffix = "" if rank is None else f".{rank}"
    return f"{index.id_prefix(ref.file_no)}:{ref.line}{suffix}"


def shuffled_order(n: int, seed: int) -> array:
    """A seeded uniform permutation of range(n) in an ``array('q')`` (8 bytes a record)."""
    order = array("q", range(n))
    random.Random(seed).shuffle(order)  # Fisher-Yates, in place
    return order


def read_sample(
    index: SourceIndex,
    i: int,
    fmt: str,
    turns: str,
    system_prompt: str | None,
    field_map: dict[str, str] | None = None,
    role_map: dict[str, str] | None = None,
) -> Sample:
    """Read record `i` and normalise it with `formats.turns.to_conversation`.

    Raises `Rejected` with `where` and `sample_id` filled in. `source_id` is the record's
    own ``id`` field as a string (None when absent or not a string or integer).
    """
    sid = sample_id(index, i)
    try:
        record = index.read(i)
        conv = to_conversation(record, fmt, turns, system_prompt, field_map, role_map)
    except Rejected as exc:
        exc.where = index.where(i)
        exc.sample_id = sid
        raise
    own = record.get("id")
    source_id = str(own) if isinstance(own, str | int) and not isinstance(own, bool) else None
    unread = tuple(unread_keys(record, fmt, field_map))
    if isinstance(conv, list):
        return Sample(sid, i, index.where(i), source_id, conv, unread=unread)
    return Sample(sid, i, index.where(i), source_id, conv.prompt(), conv, unread)


def _json_kind(value: Any) -> str:
    kinds = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return kinds.get(type(value), "a number")
