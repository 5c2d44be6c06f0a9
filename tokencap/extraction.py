"""The hidden-state stage: the target's hidden states of every training row of a finished
generation run, extracted once per row by a vLLM server (`extract_hidden_states`), checked,
kept in a file named by the row, under a byte budget per category. Its home: what the stage
is (its rows, its run, its disk plan and the lines that say it, `plan_summary` for
`--plan`), and its one way in and out for the runner (`prepare`, `finish`); the one stage
runner runs it (`tokencap/stack/stage.py`: `run_hidden_states`).

- Its source per category is `<hidden_states.output_dir>/<category>/rows.jsonl`
  (`foundation.outputs.rows_file`): one `StatesRow` (`id`: the training row, `input_ids`:
  prompt + output) for every training row of the generation output
  (`foundation.outputs.training_rows`, what `export` writes), written once when the stage
  first runs (frozen: the stage's sample ids are its line numbers).
- It is the run `<run>.hs` (`stage_config`), fed, admitted, sent once, committed and written
  by the same producer, ledger, workers and writer as generation (`RunConfig.stage =
  "hidden_states"`: the workers ask the extraction server and keep a checked file per row,
  `consumers/extract.py`; the files' layout is `foundation.outputs.states_file`).
- Its budget per category is bytes (`hidden_states.max_bytes`), a token cap at the stage's
  bytes per token (`StatesSpec.bytes_per_token`): the ledger counts each row's tokens, so a
  category closes where the byte budget is reached, the way a token cap closes one.
- Disk as a budget: `disk_plan` gives the bytes per category (the rows' tokens, up to each
  budget); `check_disk` refuses a stage whose bytes still to write exceed the free space of
  the output folder (`DiskFull`). `--plan` prints the plan and writes nothing.
- Its end (`finish`): each ended category's manifest, written last
  (`<hidden_states.output_dir>/<category>/manifest.json`, `foundation.states_manifest`):
  every kept file with its bytes and CRC32s, what `tokencap verify` and the export check.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import msgspec

from foundation import hsfile, states_manifest
from foundation.config import UNCAPPED, Category, RunConfig, SamplingParams, StatesSpec
from foundation.engine.api import parse_urls
from foundation.errors import DiskFull, TokencapError
from foundation.outputs import (
    BadLine,
    StatesRow,
    category_dir,
    read_committed,
    read_dead_letters,
    rows_file,
    states_dir,
    training_rows,
)
from foundation.units import size_text
from foundation.wire import Outcome

if TYPE_CHECKING:
    from budget_service.telemetry import RunStatus

log = logging.getLogger(__name__)

EXTRACT_URL_ENV = "TOKENCAP_EXTRACT_URL"
STAGE_SUFFIX = ".hs"  # the stage's run is `<run>.hs`
STATES_PREFIX = "hs-"  # its processes' names beside a stack's


class CategoryPlan(NamedTuple):
    rows: int
    tokens: int  # of the rows the budget takes
    bytes: int
    budget: int | None  # bytes; None: none


class StatesStage(NamedTuple):
    """A config's hidden-state stage, resolved once (`of`): what every step here reads."""

    cfg: RunConfig
    spec: StatesSpec
    bytes_per_token: int
    budgets: dict[str, int | None]  # bytes per category; None: no budget

    @classmethod
    def of(cls, cfg: RunConfig) -> StatesStage:
        spec = cfg.states()
        return cls(cfg, spec, spec.bytes_per_token,
                   {c.name: spec.budget_for(c.name) for c in cfg.category})


def extract_url(stage: StatesStage, given: str | None = None) -> str:
    """The extraction servers in SGLANG_URL's form (comma separated): `given` (a flag), else
    TOKENCAP_EXTRACT_URL, else the config's `hidden_states.engine_url` ("": none named)."""
    return given or os.environ.get(EXTRACT_URL_ENV) or stage.spec.engine_url or ""


def extract_urls(stage: StatesStage, given: str | None = None) -> list[str]:
    """`extract_url`, one URL each."""
    return parse_urls(extract_url(stage, given))


