"""`tokencap hidden-states CONFIG`: the stage that extracts the target's hidden states of
every kept row (`tokencap/extraction.py` makes its run, `consumers/extract.py` is the
workers' step), run to its end: the rows written once, the disk checked against the plan,
then the producer with its own workers and writer, all stopped at the end. Run it again to
resume: what was kept is not asked for again."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from redis import Redis

from budget_service.keys import Keys
from budget_service.telemetry import RunStatus
from consumers import extract as states
from foundation import hsfile
from foundation.config import RunConfig
from producer.run import run_to_end
from tokencap import extraction as stage
from tokencap.reports.progress import size_text
from writer.writer import Writer

log = logging.getLogger(__name__)

EXTRACT_URL_ENV = "TOKENCAP_EXTRACT_URL"
STOP_TIMEOUT_S = 60.0


def extract_urls(cfg: RunConfig, given: str | None = None) -> list[str]:
    """The extraction servers: `given` (a flag), else TOKENCAP_EXTRACT_URL, else the config's
    `hidden_states.engine_url`."""
    from foundation.engine.api import parse_urls

    hs = stage.spec(cfg)
    return parse_urls(given or os.environ.get(EXTRACT_URL_ENV) or hs.engine_url)


def kept_bytes(cfg: RunConfig) -> dict[str, int]:
    """Bytes of states files already kept, per category."""
    hs = stage.spec(cfg)
    out = {}
    for cat in cfg.category:
        folder = states.states_dir(hs.output_dir, cat.name)
        out[cat.name] = sum(p.stat().st_size for p in folder.glob("*.safetensors")) \
            if folder.is_dir() else 0
    return out


def plan_lines(cfg: RunConfig, plan: dict[str, stage.CategoryPlan]) -> list[str]:
    hs = stage.spec(cfg)
    bpt = stage.bytes_per_token(hs)
    lines = [f"hidden states: layers {hs.layers} of {hs.num_layers}, hidden size "
             f"{hs.hidden_size}, {hs.dtype}: {bpt:,} bytes per token"]
    for name, p in plan.items():
        cap = "no byte budget" if p.budget is None else f"budget {size_text(p.budget)}"
        lines.append(f"  {name}: {p.rows:,} rows, {p.tokens:,} tokens -> "
                     f"{size_text(p.bytes)} ({cap})")
    total = sum(p.bytes for p in plan.values())
    lines.append(f"  in all: {size_text(total)} in {hs.output_dir}")
    return lines


def run_stage(cfg: RunConfig, redis: Redis, redis_url: str, urls: list[str], workers: int,
              on_progress: Callable[[RunStatus], None] | None = None,
              should_stop: Callable[[], bool] = lambda: False, progress_s: float = 2.0,
              say: Callable[[str], None] = print) -> RunStatus:
    """Extract every kept row's states (module docstring); returns the stage's status."""
    sources = stage.write_rows(cfg)
    plan = stage.disk_plan(cfg, sources)
    for line in plan_lines(cfg, plan):
        say(line)
    stage.check_disk(stage.spec(cfg), plan, kept_bytes(cfg))
    scfg = stage.stage_config(cfg, sources)
    procs: list[subprocess.Popen[bytes]] = []
    writer: dict[str, Any] = {}

    def before_feed(_producer: Any) -> None:
        w = Writer(redis, Keys(scfg.key_prefix, scfg.run), [c.name for c in scfg.category],
                   Path(scfg.output_dir), lease_ttl_s=scfg.lock_ttl_s)
        thread = threading.Thread(target=w.run, name="hs-writer", daemon=True)
        thread.start()
        writer.update(w=w, thread=thread)
        env = {**os.environ, "REDIS_URL": redis_url, "SGLANG_URL": ",".join(urls),
               "TOKENCAP_RUN": scfg.run, "TOKENCAP_PREFIX": scfg.key_prefix}
        for _ in range(workers):
            procs.append(subprocess.Popen([sys.executable, "-m", "tokencap.cli", "worker"],
                                          env=env, stdin=subprocess.DEVNULL,
                                          start_new_session=True))

    stopped = threading.Event()

    def stop() -> bool:
        if should_stop():
            stopped.set()
        return stopped.is_set()

    try:
        status = run_to_end(scfg, redis, urls, on_progress=on_progress,
                            before_feed=before_feed, should_stop=stop, progress_s=progress_s)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        if writer:
            writer["w"].stop_event.set()
            writer["thread"].join(STOP_TIMEOUT_S)
            writer["w"].close()
    if not stopped.is_set():
        # every row is done and the workers are stopped: no temporary is still being written
        # (one left by a worker killed mid-write, whose row was then done by another attempt)
        removed = sum(hsfile.remove_folder_temps(states.states_dir(stage.spec(cfg).output_dir,
                                                                   c.name))
                      for c in cfg.category)
        if removed:
            log.info("removed %d temporary file(s) left by killed workers", removed)
    return status
