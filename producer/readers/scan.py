"""The build pass of a `SourceIndex` (`producer/readers/`): one streaming scan of each file
that keeps where its records lie (byte ranges and start lines of JSON and JSONL records in
`array('q')`s, the row-group layout of Parquet), after decompressing a ``.gz`` or ``.zst``
file once into the source cache (`source_cache`)."""

from __future__ import annotations

import gzip
import hashlib
import logging
import os
import re
import shutil
from array import array
from pathlib import Path
from typing import IO, NamedTuple

from foundation.errors import SourceError
from foundation.sources import SUPPORTED, source_type

log = logging.getLogger(__name__)

SCAN_CHUNK_BYTES = 1024 * 1024  # read size of the build-time scan
UTF8_BOM = b"\xef\xbb\xbf"
WHITESPACE = b" \t\r\n"
SOURCE_CACHE_ENV = "TOKENCAP_SOURCE_CACHE"

# A whole string when it ends inside the chunk, else its opening quote alone.
_STRING = rb'"(?:[^"\\]++|\\.)*+"|"'
# Directly in the top-level array every token matters: strings, brackets, commas, scalars.
_TOP_TOKEN = re.compile(_STRING + rb'|[\[\]{},]|[^\s\[\]{},"]+', re.DOTALL)
# Deeper inside an element only strings and brackets matter.
_NESTED_TOKEN = re.compile(_STRING + rb"|[\[\]{}]", re.DOTALL)
_INSIDE_TOKEN = re.compile(rb'["\\]')  # inside strings only quotes and escapes matter


class _Span:
    """Byte ranges and start lines of the records of one JSON or JSONL file."""

    def __init__(self) -> None:
        self.offsets = array("q")
        self.lengths = array("q")
        self.lines = array("q")

    def add(self, offset: int, length: int, line: int) -> None:
        self.offsets.append(offset)
        self.lengths.append(length)
        self.lines.append(line)

    def __len__(self) -> int:
        return len(self.offsets)


class Segment(NamedTuple):
    path: Path  # the file read (a compressed source's decompressed copy)
    start: int  # global index of the file's first record
    span: _Span | None  # json only
    row_group_starts: list[int] | None  # parquet only: first row of each row group
    name: Path  # the source file as configured



def source_cache() -> Path:
    """Where compressed sources are decompressed: TOKENCAP_SOURCE_CACHE, else
    ``$XDG_CACHE_HOME/tokencap/sources`` (``~/.cache/tokencap/sources``)."""
    given = os.environ.get(SOURCE_CACHE_ENV)
    if given:
        return Path(given)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "tokencap" / "sources"


def _decompressed(path: Path, compression: str) -> Path:
    """`path` decompressed into the source cache (streaming; reused while unchanged)."""
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
    name = path.name[: -len(compression)]
    out = source_cache() / f"{key.hexdigest()[:16]}-{name}"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        with open(path, "rb") as raw, open(tmp, "wb") as dst:
            if compression == ".gz":
                with gzip.GzipFile(fileobj=raw) as src:
                    shutil.copyfileobj(src, dst, SCAN_CHUNK_BYTES)
            else:
                import zstandard

                zstandard.ZstdDecompressor().copy_stream(raw, dst, SCAN_CHUNK_BYTES)
        os.replace(tmp, out)
    except Exception as exc:  # OSError, EOFError, zstandard.ZstdError: a corrupt file
        tmp.unlink(missing_ok=True)
        raise SourceError(f"{path}: cannot decompress: {exc}") from None
    log.info("decompressed %s into %s", path, out)
    return out


def index_file(path: Path, start: int) -> Segment:
    kind = source_type(path)
    if kind is None:
        raise SourceError(f"{path}: unsupported file type {''.join(path.suffixes[-2:])!r} "
                          f"(use {SUPPORTED})")
    container, compression = kind
    if container == ".parquet":
        return Segment(path, start, None, _parquet_row_groups(path), path)
    readable = _decompressed(path, compression) if compression else path
    lines: array | None = None
    if container in (".csv", ".tsv"):
        readable, lines = _table_as_jsonl(readable, path, "\t" if container == ".tsv" else ",")
    span = _Span()
    with open(readable, "rb") as f:
        first = _first_byte(f)
        if container == ".json" and first == b"[":
            _scan_json_array(f, span, path)
        else:
            _scan_jsonl(f, span)
    if lines is not None:  # each record where it starts in the table, not in its copy
        span.lines = lines
    return Segment(readable, start, span, None, path)


TABLE_FORMAT = 1  # the layout of a table's JSONL copy in the cache: a new one writes anew
CSV_ERROR = "__csv_error__"  # a row that does not match the header: its record says so


