"""Helpers several test modules share; no test module imports another one.

- the ledger, driven directly (`make_cfg`, `pending`, `result`, `turn_result`, `feed`,
  `LEASE_MS`): a run of one or more categories with small caps, its samples fed one at a time
  and their results (what it holds, read raw: `ck`, a category's keys, and
  `testing.harness`'s `ledger_state`, `ledger_entry`, `final_marks`);
- a run's status made by hand for a board (`category_state`, `run_status`);
- a run's output folder written by hand (`row_result`, `write_run`): what an export reads;
  a hidden-state stage's kept file (`keep_states`), what a manifest names;
- a record's first prompt (`to_prompt`), the conversations fixture's records by id
  (`conversation_records`), and the budget service's HTTP face served from a thread
  (`serve_in_thread`);
- the reference parser's test cases (`parser_cases`, `check_parser_case`): each parser
  family's test file runs the cases of its own module;
- the stack's shell (`STACK_VARS`): the variables a stack's run file sets, which a new
  shell does not have;
- a command's mistake said in one line (`one_line_error`: click's usage errors and
  `tokencap: error: ...`, with the exit code, never a traceback);
- forged RQ jobs (`producers_job`, `Listener`): a job as the producer enqueues it, plus the
  options a forger adds, and a local HTTP listener that records any webhook request;
- an engine's load as a `requests` session reads it, scripted (`Reply`, `QueueSession`): what
  `foundation.engine.load.LoadReader` and `consumers.routing.EnginePool` are given.
"""

from __future__ import annotations

import json
import os
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import msgspec
import pytest
import requests
from rq import Queue
from rq.job import Job

from budget_service.budget import Budget
from budget_service.jobs import JOB_FAILURE_TTL_S, JOB_FUNC, JOB_RESULT_TTL_S
from budget_service.keys import CategoryKeys
from budget_service.ledger import CategoryState, now_ms
from budget_service.telemetry import RunStatus, WriterState
from foundation.config import Category, RunConfig, SamplingParams
from foundation.wire import JobRef, Pending, Result, encode
from producer.formats.turns import to_conversation
from producer.parsers.registry import Unparsed, reasoning_parser, tool_call_parser
from tests.conftest import DATASETS, FIXTURES

# -- the ledger ---------------------------------------------------------------------------------

LEASE_MS = 30_000


def make_cfg(cap: int = 1000, cats: tuple[str, ...] = ("code",)) -> RunConfig:
    """Run "t": each of `cats` capped at `cap` tokens, `max_new_tokens` 64."""
    return RunConfig(
        run="t", output_dir="/tmp/unused", cap_tokens=cap,
        category=[Category(name=c, sampling=SamplingParams(max_new_tokens=64), sources=["x"])
                  for c in cats],
    )


def pending(sid: str, prompt: tuple[int, ...] = (1, 2, 3)) -> Pending:
    return Pending(sample_id=sid, ordinal=0, prompt_ids=list(prompt),
                   sampling={"max_new_tokens": 64})


def result(sid: str, n: int, finish: str = "stop") -> Result:
    """A result of category "code" with `n` output tokens, all counted."""
    return Result(id=sid, category="code", prompt_ids=[1, 2, 3], output_ids=list(range(n)),
                  prompt_tokens=3, completion_tokens=n, finish_reason=finish, text="x",
                  sampling={}, counted_tokens=n)


def turn_result(conv: str, turn: int, total: int, out: list[int]) -> Result:
    """Turn `turn` of `total` of conversation `conv` (category "code", record ordinal 7),
    its output ids `out`, all counted."""
    return Result(id=f"{conv}#t{turn}", category="code", prompt_ids=[1], output_ids=out,
                  prompt_tokens=1, completion_tokens=len(out), finish_reason="stop", text="x",
                  sampling={}, counted_tokens=len(out), ordinal=7, conversation_id=conv,
                  turn=turn, turns_total=total)


