"""The commands on files only, no Redis (`tokencap/cli/offline.py`: `export`, `plan`,
`preview`, `init`, `audit`, `verify`): the wiring around the modules they call (whose own tests are
`tests/unit/tokencap/export/`, `prepare/`): which arguments go together, what is said beside
the result, and the mistakes refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from tests.conftest import QWEN
from tests.helpers import keep_states, one_line_error, row_result, write_run
from tokencap.cli.main import main


def _run(tmp: Path, hidden_size: int = 64) -> str:
    """A config of one category "a" (1,000 token-id prompts, a cap of a million tokens) whose
    output folder holds two rows; its [hidden_states] for a model of `hidden_size`."""
    (tmp / "ids.jsonl").write_text("".join(f'{{"input_ids": [{i}, 12, 13]}}\n'
                                           for i in range(1000)))
    (tmp / "model.json").write_text(json.dumps({"num_hidden_layers": 8,
                                                "hidden_size": hidden_size}))
    write_run(tmp / "out", {"a": [row_result("a", f"s{i}", [11, 12, 13], [20 + i, 30])
                                  for i in range(2)]})
    (tmp / "run.toml").write_text(
        f'run = "r"\noutput_dir = "{tmp / "out"}"\nsampling_defaults = "engine"\n'
        f'[hidden_states]\nmodel_config = "{tmp / "model.json"}"\noutput_dir = "{tmp / "hs"}"\n'
        f'[[category]]\nname = "a"\nsource = "{tmp / "ids.jsonl"}"\nformat = "input_ids"\n'
        "cap_tokens = 1_000_000\nsampling = { max_new_tokens = 8 }\n")
    return str(tmp / "run.toml")


def test_export_takes_one_config_and_says_what_it_wrote(tmp_path) -> None:
    path = _run(tmp_path)
    two = CliRunner().invoke(main, ["export", path, "--config", str(tmp_path / "other.toml"),
                                    "--dest", str(tmp_path / "d")])
    assert one_line_error(two, 1) and "two configs" in two.output
    res = CliRunner().invoke(main, ["export", path, "--dest", str(tmp_path / "d"),
                                    "--draft-vocab-size", "0"])
    assert res.exit_code == 0, res.output
    total = next(line for line in res.stdout.splitlines() if line.startswith("total"))
    assert total.split()[1:3] == ["2", "0"]  # rows, eval rows
    assert f"wrote {tmp_path / 'd' / 'a' / 'specforge.jsonl'}" in res.stdout


def test_export_without_a_tokenizer_writes_no_vocabulary_and_says_why(tmp_path) -> None:
    _run(tmp_path)
    res = CliRunner().invoke(main, ["export", "--out", str(tmp_path / "out"), "--dest",
                                    str(tmp_path / "d")], env={"TOKENCAP_TOKENIZER": None})
    assert res.exit_code == 0, res.output
    assert "no draft vocabulary written: it needs the target's vocabulary size" in res.stderr
    assert not list((tmp_path / "d").glob("d2t-*.npy"))


def test_export_of_hidden_states_needs_a_config_that_names_them(tmp_path) -> None:
    _run(tmp_path)
    res = CliRunner().invoke(main, ["export", "--out", str(tmp_path / "out"), "--dest",
                                    str(tmp_path / "d"), "--hidden-states"])
    assert one_line_error(res, 1) and "--hidden-states needs CONFIG with a [hidden_states]" \
        in res.output
    assert not (tmp_path / "d").exists()


def test_preview_of_a_category_the_config_does_not_have_is_refused(tmp_path) -> None:
    path = _run(tmp_path)
    res = CliRunner().invoke(main, ["preview", path, "--category", "b"])
    assert one_line_error(res, 1) and f"no category 'b' in {path}" in res.output


def test_plan_warns_of_hidden_states_that_would_not_fit_and_check_refuses_them(
        tmp_path) -> None:
    path = _run(tmp_path, hidden_size=2_000_000_000)  # 16 GB a token: no disk holds them
    res = CliRunner().invoke(main, ["plan", path])
    assert res.exit_code == 0, res.output
    assert "warning: the hidden states need" in res.stderr and "GB free" in res.stderr
    res = CliRunner().invoke(main, ["plan", path, "--check"])
    assert one_line_error(res, 10) and "GB free" in res.output


def test_init_on_a_file_that_is_not_utf8_is_exit_2_naming_the_file_and_line(tmp_path) -> None:
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(b'{"prompt": "caf\xe9"}\n')
    res = CliRunner().invoke(main, ["init", str(bad), "--tokenizer", str(QWEN),
                                    "--out", str(tmp_path / "run.toml")])
    assert one_line_error(res), res.output
    assert f"{bad}:1: invalid_utf8" in res.output


def test_verify_exits_0_on_clean_states_and_2_naming_each_problem(tmp_path) -> None:
    from foundation import states_manifest as sm

    hs = tmp_path / "hs"
    files = [keep_states(hs, "code", f"r{i}", [i, i + 1, i + 2]) for i in range(3)]
    sm.write(hs, "code", "r.hs", files)
    res = CliRunner().invoke(main, ["verify", str(hs)])
    assert res.exit_code == 0, res.output
    assert res.stdout.splitlines()[0].startswith("code: 3 files, ")
    assert res.stdout.splitlines()[0].endswith("every file as the manifest says")
    (hs / files[1].file).unlink()
    res = CliRunner().invoke(main, ["verify", str(hs), "--category", "code"])
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert res.stdout.splitlines()[1] == f"missing: {files[1].file}: row r1: no such file"
    doc = json.loads(CliRunner().invoke(main, ["verify", str(hs), "--json"]).stdout)
    assert doc["clean"] is False and doc["categories"]["code"]["problems"] == [
        {"kind": "missing", "file": files[1].file, "detail": "row r1: no such file"}]
    # a category whose stage has not ended: states, no manifest
    keep_states(hs, "chat", "c0", [1, 2])
    res = CliRunner().invoke(main, ["verify", str(hs), "--category", "chat"])
    assert res.exit_code == 2 and "its stage has not ended" in res.stdout


def test_verify_of_a_folder_that_is_not_there_is_one_line_exit_2(tmp_path) -> None:
    res = CliRunner().invoke(main, ["verify", str(tmp_path / "nope")])
    assert one_line_error(res) and f"{tmp_path / 'nope'}: no such folder" in res.output
