"""Hidden states in the trainers' offline layouts (`export --hidden-states`), from the files
the hidden-state stage keeps per row (`foundation.outputs.states_file`, docs/HIDDEN_STATES.md),
as the category's manifest proves them (`KeptStates`):

- speculators: ``<speculators>/hidden_states/hs_<i>.safetensors`` for row i of the folder's
  dataset (its trainer's `--data-path`): ``hidden_states`` [T, layers, H] (the aux layers,
  then the last layer before the final norm, as vLLM wrote them) and ``token_ids`` (int64),
  T the row's length after the export's length limit (a cut row's states are the first T:
  a token's states do not depend on what follows it). A row kept whole is a hard link to the
  stage's file (a copy across file systems). FP8 files (``hidden_states`` F8_E4M3 and
  ``hidden_states_scales`` float32 [T, 1, 1]) are given as they are, a cut row's scales cut
  with its states: its trainer reads them with ``--hidden-states-backend fp8``.
- SpecForge: ``specforge_offline/rows_<a>-<a+2000>/data_<i>.ckpt`` (`torch.save`): ``input_ids``
  (int64 [T]), ``loss_mask`` (int64 [T]), ``aux_hidden_state`` [1, T, (layers-1) H] and
  ``hidden_state`` [1, T, H] **after** the model's final RMSNorm (its weight and eps from the
  model's files: `FinalNorm`), both bfloat16 (its trainer's matmuls want one dtype); FP8
  states dequantized first, exactly as speculators' trainer does (`hsfile.from_fp8`). Needs
  torch (`pip install 'tokencap[train]'`).

A row without a kept states file is left out of every format of such an export
(`dropped_no_states`): the trainer would fail on it (speculators' `on_missing = "raise"`) or
skip it silently. A row whose file disagrees with its category's manifest (missing, another
size, not in it, or, where the export reads the file anyway, other CRC32s), or every row of a
category with no manifest, stops the export (`StatesRefused`, exit 2) unless
`--skip-bad-states`, which leaves it out (`dropped_bad_states`). `trainer_flags`: each
trainer's flags for the layers (and dtype) used, for the export manifest.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from foundation import hsfile
from foundation import states_manifest as sm
from foundation.config import StatesSpec
from foundation.errors import SourceError
from foundation.outputs import states_file
from tokencap.export.sinks import ExportError, TmpDir, TrainingRow

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger(__name__)

SPECFORGE_OFFLINE = "specforge_offline"
SPECFORGE_FOLDER_ROWS = 2000  # SpecForge's rows_<a>-<a+2000> folders
SPECULATORS_STATES = "hidden_states"


def row_states(spec: StatesSpec, category: str, row_id: str) -> Path:
    """The stage's file of a training row's states (it may not exist)."""
    return states_file(spec.output_dir, category, row_id)


Loaded = tuple[dict[str, hsfile.Tensor], dict[str, str]]  # a file's tensors and metadata


class StatesRefused(SourceError):
    """A category's kept states that disagree with its manifest (or have none): the export
    stops, naming the category, the first file and what is wrong (exit 2)."""


class KeptStates:
    """The stage's kept files as each category's manifest proves them (`foundation.
    states_manifest`), for one export: whether a row's states may be taken (`check`, before
    any format gets the row; `load` too where the export reads the file), and the file the
    last `load` read, for the layouts that write from it (`tensors`: read once). A row that
    disagrees stops the export (`StatesRefused`), or, with `skip_bad`, is left out and its
    first problems logged."""

    SHOWN = 5  # problems logged per category when they are skipped

    def __init__(self, spec: StatesSpec, skip_bad: bool = False) -> None:
        self.spec = spec
        self.skip_bad = skip_bad
        self._entries: dict[str, dict[str, sm.StatesFile] | None] = {}
        self._loaded: tuple[Path, Loaded] | None = None
        self.skipped: dict[str, int] = {}

    def open(self, category: str) -> None:
        """Read the category's manifest; without one, refuse (`StatesRefused`) or, skipping,
        take none of its rows' states."""
        path = sm.manifest_path(self.spec.output_dir, category)
        try:
            self._entries[category] = sm.read(path, category).by_file()
        except sm.ManifestError as exc:
            if not path.exists() and not self.skip_bad:
                raise StatesRefused(
                    f"{category}: no manifest {path}: its hidden-state stage has not ended, so "
                    "nothing proves its files (run `tokencap hidden-states CONFIG` to its end; "
                    f"`tokencap verify {self.spec.output_dir}` checks them; --skip-bad-states "
                    "leaves its rows out)") from None
            if not self.skip_bad:
                raise StatesRefused(f"{category}: {exc}") from None
            log.warning("%s: every row with states left out (--skip-bad-states): %s",
                        category, exc)
            self._entries[category] = None

    def check(self, category: str, row_id: str, tokens: int) -> str:
        """Whether the row's states may be taken: "" (its file is the manifest's, of the
        manifest's size, of `tokens` tokens), "dropped_no_states" (no file and none in the
        manifest: the stage kept none) or "dropped_bad_states" (skipped; else
        `StatesRefused`)."""
        if category not in self._entries:
            self.open(category)
        path = row_states(self.spec, category, row_id)
        rel = os.path.relpath(path, self.spec.output_dir)
        entries = self._entries[category]
        if entries is None:
            return self._bad(category, rel, "") if path.exists() else "dropped_no_states"
        entry = entries.get(rel)
        if entry is None:
            if not path.exists():
                return "dropped_no_states"
            return self._bad(category, rel, f"row {row_id}: not in the manifest (kept after "
                             "the stage's end, or copied in)")
        if entry.row and entry.row != row_id:
            return self._bad(category, rel, f"the manifest says it holds row {entry.row}, not "
                             f"{row_id}")
        if entry.tokens != tokens:
            return self._bad(category, rel, f"row {row_id}: states of {entry.tokens:,} tokens, "
                             f"the row has {tokens:,}")
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return self._bad(category, rel, f"missing: row {row_id}: no such file")
        if size != entry.bytes:
            return self._bad(category, rel, f"changed: row {row_id}: {size:,} bytes, the "
                             f"manifest says {entry.bytes:,}")
        return ""

    def entry(self, category: str, row_id: str) -> sm.StatesFile | None:
        entries = self._entries.get(category)
        if not entries:
            return None
        rel = os.path.relpath(row_states(self.spec, category, row_id), self.spec.output_dir)
        return entries.get(rel)

    def load(self, category: str, row_id: str) -> str:
        """Read a row's file (after `check`) and compare its CRC32s with the manifest's:
        "" (kept for `tensors`), or "dropped_bad_states" (skipped; else `StatesRefused`)."""
        path = row_states(self.spec, category, row_id)
        rel = os.path.relpath(path, self.spec.output_dir)
        entry = self.entry(category, row_id)
        try:
            data = path.read_bytes()
            tensors, meta = hsfile.decode(data, path)
        except (OSError, hsfile.BadFile) as exc:
            return self._bad(category, rel, f"torn: row {row_id}: {exc}")
        if entry is not None:
            got = sm.crc32s(tensors)
            if entry.crc32 and got != entry.crc32:
                diff = sorted(n for n in set(got) | set(entry.crc32)
                              if got.get(n) != entry.crc32.get(n))
                return self._bad(category, rel, f"changed: row {row_id}: the CRC32 of "
                                 f"{', '.join(diff)} differs from the manifest's")
            if entry.header_crc32 is not None and sm.header_crc32(data) != entry.header_crc32:
                return self._bad(category, rel, f"changed: row {row_id}: the CRC32 of its "
                                 "header differs from the manifest's")
        self._loaded = (path, (tensors, meta))
        return ""

    def tensors(self, path: Path) -> Loaded:
        """The file `load` last read when it is `path`, else read now."""
        if self._loaded is not None and self._loaded[0] == path:
            return self._loaded[1]
        return hsfile.read(path)

    def _bad(self, category: str, rel: str, what: str) -> str:
        what = what or "its category has no manifest"
        if not self.skip_bad:
            raise StatesRefused(f"{category}: {rel}: {what} (`tokencap verify "
                                f"{self.spec.output_dir}` lists every file that disagrees; "
                                "--skip-bad-states leaves such rows out)")
        n = self.skipped.get(category, 0)
        self.skipped[category] = n + 1
        if n < self.SHOWN:
            log.warning("%s: %s: %s: row left out (--skip-bad-states)", category, rel, what)
        return "dropped_bad_states"


