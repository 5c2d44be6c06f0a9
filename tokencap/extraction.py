"""The hidden-state stage: the target's hidden states of every training row of a generation
run (after it, or beside it category by category), extracted once per row by a vLLM server
(`extract_hidden_states`), checked, kept in a file named by the row, under a byte budget per
category. Its home: what the stage is (its rows and their arrival, its run, its disk plan
said and checked, `say_plan`; `say_disk_plan` for `--plan`), and its one way in and out
for the runner (`prepare`, `end`); the one stage runner runs it
(`tokencap/stack/stage.py`: `run_hidden_states`, `StatesBeside`).

- Its source per category is `<hidden_states.output_dir>/<category>/rows.jsonl`
  (`foundation.outputs.rows_file`): one `StatesRow` (`id`: the training row, `input_ids`:
  prompt + output) for every training row of the generation output
  (`foundation.outputs.training_rows`, what `export` writes). The stage's sample ids are its
  line numbers, so it only grows: each stage run appends the rows generated since the last
  (`append_rows`: a cap raised, a run resumed), and a line once written never changes.
- Its categories arrive (`Arrivals`, the producer's `Arriving`): a category's rows are
  listed, and the stage feeds it, once its generation has ended; all at once when generation
  is over (`tokencap hidden-states`), one by one as each ends when the stage runs beside
  generation (`tokencap up`), and again when a category's generation ends again with more
  rows (a raised cap). A plan counts the training rows not yet in a rows file
  (`RowTokens.missing`) and says them.
- It is the run `<run>.hs` (`stage_config`), fed, admitted, sent once, committed and written
  by the same producer, ledger, workers and writer as generation (`RunConfig.stage =
  "hidden_states"`: the workers ask the extraction server and keep a checked file per row,
  `consumers/extract.py`; the files' layout is `foundation.outputs.states_file`).
- Its budget per category is bytes (`hidden_states.max_bytes`), a token cap at the stage's
  bytes per token (`StatesSpec.bytes_per_token`): the ledger counts each row's tokens, so a
  category closes where the byte budget is reached, the way a token cap closes one.
- Disk as a budget: `disk_plan` gives the bytes per category (the rows' tokens, up to each
  budget); `check_disk` refuses a stage whose bytes still to write exceed the free space of
  the output folder less the states already kept (`DiskFull`), after the plan is said
  (`say_plan`, one way for `--plan`, the stage and `tokencap plan`). `--plan` writes
  nothing.
- Its end (`end`, through `finish`): each ended category's manifest, written last
  (`<hidden_states.output_dir>/<category>/manifest.json`, `foundation.states_manifest`):
  every kept file with its bytes and CRC32s, what `tokencap verify` and the export check.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import msgspec

from budget_service.ledger import CategoryState
from foundation import hsfile, states_manifest
from foundation.config import (
    STATES_RUN_SUFFIX,
    UNCAPPED,
    Category,
    RunConfig,
    SamplingParams,
    StatesSpec,
)
from foundation.engine.api import parse_urls
from foundation.errors import DiskFull, TokencapError
from foundation.outputs import (
    BadLine,
    StatesRow,
    category_dir,
    count_committed,
    read_committed,
    read_dead_letters,
    repair_tail,
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
STAGE_SUFFIX = STATES_RUN_SUFFIX  # the stage's run is `<run>.hs`
STATES_PREFIX = "hs-"  # its processes' names beside a stack's
ARRIVALS_EVERY_S = 0.5  # how often a stage beside generation looks at generation's states


class CategoryPlan(NamedTuple):
    rows: int
    tokens: int  # of the rows the budget takes
    bytes: int
    budget: int | None  # bytes; None: none
    missing: int = 0  # rows not in the rows file yet (`RowTokens.missing`)


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
    stage extracts states of), their output tokens, the samples already final (rows,
    replies the gate kept out, dead letters: what a plan counts as done), and of the rows
    those not yet in the category's rows file (generated since a stage ran: the next stage
    run appends them; 0 when no stage wrote one)."""

    rows: int
    tokens: int
    output: int
    final: int
    missing: int = 0

    @property
    def ratio(self) -> float | None:
        """Row tokens per output token, measured (None when nothing is written)."""
        return self.tokens / self.output if self.output else None


class _Listed(msgspec.Struct):
    """A rows file's line, its row id alone (the ids are not decoded)."""

    id: str


def _listed(path: Path, with_tokens: bool) -> dict[str, int]:
    """The rows a rows file lists: row id -> its tokens (0 unless `with_tokens`); a partial
    last line (a crash mid-append) is not a row."""
    out: dict[str, int] = {}
    if not path.is_file():
        return out
    full, ids = msgspec.json.Decoder(StatesRow), msgspec.json.Decoder(_Listed)
    with path.open("rb") as f:
        for line in f:
            if not line.endswith(b"\n") or not line.strip():
                continue
            if with_tokens:
                row = full.decode(line)
                out[row.id] = len(row.input_ids)
            else:
                out[ids.decode(line).id] = 0
    return out


