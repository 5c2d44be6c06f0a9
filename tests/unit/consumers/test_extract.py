"""`consumers/extract.py`, the hidden-state stage's step: a row's file already in place is kept
only when it holds the row's states (`kept`); the engine's file is checked in place and kept
under the row's name with each byte written once (renamed on one file system, copied once
across two, quantized to FP8 by the worker for the stock connector), its lock and an earlier
attempt's leftovers removed whatever happens (`take`); a file that fails a check is refused
with its reason; a full states folder pauses the row (`room_for`, `StatesDiskFull`). The
files are made with `foundation.hsfile`, as vLLM's connector writes them."""

from __future__ import annotations

import errno
import logging
import shutil
import tempfile
import zlib
from pathlib import Path

import msgspec
import numpy as np
import pytest

from consumers import extract
from consumers.extract import StatesDiskFull, kept, result, room_for, row_file, take
from foundation import hsfile
from foundation.config import StatesSpec
from foundation.engine.api import BadStates, Generation, InvalidResponse
from foundation.outputs import states_file
from foundation.states_manifest import StatesFile
from foundation.wire import Pending
from tests.helpers import make_cfg

IDS = [11, 12, 13]
LAYERS = (2, 5)
HIDDEN = 4


def spec(out: Path) -> StatesSpec:
    return StatesSpec(engine_url=None, layers=LAYERS, dtype="float32", output_dir=str(out),
                      model_config="config.json", max_bytes=None, hidden_size=HIDDEN,
                      num_layers=6)


def states(ids: list[int] = IDS, value: float = 0.5) -> dict[str, hsfile.Tensor]:
    hs = np.full((len(ids), len(LAYERS), HIDDEN), value, dtype=np.float32)
    hs[0, 0, 0] = 1.0
    return {"hidden_states": hsfile.Tensor("F32", hs.shape, hs.tobytes()),
            "token_ids": hsfile.Tensor("I64", (len(ids),),
                                       np.asarray(ids, dtype=np.int64).tobytes())}


def engine_file(folder: Path, data: bytes) -> Path:
    """A file as vLLM's connector leaves it: the states and an (unlocked) lock file beside."""
    path = folder / "engine" / "req-1.safetensors"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    path.with_name(path.name + ".lock").write_bytes(b"")
    return path


def gen(path: Path | None) -> Generation:
    return Generation(output_ids=[1], text="", prompt_tokens=3, completion_tokens=1,
                      finish_reason="length", finish={}, latency_s=0.5, engine="http://e",
                      model="m", engine_version="0.11.0",
                      hidden_states_path=str(path) if path else None)


def test_a_file_holding_the_row_s_states_is_kept_and_a_killed_attempt_s_temporary_removed(
        tmp_path: Path) -> None:
    path = states_file(tmp_path, "code", "r1")
    hsfile.write_whole(path, hsfile.encode(states()))
    stale = path.with_name(f".{path.name}.999.tmp")
    stale.write_bytes(b"torn")
    desc = kept(path, spec(tmp_path), IDS, str(tmp_path), "r1")
    assert desc is not None
    assert (desc.file, desc.tokens, desc.layers, desc.hidden_size, desc.dtype, desc.bytes,
            desc.row, desc.layers_from) == ("code/states/" + path.name, 3, [2, 5], HIDDEN,
                                            "F32", path.stat().st_size, "r1", "config")
    assert desc.crc32 == {name: zlib.crc32(t.data) for name, t in states().items()}
    assert not stale.exists()
    assert kept(tmp_path / "absent.safetensors", spec(tmp_path), IDS, str(tmp_path),
                "r1") is None


@pytest.mark.parametrize(("data", "why"), [
    (hsfile.encode(states())[:-5], "cut short"),  # torn
    (hsfile.encode(states(value=float("nan"))), "not finite"),
    (hsfile.encode(states([11, 12, 14])), "token_ids differ"),  # another row's
    (hsfile.encode(states(value=0.0)), "all zeros"),
])
def test_a_file_that_fails_a_check_is_redone(tmp_path: Path, caplog, data: bytes,
                                             why: str) -> None:
    path = states_file(tmp_path, "code", "r1")
    hsfile.write_whole(path, data)
    with caplog.at_level(logging.WARNING, "consumers.extract"):
        assert kept(path, spec(tmp_path), IDS, str(tmp_path), "r1") is None
    assert f"{path}: redone" in caplog.text and why in caplog.text


