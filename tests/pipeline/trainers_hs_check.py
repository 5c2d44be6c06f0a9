"""Run by the trainers' venv (torch, specforge 0.2.0, speculators 0.9.0, hs-connectors): what
SpecForge's and speculators' own code make of tokencap's hidden-state export, and whether each
trainer's own training entry point takes a few EAGLE-3 steps on it.

    python trainers_hs_check.py LAYOUT_DIR TARGET_MODEL_DIR

LAYOUT_DIR/speculators: an Arrow dataset (torch format; id, input_ids, loss_mask, seq_len),
hidden_states/hs_{i}.safetensors (hidden_states [T, 4, H]: layers 2, N//2, N-3, then N before
the final norm; token_ids int64 [T]; FP8 states: hidden_states float8_e4m3fn and
hidden_states_scales float32 [T, 1, 1], read with speculators' `--hidden-states-backend fp8`,
which the export manifest's speculators args say), token_freq.pt, d2t-{D}.npy, t2d-{D}.npy.
LAYOUT_DIR/specforge_offline: rows_{g}-{g+2000}/data_{i}.ckpt (input_ids, loss_mask,
hidden_state bf16 [1, T, H] after the final norm, aux_hidden_state bf16 [1, T, 3H]);
LAYOUT_DIR/vocab_mapping-<target>-<D>.pt (SpecForge's {d2t, t2d}). What `tokencap export
--merged --format specforge --format speculators --hidden-states` writes.

Prints one JSON document. Nothing is written into LAYOUT_DIR or TARGET_MODEL_DIR: training
runs in a temporary folder, in a child process per trainer (this script again, with
``--child``), with the test-only CPU overrides:
- speculators: its trainer's local-rank function returns the CPU device and
  ``torch.accelerator.synchronize`` is a no-op; ``--loss-implementation eager --num-workers 0
  --on-missing raise`` and ``--draft-attn-impl sdpa`` (FlexAttention has no backward on CPU).
- SpecForge: ``specforge.core.loss`` (a Triton kernel imported at module level) is replaced,
  before import, by a torch module of the same formula; gloo, ``fsdp_sharding: NO_SHARD``,
  ``TORCHDYNAMO_DISABLE=1``; the target is linked into a temporary folder with the
  ``*.index.json`` its target-head loader needs; the draft config is SpecForge's own derivation
  from the target with ``draft_vocab_size`` = len(d2t).

Keys: speculators_rows_read / _skipped (token ids differ: its reader drops the row with a
warning) / _missing, *_ids_mask_agree, speculators_hs_backend (file, or fp8: the export
manifest says dtype fp8_e4m3 or the files hold hidden_states_scales) / _transfer (the class
its backend gives ArrowDataset) / _hs_dtypes (the files' own) / _read_dtypes (what its reader
returns), specforge_files_read, specforge_layout_problems, *_layers_found / *_layers_ok /
*_max_rel_err / *_next_rel_err (each stored slot against a transformers forward of the target,
first rows; FP8 dequantized as its trainer does), vocab_mappings_equal, *_losses (one per
step; *_train_ok: STEPS finite non-zero losses), *_train_error, all_ok, seconds.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
import types
import warnings
from pathlib import Path

import numpy as np
import torch

STEPS = 3
SPECFORGE = "specforge_offline"  # tokencap.export.state_layouts.SPECFORGE_OFFLINE
TRAIN_RATIO = 0.75  # speculators: train rows int(n * ratio), the rest validation


# --------------------------------------------------------------------------- readers

def _target_config(target: Path) -> dict:
    cfg = json.loads((target / "config.json").read_text())
    return cfg.get("text_config", cfg)


def _draft_size(folder: Path) -> int:
    sizes = sorted(int(m.group(1)) for p in folder.glob("d2t-*.npy")
                   if (m := re.fullmatch(r"d2t-(\d+)\.npy", p.name)))
    if len(sizes) != 1:
        raise ValueError(f"expected one d2t-<D>.npy in {folder}, found sizes {sizes}")
    return sizes[0]


def _manifest(layout: Path) -> dict:
    path = layout / "export-manifest.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _is_fp8(folder: Path) -> bool:
    """FP8 states: the export manifest says dtype fp8_e4m3, or the files hold the scales."""
    from hs_connectors.fp8_utils import SCALES_KEY
    from safetensors import safe_open

    states = _manifest(folder.parent).get("hidden_states") or {}
    if states.get("dtype") == "fp8_e4m3":
        return True
    first = sorted((folder / "hidden_states").glob("hs_*.safetensors"))[:1]
    if not first:
        return False
    with safe_open(str(first[0]), "pt") as f:
        return SCALES_KEY in f.keys()


def read_speculators(folder: Path, hidden: int, out: dict) -> dict:
    """Every row through speculators' own reader (the transfer its trainer builds: its
    backend registry's `from_train_args`, `fp8` for FP8 files, which dequantizes them);
    counts what it actually returns. The raw files are read too (speculators' FileTransfer,
    nothing dequantized): their layers and dtype, and for FP8 the scales' shape."""
    import argparse

    from hs_connectors import FileTransfer, HiddenStatesBackend
    from hs_connectors.fp8_utils import SCALES_KEY
    from speculators.train.data import ArrowDataset
    from speculators.train.recovery import SampleUnavailable

    backend = "fp8" if _is_fp8(folder) else "file"
    # as speculators.train.cli.main does with --hidden-states-backend (no --hidden-states-path:
    # <data-path>/hidden_states)
    ds_transfer = HiddenStatesBackend.registry[backend].from_train_args(
        argparse.Namespace(hidden_states_path=None), str(folder))
    ds = ArrowDataset(max_len=1 << 20, datapath=str(folder), transfer=ds_transfer,
                      on_missing="raise")
    data = ds.data
    plain = data.with_format(None)
    n = len(ds)
    read, skipped, missing, skip_reasons, agree, shapes_ok = 0, 0, 0, [], True, True
    raw_layers, dtypes, read_dtypes = set(), set(), set()
    transfer = FileTransfer(folder / "hidden_states")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(n):
            try:
                item = ds[i]
            except RuntimeError as e:  # on_missing="raise": no hs_{i}.safetensors
                missing += 1
                skip_reasons.append(f"{i}: {e}")
                continue
            if isinstance(item, SampleUnavailable):
                skipped += 1
                skip_reasons.append(f"{i}: {item.reason}")
                continue
            read += 1
            row = data[i]
            t = int(row["seq_len"])
            agree &= bool(torch.equal(item["input_ids"], row["input_ids"])
                          and torch.equal(item["loss_mask"], row["loss_mask"])
                          and len(row["input_ids"]) == len(row["loss_mask"]) == t)
            shapes_ok &= (tuple(item["hidden_states"].shape) == (t, 3 * hidden)
                          and tuple(item["verifier_last_hidden_states"].shape) == (t, hidden)
                          and item["input_ids"].dtype == torch.int64)
            read_dtypes.add(str(item["hidden_states"].dtype).removeprefix("torch."))
            raw = transfer.get_cached(i)
            raw_layers.add(int(raw["hidden_states"].shape[1]))
            dtypes.add(str(raw["hidden_states"].dtype).removeprefix("torch."))
            if backend == "fp8":
                scales = raw.get(SCALES_KEY)
                shapes_ok &= (scales is not None and tuple(scales.shape) == (t, 1, 1)
                              and scales.dtype == torch.float32
                              and raw["hidden_states"].dtype == torch.float8_e4m3fn)
    ids = plain["id"]
    out.update({
        "speculators_rows": n,
        "speculators_rows_read": read,
        "speculators_rows_skipped": skipped,
        "speculators_rows_missing": missing,
        "speculators_skip_reasons": skip_reasons[:5],
        "speculators_reader_warnings": len(caught),
        "speculators_ids_mask_agree": bool(agree) and read == n,
        "speculators_shapes_ok": bool(shapes_ok) and raw_layers == {4},
        "speculators_hs_dtypes": sorted(dtypes),
        "speculators_hs_backend": backend,
        "speculators_transfer": type(ds_transfer).__name__,
        "speculators_read_dtypes": sorted(read_dtypes),
        "speculators_format": data.format["type"],
        "speculators_id_column_unique": len(set(ids)) == len(ids),
        "speculators_loss_tokens": int(sum(int(data[i]["loss_mask"].sum()) for i in range(n))),
        "speculators_no_loss_rows": sum(int(data[i]["loss_mask"].sum()) == 0 for i in range(n)),
        "speculators_hidden_files": len(list((folder / "hidden_states").glob("hs_*.safetensors"))),
    })
    return {"input_ids": plain["input_ids"], "loss_mask": plain["loss_mask"],
            "seq_len": plain["seq_len"]}