def rows_on_disk(stage: StatesStage) -> dict[str, RowTokens]:
    """Per category, its training rows on disk (`RowTokens`): those its rows file lists (when
    a stage wrote one), and the training rows it does not list yet, which the next stage
    run appends (every one when there is no rows file yet). Writes nothing."""
    out = {}
    for name in stage.budgets:
        cat_dir = category_dir(Path(stage.cfg.output_dir), name)
        path = rows_file(stage.spec.output_dir, name)
        listed = _listed(path, with_tokens=True)
        output = new = new_tokens = 0
        for r in training_rows(cat_dir):  # streamed: a category's rows can be gigabytes
            output += len(r.output_ids)
            if r.id not in listed:
                new += 1
                new_tokens += len(r.prompt_ids) + len(r.output_ids)
        final = count_committed(cat_dir) + sum(
            1 for d in read_dead_letters(cat_dir)
            if isinstance(d, BadLine) or d.outcome != Outcome.CUT)
        out[name] = RowTokens(len(listed) + new, sum(listed.values()) + new_tokens, output,
                              final, new if path.is_file() else 0)
    return out


class RowPlan(NamedTuple):
    """The rows a stage will extract in a category, their tokens, and of them those not yet
    in its rows file (`RowTokens.missing`)."""

    rows: int
    tokens: int
    missing: int = 0


def row_token_plan(stage: StatesStage, planned: dict[str, tuple[int, float, float]]
                   ) -> tuple[dict[str, RowPlan], dict[str, str]]:
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
        out[name] = RowPlan(m.rows + todo, m.tokens + round(todo * output * ratio), m.missing)
    return out, how


def append_rows(stage: StatesStage, name: str) -> int:
    """Append to the category's rows file every training row it does not list yet, in the
    order they were written (the file made whole the first time, even empty: the stage's
    source). Its lines are the stage's sample ids: one once written never changes, so the
    file only grows. A partial last line (a crash mid-append; never read: the stage opens
    the file only once an append has ended) is cut first. Returns how many were appended."""
    path = rows_file(stage.spec.output_dir, name)
    existed = path.is_file()
    if existed:
        repair_tail(path)
    have = set(_listed(path, with_tokens=False))
    lines = []
    for r in training_rows(category_dir(Path(stage.cfg.output_dir), name)):
        if r.id not in have:
            have.add(r.id)
            lines.append(msgspec.json.encode(StatesRow(r.id, [*r.prompt_ids, *r.output_ids])))
    data = b"".join(line + b"\n" for line in lines)
    if not existed:
        hsfile.write_whole(path, data)
    elif data:
        with path.open("ab") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    return len(lines)