def _first(t: hsfile.Tensor, n: int) -> hsfile.Tensor:
    """A tensor's first `n` entries along its first (token) axis."""
    per = len(t.data) // t.shape[0] if t.shape and t.shape[0] else 0
    return hsfile.Tensor(t.dtype, (n, *t.shape[1:]), t.data[:n * per])


def _sliced(loaded: Loaded, n: int) -> bytes:
    """The first `n` tokens of a stage file: every tensor whose first axis is the tokens'
    (states, FP8 scales, ids) cut to `n`, the metadata kept."""
    tensors, meta = loaded
    tokens = tensors["token_ids"].shape[0]
    return hsfile.encode({name: _first(t, n) if t.shape and t.shape[0] == tokens else t
                          for name, t in tensors.items()}, meta)


def trainer_flags(spec: StatesSpec) -> dict[str, Any]:
    """What each trainer must be told of the states (the export manifest's
    `hidden_states.trainers`): speculators' `--target-layer-ids` (the config's layer ids but
    the last, which its trainer takes as the final layer itself; its default is [2, n//2,
    n-3]) and, for FP8 files, `--hidden-states-backend fp8`; SpecForge's draft config's
    `eagle_config.eagle_aux_hidden_state_layer_ids` (SGLang counts layer outputs: vLLM's ids
    less one, its default [1, n//2-1, n-4]): its offline trainer reads the aux states from
    the .ckpt files and no layer id, but the draft it trains tells SGLang which layers to
    capture when it serves it."""
    aux = list(spec.layers[:-1])
    n = spec.num_layers
    default = [2, n // 2, n - 3]
    fp8 = hsfile.DTYPE_NAMES.get(spec.dtype) == hsfile.FP8
    args = ["--target-layer-ids", *map(str, aux)]
    if fp8:
        args += ["--hidden-states-backend", "fp8"]
    sglang = [k - 1 for k in aux]
    return {
        "speculators": {
            "args": " ".join(args),
            "target_layer_ids": aux,
            "hidden_states_backend": "fp8" if fp8 else "file",
            "note": ("--target-layer-ids: the config's layers without the last (speculators "
                     f"appends the final layer itself); its default for {n} layers is "
                     f"{default}" + (", the same" if aux == default else
                                     ": without the flag the draft would name the wrong "
                                     "layers") + "."
                     + (" The files are FP8 (hidden_states float8_e4m3fn with "
                        "hidden_states_scales): its trainer dequantizes them with "
                        "--hidden-states-backend fp8." if fp8 else "")),
        },
        "specforge": {
            "eagle_aux_hidden_state_layer_ids": sglang,
            "where": "the draft model config's eagle_config (SGLang serves the draft with "
                     "these layers)",
            "note": ("SGLang and SpecForge count layer outputs: vLLM's ids less one (default "
                     f"[1, n//2-1, n-4] = {[1, n // 2 - 1, n - 4]}). SpecForge's offline "
                     "trainer reads the aux states from the .ckpt files and no layer ids "
                     "(model.aux_hidden_state_layer_ids is its online capture's)."
                     + (" The .ckpt states are the FP8 files dequantized to bf16 as "
                        "speculators' trainer does." if fp8 else "")),
        },
    }


class SpeculatorsStates:
    """Writes the hs_<i> file of each row a speculators folder takes (its `on_row`), into
    the folder's temporary name: published with it. A cut row's file is written from what
    `kept` read (and checked) for it."""

    def __init__(self, spec: StatesSpec, kept: KeptStates | None = None) -> None:
        self.spec = spec
        self.kept = kept
        self.files = 0

    def __call__(self, folder: Path, index: int, row: TrainingRow) -> None:
        src = row_states(self.spec, row.result.category, row.result.id)
        out = folder / SPECULATORS_STATES
        out.mkdir(exist_ok=True)
        dst = out / f"hs_{index}.safetensors"
        if len(row.input_ids) == tokens_of(src, self.kept, row):  # whole
            try:
                os.link(src, dst)
            except OSError:
                shutil.copyfile(src, dst)
        else:
            loaded = self.kept.tensors(src) if self.kept is not None else hsfile.read(src)
            hsfile.write_whole(dst, _sliced(loaded, len(row.input_ids)))
        self.files += 1


def tokens_of(src: Path, kept: KeptStates | None, row: TrainingRow) -> int:
    """The tokens of a row's states file: its manifest's, else its header's."""
    entry = kept.entry(row.result.category, row.result.id) if kept is not None else None
    if entry is not None:
        return entry.tokens
    shape: list[int] = hsfile.header(src)[0]["token_ids"]["shape"]
    return shape[0]


def reads_file(sinks: list[Any], tokens: int, file_tokens: int) -> bool:
    """Whether writing a row of `tokens` tokens (after the length limit) to `sinks` reads its
    states file's bytes (SpecForge's .ckpt always; speculators' hs_<i> for a cut row), so
    that its CRC32s are checked first."""
    from tokencap.export.sinks import SpeculatorsSink

    for sink in sinks:
        if isinstance(sink, SpecforgeOfflineSink):
            return True
        if isinstance(sink, SpeculatorsSink) and isinstance(sink.on_row, SpeculatorsStates) \
                and tokens < file_tokens:
            return True
    return False


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

    def __init__(self, path: Path, spec: StatesSpec, kept: KeptStates | None = None) -> None:
        try:
            import torch
        except ImportError:
            raise ExportError("SpecForge's offline files (.ckpt) need torch: pip install "
                              "'tokencap[train]', then export again") from None
        super().__init__(path)
        self.torch = torch
        self.spec = spec
        self.kept = kept
        self.norm = FinalNorm(Path(spec.model_config))
        self.rows = 0

    def write_row(self, row: TrainingRow) -> None:
        torch = self.torch
        n = len(row.input_ids)
        src = row_states(self.spec, row.result.category, row.result.id)
        tensors, _ = self.kept.tensors(src) if self.kept is not None else hsfile.read(src)
        states = bf16_states(torch, tensors, n)
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


def bf16_states(torch: Any, tensors: dict[str, hsfile.Tensor], n: int) -> Any:
    """A file's first `n` tokens' states as a torch bfloat16 [n, L, H] (`bf16_bits`)."""
    import numpy as np

    return torch.from_numpy(bf16_bits(tensors, n).view(np.int16)).view(torch.bfloat16)


def bf16_bits(tensors: dict[str, hsfile.Tensor], n: int) -> np.ndarray:
    """A file's first `n` tokens' states as bfloat16 bit patterns (uint16 [n, L, H]): bf16
    as stored, F16 and F32 rounded to nearest even, FP8 dequantized as speculators' trainer
    does (`hsfile.from_fp8`: fp8 and scale each in bf16, their product in bf16)."""
    import numpy as np

    hs = _first(tensors["hidden_states"], n)
    if hs.dtype == hsfile.FP8:
        return hsfile.from_fp8(hs, _first(tensors[hsfile.SCALES], n))
    if hs.dtype == "BF16":
        return np.frombuffer(hs.data, dtype=np.uint16).reshape(hs.shape).copy()
    return hsfile.to_bf16_bits(hs.array())
