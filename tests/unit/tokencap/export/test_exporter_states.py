"""`export --hidden-states` (`tokencap/export/exporter.py` with `state_layouts.KeptStates`):
each category's kept files taken only as the manifest its stage wrote proves them. A category
without a manifest, or with a row whose file is missing, of another size, not in it, or (where
the export reads the file: SpecForge's .ckpt, a row cut by the length limit) of other CRC32s,
stops the export in one line naming the category, the file and what is wrong (exit 2), unless
--skip-bad-states, which leaves those rows out and counts them (`dropped_bad_states`); rows
the stage kept nothing for stay `dropped_no_states`. The export manifest gives each trainer's
flags for the layers used, and for FP8 files speculators' backend."""

from __future__ import annotations

import json
import os
from pathlib import Path

import msgspec
import numpy as np
import pyarrow as pa
import pytest
from click.testing import CliRunner

from foundation import hsfile
from foundation import states_manifest as sm
from foundation.config import StatesSpec, load_config
from tests.helpers import (
    STATES_HIDDEN,
    keep_states,
    one_line_error,
    row_result,
    write_run,
)
from tokencap.cli.main import main
from tokencap.export.exporter import export
from tokencap.export.length import Limits
from tokencap.export.state_layouts import StatesRefused

ROWS = 4


def stage(tmp: Path, fp8: bool = False, dtype: str = "bfloat16") -> tuple[str, StatesSpec]:
    """A run of one category "a" (ROWS rows of 6 + 4 tokens) whose hidden-state stage kept
    every row's states (a model of 8 layers, hidden size 16: layers [2, 4, 5, 8]) and wrote
    its manifest; returns the config's path and its [hidden_states]."""
    (tmp / "model").mkdir()
    (tmp / "model" / "config.json").write_text(json.dumps({
        "num_hidden_layers": 8, "hidden_size": STATES_HIDDEN, "torch_dtype": "bfloat16"}))
    (tmp / "model" / "model.safetensors").write_bytes(hsfile.encode({  # the final norm's
        "model.norm.weight": hsfile.Tensor("F32", (STATES_HIDDEN,),
                                           np.ones(STATES_HIDDEN, np.float32).tobytes())}))
    (tmp / "ids.jsonl").write_text('{"input_ids": [1, 2]}\n')
    rows = [row_result("a", f"s{i}", list(range(10 * i, 10 * i + 6)), [500 + i] * 4)
            for i in range(ROWS)]
    write_run(tmp / "out", {"a": rows})
    (tmp / "run.toml").write_text(
        f'run = "r"\noutput_dir = "{tmp / "out"}"\nsampling_defaults = "engine"\n'
        f'[hidden_states]\nmodel_config = "{tmp / "model" / "config.json"}"\n'
        f'output_dir = "{tmp / "hs"}"\ndtype = "{dtype}"\n'
        f'[[category]]\nname = "a"\nsource = "{tmp / "ids.jsonl"}"\nformat = "input_ids"\n'
        "sampling = { max_new_tokens = 8 }\n")
    spec = load_config(tmp / "run.toml").states()
    files = [keep_states(Path(spec.output_dir), "a", r.id,
                         list(r.prompt_ids) + list(r.output_ids), fp8) for r in rows]
    sm.write(spec.output_dir, "a", "r.hs", files)
    return str(tmp / "run.toml"), spec


def file_of(spec: StatesSpec, row: str) -> Path:
    from foundation.outputs import states_file

    return states_file(spec.output_dir, "a", row)


def run_export(tmp: Path, spec: StatesSpec, max_length: int | None = None,
               skip: bool = False) -> dict:
    return export(tmp / "out", tmp / "train", ["speculators"], states=spec,
                  limits=Limits(max_length), skip_bad_states=skip)


def flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_proven_stage_exports_every_row_with_its_states(tmp_path) -> None:
    _, spec = stage(tmp_path)
    summary = run_export(tmp_path, spec, max_length=8)  # every row cut: every file read
    st = summary["categories"]["a"]
    assert st["rows"] == ROWS and st["dropped_bad_states"] == st["dropped_no_states"] == 0
    folder = tmp_path / "train" / "a" / "speculators" / "hidden_states"
    assert sorted(p.name for p in folder.iterdir()) == [f"hs_{i}.safetensors"
                                                         for i in range(ROWS)]
    tensors, _ = hsfile.read(folder / "hs_0.safetensors")
    assert tensors["token_ids"].shape == (8,)


def test_a_category_without_a_manifest_is_refused_or_its_rows_left_out(tmp_path) -> None:
    _, spec = stage(tmp_path)
    sm.manifest_path(spec.output_dir, "a").unlink()
    with pytest.raises(StatesRefused, match=r"^a: no manifest .*has not ended.*tokencap "
                       r"verify .*--skip-bad-states") as exc:
        run_export(tmp_path, spec)
    assert exc.value.exit_code == 2 and not (tmp_path / "train").exists()  # nothing made
    file_of(spec, "s3").unlink()  # a row the stage kept nothing for: no states, as before
    st = run_export(tmp_path, spec, skip=True)["categories"]["a"]
    assert (st["rows"], st["dropped_bad_states"], st["dropped_no_states"]) == (0, 3, 1)


@pytest.mark.parametrize(("harm", "what"), [
    ("delete", "missing: row s1: no such file"),
    ("grow", "changed: row s1: "),
    ("unlisted", "row s1: not in the manifest"),
    ("other_row", "the manifest says it holds row s2, not s1"),
    ("other_length", "row s1: states of 11 tokens, the row has 10"),
])
def test_a_file_that_disagrees_with_the_manifest_is_refused_naming_it(tmp_path, harm,
                                                                      what) -> None:
    _, spec = stage(tmp_path)
    path = file_of(spec, "s1")
    rel = os.path.relpath(path, spec.output_dir)
    doc = sm.read(sm.manifest_path(spec.output_dir, "a"))
    edits = {"other_row": {"row": "s2"}, "other_length": {"tokens": 11}}
    if harm == "delete":
        path.unlink()
    elif harm == "grow":
        path.write_bytes(path.read_bytes() + b"more")
    elif harm == "unlisted":  # the manifest written without it: the file is not proven
        sm.write(spec.output_dir, "a", "r.hs", [f for f in doc.files if f.row != "s1"])
    else:  # the manifest's entry for s1 says another row, or another length
        sm.write(spec.output_dir, "a", "r.hs", [
            msgspec.structs.replace(f, **edits[harm]) if f.row == "s1" else f
            for f in doc.files])
    with pytest.raises(StatesRefused) as exc:
        run_export(tmp_path, spec)
    assert str(exc.value).startswith(f"a: {rel}: {what}")
    assert f"`tokencap verify {spec.output_dir}`" in str(exc.value)
    st = run_export(tmp_path, spec, skip=True)["categories"]["a"]
    assert (st["rows"], st["dropped_bad_states"]) == (ROWS - 1, 1)


def test_a_flipped_byte_is_caught_where_the_export_reads_the_file(tmp_path) -> None:
    _, spec = stage(tmp_path)
    flip_last_byte(file_of(spec, "s2"))  # same size: only its CRC32 tells
    # a whole row goes to speculators as a link: its bytes are not read (`tokencap verify`
    # reads them all)
    assert run_export(tmp_path, spec)["categories"]["a"]["rows"] == ROWS
    # cut by the length limit, its states are read to be sliced: the CRC32s are checked
    with pytest.raises(StatesRefused, match=r"changed: row s2: the CRC32 of token_ids "
                       r"differs from the manifest's"):
        run_export(tmp_path, spec, max_length=8)
    st = run_export(tmp_path, spec, max_length=8, skip=True)["categories"]["a"]
    assert (st["rows"], st["dropped_bad_states"]) == (ROWS - 1, 1)
    with pa.ipc.open_stream(str(tmp_path / "train" / "a" / "speculators" /
                                "data-00000-of-00001.arrow")) as r:
        assert r.read_all().column("id").to_pylist() == ["s0", "s1", "s3"]


