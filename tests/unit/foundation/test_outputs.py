"""`foundation/outputs.py`: the output files' layout, their one reader (bad lines named by
file and line), which committed replies are training rows (`row_verdicts`,
`training_rows`), the hidden-state stage's files, and a torn last line cut (`repair_tail`)."""

from __future__ import annotations

from pathlib import Path

import msgspec

from foundation.outputs import (
    DEFAULT_RULE,
    FAILED_FILE,
    LEGACY_DEAD_FILE,
    REJECTED_FILE,
    STOPPED_FILE,
    BadLine,
    RowRule,
    categories_on_disk,
    count_committed,
    letter_files,
    letter_path,
    part_files,
    part_path,
    read_committed,
    read_dead_letters,
    read_results,
    relative_where,
    repair_tail,
    row_verdicts,
    rows_file,
    states_file,
    training_rows,
    written_files,
)
from foundation.wire import DeadLetter, Outcome, Result, encode


def row(sid: str, finish: str = "stop", conv: str | None = None, turn: int = 0,
        **fields: object) -> Result:
    return Result(id=sid, category="code", prompt_ids=[1, 2], output_ids=[3, 4],
                  prompt_tokens=2, completion_tokens=2, finish_reason=finish, text="x",
                  sampling={}, counted_tokens=2, conversation_id=conv, turn=turn,
                  turns_total=3 if conv else 0, **fields)  # type: ignore[arg-type]


def turn(conv: str, n: int, finish: str = "stop", **fields: object) -> Result:
    return row(f"{conv}#t{n}", finish, conv, n, **fields)