def modes_budget(redis: Any, run: str) -> Budget:
    """Run `run` of two categories of modes think (weight 3) and fast (1): "conv" shares
    them by conversation, "tok" by tokens (its budgets "tok.think" and "tok.fast", 750 and
    250 of a 1,000-token cap); committed: conv think 30 + 30, conv fast 40, tok.think 60,
    tok.fast 20 tokens, one row each."""
    from foundation.config import Mode, split_by_mode

    base = make_cfg(cats=("conv", "tok"))
    modes = [Mode(name="think", weight=3.0), Mode(name="fast", weight=1.0)]
    conv, tok = (msgspec.structs.replace(c, modes=modes) for c in base.category)
    cfg = msgspec.structs.replace(base, run=run,
                                  category=[conv, *split_by_mode(tok, 1000)])
    from budget_service.keys import Keys

    budget = Budget(redis, Keys("tokencap", run))
    budget.feeding.init_run(cfg)
    for cat, sid, n, mode in (("conv", "a", 30, "think"), ("conv", "b", 30, "think"),
                              ("conv", "c", 40, "fast"), ("tok.think", "d", 60, "think"),
                              ("tok.fast", "e", 20, "fast")):
        feed(budget, sid, category=cat)
        budget.samples.admit(cat, sid, 10, LEASE_MS)
        row = msgspec.structs.replace(result(sid, n), category=cat, mode=mode)
        budget.samples.commit(row, 0, 0.0)
    return budget


def ck(budget: Budget, category: str = "code") -> CategoryKeys:
    """The keys of one category of the ledger's run, to read what a script wrote."""
    return budget.keys.cat(category)


def feed(budget: Budget, sid: str, prompt: tuple[int, ...] | None = None,
         category: str = "code") -> int:
    """Feed one sample at the current cursor; 1 if it was recorded now."""
    at = budget.feeding.cursor(category)
    ids = budget.feeding.feed(category, at, at + 1, now_ms() + LEASE_MS,
                              [pending(sid, prompt or (1, 2, 3, len(sid), *map(ord, sid)))], [])
    assert ids is not None
    return len(ids)


def category_state(**fields: object) -> CategoryState:
    """A category's state with these fields, every other one zero (or empty, open, capped at
    1,000)."""
    zero: dict[str, object] = dict.fromkeys(CategoryState.__struct_fields__, 0)
    zero.update(cap=1000, state="open", rejected_tokens={}, rejected_replies={}, reasons={},
                modes={})
    return msgspec.convert({**zero, **fields}, CategoryState)


def run_status(categories: dict[str, CategoryState], run: str = "r",
               writer: WriterState | None = None, **fields: object) -> RunStatus:
    """A run's status with these categories; no writer holds it and nothing waits for one
    unless `writer` says, no engine is known unless `fields` say."""
    return RunStatus(run, categories, writer or WriterState(None, None, 0), {}, **fields)


# -- a record's prompt --------------------------------------------------------------------------

def to_prompt(record: dict, fmt: str, turns: str = "first", **options: Any
              ) -> list[dict] | list[int]:
    """The messages of a record's first prompt (its `Conversation`'s first turn), or its token
    ids (format input_ids); `options` as `to_conversation` takes them."""
    conv = to_conversation(record, fmt, turns, **options)
    return conv if isinstance(conv, list) else conv.prompt()


CONVERSATIONS = DATASETS / "conversations" / "tokencap_conversations.jsonl"


def conversation_records() -> dict[str, dict]:
    """The records of the conversations fixture (chats and agent traces), by their `id`."""
    return {r["id"]: r for r in map(json.loads, CONVERSATIONS.read_text().splitlines())}


# -- the reference parser's cases -----------------------------------------------------------
# `tests/fixtures/parsers/sglang_cases.json`: the replies SGLang's unit tests feed its
# detectors, with what those tests assert (each case names its test function). A parser
# family's test file runs the cases of its module, with its `DEVIATIONS`: (entry, test) ->
# (UNPARSED or KEPT_UNKNOWN, why tokencap is stricter on purpose).

PARSER_CASES: dict[str, Any] = json.loads(
    (FIXTURES / "parsers" / "sglang_cases.json").read_text())["parsers"]
