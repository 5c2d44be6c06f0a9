"""The trainers' hidden-state layouts (`tokencap/export/state_layouts.py`), from the files the
hidden-state stage keeps per row: speculators' hs_<i> files (a row kept whole is a hard link
to the stage's file, a cut row its first tokens' states; FP8 files as they are, a cut row's
scales cut with its states), the model's final norm read from its weights, and SpecForge's
offline .ckpt files (torch: skipped without it, where the export says in one line how to get
it; FP8 dequantized as speculators' trainer does); each trainer's flags for the layers used.
`KeptStates` (a row's file against its category's manifest) is tested through the export,
`test_exporter_states.py`, and here for the states a layout reads."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import msgspec
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
    KeptStates,
    SpecforgeOfflineSink,
    SpeculatorsStates,
    bf16_bits,
    row_states,
    trainer_flags,
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


def kept(spec: StatesSpec, row_id: str, ids: list[int], fp8: bool = False) -> np.ndarray:
    """The stage's file of `row_id`, as the stage keeps it (bf16, or FP8 as speculators
    stores it); returns its states (as its trainer reads them back)."""
    states = (np.arange(len(ids) * LAYERS * HIDDEN, dtype=np.float32) % 64 + 1).reshape(
        len(ids), LAYERS, HIDDEN)
    hs = hsfile.Tensor("BF16", states.shape, bf16(states))
    tensors = {"hidden_states": hs}
    if fp8:
        q, scales = hsfile.to_fp8(hs)
        tensors = {"hidden_states": q, hsfile.SCALES: scales}
        states = (hsfile.from_fp8(q, scales).astype(np.uint32) << 16).view(np.float32)
    tensors["token_ids"] = hsfile.Tensor("I64", (len(ids),), np.asarray(ids, np.int64).tobytes())
    hsfile.write_whole(row_states(spec, "a", row_id), hsfile.encode(tensors, {"row": row_id}))
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


def test_an_fp8_file_goes_to_speculators_as_it_is_and_a_cut_one_with_its_scales(
        tmp_path) -> None:
    spec = spec_of(tmp_path)
    ids = list(range(100, 100 + TOKENS))
    kept(spec, "r1", ids, fp8=True)
    folder = tmp_path / "speculators.tmp"
    folder.mkdir()
    layout = SpeculatorsStates(spec)
    layout(folder, 0, training_row("r1", ids))
    layout(folder, 1, training_row("r1", ids[:4]))
    hs0, hs1 = (folder / SPECULATORS_STATES / f"hs_{i}.safetensors" for i in (0, 1))
    assert os.stat(hs0).st_ino == os.stat(row_states(spec, "a", "r1")).st_ino
    whole, _ = hsfile.read(hs0)
    cut, meta = hsfile.read(hs1)
    hsfile.check(hs1, cut, ids[:4], LAYERS, HIDDEN, hsfile.FP8)  # scales [4, 1, 1] checked
    assert set(cut) == {"hidden_states", hsfile.SCALES, "token_ids"} and meta == {"row": "r1"}
    for name in ("hidden_states", hsfile.SCALES):
        assert cut[name].shape[0] == 4
        assert bytes(cut[name].data) == bytes(whole[name].data)[:len(cut[name].data)]


def test_the_bf16_states_a_ckpt_gets_are_fp8_dequantized_as_speculators_reads_them(
        tmp_path) -> None:
    spec = spec_of(tmp_path)
    ids = list(range(TOKENS))
    back = kept(spec, "r1", ids, fp8=True)
    tensors, _ = hsfile.read(row_states(spec, "a", "r1"))
    bits = bf16_bits(tensors, 4)
    assert bits.dtype == np.uint16 and bits.shape == (4, LAYERS, HIDDEN)
    assert np.array_equal(bits, hsfile.from_fp8(tensors["hidden_states"],
                                                 tensors[hsfile.SCALES])[:4])
    assert np.array_equal((bits.astype(np.uint32) << 16).view(np.float32), back[:4])
    # bf16 as stored; f32 rounded to the nearest bf16
    plain = kept(spec, "r2", ids)
    tensors, _ = hsfile.read(row_states(spec, "a", "r2"))
    assert np.array_equal((bf16_bits(tensors, 4).astype(np.uint32) << 16).view(np.float32),
                          plain[:4])
    f32 = {"hidden_states": hsfile.Tensor("F32", (1, 1, 2),
                                          np.asarray([1.0 + 2 ** -9, 3.0], np.float32).tobytes())}
    assert bf16_bits(f32, 1).tolist() == [[[0x3F80, 0x4040]]]  # 1 + 2^-9 rounds to 1.0


def test_specforges_offline_file_of_fp8_states_is_dequantized_then_normed(tmp_path) -> None:
    torch = pytest.importorskip("torch")
    spec = spec_of(tmp_path)
    ids = list(range(TOKENS))
    states = kept(spec, "r1", ids, fp8=True)  # as speculators' trainer reads them, bf16
    sink = SpecforgeOfflineSink(tmp_path / "specforge_offline", spec)
    sink.write_row(training_row("r1", ids[:5]))
    sink.finish()
    sink.publish()
    data = torch.load(tmp_path / "specforge_offline" / "rows_0-2000" / "data_0.ckpt")
    aux, last = data["aux_hidden_state"], data["hidden_state"]
    assert aux.dtype == last.dtype == torch.bfloat16
    assert np.array_equal(aux[0].float().numpy(), states[:5, :LAYERS - 1].reshape(5, -1))
    x = states[:5, LAYERS - 1]
    want = x / np.sqrt((x ** 2).mean(-1, keepdims=True) + 1e-5) * (np.arange(1, 9) / 2)
    assert np.allclose(last[0].float().numpy(), want, rtol=2 ** -6)


@pytest.mark.parametrize(("layers", "dtype", "aux", "sglang", "same"), [
    (None, "bfloat16", [2, 4, 5], [1, 3, 4], True),  # the default: [2, n//2, n-3, n]
    ("[1, 3, 6, 8]", "fp8_e4m3", [1, 3, 6], [0, 2, 5], False),
])
def test_each_trainer_is_told_the_layers_used_and_fp8(tmp_path, layers, dtype, aux, sglang,
                                                      same) -> None:
    spec = msgspec.structs.replace(spec_of(tmp_path), dtype=dtype, **(
        {"layers": tuple(json.loads(layers))} if layers else {}))
    flags = trainer_flags(spec)
    sp, sf = flags["speculators"], flags["specforge"]
    assert sp["target_layer_ids"] == aux
    assert sp["args"] == " ".join(["--target-layer-ids", *map(str, aux)]) + (
        " --hidden-states-backend fp8" if dtype == "fp8_e4m3" else "")
    assert sp["hidden_states_backend"] == ("fp8" if dtype == "fp8_e4m3" else "file")
    assert ("its default for 8 layers is [2, 4, 5], the same" in sp["note"]) == same
    assert sf["eagle_aux_hidden_state_layer_ids"] == sglang
    assert ("dequantized to bf16" in sf["note"]) == (dtype == "fp8_e4m3")


def test_a_cut_row_s_file_is_read_once_by_the_layouts(tmp_path, monkeypatch) -> None:
    """What `KeptStates.load` read (and checked) is what a layout writes from: the file is
    not read again."""
    from foundation import states_manifest as sm

    spec = spec_of(tmp_path)
    ids = list(range(TOKENS))
    kept(spec, "r1", ids)
    path = row_states(spec, "a", "r1")
    data = path.read_bytes()
    tensors, _ = hsfile.decode(data, path)
    sm.write(spec.output_dir, "a", "r.hs", [sm.StatesFile(
        file=os.path.relpath(path, spec.output_dir), tokens=TOKENS, bytes=len(data),
        dtype="BF16", hidden_size=HIDDEN, layers=list(spec.layers), row="r1",
        crc32=sm.crc32s(tensors), header_crc32=sm.header_crc32(data))])
    states = KeptStates(spec)
    assert states.check("a", "r1", TOKENS) == "" and states.load("a", "r1") == ""
    monkeypatch.setattr(hsfile, "read", lambda *a: pytest.fail("read again"))
    folder = tmp_path / "speculators.tmp"
    folder.mkdir()
    SpeculatorsStates(spec, states)(folder, 0, training_row("r1", ids[:3]))
    cut, _ = hsfile.decode((folder / SPECULATORS_STATES / "hs_0.safetensors").read_bytes(), "x")
    assert cut["token_ids"].shape == (3,)