def read_specforge(folder: Path, rows: dict, hidden: int, out: dict) -> None:
    """Every feature file through SpecForge's own offline reader and normalizer."""
    from specforge.algorithms.eagle3.data import normalize_offline_sample
    from specforge.runtime.data_plane.feature_store import load_feature_file
    from specforge.runtime.data_plane.offline_reader import (
        OfflineManifestReader,
        list_feature_files,
    )

    max_len = max(rows["seq_len"], default=1)
    refs = OfflineManifestReader(str(folder), validate_files=True, max_len=max_len).read()
    problems: list[str] = []
    seen: set[int] = set()
    read, agree = 0, True
    for ref in refs:
        path = Path(ref.feature_store_uri.removeprefix("file://"))
        m = re.fullmatch(r"data_(\d+)\.ckpt", path.name)
        if not m:
            problems.append(f"{path.name}: not data_<i>.ckpt")
            continue
        i = int(m.group(1))
        g = i // 2000 * 2000
        if path.parent.name != f"rows_{g}-{g + 2000}" or path.parent.parent != folder.resolve():
            problems.append(f"{path.relative_to(folder.resolve())}: expected rows_{g}-{g + 2000}/")
        raw = load_feature_file(str(path))
        keys = set(raw)
        if keys != {"input_ids", "loss_mask", "hidden_state", "aux_hidden_state"}:
            problems.append(f"data_{i}: keys {sorted(keys)}")
        specs = {k: (tuple(s.shape), s.dtype) for k, s in ref.feature_specs.items()}
        t = int(raw["input_ids"].shape[0])
        want = {"input_ids": ((t,), "int64"), "loss_mask": ((t,), "int64"),
                "hidden_state": ((1, t, hidden), "bfloat16"),
                "aux_hidden_state": ((1, t, 3 * hidden), "bfloat16")}
        for k, w in want.items():
            if specs.get(k) != w:
                problems.append(f"data_{i}.{k}: {specs.get(k)} != {w}")
        sample = normalize_offline_sample(raw, max_len=max_len)
        read += 1
        seen.add(i)
        if i >= len(rows["input_ids"]):
            agree = False
            problems.append(f"data_{i}: no speculators row {i}")
            continue
        ids = torch.tensor(rows["input_ids"][i], dtype=torch.int64)
        mask = torch.tensor(rows["loss_mask"][i], dtype=torch.int64)
        agree &= bool(torch.equal(raw["input_ids"], ids) and torch.equal(raw["loss_mask"], mask)
                      and torch.equal(sample["input_ids"][0], ids)
                      and tuple(sample["target"].shape) == (1, t, hidden))
    mapping = torch.load(mapping_path(folder.parent), weights_only=True)
    out.update({
        "specforge_files_listed": len(list_feature_files(str(folder))),
        "specforge_files_read": read,
        "specforge_rows_missing": sorted(set(range(len(rows["input_ids"]))) - seen)[:10],
        "specforge_ids_mask_agree": bool(agree) and seen == set(range(len(rows["input_ids"]))),
        "specforge_layout_problems": problems[:10],
        "specforge_vocab_mapping_keys": sorted(mapping),
    })