UNPARSED = "unparsed"  # the reply raises `Unparsed` instead
KEPT_UNKNOWN = "kept"  # the call stays (or the text is content), as the model made it
Deviations = dict[tuple[str, str], tuple[str, str]]


def parser_module(spec: dict[str, Any]) -> str:
    """The module of the parser an entry of the cases names (`producer.parsers.kimi`)."""
    parser = (reasoning_parser if spec["kind"] == "reasoning" else tool_call_parser)(
        spec["name"])
    assert parser is not None, spec["name"]
    return type(parser).__module__


def parser_cases(module: str) -> list[Any]:
    """The cases of the parsers `module` defines, as pytest params (entry, spec, case)."""
    return [pytest.param(entry, spec, case, id=f"{entry}::{case['test']}")
            for entry, spec in PARSER_CASES.items() if parser_module(spec) == module
            for case in spec["cases"]]


def case_keys(params: list[Any]) -> set[tuple[str, str]]:
    """(entry, test) of each case of `parser_cases`: what `DEVIATIONS` keys name."""
    return {(p.values[0], p.values[2]["test"]) for p in params}


def _check_text(got: dict[str, Any], case: dict[str, Any]) -> None:
    for field, want in case["expected"].items():
        if field in ("reasoning_content", "content") and isinstance(want, str):
            assert (got[field] or "") == want, field
    for field, parts in case.get("expected_contains", {}).items():
        for part in parts:
            assert part in (got[field] or ""), (field, part)
    for field, start in case.get("expected_startswith", {}).items():
        assert (got[field] or "").strip().startswith(start), field


def check_parser_case(spec: dict[str, Any], case: dict[str, Any],
                      deviation: tuple[str, str] | None) -> None:
    """tokencap's parser of the entry's name gives what the reference parser's test asserts
    of the reply, or deviates as `deviation` says."""
    if spec["kind"] == "reasoning":
        parser = reasoning_parser(spec["name"])
        assert parser is not None
        forced = bool(case.get("constructor", {}).get("force_reasoning"))
        reasoning, content = parser.split(case["text"], opened=forced)
        _check_text({"reasoning_content": reasoning, "content": content}, case)
        return
    tools = tool_call_parser(spec["name"])
    assert tools is not None
    if deviation is not None and deviation[0] == UNPARSED:
        with pytest.raises(Unparsed):
            tools.split(case["text"], case.get("tools"))
        return
    content, calls = tools.split(case["text"], case.get("tools"))
    expected = case["expected"]
    if deviation is not None:  # KEPT_UNKNOWN: the call stays, or the text is content
        assert calls or content == case["text"]
        return
    _check_text({"content": content, "reasoning_content": None}, case)
    if "n_tool_calls" in expected:
        assert len(calls) == expected["n_tool_calls"]
    if "tool_calls" in expected:
        assert [c.name for c in calls] == [c["name"] for c in expected["tool_calls"]]
        for call, want in zip(calls, expected["tool_calls"], strict=True):
            if "arguments" in want:
                assert call.arguments == want["arguments"]


# -- a run's output folder ---------------------------------------------------------------------

def row_result(cat: str, sid: str, prompt: list[int], output: list[int],
               conv: str | None = None, turn: int = 0, total: int = 0) -> Result:
    """A committed row of `cat` (finish_reason stop): `prompt` then `output`; with `conv`,
    turn `turn` of `total` of that conversation."""
    return Result(id=sid, category=cat, prompt_ids=prompt, output_ids=output,
                  prompt_tokens=len(prompt), completion_tokens=len(output),
                  finish_reason="stop", text="", sampling={}, counted_tokens=len(output),
                  conversation_id=conv, turn=turn, turns_total=total)


def write_run(out: Path, rows: dict[str, list[Result]]) -> Path:
    """`out` holding each category's `rows` in one part file, as the writer writes them."""
    for cat, results in rows.items():
        d = out / cat
        d.mkdir(parents=True, exist_ok=True)
        (d / "part-00001.jsonl").write_bytes(b"".join(encode(r) + b"\n" for r in results))
    return out


# -- a hidden-state stage's kept files ------------------------------------------------------------

STATES_LAYERS, STATES_HIDDEN = [2, 4, 5, 8], 16


