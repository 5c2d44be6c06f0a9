"""What export (`tokencap/export/exporter.py`) hands the trainer besides the rows: the eval
split (`split.py`), the length limit (`length.py`), the draft vocabulary (`vocab.py`, whose
own rules are `test_vocab.py`'s) and speculators' on-disk dataset (`sinks.SpeculatorsSink`),
checked against what each rule promises. The trainers' own code reads the same files in
tests/pipeline/test_trainers.py."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
from click.testing import CliRunner

from foundation.wire import Result
from tests.helpers import row_result, write_run
from tokencap.cli.offline import export_cmd
from tokencap.export.exporter import Vocab, export
from tokencap.export.length import Limits, apply
from tokencap.export.split import side
from tokencap.export.vocab import mapping

VOCAB = 512


def conversations(cat: str, n: int, turns: int, rng: random.Random) -> list[Result]:
    """`n` conversations of `turns` turns each, random ids below VOCAB."""
    out = []
    for c in range(n):
        prompt: list[int] = [rng.randrange(VOCAB) for _ in range(rng.randint(3, 20))]
        for t in range(1, turns + 1):
            reply = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))]
            out.append(row_result(cat, f"{cat}-c{c}#t{t}", list(prompt), reply,
                                  f"{cat}-c{c}", t, turns))
            prompt = prompt + reply + [rng.randrange(VOCAB) for _ in range(3)]
    return out


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# -- the split ---------------------------------------------------------------------------------

def test_the_split_keeps_each_conversation_on_one_side_and_the_fraction_per_category(
        tmp_path) -> None:
    rng = random.Random(3)
    rows = {"a": conversations("a", 400, 3, rng), "b": conversations("b", 400, 2, rng)}
    out = write_run(tmp_path / "out", rows)
    summary = export(out, tmp_path / "x", ["specforge"], eval_fraction=0.2, seed=7)
    for cat, results in rows.items():
        train = jsonl(tmp_path / "x" / cat / "specforge.jsonl")
        ev = jsonl(tmp_path / "x" / cat / "specforge.eval.jsonl")
        conv_of = {r.id: r.conversation_id for r in results}
        train_convs = {conv_of[r["id"]] for r in train}
        eval_convs = {conv_of[r["id"]] for r in ev}
        assert not train_convs & eval_convs  # no conversation on both sides
        assert len(train) + len(ev) == len(results)
        share = len(eval_convs) / 400
        assert abs(share - 0.2) < 4 * math.sqrt(0.2 * 0.8 / 400)  # binomial, 4 sigma
        assert summary["categories"][cat]["eval_rows"] == len(ev)
    assert summary["split"]["eval_fraction"] == 0.2


def test_the_split_is_the_same_after_a_resumed_run_and_in_every_format(tmp_path) -> None:
    rng = random.Random(5)
    rows = conversations("a", 200, 2, rng)
    half = write_run(tmp_path / "half", {"a": rows[:150]})  # the run before it resumed
    full = write_run(tmp_path / "full", {"a": rows[::-1]})  # resumed: more rows, other order
    export(half, tmp_path / "h", ["specforge", "parquet"], eval_fraction=0.1)
    export(full, tmp_path / "f", ["specforge", "parquet"], eval_fraction=0.1)
    before = {r["id"] for r in jsonl(tmp_path / "h" / "a" / "specforge.eval.jsonl")}
    after = {r["id"] for r in jsonl(tmp_path / "f" / "a" / "specforge.eval.jsonl")}
    assert before and before == after & {r.id for r in rows[:150]}
    import pyarrow.parquet as pq

    table = pq.read_table(tmp_path / "f" / "a" / "specforge.eval.parquet")
    assert set(table.column("id").to_pylist()) == after
    assert side("a-c0", 0.0, 42) == "train"


# -- the length limit -------------------------------------------------------------------------

def test_apply_cuts_or_leaves_out_and_counts_loss_tokens_within_the_limit() -> None:
    ids, mask = list(range(10)), [0] * 6 + [1] * 4
    assert apply(ids, mask, Limits(8, "truncate")) == (ids[:8], mask[:8], "")
    assert apply(ids, mask, Limits(8, "drop")) == ([], [], "over_length")
    assert apply(ids, mask, Limits(6, "truncate")) == ([], [], "too_few_loss_tokens")
    assert apply(ids, mask, Limits(None, min_loss_tokens=5))[2] == "too_few_loss_tokens"
    assert apply(ids, mask, Limits())[0] == ids


def test_truncated_rows_and_the_frequencies_count_nothing_beyond_the_limit(tmp_path) -> None:
    rng = random.Random(11)
    rows = conversations("a", 60, 2, rng)
    out = write_run(tmp_path / "out", {"a": rows})
    limit = 24
    summary = export(out, tmp_path / "x", ["specforge", "speculators"],
                     limits=Limits(limit, "truncate", 1), vocab=Vocab(VOCAB, 64))
    written = jsonl(tmp_path / "x" / "a" / "specforge.jsonl")
    assert written and all(len(r["input_ids"]) <= limit for r in written)
    expect = np.zeros(VOCAB, dtype=np.int64)
    for r in rows:
        ids, mask = (r.prompt_ids + r.output_ids)[:limit], \
            ([0] * len(r.prompt_ids) + [1] * len(r.output_ids))[:limit]
        kept = [i for i, m in zip(ids, mask, strict=True) if m]
        if kept:
            np.add.at(expect, kept, 1)
    assert np.array_equal(np.load(tmp_path / "x" / "token_freq.npy"), expect)
    st = summary["categories"]["a"]
    assert st["loss_tokens"] == int(expect.sum()) == sum(sum(r["loss_mask"]) for r in written)
    assert st["rows"] + st["dropped_too_few_loss_tokens"] == len(rows)
    assert st["truncated_to_limit"] > 0 and st["dropped_too_few_loss_tokens"] > 0
    summary = export(out, tmp_path / "d", ["specforge"], limits=Limits(limit, "drop"))
    assert summary["categories"]["a"]["dropped_over_length"] == sum(
        1 for r in rows if len(r.prompt_ids) + len(r.output_ids) > limit)


# -- the draft vocabulary ---------------------------------------------------------------------

def test_export_writes_the_vocabulary_per_category_and_merged_with_a_coverage_table(
        tmp_path) -> None:
    rng = random.Random(2)
    rows = {"a": conversations("a", 30, 2, rng), "b": conversations("b", 30, 1, rng)}
    out = write_run(tmp_path / "out", rows)
    summary = export(out, tmp_path / "x", ["specforge"], vocab=Vocab(VOCAB, 100))
    a = np.load(tmp_path / "x" / "a" / "token_freq.npy")
    b = np.load(tmp_path / "x" / "b" / "token_freq.npy")
    merged = np.load(tmp_path / "x" / "token_freq.npy")
    assert np.array_equal(a + b, merged)
    d2t = np.load(tmp_path / "x" / "d2t-100.npy")
    t2d = np.load(tmp_path / "x" / "t2d-100.npy")
    assert d2t.shape == (100,) and t2d.shape == (VOCAB,) and int(t2d.sum()) == 100
    assert np.array_equal(d2t, mapping(merged, 100)[0])
    cover = summary["vocab"]["coverage"]
    assert set(cover) == {"a", "b", "merged"} and cover["merged"]["16384"] == 1.0
    manifest = json.loads((tmp_path / "x" / "export-manifest.json").read_text())
    assert manifest["vocab"]["draft_vocab_size"] == 100 and manifest["limits"]


def test_the_eval_side_is_not_counted_in_the_vocabulary(tmp_path) -> None:
    rng = random.Random(9)
    rows = conversations("a", 100, 1, rng)
    out = write_run(tmp_path / "out", {"a": rows})
    export(out, tmp_path / "x", ["specforge"], eval_fraction=0.3, vocab=Vocab(VOCAB, 64))
    train = jsonl(tmp_path / "x" / "a" / "specforge.jsonl")
    expect = np.zeros(VOCAB, dtype=np.int64)
    for r in train:
        np.add.at(expect, [i for i, m in zip(r["input_ids"], r["loss_mask"], strict=True)
                           if m], 1)
    assert np.array_equal(np.load(tmp_path / "x" / "a" / "token_freq.npy"), expect)


# -- speculators' layout ----------------------------------------------------------------------

def test_the_speculators_folder_is_a_saved_dataset_with_ids_in_order(tmp_path) -> None:
    rng = random.Random(4)
    rows = conversations("a", 20, 2, rng)
    out = write_run(tmp_path / "out", {"a": rows})
    export(out, tmp_path / "x", ["specforge", "speculators"], merged=True,
           eval_fraction=0.25, vocab=Vocab(VOCAB, 64))
    folder = tmp_path / "x" / "speculators"
    state = json.loads((folder / "state.json").read_text())
    assert state["_format_type"] == "torch"
    with (folder / state["_data_files"][0]["filename"]).open("rb") as f:
        table = pa.ipc.open_stream(f).read_all()
    sf = jsonl(tmp_path / "x" / "specforge.jsonl")
    assert table.column("id").to_pylist() == [r["id"] for r in sf]  # the same rows, in order
    assert table.column("input_ids").to_pylist() == [r["input_ids"] for r in sf]
    assert table.column("seq_len").to_pylist() == [len(r["input_ids"]) for r in sf]
    assert table.schema.field("input_ids").type == pa.list_(pa.int64())
    assert (folder / "d2t-64.npy").is_file() and (folder / "token_freq.npy").is_file()
    assert (tmp_path / "x" / "speculators.eval" / "state.json").is_file()


def test_the_export_command_takes_the_options_and_says_what_it_left_out(tmp_path) -> None:
    rng = random.Random(8)
    out = write_run(tmp_path / "out", {"a": conversations("a", 40, 2, rng)})
    res = CliRunner().invoke(export_cmd, [
        "--out", str(out), "--dest", str(tmp_path / "x"), "--format", "specforge",
        "--eval-fraction", "0.1", "--max-length", "16", "--over-length", "drop",
        "--target-vocab-size", str(VOCAB), "--draft-vocab-size", "32"])
    assert res.exit_code == 0, res.output
    assert "left out at --max-length 16" in res.stderr
    assert "draft vocabulary 32 of 512 ids" in res.stdout
    assert (tmp_path / "x" / "d2t-32.npy").is_file()
    res = CliRunner().invoke(export_cmd, ["--out", str(out), "--dest", str(tmp_path / "y"),
                                          "--eval-fraction", "1.5"])
    assert res.exit_code == 2 and "Traceback" not in res.output