def mapping_path(layout: Path) -> Path:
    """SpecForge's vocabulary mapping as tokencap names it: vocab_mapping-<target>-<D>.pt."""
    found = sorted(layout.glob("vocab_mapping-*.pt"))
    if not found:
        raise FileNotFoundError(f"no vocab_mapping-*.pt in {layout}")
    return found[0]


def check_mappings(layout: Path, draft: int, target_vocab: int, out: dict) -> None:
    from specforge.core.compact_teacher import validate_vocab_mapping_consistency

    d2t = np.load(layout / "speculators" / f"d2t-{draft}.npy")
    t2d = np.load(layout / "speculators" / f"t2d-{draft}.npy")
    m = torch.load(mapping_path(layout), weights_only=True)
    ok = True
    try:
        validate_vocab_mapping_consistency(m["t2d"], m["d2t"])
    except Exception as e:  # reported, not raised
        ok = False
        out["specforge_vocab_mapping_error"] = str(e)[:200]
    out.update({
        "draft_vocab_size": draft,
        "specforge_vocab_mapping_valid": ok,
        "vocab_mappings_equal": bool(np.array_equal(m["d2t"].numpy(), d2t)
                                     and np.array_equal(m["t2d"].numpy(), t2d)),
        "vocab_mapping_shapes_ok": (d2t.shape == (draft,) and t2d.shape == (target_vocab,)
                                    and d2t.dtype == np.int64 and t2d.dtype == np.bool_),
    })


