"""Configs and helpers shared by the fault-injection tests."""

from __future__ import annotations

import json
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from rq import Queue

from testing.harness import Pipeline, ledger_state
from tests.conftest import write_config

PROMPTS = 200
# Short leases and timeouts, so that faults are seen and ridden out within seconds; sampling
# is the engine's (the prompts are token ids: no tokenizer, no generation config).
FAULT_KNOBS = """sampling_defaults = "engine"
lease_s = 1.0
lock_ttl_s = 2.0
max_attempts = 4
connect_timeout_s = 1.0
read_timeout_s = 5.0
http_retries = 3
backoff_max_s = 0.2"""


def ids_source(tmp: Path, n: int = PROMPTS, name: str = "ids.jsonl", base: int = 300) -> Path:
    src = tmp / name
    src.write_text("".join(json.dumps({"input_ids": [base + i, 21, 22, 23]}) + "\n"
                           for i in range(n)))
    return src


def two_category_config(tmp: Path, run: str = "faults", cap_a: int = 20000,
                        cap_b: int = 12000, extra: str = "", max_new: int = 512,
                        prompts: int = PROMPTS):
    """Two categories of `prompts` token-id prompts each, no prompt in both (a prompt one
    category fed is a duplicate in the other)."""
    src = ids_source(tmp, prompts)
    src_b = ids_source(tmp, prompts, "ids-b.jsonl", base=300 + prompts)
    return write_config(tmp, f"""
run = "{run}"
output_dir = "{tmp / 'out'}"
{FAULT_KNOBS}
{extra}
[[category]]
name = "a"
source = "{src}"
format = "input_ids"
cap_tokens = {cap_a}
sampling = {{ max_new_tokens = {max_new} }}
[[category]]
name = "b"
source = "{src_b}"
format = "input_ids"
cap_tokens = {cap_b}
sampling = {{ max_new_tokens = {max_new} }}
""")


def worker_killer(pipe: Pipeline, kills: list[int], most: int, every_tokens: int
                  ) -> Callable[[], bool]:
    """A `should_stop` for `Pipeline.run` that, every `every_tokens` committed tokens,
    SIGKILLs a worker RQ reports busy (in the middle of a request) and starts another, up to
    `most` kills (their pids appended to `kills`); it never stops the run."""
    names = [c.name for c in pipe.cfg.category]
    last = {"used": 0}

    def chaos() -> bool:
        used = sum(int(ledger_state(pipe.budget, c)["used"] or 0) for c in names)
        if len(kills) < most and used - last["used"] >= every_tokens:
            busy = pipe.busy_worker_pids()
            if busy:
                pipe.kill_worker(busy[0])
                pipe.start_workers(1)
                kills.append(busy[0])
                last["used"] = used
        return False

    return chaos


class Background:
    """Runs the producer in a thread so a test can inject faults meanwhile."""

    def __init__(self, pipe: Pipeline) -> None:
        self.pipe = pipe
        self.status: dict | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self.status = self.pipe.run()
        except BaseException as exc:  # surfaced by join()
            self.error = exc
        finally:
            self.done.set()

    def diagnose(self) -> str:
        pipe = self.pipe
        out = {"status": pipe.budget.telemetry.status()["categories"],
               "writer_lag": pipe.producer.writer_lag() if pipe.producer else None,
               "workers_alive": sum(1 for p in pipe.workers if p.poll() is None)}
        for c in pipe.cfg.category:
            ck = pipe.keys.cat(c.name)
            out[c.name] = {
                "queue": Queue(pipe.keys.queue_name(c.name), connection=pipe.redis).count,
                "leases": pipe.redis.zrange(ck.leases, 0, -1, withscores=True)[:5],
                "pending": list(pipe.redis.hkeys(ck.pending))[:5],
                "cursor": pipe.producer.feeds[c.name].cursor if pipe.producer else None,
            }
        return repr(out)

    def start(self) -> Background:
        self.thread.start()
        return self

    def join(self, timeout_s: float = 120.0) -> dict:
        if not self.done.wait(timeout_s):
            raise AssertionError(f"the run did not finish in {timeout_s} s: {self.diagnose()}")
        if self.error:
            raise self.error
        assert self.status is not None
        return self.status


STATES_LAYERS = [2, 4, 5, 8]  # of a model of 8 layers (the sim's extraction writes them)
STATES_HIDDEN = 64


def states_config(tmp: Path, run: str, rows: int, attempts: int = 4,
                  lease_s: float = 1.0, hidden: int = STATES_HIDDEN,
                  states_out: Path | None = None, rows_b: int | None = None) -> Path:
    """Two categories ("a", "b") of `rows` token-id prompts each (b `rows_b` when given),
    generated on the simulator, with a `[hidden_states]` section (a model of 8 layers, hidden
    size `hidden`, bf16) whose states go to `states_out` (default `<tmp>/hs`); returns the
    config's path."""
    model = tmp / "model" / "config.json"
    model.parent.mkdir()
    model.write_text(json.dumps({"num_hidden_layers": 8, "hidden_size": hidden,
                                 "torch_dtype": "bfloat16"}))
    a = ids_source(tmp, rows, "a.jsonl", base=300)
    b = ids_source(tmp, rows if rows_b is None else rows_b, "b.jsonl", base=300 + rows)
    knobs = FAULT_KNOBS.replace("lease_s = 1.0", f"lease_s = {lease_s}").replace(
        "max_attempts = 4", f"max_attempts = {attempts}")
    cats = "".join(f"""[[category]]
name = "{name}"
source = "{src}"
format = "input_ids"
cap_tokens = "none"
sampling = {{ max_new_tokens = 2048 }}
""" for name, src in (("a", a), ("b", b)))
    write_config(tmp, f"""run = "{run}"
output_dir = "{tmp / 'out'}"
{knobs}
[hidden_states]
model_config = "{model}"
output_dir = "{states_out or tmp / 'hs'}"
{cats}""")
    return tmp / "run.toml"


def small_tmpfs(tmp: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` (mount's words: "48m", "128k") under `tmp` for a fixture to yield,
    unmounted after; the test is skipped where it cannot be mounted (root only)."""
    import pytest

    mnt = tmp / "small"
    mnt.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
                          capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)
