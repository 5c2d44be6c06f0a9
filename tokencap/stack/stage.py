"""The one stage runner: run one stage of a run to its end, its processes tended.

This process is the stage's producer (`producer.run.run_to_end`: the engines checked, the
run created or resumed, fed until every category is done and written). Once the run is
created it starts the stage's writer and N workers as children of a `Supervisor`, and while it
feeds it tends them every TEND_EVERY_S: one that died is started again (with the
supervisor's backoff), the writer once no writer holds the run's lease (a killed one's runs
out within lock_ttl_s), the workers when none serves the run. At the end it stops them,
unless they are the stack's (`keep`: `tokencap up`'s generation leaves its workers and writer
up for the next run).

`tokencap up` runs generation through it (the stack's pid files, `keep`), and beside it,
when the config names an extraction server, the hidden-state stage (`StatesBeside`: a
thread of its own from the moment a category of generation has ended, each category's rows
fed as its generation ends); `tokencap hidden-states` runs the hidden-state stage alone
(`run_hidden_states`; `tokencap/extraction.py` defines that stage).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import NamedTuple

from redis import Redis

from budget_service.budget import Budget
from budget_service.jobs import clean_workers
from budget_service.keys import Keys
from budget_service.ledger import CategoryState, Ledger
from budget_service.telemetry import RunStatus
from foundation.config import RunConfig
from foundation.engine.api import parse_urls
from foundation.redisconn import connect
from producer.feeder import Arriving, Producer
from producer.run import run_to_end
from tokencap import extraction
from tokencap.stack import processes
from tokencap.stack.supervisor import Supervisor, tokencap_argv

log = logging.getLogger(__name__)

TEND_EVERY_S = 2.0  # how often a stage looks for a process of its own that is gone


class Stage(NamedTuple):
    """One stage to run: its run config, where its Redis and engines are (`engines`: SGLANG_URL's
    form, comma separated), how many workers."""

    cfg: RunConfig
    redis_url: str
    engines: str
    workers: int
    names: str = ""  # the prefix of its processes' names: "" generation, "hs-" states
    whose: str = "the stage's"  # how its lines name its workers ("this stack's")


class StageRun:
    """Runs `stage` with its processes under `sup` (module docstring). `say` prints the lines
    a user reads (what was started, what was started again); `also_tend` is called at
    every tend (the stack's budget service and simulator)."""

    def __init__(self, stage: Stage, redis: Redis, sup: Supervisor, *, keep: bool = False,
                 say: Callable[[str], None] = print,
                 also_tend: Callable[[bool], None] | None = None,
                 guard: Callable[[bool], AbstractContextManager[bool]] | None = None) -> None:
        self.stage = stage
        self.cfg = stage.cfg
        self.budget = Budget(redis, Keys(stage.cfg.key_prefix, stage.cfg.run))
        self.sup = sup
        self.keep = keep
        self.say = say
        self.also_tend = also_tend
        self.guard = guard or (lambda _first: contextlib.nullcontext(True))
        self.writer = f"{stage.names}writer"
        self.env = {**os.environ, "REDIS_URL": stage.redis_url,
                    "SGLANG_URL": stage.engines, "TOKENCAP_RUN": self.cfg.run,
                    "TOKENCAP_PREFIX": self.cfg.key_prefix}
        self.env.pop("TOKENCAP_TOKEN", None)  # the budget service's, never a worker's
        self.started = False
        self.producer: Producer | None = None
        self._tended_at = time.monotonic()

    # -- the processes -------------------------------------------------------------------
    def slots(self) -> list[str]:
        """The stage's worker names: pid files (the stack's, also those `add-workers` made),
        else the children this process started."""
        return self.sup.table.names(f"{self.stage.names}worker-")

    def add_workers(self, n: int) -> None:
        slots = self.slots()
        first = int(slots[-1].rsplit("-", 1)[1]) + 1 if slots else 0
        for i in range(first, first + n):
            self.sup.start(f"{self.stage.names}worker-{i}", tokencap_argv("worker"), self.env,
                           with_parent=not self.keep)

    def start(self) -> None:
        """Start what the stage lacks (its run is created: the writer and workers read it
        from Redis), said in full."""
        self.started = True
        self._tend(first=True)

    def tend(self) -> None:
        """Start again what died since (said only when something was)."""
        if self.started:
            self._tend(first=False)

    def _tend(self, first: bool) -> None:
        with self.guard(first) as allowed:
            if not allowed:
                return
            self._tend_writer(first)
            self._tend_workers(first)
            if self.also_tend is not None:
                self.also_tend(first)

    def _tend_writer(self, first: bool) -> None:
        name = self.writer
        if name in self.sup.specs:
            if self.sup.tend([name]):
                self.say(f"the run's writer was gone: started another ({self.cfg.run})")
            return
        if self.sup.alive(name):  # the stack's, from an earlier `up`
            self.sup.watch(name, tokencap_argv("writer"), self.env, with_parent=not self.keep)
            return
        holder = self.budget.writing.writer_holder()
        if holder is None:
            gone = self.sup.table.stale([name])
            if gone:
                self.say(f"stale pid file(s) replaced: {name} (its process was killed, or "
                         "the node restarted)")
            self.sup.start(name, tokencap_argv("writer"), self.env, with_parent=not self.keep)
            if gone or not first:
                self.say("the run's writer was gone: started another")
        elif first:
            self.say(f"the run's writer lease is held ({holder}): that writer is running, or "
                     "it was killed and a writer starts here once its lease runs out "
                     f"(lock_ttl_s = {self.cfg.lock_ttl_s:g} s)")

    def _tend_workers(self, first: bool) -> None:
        # RQ's way: drop the registrations of workers whose key expired (no heartbeat)
        clean_workers(self.budget.redis, self.budget.keys, [c.name for c in self.cfg.category])
        slots = self.slots()
        for slot in slots:
            if slot not in self.sup.specs:  # found by its pid file: an earlier `up`'s, or
                self.sup.watch(slot, tokencap_argv("worker"), self.env,  # add-workers'
                               with_parent=not self.keep)
        restarted = self.sup.tend(slots, at_once=first, what="worker")
        if restarted:
            self.say(f"{len(restarted)} of {self.stage.whose} {len(slots)} worker(s) were "
                     "gone: started again")
        if slots:
            return
        live = self.budget.telemetry.workers()
        if live:
            if first:
                self.say(f"{live} worker(s) already on run {self.cfg.run}; `tokencap "
                         "add-workers N` (make workers N=...) adds more")
            return
        if not first:
            self.say(f"no worker serves run {self.cfg.run} any more: starting "
                     f"{self.stage.workers}")
        self.add_workers(self.stage.workers)
        self.say(f"{self.stage.workers} worker(s) started ({self.stage.workers} in all)")

    def stop(self) -> None:
        """Stop the stage's processes (a worker finishes the sample it holds first)."""
        self.sup.stop([self.writer, *self.slots()])

    # -- the run -------------------------------------------------------------------------
    def run(self, *, on_progress: Callable[[RunStatus], None] | None = None,
            should_stop: Callable[[], bool] = lambda: False, progress_s: float = 2.0,
            before_start: Callable[[], None] | None = None,
            on_states: Callable[[Mapping[str, CategoryState]], None] | None = None,
            arriving: Arriving | None = None) -> RunStatus:
        """Run the stage to its end (or until `should_stop()`); returns its final status.
        `before_start` runs once the run is created, before its processes start (the stack
        takes over Ctrl-C there); `on_states` is told, at every look of the producer's
        loop, the category states its last tick steered on (`StatesBeside.poll`);
        `arriving`: the run's sources arrive while it runs (`producer.feeder.Arriving`)."""
        def before_feed(producer: Producer) -> None:
            self.producer = producer
            if before_start is not None:
                before_start()
            self.start()

        def stop() -> bool:
            if (on_states is not None and self.producer is not None
                    and self.producer.last_states is not None):
                on_states(self.producer.last_states)
            if time.monotonic() - self._tended_at >= TEND_EVERY_S:
                self._tended_at = time.monotonic()
                self.tend()
            return should_stop()

        try:
            return run_to_end(self.cfg, self.budget.redis, parse_urls(self.stage.engines),
                              on_progress=on_progress, before_feed=before_feed,
                              should_stop=stop, progress_s=progress_s, arriving=arriving)
        finally:
            if not self.keep and self.started:
                self.stop()


def run_hidden_states(cfg: RunConfig, redis_url: str, workers: int,
                      extract_url: str | None = None, redis: Redis | None = None,
                      sup: Supervisor | None = None,
                      on_progress: Callable[[RunStatus], None] | None = None,
                      should_stop: Callable[[], bool] = lambda: False, progress_s: float = 2.0,
                      say: Callable[[str], None] = print,
                      generation: Callable[[], Mapping[str, CategoryState]] | None = None,
                      generation_over: Callable[[], bool] = lambda: True) -> RunStatus:
    """The hidden-state stage of `cfg` (`tokencap/extraction.py` defines it) run to its end
    against its extraction servers (`extract_url`, else TOKENCAP_EXTRACT_URL, else the
    config's): the disk checked against the plan, then the stage's producer here, its
    workers and writer children of `sup` (default: of this process alone), stopped at the
    end; each category's rows file appended to and fed as its rows are there
    (`extraction.Arrivals`: all at once after generation, the default; as each category of
    generation ends when `generation` gives its states, until `generation_over()`). Run it
    again to resume: what was kept is not asked for again, and the rows generated since
    are appended and extracted. Returns the stage's final status."""
    generating = [] if generation is None or generation_over() else [
        name for name, st in generation().items() if not (st.ended and st.unwritten == 0)]
    ready = extraction.prepare(cfg, extract_url, say, generating)
    runner = StageRun(Stage(ready.run, redis_url, ready.engines, workers,
                            extraction.STATES_PREFIX),
                      redis or connect(redis_url), sup or Supervisor(processes.Table(None)),
                      say=say)
    before = runner.budget.telemetry.snapshot()
    # a rerun after generation with no row left to take: nothing to ask, not even a probe
    if generation_over() and extraction.finished(ready, before):
        say(f"the hidden-state stage {ready.run.run} has every row it can take: nothing to "
            "extract")
        extraction.end(ready, before)
        return before
    stopped = {"flag": False}

    def stop() -> bool:
        stopped["flag"] = stopped["flag"] or should_stop()
        return stopped["flag"]

    arrivals = extraction.Arrivals(ready.stage, generation, generation_over, say)
    status = runner.run(on_progress=on_progress, should_stop=stop, progress_s=progress_s,
                        arriving=arrivals)
    if not stopped["flag"]:  # every row done, the workers stopped: no file is being written
        extraction.end(ready, runner.budget.telemetry.snapshot())
    return status


class StatesBeside:
    """The hidden-state stage run beside generation (`tokencap up` given an extraction
    server), one `.hs` run with one producer: started in a thread of its own (its workers
    and writer children of `sup`, stopped at its end) once a category of generation has
    ended, everything of it written (`poll`, told generation's states at every look of its
    producer's loop); each category fed as its generation ends, again if it ends again
    with more rows (a raised cap), and every one once generation is over (`wait`).

    A stage that fails (no extraction server answers, no room on the disk) says so at once
    and leaves generation going; `wait` raises its error once generation is over. `abort`
    stops it (generation failed)."""

    def __init__(self, cfg: RunConfig, redis_url: str, workers: int, sup: Supervisor, *,
                 extract_url: str | None = None, say: Callable[[str], None] = print,
                 should_stop: Callable[[], bool] = lambda: False,
                 on_progress: Callable[[RunStatus], None] | None = None,
                 progress_s: float = 2.0) -> None:
        self.cfg = cfg
        self.redis_url = redis_url
        self.workers = workers
        self.sup = sup
        self.extract_url = extract_url
        self.say = say
        self.should_stop = should_stop
        self.on_progress = on_progress
        self.progress_s = progress_s
        self.status: RunStatus | None = None
        self.error: BaseException | None = None
        self._over = threading.Event()  # generation makes no more rows
        self._abort = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def started(self) -> bool:
        return self._thread is not None

    def poll(self, states: Mapping[str, CategoryState]) -> None:
        """Generation's category states (its producer's last tick): the stage starts once
        one has ended with everything of it written."""
        if self._thread is None and any(st.ended and st.unwritten == 0
                                        for st in states.values()):
            self._start()

    def _start(self) -> None:
        gen = Ledger(connect(self.redis_url), Keys(self.cfg.key_prefix, self.cfg.run))
        names = [c.name for c in self.cfg.category]

        def run() -> None:
            try:
                self.status = run_hidden_states(
                    self.cfg, self.redis_url, self.workers, self.extract_url,
                    redis=connect(self.redis_url), sup=self.sup, on_progress=self.on_progress,
                    should_stop=lambda: self._abort.is_set() or self.should_stop(),
                    progress_s=self.progress_s, say=self.say,
                    generation=lambda: gen.states(names), generation_over=self._over.is_set)
            except Exception as exc:  # said now; raised by `wait`, once generation is over
                self.error = exc
                self.say(f"the hidden-state stage stopped: {exc}. Generation goes on; "
                         "`tokencap hidden-states CONFIG` runs the stage again")

        self._thread = threading.Thread(target=run, name="hidden-states", daemon=True)
        self._thread.start()

    def wait(self) -> RunStatus | None:
        """Generation is over (its producer returned): the stage lists every category's
        rows one last time and runs to its end (started now if it had not); returns its
        final status (None when it was aborted before it started), or raises its error."""
        self._over.set()
        if self._thread is None and not self._abort.is_set():
            self._start()
        if self._thread is not None:
            self._thread.join()
        if self.error is not None:
            raise self.error
        return self.status

    def abort(self) -> None:
        """Stop the stage (generation failed): what it kept stays; the same command
        resumes it."""
        self._abort.set()
        self._over.set()
        if self._thread is not None:
            self._thread.join()