def _nearest(x: torch.Tensor, layers: dict) -> tuple[object, float, float]:
    """The layer `x` is closest to, its relative error, and the next closest one's (the
    margin by which it was told apart)."""
    rel = {k: float((x.float() - v).norm() / v.norm().clamp_min(1e-12))
           for k, v in layers.items() if v.shape == x.shape}
    first, second = sorted(rel.values())[:2]
    k = min(rel, key=rel.get)
    return k, first, second


def check_states(layout: Path, target: Path, rows: dict, out: dict, limit: int = 3) -> None:
    """The stored states against a transformers forward of the target: which layer each
    stored slot is closest to, and the relative error ||stored - layer|| / ||layer|| (scale
    sensitive, so the states before and after the final norm are told apart). The
    speculators files as its trainer reads them: FP8 ones dequantized by its fp8 backend's
    transfer (hs-connectors' FP8Transfer: fp8.to(bf16) * scale.to(bf16)), then widened to
    float32. *_next_rel_err: the smallest relative error of a slot to a layer it is not
    closest to (how far the nearest one stands out: FP8 costs a few percent)."""
    import argparse

    from hs_connectors import HiddenStatesBackend
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    n = model.config.num_hidden_layers
    h = model.config.hidden_size
    pre: list[torch.Tensor] = []
    model.model.norm.register_forward_pre_hook(lambda _m, a: pre.append(a[0]))
    found: dict[str, list] = {"speculators": [], "specforge": []}
    err = {"speculators": 0.0, "specforge": 0.0}
    nxt = {"speculators": math.inf, "specforge": math.inf}
    folder = layout / "speculators"
    transfer = HiddenStatesBackend.registry["fp8" if _is_fp8(folder) else "file"] \
        .from_train_args(argparse.Namespace(hidden_states_path=None), str(folder))
    for i in range(min(limit, len(rows["input_ids"]))):
        ids = torch.tensor(rows["input_ids"][i])[None]
        pre.clear()
        with torch.no_grad():
            hs = model(ids, output_hidden_states=True).hidden_states
        layers: dict[object, torch.Tensor] = {k: hs[k][0] for k in range(n)}
        layers["pre_norm"] = pre[-1][0]
        layers["post_norm"] = hs[n][0]

        stack = transfer.get_cached(i)["hidden_states"].float()
        g = i // 2000 * 2000
        sf = torch.load(layout / SPECFORGE / f"rows_{g}-{g + 2000}" / f"data_{i}.ckpt",
                        weights_only=True)
        aux = sf["aux_hidden_state"][0]
        slots = {"speculators": [stack[:, j] for j in range(stack.shape[1])],
                 "specforge": [aux[:, j * h:(j + 1) * h] for j in range(aux.shape[-1] // h)]
                 + [sf["hidden_state"][0]]}
        for kind, tensors in slots.items():
            near = [_nearest(t, layers) for t in tensors]
            found[kind].append([k for k, _, _ in near])
            err[kind] = max([err[kind]] + [e for _, e, _ in near])
            nxt[kind] = min([nxt[kind]] + [e for _, _, e in near])
    aux_ids = [2, n // 2, n - 3]
    out.update({
        "target_layers": n,
        "speculators_layers_found": found["speculators"][0] if found["speculators"] else None,
        "speculators_layers_ok": all(f == [*aux_ids, "pre_norm"] for f in found["speculators"]),
        "speculators_max_rel_err": round(err["speculators"], 6),
        "speculators_next_rel_err": round(nxt["speculators"], 6),
        "specforge_layers_found": found["specforge"][0] if found["specforge"] else None,
        "specforge_layers_ok": all(f == [*aux_ids, "post_norm"] for f in found["specforge"]),
        "specforge_max_rel_err": round(err["specforge"], 6),
        "specforge_next_rel_err": round(nxt["specforge"], 6),
    })


# --------------------------------------------------------------------------- training children

def _loss_module() -> types.ModuleType:
    """Stands in for ``specforge.core.loss`` (Triton): the same formula in torch, i.e.
    mean over positions of -sum(target_p * log_softmax(logits)) where position_mask is set."""
    mod = types.ModuleType("specforge.core.loss")

    def _compute_loss(logits, target_p, position_mask):
        logp = torch.log_softmax(logits.float(), dim=-1)
        return -(position_mask * (target_p * logp)).sum(-1).mean()

    class LogSoftmaxLoss:
        @staticmethod
        def apply(logits, target, position_mask):
            return _compute_loss(logits, target, position_mask)

    mod._compute_loss = _compute_loss
    mod.LogSoftmaxLoss = LogSoftmaxLoss
    return mod


def child_speculators(layout: Path, target: Path, work: Path) -> dict:
    import logging

    import speculators.train.cli as cli
    import speculators.train.trainer as trainer
    from speculators.train.config import TrainConfig

    trainer.get_local_rank = lambda: torch.device("cpu")  # test-only: no accelerator here
    torch.accelerator.synchronize = lambda *a, **k: None  # the step timer's sync
    losses: list[float] = []
    dropped: list[float] = []
    val: list[float] = []

    class Grab(logging.Handler):
        def emit(self, record):
            msg = record.msg
            if isinstance(msg, dict) and isinstance(msg.get("train"), dict):
                losses.append(float(msg["train"]["loss"]))
                dropped.append(float(msg["train"].get("error_records", 0)))
            if isinstance(msg, dict) and isinstance(msg.get("val"), dict):
                val.append(float(msg["val"].get("loss_epoch", float("nan"))))

    setup = cli.setup_metric_logger

    def setup_and_grab(*a, **k):
        setup(*a, **k)
        logging.getLogger("speculators.metrics").addHandler(Grab())

    cli.setup_metric_logger = setup_and_grab
    folder = layout / "speculators"
    from datasets import load_from_disk
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    lengths = load_from_disk(str(folder)).with_format(None)["seq_len"]
    seq = max(lengths)  # every row fits one batch whole
    # its loop runs one more step in each epoch begun at max_steps: as many epochs as it
    # takes its own sampler (same seed) to give STEPS training batches, and no more
    sampler = MultipackDistributedBatchSamplerV2(
        batch_max_length=seq, lengths=lengths[:int(len(lengths) * TRAIN_RATIO)],
        num_replicas=1, rank=0, seed=0)
    epochs, batches = 0, 0
    while batches < STEPS and epochs < STEPS:
        sampler.set_epoch(epochs)
        batches += len(sampler)
        epochs += 1
    argv = ["--verifier-name-or-path", str(target), "--data-path", str(folder),
            "--speculator-type", "eagle3", "--draft-vocab-size", str(_draft_size(folder)),
            "--loss-implementation", "eager", "--draft-attn-impl", "sdpa",
            "--num-workers", "0", "--on-missing", "raise",
            "--train-data-ratio", str(TRAIN_RATIO), "--total-seq-len", str(seq),
            "--seed", "0", "--epochs", str(epochs), "--max-steps", str(STEPS),
            "--save-path", str(work / "ckpt"), "--log-dir", str(work / "logs")]
    # the flags the export manifest says for the states' layers (and an FP8 backend)
    manifest = json.loads((layout / "export-manifest.json").read_text())
    argv += manifest["hidden_states"]["trainers"]["speculators"]["args"].split()
    cli.main(TrainConfig.resolve(argv))
    return {"losses": losses, "rows_dropped": sum(dropped), "val_losses": val, "argv": argv}


def _target_with_index(target: Path, work: Path) -> Path:
    """SpecForge's target-head loader needs a ``*.index.json``; a single-file target has none.
    Links the target's files into a temporary folder and writes one there."""
    if list(target.glob("*.index.json")):
        return target
    from safetensors import safe_open

    linked = work / "target"
    linked.mkdir()
    for f in target.iterdir():
        (linked / f.name).symlink_to(f.resolve())
    weight_map = {}
    for f in sorted(target.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            weight_map.update({k: f.name for k in st.keys()})
    (linked / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    return linked


def child_specforge(layout: Path, target: Path, work: Path) -> dict:
    sys.modules["specforge.core.loss"] = _loss_module()  # before anything imports it
    import specforge.training.assembly as assembly
    import yaml
    from specforge.algorithms.eagle3.providers import algorithm_providers
    from specforge.cli import main as specforge_main
    from specforge.config import Config
    from specforge.training.model_loading import resolve_draft_config

    losses: list[float] = []
    log = assembly._logger

    def grab(metrics, step):
        losses.append(float(metrics["loss"]))
        log(metrics, step)

    assembly._logger = grab
    folder = layout / SPECFORGE
    linked = _target_with_index(target, work)
    tied = bool(_target_config(target).get("tie_word_embeddings", False))
    draft = len(torch.load(mapping_path(layout), weights_only=True)["d2t"])
    max_len = max(int(torch.load(p, weights_only=True, mmap=True)["input_ids"].numel())
                  for p in folder.rglob("*.ckpt"))
    raw = {
        "model": {"target_model_path": str(linked),
                  "draft_model_config": str(work / "draft_config.json"),
                  "vocab_mapping_path": str(mapping_path(layout)),
                  "lm_head_key": "model.embed_tokens.weight" if tied else "lm_head.weight"},
        "data": {"hidden_states_path": str(folder), "max_length": max_len,
                 "dataloader_num_workers": 0, "cache_dir": str(work / "cache")},
        "training": {"strategy": "eagle3", "num_epochs": STEPS, "max_steps": STEPS,
                     "batch_size": 1, "fsdp_sharding": "NO_SHARD", "attention_backend": "sdpa",
                     "learning_rate": 1e-3, "log_interval": 1, "save_interval": 0},
        "output_dir": str(work / "out"),
    }
    # the draft config SpecForge derives from the target, with our draft vocabulary size
    draft_cfg = resolve_draft_config(Config.model_validate(
        {**raw, "model": {k: v for k, v in raw["model"].items() if k != "draft_model_config"}}),
        provider=algorithm_providers().model.draft_config)
    draft_cfg.draft_vocab_size = draft
    draft_cfg.to_json_file(str(work / "draft_config.json"))
    (work / "run.yaml").write_text(yaml.safe_dump(raw))
    rc = specforge_main(["train", "-c", str(work / "run.yaml")])
    return {"losses": losses, "rc": rc, "config": raw}


def run_child(kind: str, layout: Path, target: Path, timeout: float = 240) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"hs-check-{kind}-") as tmp:
        env = {k: v for k, v in os.environ.items() if k not in
               ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
        env.update({"TORCHDYNAMO_DISABLE": "1", "TOKENIZERS_PARALLELISM": "false",
                    "SPECFORGE_DEVICE": "cpu", "HF_HUB_OFFLINE": "1",
                    "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "disabled"})
        result = Path(tmp) / "result.json"
        start = time.monotonic()
        p = subprocess.run([sys.executable, __file__, "--child", kind, str(layout), str(target),
                            tmp, str(result)], env=env, capture_output=True, text=True,
                           timeout=timeout, check=False)
        took = round(time.monotonic() - start, 1)
        if p.returncode != 0 or not result.exists():
            return {"error": (p.stdout + p.stderr)[-3000:], "rc": p.returncode, "seconds": took}
        got = json.loads(result.read_text())
        got["seconds"] = took
        return got


def _good(losses: list) -> bool:
    return len(losses) == STEPS and all(math.isfinite(x) and x != 0 for x in losses)


def main() -> int:
    if sys.argv[1] == "--child":
        kind, layout, target, work, result = sys.argv[2:7]
        fn = child_speculators if kind == "speculators" else child_specforge
        got = fn(Path(layout).resolve(), Path(target).resolve(), Path(work))
        Path(result).write_text(json.dumps(got, default=str))
        return 0
    layout, target = Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve()
    start = time.monotonic()
    out: dict[str, object] = {}
    tcfg = _target_config(target)
    hidden = int(tcfg["hidden_size"])
    rows: dict = {"input_ids": [], "loss_mask": [], "seq_len": []}
    phases = [("speculators_read", lambda: rows.update(
                   read_speculators(layout / "speculators", hidden, out))),
              ("specforge_read", lambda: read_specforge(layout / SPECFORGE, rows, hidden, out)),
              ("mappings", lambda: check_mappings(layout, _draft_size(layout / "speculators"),
                                                  int(tcfg["vocab_size"]), out)),
              ("states", lambda: check_states(layout, target, rows, out))]
    for name, phase in phases:
        try:
            phase()
        except Exception as e:  # reported in the JSON, the rest still runs
            out[f"{name}_error"] = f"{type(e).__name__}: {e}"[:500]
    for kind in ("speculators", "specforge"):
        got = run_child(kind, layout, target)
        out[f"{kind}_losses"] = got.get("losses")
        out[f"{kind}_train_seconds"] = got.get("seconds")
        if kind == "speculators":
            out["speculators_train_rows_dropped"] = got.get("rows_dropped")
            out["speculators_val_losses"] = got.get("val_losses")
        out[f"{kind}_train_ok"] = _good(got.get("losses") or [])
        if "error" in got:
            out[f"{kind}_train_error"] = got["error"]
        if "argv" in got:
            out["speculators_train_argv"] = got["argv"]
        if "config" in got:
            out["specforge_train_config"] = got["config"]
    n = out.get("speculators_rows")
    out["all_ok"] = bool(
        n and out.get("speculators_rows_read") == n and out.get("specforge_files_read") == n
        and all(out.get(k) is True for k in (
            "speculators_ids_mask_agree", "speculators_shapes_ok", "specforge_ids_mask_agree",
            "specforge_vocab_mapping_valid", "vocab_mappings_equal", "vocab_mapping_shapes_ok",
            "speculators_layers_ok", "specforge_layers_ok", "speculators_train_ok",
            "specforge_train_ok"))
        and not out.get("specforge_layout_problems")
        and not any(k.endswith("_error") for k in out))
    out["seconds"] = round(time.monotonic() - start, 1)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