def append(path: Path, *items: Result | DeadLetter | bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("ab") as f:
        for item in items:
            f.write(item if isinstance(item, bytes) else encode(item) + b"\n")


def verdicts(cat: Path, rule: RowRule = DEFAULT_RULE) -> list[tuple[str, str, bool]]:
    return [(v.item.where if isinstance(v.item, BadLine) else v.item.id, v.left_out, v.gated)
            for v in row_verdicts(cat, rule)]


# -- the layout ----------------------------------------------------------------------------

def test_each_record_has_its_file(tmp_path: Path) -> None:
    cat = tmp_path / "code"
    assert part_path(cat, 12) == cat / "part-00012.jsonl"
    assert letter_path(cat, Outcome.CUT) == letter_path(cat, Outcome.STOPPED) == cat / STOPPED_FILE
    assert letter_path(cat, Outcome.REJECTED) == letter_path(cat, Outcome.DEAD) == cat / FAILED_FILE
    for name in (STOPPED_FILE, FAILED_FILE, LEGACY_DEAD_FILE, REJECTED_FILE,
                 "part-00001.jsonl", "part-00000.jsonl", "notes.txt"):
        append(cat / name, b"\n")
    assert letter_files(cat) == [cat / LEGACY_DEAD_FILE, cat / FAILED_FILE, cat / STOPPED_FILE]
    assert written_files(cat) == [cat / "part-00000.jsonl", cat / "part-00001.jsonl",
                                  cat / REJECTED_FILE, *letter_files(cat)]
    (tmp_path / "empty").mkdir()
    append(tmp_path / "only-failed" / FAILED_FILE, b"\n")
    assert categories_on_disk(tmp_path) == ["code"]


def test_a_record_s_place_is_said_relative_to_the_output_folder(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert relative_where(f"{tmp_path}/data/a.jsonl:17", out) == "../data/a.jsonl:17"
    assert relative_where("no-line", out) == "no-line"
    assert relative_where(":3", out) == ":3"


def test_every_line_is_read_in_order_and_a_bad_one_named_by_its_place(tmp_path: Path) -> None:
    cat = tmp_path / "code"
    append(part_path(cat, 0), row("a"), b"\n", b'{"id": "half"\n')
    append(part_path(cat, 1), row("b"))
    append(cat / REJECTED_FILE, row("g", gate="loop"))
    got = list(read_results(cat))
    assert [r.id for r in got if isinstance(r, Result)] == ["a", "b"]
    [bad] = [r for r in got if isinstance(r, BadLine)]
    assert bad.where == f"{part_path(cat, 0)}:3"  # the blank line counts
    assert [r.id for r in read_committed(cat) if isinstance(r, Result)] == ["a", "b", "g"]
    # counted without decoding: every committed line, the bad one too, no blank one
    assert count_committed(cat) == len(list(read_committed(cat))) == 4
    append(cat / LEGACY_DEAD_FILE, DeadLetter("old", "code", Outcome.DEAD, "timeout"))
    append(cat / STOPPED_FILE, DeadLetter("c#t2", "code", Outcome.CUT, "cap"))
    append(cat / FAILED_FILE, row("not-a-letter"))
    letters = list(read_dead_letters(cat))
    assert [d.id for d in letters if isinstance(d, DeadLetter)] == ["old", "c#t2"]
    assert [d.where for d in letters if isinstance(d, BadLine)] == [f"{cat / FAILED_FILE}:1"]


# -- training rows -------------------------------------------------------------------------

def test_a_cut_reply_and_the_later_turns_of_its_conversation_are_no_training_rows(
        tmp_path: Path) -> None:
    cat = tmp_path / "code"
    append(part_path(cat, 0), row("a"), turn("c", 1), turn("c", 2, "length"), turn("c", 3),
           row("b", "length"), turn("d", 1), turn("d", 2))
    assert verdicts(cat) == [
        ("a", "", False), ("c#t1", "", False), ("c#t2", "dropped_truncated", False),
        ("c#t3", "dropped_after_truncated", False), ("b", "dropped_truncated", False),
        ("d#t1", "", False), ("d#t2", "", False)]
    assert [r.id for r in training_rows(cat)] == ["a", "c#t1", "d#t1", "d#t2"]
    # a line that is no result (the cut is read from three fields) says nothing of its turn
    append(part_path(cat, 1), b'{"finish_reason": "length", "conversation_id": "d", '
           b'"turn": 1}\n')
    assert [r.id for r in training_rows(cat)] == ["a", "c#t1", "d#t1", "d#t2"]


def test_keep_truncated_keeps_them_and_the_cut_replies_the_gate_kept_out(tmp_path: Path) -> None:
    cat = tmp_path / "code"
    append(part_path(cat, 0), turn("c", 1, "length"), turn("c", 2))
    # a gated run: the cut replies lie in rejected-replies.jsonl with the gate's other ones
    append(cat / REJECTED_FILE, row("g", "length", gate="length"), row("l", gate="loop"),
           row("e", gate="empty"))
    keep = RowRule(keep_truncated=True)
    assert verdicts(cat, keep) == [("c#t1", "", False), ("c#t2", "", False), ("g", "", True)]
    assert [r.id for r in training_rows(cat, keep)] == ["c#t1", "c#t2", "g"]
    assert verdicts(cat) == [("c#t1", "dropped_truncated", False),
                             ("c#t2", "dropped_after_truncated", False),
                             ("g", "dropped_truncated", True)]


def test_a_row_written_twice_counts_once_and_a_bad_line_is_said(tmp_path: Path) -> None:
    cat = tmp_path / "code"
    append(part_path(cat, 0), row("a"), b"not json\n", row("a"))
    append(cat / REJECTED_FILE, row("a", "length", gate="length"), b"{}\n")
    rule = RowRule(keep_truncated=True)
    assert verdicts(cat, rule) == [
        ("a", "", False), (f"{part_path(cat, 0)}:2", "bad_lines", False),
        ("a", "duplicates", False), ("a", "duplicates", True),
        (f"{cat / REJECTED_FILE}:2", "bad_lines", True)]
    assert [r.id for r in training_rows(cat, rule)] == ["a"]


def test_the_stricter_rules_leave_out_inconsistent_turns_and_other_tool_arguments(
        tmp_path: Path) -> None:
    cat = tmp_path / "code"
    append(part_path(cat, 0), turn("c", 2, prefix_consistent=False),
           turn("d", 2, tool_args_match=False), turn("e", 2, prefix_consistent=True,
                                                     tool_args_match=True), row("f"))
    assert [r.id for r in training_rows(cat)] == ["c#t2", "d#t2", "e#t2", "f"]
    strict = RowRule(consistent_only=True, exact_tool_args=True)
    assert verdicts(cat, strict) == [("c#t2", "dropped_inconsistent", False),
                                     ("d#t2", "dropped_tool_args", False),
                                     ("e#t2", "", False), ("f", "", False)]


def test_no_output_no_rows(tmp_path: Path) -> None:
    assert list(row_verdicts(tmp_path / "code")) == []
    assert part_files(tmp_path / "code") == []


# -- the hidden-state stage's files --------------------------------------------------------

def test_a_row_s_states_file_is_named_by_the_row_alone(tmp_path: Path) -> None:
    a = states_file(tmp_path, "code", "c#t2")
    assert a == states_file(str(tmp_path), "code", "c#t2")  # however often it is asked
    assert a.parent == tmp_path / "code" / "states" and a.suffix == ".safetensors"
    assert len(a.stem) == 24 and "#" not in a.name
    others = {states_file(tmp_path, "code", r) for r in ("c#t1", "c#t3", "a", "a ")}
    assert a not in others and len(others) == 4
    assert states_file(tmp_path, "math", "c#t2").name == a.name  # the category is the folder
    assert rows_file(tmp_path, "code") == tmp_path / "code" / "rows.jsonl"


# -- a torn last line ----------------------------------------------------------------------

def test_a_torn_last_line_is_cut_and_a_whole_file_left_alone(tmp_path: Path) -> None:
    whole = tmp_path / "whole.jsonl"
    whole.write_bytes(b'{"a": 1}\n{"b": 2}\n')
    assert repair_tail(whole) == 0 and whole.read_bytes() == b'{"a": 1}\n{"b": 2}\n'
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    assert repair_tail(empty) == 0
    torn = tmp_path / "torn.jsonl"
    torn.write_bytes(b'{"a": 1}\n{"b": 2}\n{"c": ')
    assert repair_tail(torn) == len(b'{"c": ') and torn.read_bytes() == b'{"a": 1}\n{"b": 2}\n'
    assert repair_tail(torn) == 0
    alone = tmp_path / "alone.jsonl"
    alone.write_bytes(b'{"never ended"')
    assert repair_tail(alone) == len(b'{"never ended"') and alone.read_bytes() == b""


def test_a_torn_line_longer_than_a_read_is_cut_whole(tmp_path: Path) -> None:
    torn = tmp_path / "long.jsonl"
    head = msgspec.json.encode({"ok": 1}) + b"\n"
    tail = b'{"text": "' + b"x" * 200_000  # past several 64 KiB chunks read backwards
    torn.write_bytes(head + tail)
    assert repair_tail(torn) == len(tail)
    assert torn.read_bytes() == head
