"""docs/DATA.md's training snippet holds together: the `tokencap export` it shows runs as
written (on a small run), and every file the trainer lines after it name is one that export
wrote (a `.pt` file: its numpy twin, where torch is not installed, and the sizes in its name
the export's own: one model throughout, not Kimi's vocabulary then Qwen's mapping)."""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

import msgspec
from click.testing import CliRunner

from foundation.wire import Result
from tests.conftest import DATASETS, FIXTURES, ROOT
from tokencap.cli.main import main

DOC = ROOT / "docs" / "DATA.md"
FIRST_LINE = "tokencap export --config run.toml --dest train/"


def _snippet() -> list[str]:
    """The fenced block of the training snippet, its lines (comments kept: the SpecForge
    config is written in them)."""
    text = DOC.read_text()
    block = next(b for b in re.findall(r"```\n(.*?)```", text, re.S) if FIRST_LINE in b)
    return [ln.rstrip() for ln in block.splitlines()]


def _export_argv(lines: list[str]) -> list[str]:
    joined, out = "", []
    for ln in (raw.split("#", 1)[0].rstrip() for raw in lines):
        joined += ln.rstrip("\\").strip() + " "
        if not ln.endswith("\\"):
            if joined.strip().startswith("tokencap export"):
                out = shlex.split(joined)[1:]
            joined = ""
    return out


def _export_block(lines: list[str]) -> list[str]:
    """The lines of the `tokencap export` command (its continuation lines too)."""
    out: list[str] = []
    for ln in lines:
        code = ln.split("#", 1)[0].rstrip()
        if code.strip().startswith("tokencap export") or (out and out[-1].split("#", 1)[
                0].rstrip().endswith("\\")):
            out.append(ln)
    return out


def _a_run(tmp: Path) -> None:
    (tmp / "run.toml").write_text(
        f'run = "d"\noutput_dir = "out"\ntokenizer = "{FIXTURES / "tokenizers" / "qwen3"}"\n'
        f'[[category]]\nname = "a"\n'
        f'source = "{DATASETS / "question_answer" / "gsm8k_test_first200.jsonl"}"\n'
        "sampling = { max_new_tokens = 64 }\n")
    (tmp / "out" / "a").mkdir(parents=True)
    rows = [Result(id=f"r{i}", category="a", prompt_ids=[1, 2, 3],
                   output_ids=[10 + i, 11, 151645], prompt_tokens=3, completion_tokens=3,
                   finish_reason="stop", text="", sampling={}, counted_tokens=3)
            for i in range(40)]
    (tmp / "out" / "a" / "part-00000.jsonl").write_bytes(
        b"".join(msgspec.json.encode(r) + b"\n" for r in rows))


def test_the_training_snippet_exports_what_its_trainers_read(tmp_path, monkeypatch) -> None:
    lines = _snippet()
    argv = _export_argv(lines)
    assert argv[:2] == ["export", "--config"], argv
    _a_run(tmp_path)
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(main, argv)
    assert res.exit_code == 0, res.output
    sizes = {f: argv[argv.index(f) + 1] for f in ("--target-vocab-size", "--draft-vocab-size")}
    export_lines = _export_block(lines)
    named = sorted({m for ln in lines if ln not in export_lines
                    for m in re.findall(r"train/[\w./-]+", ln)})
    assert named, "the trainer lines name no file of the export"
    has_torch = importlib.util.find_spec("torch") is not None
    for name in named:
        path = tmp_path / name
        if path.suffix == ".pt":
            m = re.match(r"vocab_mapping-(\d+)-(\d+)\.pt", path.name)
            assert m and m.groups() == (sizes["--target-vocab-size"],
                                        sizes["--draft-vocab-size"]), name
            if not has_torch:  # the mapping is written as numpy without torch
                assert (path.parent / f"d2t-{m.group(2)}.npy").is_file(), name
                continue
        assert path.exists(), f"{name}: the trainer line names it, the export did not write it"
