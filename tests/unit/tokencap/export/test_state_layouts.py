"""The trainers' hidden-state layouts (`tokencap/export/state_layouts.py`), from the files the
hidden-state stage keeps per row: speculators' hs_<i> files (a row kept whole is a hard link
to the stage's file, a cut row its first tokens' states), the model's final norm read from its
weights, and SpecForge's offline .ckpt files (torch: skipped without it, where the export says
in one line how to get it)."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pytest

from foundation import hsfile
from foundation.config import StatesSpec, load_config
from foundation.outputs import states_file
from foundation.wire import Result
from tokencap.export.sinks import ExportError, TrainingRow
from tokencap.export.state_layouts import (
    SPECULATORS_STATES,
    FinalNorm,
    SpecforgeOfflineSink,
    SpeculatorsStates,
    row_states,
)

HAS_TORCH = importlib.util.find_spec("torch") is not None
LAYERS, HIDDEN, TOKENS = 4, 8, 6


def spec_of(tmp: Path) -> StatesSpec:
    """[hidden_states] of a model of 8 layers, hidden size 8, bf16; its weights beside its
    config (the final norm's weight, 0.5 .. 4.0, and eps 1e-5)."""
    model = tmp / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "num_hidden_layers": 8, "hidden_size": HIDDEN, "torch_dtype": "bfloat16",
        "rms_norm_eps": 1e-5}))
    weight = np.arange(1, HIDDEN + 1, dtype=np.float32) / 2
    (model / "model.safetensors").write_bytes(hsfile.encode({
        "model.embed_tokens.weight": hsfile.Tensor("F32", (2, HIDDEN), bytes(2 * HIDDEN * 4)),
        "model.norm.weight": hsfile.Tensor("F32", (HIDDEN,), weight.tobytes())}))
    (tmp / "ids.jsonl").write_text('{"input_ids": [1, 2]}\n')
    (tmp / "run.toml").write_text(
        f'run = "r"\noutput_dir = "{tmp / "out"}"\nsampling_defaults = "engine"\n'
        f'[hidden_states]\nmodel_config = "{model / "config.json"}"\n'
        f'output_dir = "{tmp / "hs"}"\n'
        f'[[category]]\nname = "a"\nsource = "{tmp / "ids.jsonl"}"\nformat = "input_ids"\n'
        "sampling = { max_new_tokens = 8 }\n")
    return load_config(tmp / "run.toml").states()


