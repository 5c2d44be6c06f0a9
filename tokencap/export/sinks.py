"""The export's files and rows: each file written under a temporary name and published by a
rename (`tokencap.export`), the training row of a result (`TrainingRow`: SpecForge's
``{id, input_ids, loss_mask}``), the sinks of the token formats (SpecForge JSONL, Parquet,
speculators' on-disk dataset), the per-category counts."""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import msgspec

from foundation.errors import TokencapError
from foundation.wire import Result

log = logging.getLogger(__name__)


PARQUET_ROW_GROUP_ROWS = 1024  # rows buffered before a Parquet row group is written


class SpecforgeRow(msgspec.Struct):
    """SpecForge's pre-tokenized row: loss on exactly the generated tokens."""

    id: str
    input_ids: list[int]
    loss_mask: list[int]


class TrainingRow(NamedTuple):
    """One row of the token formats, within the export's length limit, and its result."""

    id: str
    input_ids: list[int]
    loss_mask: list[int]
    result: Result


@dataclass
class CategoryStats:
    """Per-category counts of one export. `tokens` counts input_ids, `output_tokens` the
    supervised ones (loss_mask 1)."""

    rows: int = 0
    tokens: int = 0
    output_tokens: int = 0
    dropped_truncated: int = 0
    dropped_after_truncated: int = 0
    dropped_inconsistent: int = 0
    dropped_tool_args: int = 0
    # an export with hidden states: rows the stage kept no states file for, and rows whose
    # file disagrees with its category's manifest, left out (--skip-bad-states)
    dropped_no_states: int = 0
    dropped_bad_states: int = 0
    duplicates: int = 0
    bad_lines: int = 0
    conversations: int = 0
    conversations_complete: int = 0
    conversations_in_progress: int = 0
    # the length limit (token formats) and the split
    truncated_to_limit: int = 0
    dropped_over_length: int = 0
    dropped_too_few_loss_tokens: int = 0
    loss_tokens: int = 0  # loss-masked tokens written, within the limit
    eval_rows: int = 0
    eval_tokens: int = 0
    # rows left out by `--mode` (made in another mode)
    other_modes: int = 0
    bad: list[dict] = field(default_factory=list)
    made_by: list[str] = field(default_factory=list)  # the manifests its rows name
    # rows, tokens and output tokens written per decode mode (rows made in one)
    modes: dict[str, dict[str, int]] = field(default_factory=dict)

    def count_mode(self, mode: str, tokens: int, output_tokens: int) -> None:
        """One row of `mode` written, of `tokens` input ids and `output_tokens` generated."""
        m = self.modes.setdefault(mode, {"rows": 0, "tokens": 0, "output_tokens": 0})
        m["rows"] += 1
        m["tokens"] += tokens
        m["output_tokens"] += output_tokens

    def add(self, other: CategoryStats) -> None:
        self.made_by = sorted({*self.made_by, *other.made_by})
        for mode, m in other.modes.items():
            mine = self.modes.setdefault(mode, {"rows": 0, "tokens": 0, "output_tokens": 0})
            for k, v in m.items():
                mine[k] += v
        for name in ("rows", "tokens", "output_tokens", "dropped_truncated",
                     "dropped_after_truncated", "dropped_inconsistent", "dropped_tool_args",
                     "dropped_no_states", "dropped_bad_states", "duplicates",
                     "bad_lines", "conversations", "conversations_complete",
                     "conversations_in_progress", "truncated_to_limit",
                     "dropped_over_length", "dropped_too_few_loss_tokens", "loss_tokens",
                     "eval_rows", "eval_tokens", "other_modes"):
            setattr(self, name, getattr(self, name) + getattr(other, name))


