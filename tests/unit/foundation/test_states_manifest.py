"""foundation/states_manifest.py: a category's manifest written whole, read back checked, and
`verify` naming each way a kept file goes wrong (deleted, extra, truncated, one flipped byte,
swapped with another row's), nothing on an untouched stage; the entries of earlier versions'
result rows; the CRC32s read once, streamed."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import msgspec
import numpy as np
import pytest

from foundation import hsfile
from foundation import states_manifest as sm
from foundation.outputs import states_file
from foundation.wire import Result
from tests.helpers import STATES_HIDDEN, STATES_LAYERS, keep_states

LAYERS, HIDDEN = STATES_LAYERS, STATES_HIDDEN
ROWS = ["r0", "r1", "r2"]


def keep(root: Path, row: str, ids: list[int], fp8: bool = False) -> sm.StatesFile:
    entry: sm.StatesFile = keep_states(root, "code", row, ids, fp8)
    return entry


def stage(root: Path) -> list[sm.StatesFile]:
    """Three kept rows of category "code" (one in FP8), their manifest written."""
    files = [keep(root, row, list(range(100 * i, 100 * i + 6 + i)), fp8=i == 2)
             for i, row in enumerate(ROWS)]
    sm.write(root, "code", "run.hs", files)
    return files


def problems(root: Path) -> list[tuple[str, str]]:
    return [(p.kind, p.file) for p in sm.verify(root, "code").problems]


def test_an_untouched_stage_verifies_with_no_problem(tmp_path) -> None:
    files = stage(tmp_path)
    seen: list[tuple[int, int]] = []
    got = sm.verify(tmp_path, "code", lambda done, read: seen.append((done, read)))
    assert got.problems == [] and got.files == 3
    assert got.bytes == got.read == sum(f.bytes for f in files)
    assert [d for d, _ in seen] == [1, 2, 3] and seen[-1][1] == got.read  # progress per file
    # written whole: the manifest and the states folder, no temporary beside them
    assert sorted(p.name for p in (tmp_path / "code").iterdir()) == ["manifest.json", "states"]
    doc = sm.read(sm.manifest_path(tmp_path, "code"), "code")
    assert doc.run == "run.hs" and [f.row for f in doc.files] == [
        f.row for f in sorted(files, key=lambda f: f.file)]
    assert doc.files[0].final_norm == ["pre"] * 4 and doc.bytes == got.bytes


def test_a_deleted_file_is_missing_naming_its_row(tmp_path) -> None:
    files = stage(tmp_path)
    (tmp_path / files[1].file).unlink()
    [p] = sm.verify(tmp_path, "code").problems
    assert (p.kind, p.file) == ("missing", files[1].file)
    assert p.line() == f"missing: {files[1].file}: row r1: no such file"


def test_an_extra_file_is_named(tmp_path) -> None:
    files = stage(tmp_path)
    stray = states_file(tmp_path, "code", "not-a-row")
    shutil.copyfile(tmp_path / files[0].file, stray)
    # a temporary a killed writer left is no states file: not named
    (stray.parent / f".{stray.name}.77.tmp").write_bytes(b"torn")
    assert problems(tmp_path) == [("extra", os.path.relpath(stray, tmp_path))]


def test_a_truncated_file_is_torn(tmp_path) -> None:
    files = stage(tmp_path)
    path = tmp_path / files[2].file
    os.truncate(path, files[2].bytes - 100)
    [p] = sm.verify(tmp_path, "code").problems
    assert (p.kind, p.file) == ("torn", files[2].file)
    assert "row r2" in p.detail and "cut short" in p.detail
    os.truncate(path, 5)  # not even a header
    assert problems(tmp_path) == [("torn", files[2].file)]


@pytest.mark.parametrize("where", ["states", "scales", "ids", "header"])
def test_one_flipped_byte_is_a_changed_file(tmp_path, where) -> None:
    files = stage(tmp_path)
    entry = files[2]  # the FP8 one: states, scales, ids
    path = tmp_path / entry.file
    data = bytearray(path.read_bytes())
    (n,) = np.frombuffer(bytes(data[:8]), dtype="<u8")
    tensors, _ = hsfile.decode(bytes(data), path)
    header = bytes(data[8:8 + int(n)])
    offset = {"states": 8 + int(n) + 40,
              "scales": 8 + int(n) + len(tensors["hidden_states"].data) + 1,
              "ids": len(data) - 3,
              "header": 8 + header.index(b'"r2"') + 2}[where]  # the row's metadata
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))
    [p] = sm.verify(tmp_path, "code").problems
    assert (p.kind, p.file) == ("changed", entry.file)
    name = {"states": "hidden_states", "scales": hsfile.SCALES, "ids": "token_ids",
            "header": "its header"}[where]
    assert name in p.detail and "row r2" in p.detail


def test_a_file_swapped_with_another_rows_names_that_row(tmp_path) -> None:
    files = stage(tmp_path)
    a, b = tmp_path / files[0].file, tmp_path / files[1].file
    data_a, data_b = a.read_bytes(), b.read_bytes()
    a.write_bytes(data_b)
    b.write_bytes(data_a)
    got = {p.file: p for p in sm.verify(tmp_path, "code").problems}
    assert sorted(got) == sorted([files[0].file, files[1].file])
    assert got[files[0].file].kind == got[files[1].file].kind == "swapped"
    assert got[files[0].file].detail == (f"holds the states of row r1 ({files[1].file}), "
                                         "not of row r0")


def test_a_file_of_other_bytes_and_the_same_size_is_changed(tmp_path) -> None:
    files = stage(tmp_path)
    path = tmp_path / files[0].file
    data = bytearray(path.read_bytes())
    data[-20:] = bytes(20)  # its last ids zeroed
    path.write_bytes(bytes(data))
    assert problems(tmp_path) == [("changed", files[0].file)]
    path.write_bytes(bytes(data) + b"tail")  # longer: its size says so
    [p] = sm.verify(tmp_path, "code").problems
    assert p.kind == "changed" and f"{files[0].bytes + 4:,} bytes" in p.detail


def test_no_manifest_or_a_bad_one_is_an_exit_2_error_naming_it(tmp_path) -> None:
    stage(tmp_path)
    path = sm.manifest_path(tmp_path, "code")
    with pytest.raises(sm.ManifestError, match="no manifest.*has not ended") as exc:
        sm.verify(tmp_path, "other")
    assert exc.value.exit_code == 2
    doc = msgspec.json.decode(path.read_bytes())
    doc["files"][1]["file"] = "../../etc/passwd"
    path.write_bytes(msgspec.json.encode(doc))
    with pytest.raises(sm.ManifestError, match=r"\$\.files\[1\]\.file '../../etc/passwd'"):
        sm.verify(tmp_path, "code")
    with pytest.raises(sm.ManifestError, match="manifest of category 'code', in the folder"):
        sm.read(path, "chat")
    path.write_text("{")
    with pytest.raises(sm.ManifestError, match="not a states manifest"):
        sm.verify(tmp_path, "code")


def test_an_earlier_versions_result_row_is_an_entry_with_its_row_and_sides(tmp_path) -> None:
    old = {"file": "code/states/ab.safetensors", "tokens": 5, "layers": LAYERS,
           "hidden_size": HIDDEN, "dtype": "BF16", "bytes": 999}
    res = Result(id="3", category="code", prompt_ids=[], output_ids=[], prompt_tokens=5,
                 completion_tokens=0, finish_reason="stop", text="", sampling={},
                 counted_tokens=5, source_id="row-7", hidden_states=old)
    entry = sm.from_result(res)
    assert entry is not None and entry.row == "row-7" and entry.final_norm == ["pre"] * 4
    assert entry.crc32 == {} and entry.header_crc32 is None and entry.layers_from == "config"
    assert sm.from_result(msgspec.structs.replace(res, hidden_states=None)) is None
    bad = msgspec.structs.replace(res, hidden_states={**old, "tokens": "five"})
    with pytest.raises(sm.ManifestError, match=r"result code/3: hidden_states .*\$\.tokens"):
        sm.from_result(bad)


def test_complete_reads_what_the_row_does_not_say_once(tmp_path) -> None:
    whole = keep(tmp_path, "r0", [1, 2, 3, 4])
    bare = msgspec.structs.replace(whole, crc32={}, header_crc32=None)
    assert sm.complete(tmp_path, bare) == whole  # read from the file
    # the tensors' given, the header's read (the header only)
    assert sm.complete(tmp_path, msgspec.structs.replace(whole, header_crc32=None)) == whole
    # an earlier manifest's entry for the same file and size: taken, the file not read
    (tmp_path / whole.file).unlink()
    assert sm.complete(tmp_path, bare, earlier=whole) == whole
    # not there, or another size than the row says: left bare, for verify to name
    assert sm.complete(tmp_path, bare) == bare
    other = keep(tmp_path, "r0", [1, 2, 3])
    assert sm.complete(tmp_path, bare) == bare and other.bytes != bare.bytes


def test_the_crc32s_are_streamed_and_equal_zlibs_of_each_tensor(tmp_path, monkeypatch) -> None:
    entry = keep(tmp_path, "r0", list(range(50)), fp8=True)
    monkeypatch.setattr(sm, "READ_CHUNK_BYTES", 1000)  # many chunks per tensor
    got = sm.read_crc32s(tmp_path / entry.file)
    assert got.crc32 == entry.crc32 and got.header_crc32 == entry.header_crc32
    assert got.size == entry.bytes and set(got.crc32) == {"hidden_states", hsfile.SCALES,
                                                          "token_ids"}


def test_write_keeps_one_entry_per_file_the_last(tmp_path) -> None:
    first = keep(tmp_path, "r0", [1, 2, 3])
    again = msgspec.structs.replace(first, engine="http://b:8000")
    sm.write(tmp_path, "code", "run.hs", [first, keep(tmp_path, "r1", [4, 5]), again])
    doc = sm.read(sm.manifest_path(tmp_path, "code"))
    assert len(doc.files) == 2 and doc.by_file()[first.file].engine == "http://b:8000"
    assert sm.categories(tmp_path) == ["code"] and sm.categories(tmp_path / "no") == []


def test_the_crc32s_are_zlibs() -> None:
    # The manifest's CRC32s are zlib's (speculators' Mooncake backend keeps those), whichever
    # library computes them; streamed in chunks they are the same
    import zlib

    data = np.random.default_rng(3).integers(0, 256, size=1 << 20, dtype=np.uint8).tobytes()
    t = hsfile.Tensor("U8", (len(data),), data)
    assert sm.crc32s({"x": t}) == {"x": zlib.crc32(data)}
    assert sm.crc32(data[1000:], sm.crc32(data[:1000])) == zlib.crc32(data)