def bf16(values: np.ndarray) -> bytes:
    """float32 values (exact in bf16) as bf16's bytes."""
    return (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes()


def kept(spec: StatesSpec, row_id: str, ids: list[int]) -> np.ndarray:
    """The stage's file of `row_id`, as the stage keeps it; returns its states."""
    states = (np.arange(len(ids) * LAYERS * HIDDEN, dtype=np.float32) % 64 + 1).reshape(
        len(ids), LAYERS, HIDDEN)
    hsfile.write_whole(row_states(spec, "a", row_id), hsfile.encode({
        "hidden_states": hsfile.Tensor("BF16", states.shape, bf16(states)),
        "token_ids": hsfile.Tensor("I64", (len(ids),), np.asarray(ids, np.int64).tobytes()),
    }, {"row": row_id}))
    return states


def training_row(row_id: str, ids: list[int]) -> TrainingRow:
    res = Result(id=row_id, category="a", prompt_ids=ids[:2], output_ids=ids[2:],
                 prompt_tokens=2, completion_tokens=len(ids) - 2, finish_reason="stop",
                 text="", sampling={}, counted_tokens=len(ids) - 2)
    return TrainingRow(f"a/{row_id}", ids, [0, 0] + [1] * (len(ids) - 2), res)


def test_a_rows_states_are_the_stages_file_named_by_the_row(tmp_path) -> None:
    spec = spec_of(tmp_path)
    assert spec.layers == (2, 4, 5, 8) and len(spec.layers) == LAYERS
    assert row_states(spec, "a", "r1") == states_file(spec.output_dir, "a", "r1")


def test_speculators_files_link_a_whole_row_and_slice_a_cut_one(tmp_path) -> None:
    spec = spec_of(tmp_path)
    ids = list(range(100, 100 + TOKENS))
    whole = kept(spec, "r1", ids)
    kept(spec, "r2", ids)
    folder = tmp_path / "speculators.tmp"
    folder.mkdir()
    layout = SpeculatorsStates(spec)
    layout(folder, 0, training_row("r1", ids))
    layout(folder, 1, training_row("r2", ids[:4]))  # cut at the export's length limit
    assert layout.files == 2
    hs0, hs1 = (folder / SPECULATORS_STATES / f"hs_{i}.safetensors" for i in (0, 1))
    # a whole row: the stage's own file, linked (no copy of gigabytes)
    assert os.stat(hs0).st_ino == os.stat(row_states(spec, "a", "r1")).st_ino
    # a cut row: its first 4 tokens' states and ids, checked as the stage checks a file
    tensors, meta = hsfile.read(hs1)
    hsfile.check(hs1, tensors, ids[:4], LAYERS, HIDDEN, "BF16")
    assert np.array_equal(tensors["hidden_states"].array(), whole[:4]) and meta == {"row": "r2"}
    assert os.stat(hs1).st_ino != os.stat(row_states(spec, "a", "r2")).st_ino


def test_a_whole_row_on_another_file_system_is_copied(tmp_path, monkeypatch) -> None:
    spec = spec_of(tmp_path)
    ids = list(range(TOKENS))
    kept(spec, "r1", ids)

    def cross_device(src: object, dst: object) -> None:
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", cross_device)
    folder = tmp_path / "elsewhere"
    folder.mkdir()
    SpeculatorsStates(spec)(folder, 0, training_row("r1", ids))
    copy = folder / SPECULATORS_STATES / "hs_0.safetensors"
    assert copy.read_bytes() == row_states(spec, "a", "r1").read_bytes()


def test_the_final_norm_is_read_from_the_models_weights(tmp_path) -> None:
    spec = spec_of(tmp_path)
    norm = FinalNorm(Path(spec.model_config))
    assert norm.eps == pytest.approx(1e-5)
    assert norm.weight.tolist() == [0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0]
    # a multimodal checkpoint names it under its language model: found there too
    model = tmp_path / "vlm"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"text_config": {"rms_norm_eps": 1e-6}}))
    (model / "model-00001-of-00001.safetensors").write_bytes(hsfile.encode({
        "model.language_model.model.norm.weight": hsfile.Tensor(
            "F32", (2,), np.asarray([1.0, 2.0], np.float32).tobytes())}))
    vlm = FinalNorm(model / "config.json")
    assert vlm.eps == pytest.approx(1e-6) and vlm.weight.tolist() == [1.0, 2.0]
    (model / "model-00001-of-00001.safetensors").unlink()
    with pytest.raises(hsfile.BadFile, match="no model.norm.weight"):
        FinalNorm(model / "config.json")


@pytest.mark.skipif(HAS_TORCH, reason="torch is installed: the .ckpt files are written")
def test_specforges_offline_files_without_torch_say_how_to_get_it(tmp_path) -> None:
    spec = spec_of(tmp_path)
    with pytest.raises(ExportError, match=r"need torch: pip install 'tokencap\[train\]'"):
        SpecforgeOfflineSink(tmp_path / "specforge_offline", spec)
    assert not list(tmp_path.glob("*specforge_offline*"))  # nothing made


def test_specforges_offline_files_hold_the_aux_states_and_the_normed_last_one(tmp_path) -> None:
    torch = pytest.importorskip("torch")
    spec = spec_of(tmp_path)
    ids = list(range(TOKENS))
    states = kept(spec, "r1", ids)
    sink = SpecforgeOfflineSink(tmp_path / "specforge_offline", spec)
    sink.write_row(training_row("r1", ids[:5]))
    sink.finish()
    sink.publish()
    data = torch.load(tmp_path / "specforge_offline" / "rows_0-2000" / "data_0.ckpt")
    assert data["input_ids"].tolist() == ids[:5] and data["loss_mask"].tolist() == [0, 0, 1, 1, 1]
    aux, last = data["aux_hidden_state"], data["hidden_state"]
    assert aux.dtype == last.dtype == torch.bfloat16
    assert tuple(aux.shape) == (1, 5, (LAYERS - 1) * HIDDEN)
    assert tuple(last.shape) == (1, 5, HIDDEN)
    assert np.array_equal(aux[0].float().numpy(), states[:5, :LAYERS - 1].reshape(5, -1))
    x = states[:5, LAYERS - 1]
    want = x / np.sqrt((x ** 2).mean(-1, keepdims=True) + 1e-5) * (np.arange(1, 9) / 2)
    assert np.allclose(last[0].float().numpy(), want, rtol=2 ** -6)
