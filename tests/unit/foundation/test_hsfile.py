"""foundation/hsfile.py: a file written whole, and the temporaries a killed writer left."""

from __future__ import annotations

from pathlib import Path

from foundation import hsfile


def test_a_write_leaves_the_file_whole_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "states" / "row.safetensors"
    hsfile.write_whole(target, b"new")
    hsfile.write_whole(target, b"newer")
    assert target.read_bytes() == b"newer"
    assert [p.name for p in target.parent.iterdir()] == ["row.safetensors"]


def test_the_temporaries_of_one_name_are_removed_and_no_other(tmp_path: Path) -> None:
    # Given what killed writers left: two temporaries of row's file, one of another row's
    target = tmp_path / "row.safetensors"
    target.write_bytes(b"whole")
    mine = [tmp_path / ".row.safetensors.41.tmp", tmp_path / ".row.safetensors.42.tmp"]
    other = tmp_path / ".row2.safetensors.41.tmp"
    for p in (*mine, other):
        p.write_bytes(b"torn")
    # When the row's file is in place and its temporaries are removed
    removed = hsfile.remove_temps(target)
    # Then only the row's own are gone, the file and the other row's temporary are kept
    assert removed == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".row2.safetensors.41.tmp", "row.safetensors"]
    assert target.read_bytes() == b"whole"
    assert hsfile.remove_temps(target) == 0


def test_a_name_with_glob_characters_matches_only_itself(tmp_path: Path) -> None:
    target = tmp_path / "r[1].safetensors"
    (tmp_path / ".r1.safetensors.7.tmp").write_bytes(b"other")
    (tmp_path / ".r[1].safetensors.7.tmp").write_bytes(b"mine")
    assert hsfile.remove_temps(target) == 1
    assert [p.name for p in tmp_path.iterdir()] == [".r1.safetensors.7.tmp"]