def test_specforge_reads_every_file_so_every_file_s_crc32s_are_checked(tmp_path) -> None:
    torch = pytest.importorskip("torch")
    _, spec = stage(tmp_path, fp8=True, dtype="fp8_e4m3")
    summary = export(tmp_path / "out", tmp_path / "train", ["specforge"], states=spec)
    assert summary["categories"]["a"]["rows"] == ROWS
    data = torch.load(tmp_path / "train" / "a" / "specforge_offline" / "rows_0-2000" /
                      "data_1.ckpt")
    tensors, _ = hsfile.read(file_of(spec, "s1"))  # FP8: dequantized as speculators reads it
    want = hsfile.from_fp8(tensors["hidden_states"], tensors[hsfile.SCALES])
    aux = data["aux_hidden_state"][0].view(torch.int16).numpy().view(np.uint16)
    assert data["aux_hidden_state"].dtype == torch.bfloat16
    assert np.array_equal(aux, want[:, :3].reshape(10, -1))
    flip_last_byte(file_of(spec, "s2"))  # a whole row: SpecForge's .ckpt reads it anyway
    with pytest.raises(StatesRefused, match="changed: row s2: the CRC32 of token_ids"):
        export(tmp_path / "out", tmp_path / "train", ["specforge"], states=spec)


def test_fp8_states_go_to_speculators_as_they_are_and_the_manifest_says_how_to_train(
        tmp_path) -> None:
    _, spec = stage(tmp_path, fp8=True, dtype="fp8_e4m3")
    summary = run_export(tmp_path, spec, max_length=8)
    folder = tmp_path / "train" / "a" / "speculators" / "hidden_states"
    for i in range(ROWS):
        f = folder / f"hs_{i}.safetensors"
        tensors, _ = hsfile.read(f)
        hsfile.check(f, tensors, list(range(10 * i, 10 * i + 6)) + [500 + i] * 2, 4,
                     STATES_HIDDEN, hsfile.FP8)
    doc = json.loads((tmp_path / "train" / "export-manifest.json").read_text())
    assert doc == json.loads(json.dumps(summary))
    hs = doc["hidden_states"]
    assert hs["dtype"] == "fp8_e4m3" and hs["layers"] == [2, 4, 5, 8]
    assert hs["trainers"]["speculators"]["args"] == (
        "--target-layer-ids 2 4 5 --hidden-states-backend fp8")
    assert hs["trainers"]["specforge"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]


def test_the_command_refuses_in_one_line_and_says_the_trainers_flags(tmp_path) -> None:
    path, spec = stage(tmp_path)
    args = ["export", path, "--dest", str(tmp_path / "train"), "--format", "speculators",
            "--hidden-states", "--draft-vocab-size", "0"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    assert "hidden states: train speculators with --target-layer-ids 2 4 5; SpecForge's " \
        "draft config: eagle_config.eagle_aux_hidden_state_layer_ids = [1, 3, 4]" in res.stderr
    file_of(spec, "s0").unlink()
    res = CliRunner().invoke(main, args)
    assert one_line_error(res) and "a: a/states/" in res.output and "missing: row s0" in res.output
    res = CliRunner().invoke(main, [*args, "--skip-bad-states"])
    assert res.exit_code == 0, res.output
    assert "a: left out 1 rows whose states file disagrees with the category's manifest" \
        in res.stderr
    res = CliRunner().invoke(main, ["export", path, "--dest", str(tmp_path / "t2"),
                                    "--skip-bad-states"])
    assert one_line_error(res, 1) and "--skip-bad-states is for --hidden-states" in res.output