def keep_states(root: Path, category: str, row: str, ids: list[int], fp8: bool = False
                ) -> Any:
    """The file a hidden-state stage keeps for `row` under `root` (its output folder): the
    simulator's bf16 states of `ids` (layers `STATES_LAYERS`, hidden size `STATES_HIDDEN`),
    or them in FP8 as speculators stores them; returns its manifest entry
    (`foundation.states_manifest.StatesFile`) as a worker describes it."""
    import os

    from foundation import hsfile
    from foundation import states_manifest as sm
    from foundation.outputs import states_file
    from sglang_sim.hidden import file_bytes

    tensors, _ = hsfile.decode(file_bytes(ids, STATES_LAYERS, STATES_HIDDEN, "bfloat16"), row)
    if fp8:
        q, scales = hsfile.to_fp8(tensors["hidden_states"])
        tensors = {"hidden_states": q, hsfile.SCALES: scales, "token_ids": tensors["token_ids"]}
    data = hsfile.encode(tensors, {"row": row})
    path = states_file(root, category, row)
    hsfile.write_whole(path, data)
    return sm.StatesFile(file=os.path.relpath(path, root), tokens=len(ids), bytes=len(data),
                         dtype=tensors["hidden_states"].dtype, hidden_size=STATES_HIDDEN,
                         layers=STATES_LAYERS, final_norm=["pre"] * len(STATES_LAYERS),
                         row=row, crc32=sm.crc32s(tensors), header_crc32=sm.header_crc32(data))


# -- the stack's shell --------------------------------------------------------------------------

STACK_VARS = ("REDIS_URL", "SGLANG_URL", "SGLANG_API_KEY", "TOKENCAP_RUN", "TOKENCAP_PREFIX",
              "TOKENCAP_TOKEN", "TOKENCAP_STATE_DIR", "BUDGET_PORT")


def ids_config(tmp: Path, extra: str = "") -> str:
    """A run config at `tmp/run.toml` over two token-id prompts (category `a`, the engine's
    sampling, 8 new tokens), `extra` TOML before its category, and a small `model.json` a
    `[hidden_states]` table in `extra` may name. Returns its path."""
    (tmp / "ids.jsonl").write_text('{"input_ids": [11, 12, 13]}\n{"input_ids": [14, 15]}\n')
    (tmp / "model.json").write_text('{"num_hidden_layers": 8, "hidden_size": 64}')
    (tmp / "run.toml").write_text(
        f'run = "r"\noutput_dir = "{tmp / "out"}"\nsampling_defaults = "engine"\n{extra}\n'
        f'[[category]]\nname = "a"\nsource = "{tmp / "ids.jsonl"}"\nformat = "input_ids"\n'
        "sampling = { max_new_tokens = 8 }\n")
    return str(tmp / "run.toml")


def one_line_error(res: Any, code: int = 2) -> bool:
    """Whether click's `CliRunner` result `res` ended with exit `code` and one error line
    (click's `Error: ...` or tokencap's `tokencap: error: ...`), no traceback."""
    lines = [ln for ln in res.output.splitlines() if ln.startswith(("Error", "tokencap: error"))]
    return res.exit_code == code and len(lines) == 1 and "Traceback" not in res.output and (
        res.exception is None or isinstance(res.exception, SystemExit))


# -- forged jobs --------------------------------------------------------------------------------

FORGED_REF = msgspec.to_builtins(JobRef(run="sec", category="q", sample_id="s:1"))


def producers_job(q: Queue, **extra: object) -> Job:
    """A job as the producer enqueues it (producer/feeder.py), plus `extra` enqueue options."""
    return q.enqueue(JOB_FUNC, FORGED_REF, result_ttl=JOB_RESULT_TTL_S,
                     failure_ttl=JOB_FAILURE_TTL_S, **extra)


