"""Run by the trainers' venv (torch, specforge 0.2.0, speculators 0.9.0; `make test-engine`
makes it): what SpecForge's and speculators' own code make of a tokencap export.

    python trainers_check.py EXPORT_DIR DRAFT TARGET

EXPORT_DIR is a merged export (specforge.jsonl, speculators/, token_freq.pt, d2t/t2d files).
Prints one JSON document: each trainer's mapping built by its own code from our frequencies
and rows, compared with ours; the rows and loss tokens its own readers read.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import torch


def main() -> int:
    export, draft, target = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    out: dict[str, object] = {}
    ours_d2t = np.load(export / f"d2t-{draft}.npy")
    ours_t2d = np.load(export / f"t2d-{draft}.npy")
    freq = torch.load(export / "token_freq.pt", weights_only=True)

    # speculators: the mapping from our frequencies, and what its CLI loads from our folder
    from speculators.train.cli import parse_vocab_mappings
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    d2t, t2d = build_vocab_mappings_from_distribution(dict(freq), draft, target)
    out["speculators_mapping_equal"] = bool(np.array_equal(d2t.numpy(), ours_d2t)
                                            and np.array_equal(t2d.numpy(), ours_t2d))
    folder = export / "speculators"
    args = argparse.Namespace(d2t_path=None, t2d_path=None, data_path=str(folder),
                              draft_vocab_size=draft, token_freq_path=None,
                              verifier_name_or_path=None, trust_remote_code=False)
    loaded = parse_vocab_mappings(args)
    out["speculators_cli_loaded_ours"] = bool(
        np.array_equal(np.asarray(loaded[0]), ours_d2t)
        and np.array_equal(np.asarray(loaded[1]), ours_t2d) and loaded[2] == draft)
    with tempfile.TemporaryDirectory() as tmp:  # from token_freq.pt alone (it caches d2t)
        copy = Path(tmp) / "data"
        shutil.copytree(folder, copy)
        for f in copy.glob("[dt]2[dt]-*.npy"):
            f.unlink()
        verifier = Path(tmp) / "verifier"  # its target vocabulary comes from a model config
        verifier.mkdir()
        (verifier / "config.json").write_text(json.dumps({"model_type": "qwen2",
                                                          "vocab_size": target}))
        args.data_path = str(copy)
        args.verifier_name_or_path = str(verifier)
        built = parse_vocab_mappings(args)
        out["speculators_cli_built_equal"] = bool(
            np.array_equal(np.asarray(built[0]), ours_d2t)
            and np.array_equal(np.asarray(built[1]), ours_t2d))

    # speculators' dataset reader on our layout
    from speculators.train.data import ArrowDataset

    ds = ArrowDataset(max_len=1 << 20, datapath=str(folder), on_missing="raise")
    data = ds.data  # torch format, as its trainer indexes it
    out["speculators_rows"] = len(ds)
    out["speculators_loss_tokens"] = int(sum(int(data[i]["loss_mask"].sum())
                                             for i in range(len(data))))
    ids = data.with_format(None)["id"]
    ours = [json.loads(line)["id"] for line in
            (export / "specforge.jsonl").read_text().splitlines()]
    out["speculators_ids_in_our_order"] = ids == ours
    out["speculators_lengths_are_seq_len"] = ds._compute_approx_lengths() == [
        len(data[i]["input_ids"]) for i in range(len(data))]
    # each row's `metadata` (its mode and sampling_params), through the torch format its
    # trainer indexes and as plain values
    plain = data.with_format(None)
    out["speculators_metadata"] = [plain[i]["metadata"] for i in range(len(plain))]
    out["speculators_torch_rows_with_metadata"] = sum(
        1 for i in range(len(data)) if "metadata" in data[i])

    # SpecForge: its mapping from the same counts, its check, its loader of our file
    from specforge.core.compact_teacher import validate_vocab_mapping_consistency
    from specforge.data.preprocessing import process_token_dict_to_mappings
    from specforge.data.prompt_builder import prepare_prompt_tasks

    rows = [json.loads(line) for line in (export / "specforge.jsonl").read_text().splitlines()]
    counts: Counter[int] = Counter()
    for r in rows:  # as generate_vocab_mapping_file counts, in row order
        ids = torch.tensor(r["input_ids"])
        masked = ids[torch.tensor(r["loss_mask"]) == 1]
        uniq, n = masked.unique(return_counts=True)
        counts.update(dict(zip(uniq.tolist(), n.tolist(), strict=True)))
    sd2t, st2d = process_token_dict_to_mappings(counts, draft, target)
    out["specforge_mapping_equal"] = bool(np.array_equal(sd2t.numpy(), ours_d2t)
                                          and np.array_equal(st2d.numpy(), ours_t2d))
    mapping = torch.load(export / f"vocab_mapping-{target}-{draft}.pt")
    validate_vocab_mapping_consistency(mapping["t2d"], mapping["d2t"])
    out["specforge_file_equal"] = bool(np.array_equal(mapping["d2t"].numpy(), ours_d2t)
                                       and np.array_equal(mapping["t2d"].numpy(), ours_t2d))
    tasks = prepare_prompt_tasks(export / "specforge.jsonl", None, chat_template=None,
                                 max_length=1 << 20, is_preformatted=True,
                                 train_only_last_turn=False, cache_dir=None, cache_key=None,
                                 num_proc=None)
    out["specforge_rows"] = len(tasks)
    out["specforge_loss_tokens"] = int(sum(sum(t["payload"]["loss_mask"]) for t in tasks))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