class RowTokens(NamedTuple):
    """A category's training rows on disk: how many, their tokens (prompt + output: what the
    stage extracts states of), their output tokens, and the samples already final (rows,
    replies the gate kept out, dead letters: what a plan counts as done)."""

    rows: int
    tokens: int
    output: int
    final: int

    @property
    def ratio(self) -> float | None:
        """Row tokens per output token, measured (None when nothing is written)."""
        return self.tokens / self.output if self.output else None


def rows_on_disk(stage: StatesStage) -> dict[str, RowTokens]:
    """Per category, its training rows on disk (`RowTokens`): the rows file's when a stage
    wrote one, else the training rows it would write. Writes nothing."""
    out = {}
    decoder = msgspec.json.Decoder(StatesRow)
    for name in stage.budgets:
        cat_dir = category_dir(Path(stage.cfg.output_dir), name)
        rows = list(training_rows(cat_dir))
        output = sum(len(r.output_ids) for r in rows)
        final = sum(1 for _ in read_committed(cat_dir)) + sum(
            1 for d in read_dead_letters(cat_dir)
            if isinstance(d, BadLine) or d.outcome != Outcome.CUT)
        path = rows_file(stage.spec.output_dir, name)
        if path.is_file():
            lengths = [len(decoder.decode(line).input_ids)
                       for line in path.read_bytes().splitlines() if line.strip()]
        else:
            lengths = [len(r.prompt_ids) + len(r.output_ids) for r in rows]
        out[name] = RowTokens(len(lengths), sum(lengths), output, final)
    return out


def row_token_plan(stage: StatesStage, planned: dict[str, tuple[int, float, float]]
                   ) -> tuple[dict[str, tuple[int, int]], dict[str, str]]:
    """The rows and row tokens the stage will extract per category: those on disk, plus
    for each sample a generation plan still expects (`planned`: its samples, mean output
    tokens and mean prompt tokens per sample) as many row tokens as its output times the
    row tokens per output token measured on disk, else assumed (prompt + output of a first
    turn: a later turn carries its conversation's history, which the measure counts once
    rows exist). Returns that, and per category how the ratio was found. `plan` and
    `hidden-states --plan` both price the states so: one figure for one question."""
    disk = rows_on_disk(stage)
    out, how = {}, {}
    for name, m in disk.items():
        samples, output, prompt = planned.get(name, (0, 0.0, 0.0))
        todo = max(0, samples - m.final)
        ratio = m.ratio if m.ratio is not None else (output + prompt) / output if output else 1.0
        how[name] = (f"{ratio:.2f} row tokens per output token, "
                     + ("measured" if m.ratio is not None else "assumed: prompt + output"))
        out[name] = (m.rows + todo, m.tokens + round(todo * output * ratio))
    return out, how


def write_rows(stage: StatesStage) -> dict[str, Path]:
    """Each category's rows file, written once (an existing one is the stage's source as
    it is: its line numbers are the stage's sample ids)."""
    out = {}
    for name in stage.budgets:
        path = rows_file(stage.spec.output_dir, name)
        if not path.is_file():
            rows = [StatesRow(r.id, list(r.prompt_ids) + list(r.output_ids)) for r in
                    training_rows(category_dir(Path(stage.cfg.output_dir), name))]
            hsfile.write_whole(path, b"".join(msgspec.json.encode(r) + b"\n" for r in rows))
            log.info("%s: %d training rows to extract (%s)", name, len(rows), path)
        out[name] = path
    return out