class TmpFile:
    """A file written under a temporary name; `publish` renames it over `path`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        path.parent.mkdir(parents=True, exist_ok=True)

    def publish(self) -> None:
        os.replace(self.tmp, self.path)

    def discard(self) -> None:
        self.tmp.unlink(missing_ok=True)


class ExportError(TokencapError):
    """The export cannot start: no output folder, no categories, unknown format, a format
    whose library is missing."""


class TmpDir:
    """A folder written under a temporary name; `publish` swaps it in over `path` (an
    earlier export's folder replaced whole), `discard` removes it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        if self.tmp.exists():
            shutil.rmtree(self.tmp)
        self.tmp.mkdir(parents=True)

    @property
    def folder(self) -> Path:
        """Where the folder's files go before `publish`."""
        return self.tmp

    def finish(self) -> None:
        """Everything written is on disk (each file was fsynced, or is a link)."""

    def publish(self) -> None:
        if self.path.exists():
            old = self.path.with_name(f".{self.path.name}.old-{os.getpid()}")
            os.replace(self.path, old)
            os.replace(self.tmp, self.path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(self.tmp, self.path)

    def discard(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


def fsync_path(path: Path) -> None:
    with path.open("rb") as f:
        os.fsync(f.fileno())


class JsonlFile(TmpFile):
    """One JSON document a line, fsynced before it is published."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self._enc = msgspec.json.Encoder()
        self._f = self.tmp.open("wb")

    def _write(self, doc: Any) -> None:
        self._f.write(self._enc.encode(doc) + b"\n")

    def finish(self) -> None:
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()

    def discard(self) -> None:
        self._f.close()
        super().discard()


class JsonlSink(JsonlFile):
    """Writes one JSON line per row, made by `make_row(row, row_id)`."""

    def __init__(self, path: Path, make_row: Callable[[Result, str], Any]) -> None:
        super().__init__(path)
        self.make_row = make_row

    def write(self, row: Result, row_id: str) -> None:
        self._write(self.make_row(row, row_id))


class SpecforgeSink(JsonlFile):
    """SpecForge's pre-tokenized JSONL: one ``{"id", "input_ids", "loss_mask"}`` a line."""

    def write_row(self, row: TrainingRow) -> None:
        self._write(SpecforgeRow(row.id, row.input_ids, row.loss_mask))


class ParquetSink(TmpFile):
    """Writes SpecForge rows plus category, finish_reason and counted_tokens to Parquet."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        import pyarrow as pa
        import pyarrow.parquet as pq

        self._pa = pa
        self.schema = pa.schema([
            ("id", pa.string()),
            ("category", pa.string()),
            ("input_ids", pa.list_(pa.int32())),
            ("loss_mask", pa.list_(pa.int32())),
            ("finish_reason", pa.string()),
            ("counted_tokens", pa.int64()),
        ])
        self._writer = pq.ParquetWriter(str(self.tmp), self.schema)
        self._rows: dict[str, list] = {name: [] for name in self.schema.names}

    def write_row(self, row: TrainingRow) -> None:
        res = row.result
        for name, value in (("id", row.id), ("category", res.category),
                            ("input_ids", row.input_ids), ("loss_mask", row.loss_mask),
                            ("finish_reason", res.finish_reason),
                            ("counted_tokens", res.counted_tokens)):
            self._rows[name].append(value)
        if len(self._rows["id"]) >= PARQUET_ROW_GROUP_ROWS:
            self._flush()

    def _flush(self) -> None:
        if self._rows["id"]:
            self._writer.write_table(self._pa.table(self._rows, schema=self.schema))
            self._rows = {name: [] for name in self.schema.names}

    def finish(self) -> None:
        self._flush()
        self._writer.close()
        fsync_path(self.tmp)

    def discard(self) -> None:
        self._writer.close()
        super().discard()


def specforge_row(row: Result, row_id: str, loss_mask: str = "generated") -> SpecforgeRow:
    """``input_ids = prompt + output``; loss 0 over the prompt, 1 over every generated
    token (reasoning and end-of-turn tokens included): `loss_mask` "generated". "shifted" moves
    that span one position left, for a trainer that shifts the ids and targets by one but not
    the mask (SpecForge at a6b6b02, issue #885): each supervised position then predicts a
    generated token."""
    n_prompt, n_out = len(row.prompt_ids), len(row.output_ids)
    if loss_mask == "shifted" and n_prompt:
        mask = [0] * (n_prompt - 1) + [1] * n_out + [0]
    else:
        mask = [0] * n_prompt + [1] * n_out
    return SpecforgeRow(id=row_id, input_ids=row.prompt_ids + row.output_ids, loss_mask=mask)


SPECULATORS_SHARD = "data-00000-of-00001.arrow"
# speculators' rows keep what made them under `metadata` (its regeneration writes
# `metadata.sampling_params`, the params each request was sent with: its PR #1037); here the
# params as sent to the engine (`Result.sampling`: SGLang's names), typed as
# `foundation.config.SamplingParams` types them; `stop` always a list, `logit_bias` and the
# chat-template kwargs (any values) as JSON text
_SAMPLING_TYPES = {
    "max_new_tokens": "int64", "temperature": "float64", "top_p": "float64", "top_k": "int64",
    "min_p": "float64", "frequency_penalty": "float64", "presence_penalty": "float64",
    "repetition_penalty": "float64", "min_new_tokens": "int64", "stop": "list<string>",
    "stop_token_ids": "list<int64>", "ignore_eos": "bool", "skip_special_tokens": "bool",
    "no_stop_trim": "bool", "sampling_seed": "int64", "logit_bias": "string",
}


def metadata_type(pa: Any) -> Any:
    """The Arrow type of speculators' `metadata` column."""
    def one(t: str) -> Any:
        if t.startswith("list<"):
            return pa.list_(one(t[5:-1]))
        return {"int64": pa.int64(), "float64": pa.float64(), "bool": pa.bool_(),
                "string": pa.string()}[t]

    sampling = pa.struct([(k, one(t)) for k, t in _SAMPLING_TYPES.items()])
    return pa.struct([("mode", pa.string()), ("finish_reason", pa.string()),
                      ("sampling_params", sampling), ("chat_template_kwargs", pa.string())])


def metadata_features() -> dict[str, Any]:
    """`metadata_type` as `datasets` writes its features (dataset_info.json)."""
    def one(t: str) -> dict[str, Any]:
        if t.startswith("list<"):
            return {"feature": one(t[5:-1]), "_type": "List"}
        return {"dtype": t, "_type": "Value"}

    return {"mode": one("string"), "finish_reason": one("string"),
            "sampling_params": {k: one(t) for k, t in _SAMPLING_TYPES.items()},
            "chat_template_kwargs": one("string")}


def row_metadata(row: Result) -> dict[str, Any]:
    """A row's `metadata`: its mode, finish reason, sampling params and template kwargs."""
    sampling: dict[str, Any] = {k: None for k in _SAMPLING_TYPES}
    for k, v in (row.sampling or {}).items():
        if k not in sampling:
            continue  # a key of a newer tokencap: the row file keeps it
        if k == "stop" and isinstance(v, str):
            v = [v]
        elif k == "logit_bias" and v is not None:
            v = json.dumps(v, sort_keys=True)
        sampling[k] = v
    kwargs = row.chat_template_kwargs
    return {"mode": row.mode, "finish_reason": row.finish_reason, "sampling_params": sampling,
            "chat_template_kwargs": None if kwargs is None else json.dumps(kwargs,
                                                                          sort_keys=True)}


class SpeculatorsSink(TmpDir):
    """speculators' prepared dataset, the folder its trainer reads with `--data-path`
    (`datasets.load_from_disk`, torch format): ``data-00000-of-00001.arrow`` (Arrow IPC
    stream), ``dataset_info.json`` and ``state.json`` as `Dataset.save_to_disk` writes them,
    columns ``id`` (string), ``input_ids`` and ``loss_mask`` (list<int64>), ``seq_len``
    (int64). Unlike speculators' own `prepare-data`, rows keep their ids and their order (the
    link to hidden-state files ``hs_<row index>``). The draft vocabulary's files go in the
    folder too (`tokencap.export.vocab`). Written under a temporary name, renamed over the
    folder by `publish`."""

    COLUMNS = ("id", "input_ids", "loss_mask", "seq_len", "metadata")

    def __init__(self, path: Path,
                 on_row: Callable[[Path, int, TrainingRow], None] | None = None) -> None:
        import pyarrow as pa

        super().__init__(path)
        # called with the folder, the row's index and the row (the hidden states' hs_<i>)
        self.on_row = on_row
        self._pa = pa
        self.schema = pa.schema([
            ("id", pa.string()),
            ("input_ids", pa.list_(pa.int64())),
            ("loss_mask", pa.list_(pa.int64())),
            ("seq_len", pa.int64()),
            ("metadata", metadata_type(pa)),
        ], metadata={"huggingface": json.dumps({"info": {"features": self.features()}})})
        self._f = (self.tmp / SPECULATORS_SHARD).open("wb")
        self._writer = pa.ipc.new_stream(self._f, self.schema)
        self._rows: dict[str, list] = {name: [] for name in self.COLUMNS}
        self.rows = 0

    @staticmethod
    def features() -> dict[str, Any]:
        ints = {"feature": {"dtype": "int64", "_type": "Value"}, "_type": "List"}
        return {"id": {"dtype": "string", "_type": "Value"}, "input_ids": ints,
                "loss_mask": dict(ints), "seq_len": {"dtype": "int64", "_type": "Value"},
                "metadata": metadata_features()}

    def write_row(self, row: TrainingRow) -> None:
        if self.on_row is not None:
            self.on_row(self.tmp, self.rows, row)
        for name, value in (("id", row.id), ("input_ids", row.input_ids),
                            ("loss_mask", row.loss_mask), ("seq_len", len(row.input_ids)),
                            ("metadata", row_metadata(row.result))):
            self._rows[name].append(value)
        self.rows += 1
        if len(self._rows["id"]) >= PARQUET_ROW_GROUP_ROWS:
            self._flush()

    def _flush(self) -> None:
        if self._rows["id"]:
            self._writer.write_table(self._pa.table(self._rows, schema=self.schema))
            self._rows = {name: [] for name in self.COLUMNS}

    def finish(self) -> None:
        self._flush()
        self._writer.close()
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        state: dict[str, Any] = {"_data_files": [{"filename": SPECULATORS_SHARD}],
                 "_fingerprint": os.urandom(8).hex(), "_format_columns": None,
                 "_format_kwargs": {}, "_format_type": "torch", "_output_all_columns": False,
                 "_split": None}
        info = {"citation": "", "description": "", "features": self.features(),
                "homepage": "", "license": ""}
        (self.tmp / "state.json").write_text(json.dumps(state, indent=2))
        (self.tmp / "dataset_info.json").write_text(json.dumps(info, indent=2))

    def discard(self) -> None:
        if not self._f.closed:
            self._f.close()
        super().discard()