def _table_as_jsonl(readable: Path, name: Path, delimiter: str) -> tuple[Path, array]:
    """A CSV or TSV file (a header row, then a record a row; a quoted value may hold line
    breaks) as one JSON object a line (header -> text) in the source cache, made once while
    the file is unchanged; and the line of the table each record starts on. A row with more
    or fewer values than the header is kept as a record that says so (`CSV_ERROR`): read, it
    is rejected with its line, as a bad JSON line is."""
    import csv
    import json

    st = readable.stat()
    key = hashlib.sha256(f"{readable.resolve()}|{st.st_size}|{st.st_mtime_ns}|"
                         f"{TABLE_FORMAT}".encode())
    out = source_cache() / f"{key.hexdigest()[:16]}-{readable.name}.jsonl"
    starts = array("q")
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        with open(readable, newline="", encoding="utf-8-sig") as src:
            reader = csv.reader(src, delimiter=delimiter)
            header = next(reader, None)
            if not header or any(not h.strip() for h in header) or len(set(header)) < len(
                    header):
                raise SourceError(f"{name}:1: the first row must name every column once "
                                  f"(got {header})")
            out.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "w", encoding="utf-8") as dst:
                line = reader.line_num + 1
                for row in reader:
                    if row:
                        if len(row) == len(header):
                            record: dict[str, str] = dict(zip(header, row, strict=True))
                        else:
                            record = {CSV_ERROR: f"{len(row)} values, the header names "
                                                 f"{len(header)} columns"}
                        dst.write(json.dumps(record, ensure_ascii=False) + "\n")
                        starts.append(line)
                    line = reader.line_num + 1
        os.replace(tmp, out)
    except UnicodeDecodeError as exc:
        tmp.unlink(missing_ok=True)
        raise SourceError(f"{name}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except csv.Error as exc:
        tmp.unlink(missing_ok=True)
        raise SourceError(f"{name}: not a readable table: {exc}") from None
    return out, starts


def _first_byte(f: IO[bytes]) -> bytes:
    """The first non-space byte after an optional BOM; leaves `f` after the BOM."""
    head = f.read(len(UTF8_BOM))
    f.seek(len(UTF8_BOM) if head == UTF8_BOM else 0)
    at = f.tell()
    while chunk := f.read(SCAN_CHUNK_BYTES):
        stripped = chunk.lstrip(WHITESPACE)
        if stripped:
            f.seek(at)
            return stripped[:1]
    f.seek(at)
    return b""


def _scan_jsonl(f: IO[bytes], span: _Span) -> None:
    """Record the byte range of every non-blank line; never holds more than one chunk."""
    pos = f.tell()  # file offset of the current chunk
    line = 1
    rec_start = pos  # offset of the current line
    blank = True  # the current line has only whitespace so far
    while chunk := f.read(SCAN_CHUNK_BYTES):
        at = 0
        while (nl := chunk.find(b"\n", at)) >= 0:
            if blank and chunk[at:nl].strip(WHITESPACE):
                blank = False
            if not blank:
                span.add(rec_start, pos + nl - rec_start, line)
            line += 1
            rec_start, blank, at = pos + nl + 1, True, nl + 1
        if blank and chunk[at:].strip(WHITESPACE):
            blank = False
        pos += len(chunk)
    if not blank:
        span.add(rec_start, pos - rec_start, line)


def _scan_json_array(f: IO[bytes], span: _Span, path: Path) -> None:
    """Record the byte range and start line of each top-level element of a JSON array.

    Tracks strings (with escapes) and bracket depth across chunks; elements are not
    parsed, so a malformed element is found when it is read, not here.
    """
    base = f.tell()  # file offset of the current chunk
    line, counted = 1, 0  # line at chunk offset `counted`
    depth, in_string, skip = 0, False, 0  # skip: bytes still to skip after a backslash
    elem_start, elem_end, elem_line, done = -1, -1, 0, False
    while chunk := f.read(SCAN_CHUNK_BYTES):
        at = skip
        skip = 0
        size = len(chunk)
        while at < size:
            if in_string:
                m = _INSIDE_TOKEN.search(chunk, at)
                if m is None:
                    break
                at = m.end()
                if m.group() == b"\\":
                    at += 1
                    skip = max(0, at - size)
                else:
                    in_string = False
                    elem_end = base + at
                continue
            m = (_NESTED_TOKEN if depth > 1 else _TOP_TOKEN).search(chunk, at)
            if m is None:
                break
            token, here, at = m.group(), m.start(), m.end()
            if done or (depth == 0 and token != b"["):
                raise SourceError(f"{path}: unexpected {token[:20]!r} outside the top-level array")
            if depth == 1 and elem_start < 0 and token not in (b",", b"]"):
                line += chunk.count(b"\n", counted, here)
                counted = here
                elem_start, elem_line = base + here, line
            if token == b'"':  # a string that goes on in the next chunk
                in_string = True
            elif token in (b"[", b"{"):
                depth += 1
            elif token in (b"]", b"}"):
                depth -= 1
                if depth == 0:
                    done = True
                else:
                    elem_end = base + at
            elif token != b",":
                elem_end = base + at  # a whole string or a scalar run
            if (token == b"," and depth == 1) or done:
                if elem_start >= 0:
                    span.add(elem_start, elem_end - elem_start, elem_line)
                elif token == b",":
                    raise SourceError(f"{path}:{line}: empty element in the top-level array")
                elem_start = -1
        line += chunk.count(b"\n", counted)
        counted = 0
        base += size
    if not done:
        raise SourceError(f"{path}: the top-level JSON array is not closed")


def _parquet_row_groups(path: Path) -> list[int]:
    """First row of each row group, then the row count; reads metadata only."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    with open(path, "rb") as f:  # raises FileNotFoundError naming the path
        try:
            meta = pq.ParquetFile(f).metadata
        except pa.ArrowException as exc:
            raise SourceError(f"{path}: not a readable Parquet file: {exc}") from None
        starts = [0]
        for g in range(meta.num_row_groups):
            starts.append(starts[-1] + meta.row_group(g).num_rows)
    return starts