def _written() -> int:
    """Bytes this process has passed to write() so far (/proc/self/io's wchar)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise AssertionError("no wchar in /proc/self/io")


def big_states(tokens: int = 64, hidden: int = 4096) -> dict[str, hsfile.Tensor]:
    ids = list(range(100, 100 + tokens))
    rng = np.random.default_rng(3)
    hs = rng.standard_normal((tokens, len(LAYERS), hidden)).astype(np.float32)
    return {"hidden_states": hsfile.Tensor("F32", hs.shape, hs.tobytes()),
            "token_ids": hsfile.Tensor("I64", (tokens,), np.asarray(ids, np.int64).tobytes())}


def test_the_engine_s_file_is_kept_as_it_is_with_no_byte_written_again(tmp_path: Path) -> None:
    """One file system: the kept file is the engine's own (its inode), checked in place and
    renamed: the worker writes none of its bytes (wchar: 0 of 2 MB), the lock is gone."""
    tensors = big_states()
    src = engine_file(tmp_path, hsfile.encode(tensors))
    inode, size = src.stat().st_ino, src.stat().st_size
    ids = list(range(100, 164))
    path = states_file(tmp_path / "hs", "code", "r1")
    out = tmp_path / "hs"
    sp = msgspec.structs.replace(spec(out), hidden_size=4096)
    before = _written()
    desc = take(gen(src), path, sp, ids, "r1", str(out))
    written = _written() - before
    assert written < 4096, f"{written:,} bytes written to keep {size:,}"
    assert path.stat().st_ino == inode and path.stat().st_size == size == desc.bytes
    assert not src.exists() and not src.with_name(src.name + ".lock").exists()
    assert hsfile.read(path)[1] == {}  # the row and the engine are the result's, not the file's
    assert (desc.row, desc.engine, desc.file) == ("r1", "http://e", f"code/states/{path.name}")
    assert desc.crc32 == {name: zlib.crc32(t.data) for name, t in tensors.items()}
    # a rerun finds it and asks nothing again
    assert kept(path, sp, ids, str(out), "r1") == msgspec.structs.replace(desc, engine="")


def _cached_share(path: Path) -> float:
    """The share of a file's pages in the kernel's page cache (mincore(2) on a mapping that
    touches none of them)."""
    import ctypes
    import mmap
    import os

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), "mmap failed"
        try:
            vec = ctypes.create_string_buffer(pages)
            assert libc.mincore(addr, size, vec) == 0, f"mincore: {ctypes.get_errno()}"
            return sum(b & 1 for b in vec.raw) / pages
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


def test_a_kept_file_leaves_the_page_cache(tmp_path: Path) -> None:
    """States are written once and read much later: the kept file's pages are dropped from
    the page cache once it is fsynced and the worker's map of it is gone (`take`; so is a
    file a rerun finds, `kept`), where the file system drops pages at all (not tmpfs)."""
    import os

    if not hasattr(os, "posix_fadvise"):
        pytest.skip("no posix_fadvise here")
    probe = tmp_path / "probe"
    probe.write_bytes(b"x" * (1 << 20))
    hsfile.keep_file(probe, tmp_path / "probe-kept")  # fsynced
    hsfile.drop_cache(probe)
    if _cached_share(probe) > 0:
        pytest.skip(f"{tmp_path}'s file system keeps a file's clean pages (tmpfs)")
    src = engine_file(tmp_path, hsfile.encode(big_states()))
    assert _cached_share(src) == 1.0  # just written
    ids = list(range(100, 164))
    out = tmp_path / "hs"
    sp = msgspec.structs.replace(spec(out), hidden_size=4096)
    path = states_file(out, "code", "r1")
    take(gen(src), path, sp, ids, "r1", str(out))
    assert _cached_share(path) == 0.0
    hsfile.read(path)  # read again (an export): cached, then a rerun drops it
    assert _cached_share(path) == 1.0
    assert kept(path, sp, ids, str(out), "r1") is not None
    assert _cached_share(path) == 0.0


def test_across_file_systems_the_file_is_copied_once(tmp_path: Path) -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("no second file system (/dev/shm) here")
    tensors = big_states()
    with tempfile.TemporaryDirectory(dir=shm) as engine_dir:
        src = engine_file(Path(engine_dir), hsfile.encode(tensors))
        size = src.stat().st_size
        out = tmp_path / "hs"
        path = states_file(out, "code", "r1")
        sp = msgspec.structs.replace(spec(out), hidden_size=4096)
        before = _written()
        desc = take(gen(src), path, sp, list(range(100, 164)), "r1", str(out))
        written = _written() - before
        assert size <= written < size + 4096  # one copy, nothing more
        assert path.read_bytes() == hsfile.encode(tensors) and desc.bytes == size
        assert not src.exists() and not src.with_name(src.name + ".lock").exists()


def test_an_fp8_stage_quantizes_the_stock_connector_s_file_and_keeps_ours_as_it_is(
        tmp_path: Path) -> None:
    tensors = big_states()
    out = tmp_path / "hs"
    ids = list(range(100, 164))
    sp = msgspec.structs.replace(spec(out), hidden_size=4096, dtype="fp8_e4m3")
    src = engine_file(tmp_path, hsfile.encode(tensors))  # vLLM's stock connector: F32 here
    path = states_file(out, "code", "r1")
    before = _written()
    desc = take(gen(src), path, sp, ids, "r1", str(out))
    written = _written() - before
    kept_t, _ = hsfile.read(path)
    q, scales = hsfile.to_fp8(tensors["hidden_states"])
    assert kept_t["hidden_states"].dtype == "F8_E4M3"
    assert bytes(kept_t["hidden_states"].data) == q.data
    assert bytes(kept_t[hsfile.SCALES].data) == scales.data
    assert written <= path.stat().st_size + 4096  # a quarter of F32's bytes, written once
    assert desc.dtype == "F8_E4M3" and desc.crc32[hsfile.SCALES] == zlib.crc32(scales.data)
    assert not src.exists()
    # tokencap's connector quantized it on the engine: kept as it is (renamed)
    fp8 = {"hidden_states": q, hsfile.SCALES: scales, "token_ids": tensors["token_ids"]}
    src2 = engine_file(tmp_path, hsfile.encode(fp8, {hsfile.META_LAYERS: "2,5"}))
    inode = src2.stat().st_ino
    path2 = states_file(out, "code", "r2")
    desc2 = take(gen(src2), path2, sp, ids, "r2", str(out))
    assert path2.stat().st_ino == inode and desc2.layers_from == "file"


def test_a_file_of_other_layers_is_refused_naming_both_lists(tmp_path: Path) -> None:
    src = engine_file(tmp_path, hsfile.encode(states(), {hsfile.META_LAYERS: "1,5"}))
    path = states_file(tmp_path / "hs", "code", "r1")
    with pytest.raises(BadStates, match=r"holds layers \[1, 5\].*asks for \[2, 5\].*\[layers\]"):
        take(gen(src), path, spec(tmp_path / "hs"), IDS, "r1", str(tmp_path / "hs"))
    assert not path.exists() and not src.exists()


def test_a_row_kept_by_another_attempt_first_keeps_its_file(tmp_path: Path) -> None:
    out = tmp_path / "hs"
    path = states_file(out, "code", "r1")
    hsfile.write_whole(path, hsfile.encode(states(value=0.25)))  # the other attempt's
    theirs = path.read_bytes()
    src = engine_file(tmp_path, hsfile.encode(states()))
    desc = take(gen(src), path, spec(out), IDS, "r1", str(out))
    assert path.read_bytes() == theirs and desc.bytes == len(theirs)
    assert not src.exists() and not src.with_name(src.name + ".lock").exists()


def test_an_earlier_attempt_s_engine_file_is_removed_by_the_row_s_next(tmp_path: Path) -> None:
    cfg = make_cfg()
    out = tmp_path / "hs"
    path = states_file(out, "code", "r1")
    marker = extract.request_marker(cfg, path)
    engine = tmp_path / "engine"
    engine.mkdir()
    left = engine / f"cmpl-{marker}0a1b-0-deadbeef.safetensors"  # a killed attempt's
    left.write_bytes(b"x")
    Path(f"{left}.lock").write_bytes(b"")
    other = engine / f"cmpl-{extract.request_marker(cfg, states_file(out, 'code', 'r2'))}1-0-" \
        "00000000.safetensors"  # another row's, in flight: left alone
    other.write_bytes(b"y")
    src = engine / f"cmpl-{marker}ffff-0-12345678.safetensors"
    src.write_bytes(hsfile.encode(states()))
    take(gen(src), path, spec(out), IDS, "r1", str(out), marker)
    assert sorted(p.name for p in engine.iterdir()) == [other.name]
    assert marker.startswith(hsfile.run_marker(cfg.run))


def test_a_full_states_folder_pauses_the_row_before_the_engine_is_asked(
        tmp_path: Path, monkeypatch) -> None:
    path = states_file(tmp_path, "code", "r1")
    room_for(path, 3, spec(tmp_path))  # room: nothing said
    monkeypatch.setattr(extract.shutil, "disk_usage",
                        lambda _p: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(StatesDiskFull, match="GB free"):
        room_for(path, 3, spec(tmp_path))


def test_a_disk_that_fills_while_the_row_is_kept_pauses_it_and_removes_the_engine_s_file(
        tmp_path: Path, monkeypatch) -> None:
    src = engine_file(tmp_path, hsfile.encode(states()))
    path = states_file(tmp_path / "hs", "code", "r1")

    def full(_src, _dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(hsfile, "keep_file", full)
    with pytest.raises(StatesDiskFull):
        take(gen(src), path, spec(tmp_path / "hs"), IDS, "r1", str(tmp_path / "hs"))
    assert not src.exists() and not src.with_name(src.name + ".lock").exists()


@pytest.mark.parametrize(("data", "reason"), [
    (hsfile.encode(states())[:40], "torn"),
    (hsfile.encode(states(value=float("inf"))), "not_finite"),
    (hsfile.encode(states([1, 2, 3])), "token_ids"),
])
def test_an_engine_file_that_fails_a_check_is_refused_with_its_reason_and_removed(
        tmp_path: Path, data: bytes, reason: str) -> None:
    src = engine_file(tmp_path, data)
    path = states_file(tmp_path / "hs", "code", "r1")
    with pytest.raises(BadStates, match=rf"\[{reason}\]$"):
        take(gen(src), path, spec(tmp_path / "hs"), IDS, "r1", str(tmp_path / "hs"))
    assert not path.exists()
    assert not src.exists() and not src.with_name(src.name + ".lock").exists()


def test_an_engine_that_wrote_no_file_or_one_the_worker_cannot_see(tmp_path: Path) -> None:
    path = states_file(tmp_path, "code", "r1")
    with pytest.raises(InvalidResponse, match="hidden_states_path"):
        take(gen(None), path, spec(tmp_path), IDS, "r1", str(tmp_path))
    with pytest.raises(BadStates, match="cannot read the engine's file"):
        take(gen(tmp_path / "elsewhere.safetensors"), path, spec(tmp_path), IDS, "r1",
             str(tmp_path))


def test_a_sample_names_its_row_s_file_and_commits_the_row_s_tokens() -> None:
    cfg = make_cfg()
    p = Pending(sample_id="s1", ordinal=3, prompt_ids=IDS, sampling={"max_new_tokens": 1},
                where="rows.jsonl:4", fed_at_ms=7, row_id="c#t2")
    assert row_file(cfg, "code", p) == states_file(cfg.output_dir, "code", "c#t2")
    with pytest.raises(InvalidResponse, match="without the row"):
        row_file(cfg, "code", Pending(sample_id="s2", ordinal=0, prompt_ids=IDS, sampling={}))
    desc = StatesFile(file="code/states/x.safetensors", tokens=3, bytes=99, dtype="F32",
                      hidden_size=HIDDEN, layers=[2, 5], row="c#t2", crc32={"a": 1})
    r = result(p, cfg, "code", desc, gen(None), sent_at_ms=9)
    assert (r.id, r.counted_tokens, r.prompt_tokens, r.output_ids) == ("s1", 3, 3, [])
    assert msgspec.convert(r.hidden_states, StatesFile) == desc
    assert (r.engine, r.latency_s, r.fed_at_ms, r.sent_at_ms, r.where) == (
        "http://e", 0.5, 7, 9, "rows.jsonl:4")
    kept_before = result(p, cfg, "code", desc, None, sent_at_ms=9)  # found on disk
    assert (kept_before.engine, kept_before.latency_s) == ("", 0.0)
