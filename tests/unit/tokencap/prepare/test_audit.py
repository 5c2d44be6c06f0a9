"""`tokencap audit` (`tokencap/prepare/audit.py`): the reply gate and the tool checks run on rows
already written, tokencap's own (`Result` lines) found in their folder: each reason counted,
with its first examples as file:line and id; a line that is neither layout is `unreadable`.
Regenerated conversations (SpecForge's layout) are
`tests/pipeline/test_reply_gate.py::test_audit_reads_regenerated_conversations_as_specforge_writes_them`'s."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
from click.testing import CliRunner

from foundation.gate import LOOP_MIN_TOKENS
from foundation.wire import Result, encode
from producer.render import Renderer
from producer.reply_parser import ReplyParser
from tests.conftest import FIXTURES
from tokencap.cli.main import main
from tokencap.prepare.audit import EXAMPLES, audit, row_files

QWEN3 = FIXTURES / "tokenizers" / "qwen3"
END = "<|im_end|>"


@pytest.fixture(scope="module")
def renderer() -> Renderer:
    return Renderer(QWEN3)


@pytest.fixture(scope="module")
def replies(renderer: Renderer) -> ReplyParser:
    return ReplyParser(renderer.tokenizer, renderer.template)


def row(renderer: Renderer, sid: str, reply: str, finish: str = "stop",
        **extra: object) -> Result:
    """A row of Qwen3's: a user's question rendered, `reply` encoded as the model's output."""
    _, prompt = renderer.render([{"role": "user", "content": "What is 2 + 2?"}])
    out = renderer.tokenizer.encode(reply, add_special_tokens=False)
    return Result(id=sid, category="math", prompt_ids=prompt, output_ids=out,
                  prompt_tokens=len(prompt), completion_tokens=len(out), finish_reason=finish,
                  text=reply, sampling={}, counted_tokens=len(out), **extra)


def write(path: Path, lines: list[bytes]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return path


HEALTHY = f"<think>\nTwo and two.\n</think>\n\nThe answer is 4.{END}"


def test_each_reason_is_counted_on_the_rows_with_file_and_line_examples(
        tmp_path, renderer, replies) -> None:
    out = tmp_path / "out"
    loop = "<think>\nok\n</think>\n\n" + "four " * (LOOP_MIN_TOKENS + 8)
    part = write(out / "math" / "part-00001.jsonl", [
        encode(row(renderer, "ok-1", HEALTHY)),
        encode(row(renderer, "args", HEALTHY, tool_args_match=False)),
        encode(row(renderer, "ok-2", HEALTHY)),
    ])
    kept_out = write(out / "math" / "rejected-replies.jsonl", [
        encode(row(renderer, "loop", loop, "length")),  # a loop cut at the limit: a loop
        encode(row(renderer, "cut", "<think>\nTwo and", "length")),
        encode(row(renderer, "open", f"<think>\nTwo and two is four{END}")),
        encode(row(renderer, "blank", f"<think>\nfour\n</think>\n\n  {END}")),
    ])
    write(out / "math" / "notes.jsonl", [b"not a row file: not read in a folder"])
    report = audit([out], replies)
    assert (report["rows"], report["replies"]) == (7, 7)
    assert report["reasons"] == {"tool_args_mismatch": 1, "loop": 1, "length": 1,
                                 "unclosed_reasoning": 1, "empty": 1}
    ex = report["examples"]
    assert ex["tool_args_mismatch"] == [f"{part}:2 args"]
    assert ex["loop"][0].startswith(f"{kept_out}:1 loop: ...") and "four four" in ex["loop"][0]
    assert ex["length"][0].startswith(f"{kept_out}:2 cut: ...")
    assert ex["unclosed_reasoning"][0].startswith(f"{kept_out}:3 open: ...")
    assert ex["empty"][0].startswith(f"{kept_out}:4 blank: ...")
    assert "\n" not in " ".join(ex["loop"])  # one line each


def test_row_files_searches_folders_for_row_files_and_takes_files_as_given(tmp_path) -> None:
    a = write(tmp_path / "out" / "a" / "part-00002.jsonl", [])
    b = write(tmp_path / "out" / "b" / "deep" / "part-00001.jsonl", [])
    r = write(tmp_path / "out" / "a" / "rejected-replies.jsonl", [])
    write(tmp_path / "out" / "a" / "failed.jsonl", [])
    given = write(tmp_path / "regenerated.jsonl", [])
    assert row_files([tmp_path / "out", given]) == [a, r, b, given]


def test_a_line_of_neither_layout_is_unreadable_and_the_rest_is_read(
        tmp_path, renderer, replies) -> None:
    good = msgspec.to_builtins(row(renderer, "ok", HEALTHY))
    path = write(tmp_path / "mixed.jsonl", [
        b"not json",
        b"",  # blank lines are skipped, and keep the numbering
        json.dumps({**good, "output_ids": "not ids"}).encode(),
        json.dumps({"id": "x", "text": "neither layout"}).encode(),
        json.dumps(good).encode(),
    ])
    report = audit([path], replies)
    assert report["reasons"] == {"unreadable": 3}
    assert report["rows"] == report["replies"] == 1
    assert report["examples"]["unreadable"] == [f"{path}:1 ", f"{path}:3 ok", f"{path}:4 "]


def test_the_examples_stop_at_a_few_per_reason_and_the_count_does_not(
        tmp_path, renderer, replies) -> None:
    n = EXAMPLES + 4
    path = write(tmp_path / "part-00001.jsonl", [
        encode(row(renderer, f"cut-{i}", "The answer", "length")) for i in range(n)])
    report = audit([path], replies)
    assert report["reasons"] == {"length": n}
    assert report["examples"]["length"] == [f"{path}:{i + 1} cut-{i}: ...The answer"
                                            for i in range(EXAMPLES)]


def test_the_audit_command_prints_the_counts_and_exits_1_when_anything_is_flagged(
        tmp_path, renderer) -> None:
    clean = write(tmp_path / "clean" / "part-00001.jsonl",
                  [encode(row(renderer, "ok", HEALTHY))])
    res = CliRunner().invoke(main, ["audit", str(clean), "--tokenizer", str(QWEN3)])
    assert res.exit_code == 0, res.output
    assert res.output.endswith("1 rows, 1 replies; nothing flagged\n")
    flagged = write(tmp_path / "cut" / "part-00001.jsonl",
                    [encode(row(renderer, "cut", "The answer", "length"))])
    res = CliRunner().invoke(main, ["audit", str(clean), str(flagged), "--tokenizer",
                                    str(QWEN3)])
    assert res.exit_code == 1, res.output
    assert res.output.splitlines()[-3:] == ["2 rows, 2 replies; flagged:", "  length: 1",
                                            f"    {flagged}:1 cut: ...The answer"]
    doc = json.loads(CliRunner().invoke(main, ["audit", str(flagged), "--tokenizer",
                                               str(QWEN3), "--json"]).stdout)
    assert doc["reasons"] == {"length": 1} and doc["rows"] == 1
