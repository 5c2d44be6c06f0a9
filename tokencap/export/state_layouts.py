"""Hidden states in the trainers' offline layouts (`export --hidden-states`), from the files
the hidden-state stage keeps per row (`foundation.outputs.states_file`, docs/HIDDEN_STATES.md):

- speculators: ``<speculators>/hidden_states/hs_<i>.safetensors`` for row i of the folder's
  dataset (its trainer's `--data-path`): ``hidden_states`` [T, layers, H] (the aux layers,
  then the last layer before the final norm, as vLLM wrote them) and ``token_ids`` (int64),
  T the row's length after the export's length limit (a cut row's states are the first T:
  a token's states do not depend on what follows it). A row kept whole is a hard link to the
  stage's file (a copy across file systems).
- SpecForge: ``specforge_offline/rows_<a>-<a+2000>/data_<i>.ckpt`` (`torch.save`): ``input_ids``
  (int64 [T]), ``loss_mask`` (int64 [T]), ``aux_hidden_state`` [1, T, (layers-1) H] and
  ``hidden_state`` [1, T, H] **after** the model's final RMSNorm (its weight and eps from the
  model's files: `FinalNorm`), both bfloat16 (its trainer's matmuls want one dtype). Needs
  torch (`pip install 'tokencap[train]'`).

A row without a kept states file is left out of every format of such an export
(`dropped_no_states`): the trainer would fail on it (speculators' `on_missing = "raise"`) or
skip it silently.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from foundation import hsfile
from foundation.config import StatesSpec
from foundation.outputs import states_file
from tokencap.export.sinks import ExportError, TmpDir, TrainingRow

if TYPE_CHECKING:
    import numpy as np

SPECFORGE_OFFLINE = "specforge_offline"
SPECFORGE_FOLDER_ROWS = 2000  # SpecForge's rows_<a>-<a+2000> folders
SPECULATORS_STATES = "hidden_states"


def row_states(spec: StatesSpec, category: str, row_id: str) -> Path:
    """The stage's file of a training row's states (it may not exist)."""
    return states_file(spec.output_dir, category, row_id)


def _sliced(src: Path, n: int) -> bytes:
    """The first `n` tokens' states and ids of a stage file."""
    tensors, meta = hsfile.read(src)
    hs, tok = tensors["hidden_states"], tensors["token_ids"]
    per = len(hs.data) // hs.shape[0]
    return hsfile.encode({
        "hidden_states": hsfile.Tensor(hs.dtype, (n, *hs.shape[1:]), hs.data[:n * per]),
        "token_ids": hsfile.Tensor(tok.dtype, (n,), tok.data[:n * 8]),
    }, meta)


class SpeculatorsStates:
    """Writes the hs_<i> file of each row a speculators folder takes (its `on_row`), into
    the folder's temporary name: published with it."""

    def __init__(self, spec: StatesSpec) -> None:
        self.spec = spec
        self.files = 0

    def __call__(self, folder: Path, index: int, row: TrainingRow) -> None:
        src = row_states(self.spec, row.result.category, row.result.id)
        out = folder / SPECULATORS_STATES
        out.mkdir(exist_ok=True)
        dst = out / f"hs_{index}.safetensors"
        if len(row.input_ids) == hsfile.header(src)[0]["token_ids"]["shape"][0]:  # whole
            try:
                os.link(src, dst)
            except OSError:
                shutil.copyfile(src, dst)
        else:
            hsfile.write_whole(dst, _sliced(src, len(row.input_ids)))
        self.files += 1


class FinalNorm:
    """The model's final RMSNorm (weight, eps) from its folder: what turns the last layer's
    pre-norm state into SpecForge's `hidden_state`."""

    def __init__(self, model_config: Path) -> None:
        import numpy as np

        folder = model_config.parent
        doc = json.loads(model_config.read_text())
        text = doc.get("text_config") if isinstance(doc.get("text_config"), dict) else doc
        self.eps = float(text.get("rms_norm_eps", 1e-6))
        weight = None
        for shard in sorted(folder.glob("*.safetensors")):
            names = [k for k in hsfile.header(shard)[0]
                     if k == "model.norm.weight" or k.endswith(".model.norm.weight")]
            if names:
                weight = hsfile.read_tensor(shard, min(names, key=len))
                break
        if weight is None:
            raise hsfile.BadFile(folder, "norm", "no model.norm.weight in the model's "
                                 "*.safetensors: SpecForge's post-norm hidden_state needs the "
                                 "final norm's weight (the model folder with its weights)")
        self.weight: np.ndarray = weight.array().astype(np.float32)

    def __call__(self, states: Any) -> Any:
        """`states` (torch, bf16 [.., H]) through the norm as the model computes it: in
        float32, cast back, times the weight."""
        import torch

        x = states.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        w = torch.from_numpy(self.weight).to(states.dtype)
        return w * x.to(states.dtype)


class SpecforgeOfflineSink(TmpDir):
    """SpecForge's offline feature files (module docstring)."""

    def __init__(self, path: Path, spec: StatesSpec) -> None:
        try:
            import torch
        except ImportError:
            raise ExportError("SpecForge's offline files (.ckpt) need torch: pip install "
                              "'tokencap[train]', then export again") from None
        super().__init__(path)
        self.torch = torch
        self.spec = spec
        self.norm = FinalNorm(Path(spec.model_config))
        self.rows = 0

    def write_row(self, row: TrainingRow) -> None:
        torch = self.torch
        n = len(row.input_ids)
        tensors, _ = hsfile.read(row_states(self.spec, row.result.category,
                                                       row.result.id))
        hs = tensors["hidden_states"]
        # [T, L, H], widened to float32 exactly, then bf16 (what SpecForge's trainer reads)
        states = torch.from_numpy(hs.array()[:n].copy()).to(torch.bfloat16)
        layers, hidden = states.shape[1], states.shape[2]
        aux = states[:, : layers - 1, :].reshape(n, (layers - 1) * hidden)
        last = self.norm(states[:, layers - 1, :])
        a = self.rows // SPECFORGE_FOLDER_ROWS * SPECFORGE_FOLDER_ROWS
        folder = self.tmp / f"rows_{a}-{a + SPECFORGE_FOLDER_ROWS}"
        folder.mkdir(exist_ok=True)
        torch.save({"input_ids": torch.tensor(row.input_ids, dtype=torch.int64),
                    "loss_mask": torch.tensor(row.loss_mask, dtype=torch.int64),
                    "aux_hidden_state": aux.unsqueeze(0).contiguous(),
                    "hidden_state": last.unsqueeze(0).contiguous()},
                   folder / f"data_{self.rows}.ckpt")
        self.rows += 1

