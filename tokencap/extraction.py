"""The stage that extracts hidden states: the run `<run>.hs` whose samples are the kept
training rows of a finished generation run, fed, admitted, sent once, committed and written
by the same producer, ledger, workers and writer as generation (`RunConfig.stage =
"hidden_states"`: the workers ask the extraction server and keep a checked file per row,
`consumers/extract.py`).

- Its source per category is `<hidden_states.output_dir>/<category>/rows.jsonl`, `{"id": the
  row's id, "input_ids": prompt + output}` for every training row of the generation output
  (the rows export writes: truncated replies and the turns after them left out), written once
  (frozen: the stage's sample ids are its line numbers; rows generated later need another
  output_dir).
- Its budget per category is bytes (`hidden_states.max_bytes`), a token cap at the run's
  bytes per token (`foundation.hsfile.bytes_per_token`): the ledger counts each row's tokens,
  so a category closes where the byte budget is reached, the way a token cap closes one.
- Disk as a budget: `disk_plan` gives the bytes per category (the rows' tokens, up to each
  budget) and refuses a stage whose total exceeds the free space of the output folder.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import NamedTuple

import msgspec

from foundation import hsfile
from foundation.config import Category, HiddenStates, RunConfig, SamplingParams
from foundation.errors import ConfigError, TokencapError
from foundation.outputs import (
    TRUNCATED,
    BadLine,
    after_truncation,
    category_dir,
    read_results,
    truncated_turns,
)

log = logging.getLogger(__name__)

ROWS_FILE = "rows.jsonl"
STAGE_SUFFIX = ".hs"


class DiskFull(TokencapError):
    """The stage's files would not fit the free space of its output folder."""


class CategoryPlan(NamedTuple):
    rows: int
    tokens: int  # of the rows the budget takes
    bytes: int
    budget: int | None  # bytes; None: none


def spec(cfg: RunConfig) -> HiddenStates:
    if cfg.hidden_states is None:
        raise ConfigError("$.hidden_states", "the config has no [hidden_states] section (the "
                          "extraction server, layers, output folder and byte budgets: "
                          "docs/HIDDEN_STATES.md)")
    return cfg.hidden_states


def bytes_per_token(hs: HiddenStates) -> int:
    return hsfile.bytes_per_token(len(hs.layers or ()), int(hs.hidden_size or 0),
                                  hs.dtype or "bfloat16")


def training_rows(cfg: RunConfig, category: str) -> list[tuple[str, list[int]]]:
    """(row id, prompt + output ids) of every training row of a category's output, in
    written order: what `export` writes (a reply cut at max_new_tokens, and the later turns
    of its conversation, left out)."""
    cat_dir = category_dir(Path(cfg.output_dir), category)
    cut = truncated_turns(cat_dir)
    rows, seen = [], set()
    for it in read_results(cat_dir):
        if isinstance(it, BadLine) or it.id in seen or it.finish_reason == TRUNCATED \
                or after_truncation(it, cut):
            continue
        seen.add(it.id)
        rows.append((it.id, list(it.prompt_ids) + list(it.output_ids)))
    return rows


def rows_file(hs: HiddenStates, category: str) -> Path:
    return Path(hs.output_dir) / category / ROWS_FILE


def write_rows(cfg: RunConfig) -> dict[str, Path]:
    """Each category's rows file, written once (an existing one is the stage's source as
    it is: its line numbers are the stage's sample ids)."""
    hs = spec(cfg)
    out = {}
    for cat in cfg.category:
        path = rows_file(hs, cat.name)
        if not path.is_file():
            rows = training_rows(cfg, cat.name)
            hsfile.write_whole(path, b"".join(
                msgspec.json.encode({"id": row_id, "input_ids": ids}) + b"\n"
                for row_id, ids in rows))
            log.info("%s: %d training rows to extract (%s)", cat.name, len(rows), path)
        out[cat.name] = path
    return out


def disk_plan(cfg: RunConfig, sources: dict[str, Path]) -> dict[str, CategoryPlan]:
    """Per category: its rows, the tokens and bytes its budget takes of them."""
    hs = spec(cfg)
    bpt = bytes_per_token(hs)
    plan = {}
    for name, path in sources.items():
        lengths = [len(json.loads(line)["input_ids"]) for line in
                   path.read_text().splitlines() if line.strip()]
        budget = hs.budget_for(name)
        tokens = sum(lengths)
        if budget is not None:
            tokens = min(tokens, budget // bpt)
        plan[name] = CategoryPlan(len(lengths), tokens, tokens * bpt, budget)
    return plan


def estimate(cfg: RunConfig, row_tokens: dict[str, tuple[int, int]]) -> dict[str, CategoryPlan]:
    """Per category, from the plan's (rows, tokens of rows) before any is generated: the
    tokens and bytes its budget takes."""
    hs = spec(cfg)
    bpt = bytes_per_token(hs)
    out = {}
    for name, (rows, tokens) in row_tokens.items():
        budget = hs.budget_for(name)
        if budget is not None:
            tokens = min(tokens, budget // bpt)
        out[name] = CategoryPlan(rows, tokens, tokens * bpt, budget)
    return out


def check_disk(hs: HiddenStates, plan: dict[str, CategoryPlan],
               have: dict[str, int] | None = None) -> int:
    """The bytes still to write (what the plan needs less what is already kept, `have`);
    `DiskFull` when they exceed the output folder's free space."""
    need = sum(p.bytes for p in plan.values()) - sum((have or {}).values())
    folder = Path(hs.output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    if need > free:
        raise DiskFull(f"the hidden states need {need / 1e9:,.2f} GB more in {folder}, which "
                       f"has {free / 1e9:,.2f} GB free: lower hidden_states.max_bytes, or "
                       "point output_dir at a larger disk")
    return need


def stage_config(cfg: RunConfig, sources: dict[str, Path]) -> RunConfig:
    """The run `<run>.hs` that extracts `cfg`'s rows (module docstring)."""
    hs = spec(cfg)
    bpt = bytes_per_token(hs)
    cats = []
    for c in cfg.category:
        budget = hs.budget_for(c.name)
        cats.append(Category(
            name=c.name, source=str(sources[c.name]), format="input_ids",
            sampling=SamplingParams(max_new_tokens=1, temperature=0.0),
            cap_tokens="none" if budget is None else budget // bpt, expected_tokens=1))
    return RunConfig(
        run=cfg.run + STAGE_SUFFIX, output_dir=hs.output_dir, count="total", reply_gate=False,
        sampling_defaults="engine", key_prefix=cfg.key_prefix, stage="hidden_states",
        hidden_states=hs, cap_tokens="none", seed=cfg.seed, expected_tokens=1,
        lease_s=cfg.lease_s, heartbeat_s=cfg.heartbeat_s, max_attempts=cfg.max_attempts,
        lock_ttl_s=cfg.lock_ttl_s, connect_timeout_s=cfg.connect_timeout_s,
        read_timeout_s=cfg.read_timeout_s, http_retries=cfg.http_retries,
        backoff_max_s=cfg.backoff_max_s, preflight_wait_s=cfg.preflight_wait_s,
        max_unwritten=cfg.max_unwritten, high_water=cfg.high_water, affinity=cfg.affinity,
        category=cats)