class Listener:
    """A local HTTP server that records every request (a webhook target)."""

    def __init__(self) -> None:
        self.requests: list[str] = []
        hits = self.requests

        class Handler(BaseHTTPRequestHandler):
            def _hit(self) -> None:
                hits.append(f"{self.command} {self.path}")
                self.send_response(200)
                self.end_headers()

            do_GET = do_POST = _hit

            def log_message(self, *args: object) -> None:
                pass

        self.server = HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def serve_in_thread(server: ThreadingHTTPServer) -> threading.Thread:
    """Serve the budget service's HTTP face (`budget_service.server.make_server`) from a
    daemon thread, as `tokencap budget` serves it from its main one."""
    t = threading.Thread(target=server.serve_forever, daemon=True, name="budget-http")
    t.start()
    return t


def worker_processes() -> list[int]:
    """The pids of the `tokencap worker` processes this process started (each leads its own
    process group): what a test kills to play a node losing its workers."""
    import psutil

    return [p.pid for p in psutil.Process().children()
            if "tokencap.cli" in " ".join(p.cmdline()) and "worker" in p.cmdline()]


def training_row_ids(cfg: RunConfig, category: str) -> list[tuple[str, list[int]]]:
    """(row id, prompt + output ids) of each training row of a category's output, in order:
    what the hidden-state stage extracts."""
    from foundation.outputs import training_rows

    return [(r.id, list(r.prompt_ids) + list(r.output_ids))
            for r in training_rows(Path(cfg.output_dir) / category)]


# -- an engine's load, scripted -----------------------------------------------------------------

class Reply:
    """A `requests.Response` as the load readers use it: a status, a body."""

    def __init__(self, status_code: int, text: str = "") -> None:
        self.status_code, self.text = status_code, text

    def raise_for_status(self) -> None:
        if self.status_code >= 400:
            raise requests.HTTPError(f"HTTP {self.status_code}")

    def json(self) -> Any:
        return json.loads(self.text)


class QueueSession:
    """A session whose load reading says the engine's queue is queue[i] at the i-th read (the
    last value from then on): on `/metrics` (`sglang:num_queue_reqs`; `/v1/loads` is 404, an
    SGLang before 0.5.9) or, with `loads`, on `/v1/loads` (two DP ranks sharing the queue)."""

    def __init__(self, queue: list[int], loads: bool = False) -> None:
        self.queue = queue
        self.loads = loads
        self.reads = 0

    def get(self, url: str, timeout: object = None, headers: object = None) -> Reply:
        if "/v1/loads" in url and not self.loads:
            return Reply(404)
        value = self.queue[min(self.reads, len(self.queue) - 1)]
        self.reads += 1
        if self.loads:
            ranks = [{"dp_rank": 0, "num_running_reqs": 1, "num_waiting_reqs": value // 2},
                     {"dp_rank": 1, "num_running_reqs": 1, "num_waiting_reqs": value - value // 2}]
            return Reply(200, json.dumps({"version": "0.5.23", "loads": ranks}))
        return Reply(200, f"sglang:num_queue_reqs {value}\n")


def fp8_server() -> tuple[str, str | None]:
    """The FP8 extraction server `make test-engine` starts (tokencap's connector storing
    FP8): its URL and its files' folder. Skipped without one, failed where the target
    requires it (TOKENCAP_ENGINE_REQUIRED, and the extraction tests not skipped on purpose)."""
    url = os.environ.get("TOKENCAP_EXTRACT_FP8_URL")
    if not url:
        if os.environ.get("TOKENCAP_ENGINE_REQUIRED") and not os.environ.get(
                "TOKENCAP_EXTRACT_SKIP"):
            pytest.fail("TOKENCAP_EXTRACT_FP8_URL is not set: `make test-engine` starts the "
                        "FP8 extraction server")
        pytest.skip("no FP8 extraction server (TOKENCAP_EXTRACT_FP8_URL)")
    return url.rstrip("/"), os.environ.get("TOKENCAP_EXTRACT_FP8_STORAGE")


def by_conversation(rows: list[Result]) -> dict[str, list[Result]]:
    """Rows by conversation id, each conversation's turns in order."""
    out: dict[str, list[Result]] = {}
    for r in sorted(rows, key=lambda r: (r.conversation_id or "", r.turn)):
        assert r.conversation_id is not None
        out.setdefault(r.conversation_id, []).append(r)
    return out
