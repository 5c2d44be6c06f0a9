"""The trainers' own code on tokencap's exports (`make test-engine` makes their venv:
torch 2.13 CPU, specforge 0.2.0, speculators 0.9.0; TOKENCAP_TRAINERS_PYTHON names it).

The export runs in that venv (torch there: the .pt files are written too), then
tests/pipeline/trainers_check.py asks each trainer's code for its mapping from our files and
rows, and reads our files with its own readers: on tie-free data both build our mapping
tensor for tensor (padded or not), speculators' on any data, and their readers count the
rows and loss tokens our manifest says."""

from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path

import msgspec
import pytest

from tests.conftest import ROOT
from tests.helpers import row_result, write_run

# two trainer runs of up to 300 s each: the test may run both
pytestmark = [pytest.mark.trainers, pytest.mark.timeout(700)]
TARGET = 512


def trainers_python() -> str:
    python = os.environ.get("TOKENCAP_TRAINERS_PYTHON")
    if not python:
        pytest.skip("no trainers' venv (make test-engine makes it)")
    return python


def run_export(python: str, out: Path, dest: Path, draft: int, *extra: str) -> dict:
    done = subprocess.run(
        [python, "-m", "tokencap.cli", "export", "--out", str(out), "--dest", str(dest),
         "--format", "specforge", "--format", "speculators", "--merged", "--json",
         "--target-vocab-size", str(TARGET), "--draft-vocab-size", str(draft), *extra],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
        text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def check(python: str, dest: Path, draft: int) -> dict:
    done = subprocess.run([python, str(ROOT / "tests" / "pipeline" / "trainers_check.py"),
                           str(dest), str(draft), str(TARGET)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def tie_free(out: Path) -> Path:
    """Id i (1..200) in i loss positions: no two ids counted alike."""
    rng = random.Random(1)
    pool = [i for i in range(1, 201) for _ in range(i)]
    rng.shuffle(pool)
    rows, k = [], 0
    while k < len(pool):
        m = rng.randint(5, 40)
        rows.append(row_result("a", f"a-{len(rows)}",
                               [rng.randrange(300, 400) for _ in range(8)], pool[k:k + m]))
        k += m
    return write_run(out, {"a": rows})


def with_ties(out: Path) -> Path:
    rng = random.Random(2)
    rows = [row_result("b", f"b-{n}", [rng.randrange(TARGET) for _ in range(6)],
                       [rng.randrange(120) for _ in range(rng.randint(1, 12))])
            for n in range(300)]
    return write_run(out, {"b": rows})


@pytest.mark.parametrize("draft", [64, 300])  # 300: more than the 200 ids seen, padded
def test_both_trainers_build_our_mapping_and_read_our_rows(tmp_path, draft) -> None:
    python = trainers_python()
    summary = run_export(python, tie_free(tmp_path / "out"), tmp_path / "x", draft)
    got = check(python, tmp_path / "x", draft)
    assert got["speculators_mapping_equal"] and got["specforge_mapping_equal"]
    assert got["speculators_cli_loaded_ours"] and got["speculators_cli_built_equal"]
    assert got["specforge_file_equal"]
    total = summary["total"]
    assert got["speculators_rows"] == got["specforge_rows"] == total["rows"]
    assert got["speculators_loss_tokens"] == got["specforge_loss_tokens"] == \
        total["loss_tokens"] == summary["vocab"]["loss_tokens"]["merged"]
    assert got["speculators_ids_in_our_order"] and got["speculators_lengths_are_seq_len"]


def test_speculators_builds_our_mapping_on_data_with_ties_and_reads_a_cut_export(
        tmp_path) -> None:
    python = trainers_python()
    summary = run_export(python, with_ties(tmp_path / "out"), tmp_path / "x", 64,
                         "--max-length", "10", "--min-loss-tokens", "2")
    got = check(python, tmp_path / "x", 64)
    assert got["speculators_mapping_equal"] and got["speculators_cli_built_equal"]
    total = summary["total"]
    assert total["truncated_to_limit"] > 0 and total["dropped_too_few_loss_tokens"] > 0
    assert got["speculators_rows"] == got["specforge_rows"] == total["rows"]
    assert got["speculators_loss_tokens"] == got["specforge_loss_tokens"] == \
        total["loss_tokens"]


def test_speculators_reads_an_export_whose_rows_carry_sampling_params(tmp_path) -> None:
    """A run with two modes: speculators' own reader loads the export, each row's
    `metadata.sampling_params` the params its mode sent (speculators PR #1037's field)."""
    python = trainers_python()
    rng = random.Random(3)
    rows = []
    for n in range(40):
        mode = "think" if n % 3 else "fast"
        sampling = {"max_new_tokens": 64, "temperature": 0.9 if mode == "think" else 0.6}
        row = row_result("m", f"m-{n}", [rng.randrange(300, 400) for _ in range(6)],
                         [rng.randrange(1, 200) for _ in range(rng.randint(2, 9))])
        rows.append(msgspec.structs.replace(row, mode=mode, sampling=sampling,
                                            chat_template_kwargs={"thinking": mode == "think"}))
    summary = run_export(python, write_run(tmp_path / "out", {"m": rows}), tmp_path / "x", 64)
    got = check(python, tmp_path / "x", 64)
    assert got["speculators_rows"] == summary["total"]["rows"] == len(rows)
    assert got["speculators_ids_in_our_order"]
    assert got["speculators_torch_rows_with_metadata"] == len(rows)
    for meta, row in zip(got["speculators_metadata"], rows, strict=True):
        assert meta["mode"] == row.mode
        assert meta["sampling_params"]["temperature"] == row.sampling["temperature"]
        assert meta["sampling_params"]["max_new_tokens"] == 64
        assert json.loads(meta["chat_template_kwargs"]) == row.chat_template_kwargs