def plan_of(stage: StatesStage, row_tokens: Mapping[str, RowPlan]) -> dict[str, CategoryPlan]:
    """Per category, from its rows (`RowPlan`): the tokens and bytes its byte budget takes
    of them."""
    bpt = stage.bytes_per_token
    out = {}
    for name, (rows, tokens, missing) in row_tokens.items():
        budget = stage.budgets.get(name)
        if budget is not None:
            tokens = min(tokens, budget // bpt)
        out[name] = CategoryPlan(rows, tokens, tokens * bpt, budget, missing)
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


def plan_lines(stage: StatesStage, plan: dict[str, CategoryPlan],
               generating: Collection[str] = ()) -> list[str]:
    """The plan for people: bytes per token, then per category (those whose generation
    still goes on, `generating`, said so: their rows so far) and in all."""
    spec = stage.spec
    lines = [f"hidden states: layers {list(spec.layers)} of {spec.num_layers}, hidden size "
             f"{spec.hidden_size}, {spec.dtype}: {stage.bytes_per_token:,} bytes per token"]
    for name, p in plan.items():
        cap = "no byte budget" if p.budget is None else f"budget {size_text(p.budget)}"
        so_far = " so far, its generation goes on" if name in generating else ""
        lines.append(f"  {name}: {p.rows:,} rows, {p.tokens:,} tokens -> "
                     f"{size_text(p.bytes)} ({cap}{so_far})")
        if p.missing:
            lines.append(f"    {name}: {p.missing:,} of them generated since the stage last "
                         "ran, not in its rows file yet: the next stage run adds them")
    total = sum(p.bytes for p in plan.values())
    lines.append(f"  in all: {size_text(total)} in {spec.output_dir}")
    return lines


def stage_config(stage: StatesStage) -> RunConfig:
    """The run `<run>.hs` that extracts the config's rows (module docstring): its sources
    are the rows files, which need not exist before their category arrives."""
    cfg, bpt = stage.cfg, stage.bytes_per_token
    cats = [Category(name=name, source=str(rows_file(stage.spec.output_dir, name)),
                     format="input_ids",
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


def say_plan(stage: StatesStage, plan: dict[str, CategoryPlan], say: Callable[[str], None],
             generating: Collection[str] = ()) -> int:
    """The plan said a line at a time (`plan_lines`), then checked against the free disk
    less the states already kept (`check_disk`): returns the bytes still to write, or raises
    `DiskFull` once the lines that explain it are said. `hidden-states --plan`, the stage's
    way in (`prepare`) and `tokencap plan` all say and check a plan so."""
    for line in plan_lines(stage, plan, generating):
        say(line)
    return check_disk(stage, plan, kept_bytes(stage))


def say_disk_plan(cfg: RunConfig, say: Callable[[str], None]) -> None:
    """`hidden-states --plan`: the plan of the rows on disk said and checked against the
    free disk (`say_plan`). Writes nothing."""
    stage = StatesStage.of(cfg)
    need = say_plan(stage, disk_plan(stage), say)
    say(f"  still to write: {size_text(need)}: fits the free space")


class Prepared(NamedTuple):
    """A stage ready to run: its run config (`<run>.hs`), its extraction servers, and its
    plan (per category the rows on disk: listed, and not listed yet)."""

    stage: StatesStage
    run: RunConfig
    engines: str  # SGLANG_URL's form
    plan: Mapping[str, CategoryPlan] = {}


def prepare(cfg: RunConfig, given_url: str | None = None,
            say: Callable[[str], None] = print, generating: Collection[str] = ()) -> Prepared:
    """The stage's one way in for its runner: the extraction servers named (`extract_url`),
    the plan said (the categories whose generation goes on, `generating`, said so) and
    checked against the disk, the stage's run config. Nothing is written here: the rows
    files grow as the categories arrive (`Arrivals`)."""
    stage = StatesStage.of(cfg)
    engines = extract_url(stage, given_url)
    if not engines:
        raise TokencapError("no extraction server: pass --extract-url, set "
                            f"{EXTRACT_URL_ENV} or hidden_states.engine_url")
    plan = disk_plan(stage)
    say_plan(stage, plan, say, generating)  # its lines said before a refusal they explain
    return Prepared(stage, stage_config(stage), engines, plan)


class Arrivals:
    """The stage's categories as their rows are there (the producer's `Arriving`). A
    category arrives once its generation has ended (`generation`: generation's category
    states; ended, and everything of it written): its new training rows are appended to its
    rows file (`append_rows`) and the stage feeds it. It arrives again when its generation
    ends again with more rows (a cap raised while the stage runs). Once `over()` (generation
    will make no more rows: it ended, or it is not running at all, `generation` None), every
    category is listed one last time and the arrivals are settled."""

    def __init__(self, stage: StatesStage,
                 generation: Callable[[], Mapping[str, CategoryState]] | None = None,
                 over: Callable[[], bool] = lambda: True,
                 say: Callable[[str], None] = print,
                 every_s: float = ARRIVALS_EVERY_S) -> None:
        self.stage = stage
        self.generation = generation
        self.over = over
        self.say = say
        self.every_s = every_s
        # per category arrived, generation's committed samples when its rows were listed
        self.listed: dict[str, int] = {}
        self._settled = False
        self._looked_at = float("-inf")

    def arrived(self) -> list[str]:
        if self._settled or time.monotonic() - self._looked_at < self.every_s:
            return []
        self._looked_at = time.monotonic()
        over = self.over()  # before the states: rows made before it are read below
        states = {} if self.generation is None else dict(self.generation())
        out = []
        for name in self.stage.budgets:
            st = states.get(name)
            done = st is not None and st.ended and st.unwritten == 0
            samples = st.samples if st is not None else -1
            if not (over or done) or (not over and self.listed.get(name) == samples):
                continue
            added = append_rows(self.stage, name)
            if name not in self.listed or added:
                out.append(name)
                if added or not over:
                    self.say(f"hidden states of {name}"
                             + ("" if over else f" (its generation {st.state if st else '?'})")
                             + f": {added:,} training row(s) added to "
                             f"{rows_file(self.stage.spec.output_dir, name)}")
            self.listed[name] = samples
        self._settled = over
        return out

    def settled(self) -> bool:
        return self._settled


def finished(ready: Prepared, status: RunStatus) -> bool:
    """Whether the stage has nothing to ask (`status`: its run's, read from Redis): its run
    exists, every category ended and wrote everything, and none has rows it has not taken
    (those its rows file lists, and the training rows it does not list yet: generated
    since, a cap raised, a run resumed; `ready.plan`) unless its byte budget closed it.
    Then a rerun asks the engine for nothing, not even its probe."""
    if not status.ended:
        return False
    for name in ready.stage.budgets:
        st = status.categories.get(name)
        if st is None or not st.ended:
            return False
        plan = ready.plan.get(name)
        rows = plan.rows if plan is not None else 0
        if st.state != "closed" and st.samples + st.failed + st.rejected < rows:
            return False
    return True


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


def end(ready: Prepared, status: RunStatus) -> None:
    """The stage's one way out, once every row is done and its workers are stopped
    (`status`: its run's): the temporaries killed workers left removed and the manifest of
    each category the stage ended written (`finish`), then the engine's files they left in
    the folders the preflight found the servers write in (`sweep_engine_files`)."""
    finish(ready.stage, [n for n, st in status.categories.items() if st.ended])
    sweep_engine_files(ready.stage, (e.states_folder for e in status.engines.values()))


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
