"""Helpers several test modules share; no test module imports another one.

- the ledger, driven directly (`make_cfg`, `pending`, `result`, `turn_result`, `feed`,
  `LEASE_MS`): a run of one or more categories with small caps, its samples fed one at a time
  and their results (what it holds, read raw: `ck`, a category's keys, and
  `testing.harness`'s `ledger_state`, `ledger_entry`, `final_marks`);
- a run's status made by hand for a board (`category_state`, `run_status`);
- a record's first prompt (`to_prompt`), and the budget service's HTTP face served from a
  thread (`serve_in_thread`);
- the stack's shell (`STACK_VARS`): the variables a stack's run file sets, which a new
  shell does not have;
- forged RQ jobs (`producers_job`, `Listener`): a job as the producer enqueues it, plus the
  options a forger adds, and a local HTTP listener that records any webhook request;
- an engine's load as a `requests` session reads it, scripted (`Reply`, `QueueSession`): what
  `foundation.engine.load.LoadReader` and `consumers.routing.EnginePool` are given.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import msgspec
import requests
from rq import Queue
from rq.job import Job

from budget_service.budget import Budget
from budget_service.jobs import JOB_FAILURE_TTL_S, JOB_FUNC, JOB_RESULT_TTL_S
from budget_service.keys import CategoryKeys
from budget_service.ledger import CategoryState, now_ms
from budget_service.telemetry import RunStatus, WriterState
from foundation.config import Category, RunConfig, SamplingParams
from foundation.wire import JobRef, Pending, Result
from producer.formats.turns import to_conversation

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
    zero.update(cap=1000, state="open", rejected_tokens={}, rejected_replies={}, reasons={})
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


# -- the stack's shell --------------------------------------------------------------------------

STACK_VARS = ("REDIS_URL", "SGLANG_URL", "SGLANG_API_KEY", "TOKENCAP_RUN", "TOKENCAP_PREFIX",
              "TOKENCAP_TOKEN", "TOKENCAP_STATE_DIR", "BUDGET_PORT")


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