def plan_of(stage: StatesStage, row_tokens: dict[str, tuple[int, int]]
            ) -> dict[str, CategoryPlan]:
    """Per category, from its (rows, tokens of those rows): the tokens and bytes its byte
    budget takes of them."""
    bpt = stage.bytes_per_token
    out = {}
    for name, (rows, tokens) in row_tokens.items():
        budget = stage.budgets.get(name)
        if budget is not None:
            tokens = min(tokens, budget // bpt)
        out[name] = CategoryPlan(rows, tokens, tokens * bpt, budget)
    return out


def disk_plan(stage: StatesStage) -> dict[str, CategoryPlan]:
    """Per category: its rows on disk, the tokens and bytes its budget takes of them."""
    return plan_of(stage, row_token_plan(stage, {})[0])


def kept_bytes(stage: StatesStage) -> dict[str, int]:
    """Bytes of states files already kept, per category."""
    out = {}
    for name in stage.budgets:
        folder = states_dir(stage.spec.output_dir, name)
        files = folder.glob("*.safetensors") if folder.is_dir() else ()
        out[name] = sum(p.stat().st_size for p in files)
    return out


def check_disk(stage: StatesStage, plan: dict[str, CategoryPlan],
               have: dict[str, int] | None = None) -> int:
    """The bytes still to write (what the plan needs less what is already kept, `have`);
    `DiskFull` when they exceed the output folder's free space (the folder's nearest
    existing parent's: nothing is made here)."""
    need = sum(p.bytes for p in plan.values()) - sum((have or {}).values())
    folder = Path(stage.spec.output_dir)
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if need > free:
        raise DiskFull(f"the hidden states need {need / 1e9:,.2f} GB more in {folder}, which "
                       f"has {free / 1e9:,.2f} GB free: lower hidden_states.max_bytes, or "
                       "point output_dir at a larger disk")
    return need


def plan_lines(stage: StatesStage, plan: dict[str, CategoryPlan]) -> list[str]:
    """The plan for people: bytes per token, then per category and in all."""
    spec = stage.spec
    lines = [f"hidden states: layers {list(spec.layers)} of {spec.num_layers}, hidden size "
             f"{spec.hidden_size}, {spec.dtype}: {stage.bytes_per_token:,} bytes per token"]
    for name, p in plan.items():
        cap = "no byte budget" if p.budget is None else f"budget {size_text(p.budget)}"
        lines.append(f"  {name}: {p.rows:,} rows, {p.tokens:,} tokens -> "
                     f"{size_text(p.bytes)} ({cap})")
    total = sum(p.bytes for p in plan.values())
    lines.append(f"  in all: {size_text(total)} in {spec.output_dir}")
    return lines


def stage_config(stage: StatesStage, sources: dict[str, Path]) -> RunConfig:
    """The run `<run>.hs` that extracts the config's rows (module docstring)."""
    cfg, bpt = stage.cfg, stage.bytes_per_token
    cats = [Category(name=name, source=str(sources[name]), format="input_ids",
                     sampling=SamplingParams(max_new_tokens=1, temperature=0.0),
                     cap_tokens=UNCAPPED if budget is None else budget // bpt,
                     expected_tokens=1)
            for name, budget in stage.budgets.items()]
    return RunConfig(
        run=cfg.run + STAGE_SUFFIX, output_dir=stage.spec.output_dir, count="total",
        reply_gate=False, sampling_defaults="engine", key_prefix=cfg.key_prefix,
        stage="hidden_states", hidden_states=cfg.hidden_states, cap_tokens=UNCAPPED,
        seed=cfg.seed, expected_tokens=1, lease_s=cfg.lease_s, heartbeat_s=cfg.heartbeat_s,
        max_attempts=cfg.max_attempts, lock_ttl_s=cfg.lock_ttl_s,
        connect_timeout_s=cfg.connect_timeout_s, read_timeout_s=cfg.read_timeout_s,
        http_retries=cfg.http_retries, backoff_max_s=cfg.backoff_max_s,
        preflight_wait_s=cfg.preflight_wait_s, max_unwritten=cfg.max_unwritten,
        high_water=cfg.high_water, affinity=cfg.affinity, category=cats)


def plan_summary(cfg: RunConfig) -> str:
    """`hidden-states --plan`: the plan, checked against the free disk (`DiskFull` when it
    does not fit). Writes nothing."""
    stage = StatesStage.of(cfg)
    plan = disk_plan(stage)
    need = check_disk(stage, plan, kept_bytes(stage))
    return "\n".join([*plan_lines(stage, plan),
                      f"  still to write: {size_text(need)}: fits the free space"])


class Prepared(NamedTuple):
    """A stage ready to run: its run config (`<run>.hs`) and its extraction servers."""

    stage: StatesStage
    run: RunConfig
    engines: str  # SGLANG_URL's form


def prepare(cfg: RunConfig, given_url: str | None = None,
            say: Callable[[str], None] = print) -> Prepared:
    """The stage's one way in for its runner: the extraction servers named (`extract_url`),
    the plan said and checked against the disk, the rows files written once, the stage's
    run config. Nothing is written when a check refuses."""
    stage = StatesStage.of(cfg)
    engines = extract_url(stage, given_url)
    if not engines:
        raise TokencapError("no extraction server: pass --extract-url, set "
                            f"{EXTRACT_URL_ENV} or hidden_states.engine_url")
    plan = disk_plan(stage)
    for line in plan_lines(stage, plan):  # said before a refusal, which it explains
        say(line)
    check_disk(stage, plan, kept_bytes(stage))
    return Prepared(stage, stage_config(stage, write_rows(stage)), engines)


def finished(ready: Prepared, status: RunStatus) -> bool:
    """Whether the stage has nothing to ask (`status`: its run's, read from Redis): its run
    exists, every category ended and wrote everything, and none has rows it has not taken
    (its rows file grown since: a cap raised, a run resumed) unless its byte budget closed
    it. Then a rerun asks the engine for nothing, not even its probe."""
    if not status.ended:
        return False
    for name in ready.stage.budgets:
        st = status.categories.get(name)
        if st is None or not st.ended:
            return False
        if st.state != "closed" and st.samples + st.failed + st.rejected < _lines(
                rows_file(ready.stage.spec.output_dir, name)):
            return False
    return True


def _lines(path: Path) -> int:
    if not path.is_file():
        return 0
    with path.open("rb") as f:
        return sum(1 for line in f if line.strip())


def sweep_engine_files(stage: StatesStage, folders: Iterable[str]) -> int:
    """The engine's files (and locks) that attempts of the stage's run left in the
    extraction servers' `folders` (a worker killed between the engine's write and its keep):
    removed. Call it only when no worker of the stage works. Returns how many."""
    marker = hsfile.run_marker(stage.cfg.run + STAGE_SUFFIX)
    removed = 0
    for folder in {f for f in folders if f}:
        for path in hsfile.engine_files(folder, marker):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed += 1
    if removed:
        log.info("removed %d engine file(s) and lock(s) left by killed workers", removed)
    return removed


def finish(stage: StatesStage, ended: Iterable[str] = ()) -> int:
    """After every row is done and the stage's workers are stopped: remove the temporary
    files a worker killed mid-write left (its row was then done by another attempt), then
    write the manifest of each category in `ended` (the categories whose state the stage
    ended in: `CategoryState.ended`), last (`write_manifest`). Returns how many temporaries
    were removed."""
    removed = sum(hsfile.remove_folder_temps(states_dir(stage.spec.output_dir, name))
                  for name in stage.budgets)
    if removed:
        log.info("removed %d temporary file(s) left by killed workers", removed)
    for name in ended:
        if name in stage.budgets:
            write_manifest(stage, name)
    return removed


def write_manifest(stage: StatesStage, name: str) -> Path:
    """The category's manifest (`foundation.states_manifest`): one entry per file its stage's
    committed result rows name, with the CRC32s a row of an earlier version does not give
    (taken from the manifest an earlier end wrote, else read from the file once). A line
    that is not a result row, or whose `hidden_states` is no file's description, is logged
    and left out: `tokencap verify` then names its file as extra. Returns its path."""
    root = stage.spec.output_dir
    earlier: dict[str, states_manifest.StatesFile] = {}
    path = states_manifest.manifest_path(root, name)
    if path.is_file():
        try:
            earlier = states_manifest.read(path, name).by_file()
        except states_manifest.ManifestError as exc:
            log.warning("%s: the earlier manifest is not read (%s): written anew", name, exc)
    entries = []
    for item in read_committed(category_dir(Path(root), name)):
        if isinstance(item, BadLine):
            log.warning("%s: %s: not a result row (%s): its states file stays out of the "
                        "manifest", name, item.where, item.error)
            continue
        try:
            entry = states_manifest.from_result(item)
        except states_manifest.ManifestError as exc:
            log.warning("%s: %s: its states file stays out of the manifest", name, exc)
            continue
        if entry is not None:
            entries.append(states_manifest.complete(
                root, entry, earlier.get(os.path.normpath(entry.file))))
    written = states_manifest.write(root, name, stage.cfg.run + STAGE_SUFFIX, entries)
    log.info("%s: manifest of %d states files written (%s)", name, len(entries), written)
    return written
