"""The SGLang simulator in a subprocess for the benchmark: its settings, its stats over
HTTP, and the figures of a window between two stats snapshots."""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import requests

from bench.context import PY, wait_for
from testing.harness import STOP_TIMEOUT_S, child_env, free_port


@dataclass
class SimSettings:
    time_scale: float
    lengths: dict[str, tuple[float, float]] = field(default_factory=dict)
    default: tuple[float, float] = (500.0, 0.8)
    max_running_requests: int = 72
    max_total_tokens: int = 4_000_000
    context_length: int = 32_768
    # the prefix cache's capacity in tokens (None: the simulator's default, its KV pool), and
    # a tokenizer to answer text with (conversations: the next prompt renders the reply)
    prefix_cache_tokens: int | None = None
    tokenizer: str | None = None
    prefill_s_per_token: float | None = None  # None: the simulator's (50,000 tok/s)

    def engine_tok_s(self, batch: int) -> float:
        """The model's decode ceiling at `batch` (prefill ignored), output tok per wall s."""
        from sglang_sim.config import DEFAULT_DECODE_BASE_S, DEFAULT_DECODE_PER_REQ_S

        step = DEFAULT_DECODE_BASE_S + DEFAULT_DECODE_PER_REQ_S * batch
        return batch / step * self.time_scale


class Sim:
    """`python -m sglang_sim` in a subprocess (its own GIL), stats over HTTP."""

    def __init__(self, workdir: Path, name: str, settings: SimSettings) -> None:
        self.settings = settings
        self.workdir = workdir
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.http = requests.Session()

    def start(self) -> Sim:
        s = self.settings
        profile = {"default": {"mean_tokens": s.default[0], "sigma": s.default[1]},
                   "categories": {k: {"mean_tokens": m, "sigma": sg}
                                  for k, (m, sg) in s.lengths.items()}}
        prof_path = self.workdir / f"sim-{self.name}.json"
        prof_path.write_text(json.dumps(profile))
        argv = [PY, "-m", "sglang_sim", "--host", "127.0.0.1", "--port", str(self.port),
                "--time-scale", str(s.time_scale),
                "--max-running-requests", str(s.max_running_requests),
                "--max-total-tokens", str(s.max_total_tokens),
                "--context-length", str(s.context_length),
                "--length-profile", str(prof_path), "--log-level", "WARNING"]
        if s.prefix_cache_tokens is not None:
            argv += ["--prefix-cache-tokens", str(s.prefix_cache_tokens)]
        if s.tokenizer is not None:
            argv += ["--tokenizer", s.tokenizer]
        if s.prefill_s_per_token is not None:
            argv += ["--prefill-s-per-token", str(s.prefill_s_per_token)]
        logf = (self.workdir / f"sim-{self.name}.log").open("ab")
        self.proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=child_env())

        def healthy() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"simulator exited; see {logf.name}")
            try:
                return self.http.get(f"{self.url}/health", timeout=2).ok
            except requests.RequestException:
                return False

        wait_for(healthy, "the simulator")
        self.ps = psutil.Process(self.proc.pid)
        return self

    def stats(self) -> dict[str, Any]:
        return self.http.get(f"{self.url}/_sim/stats", timeout=30).json()

    def reset(self) -> None:
        self.http.post(f"{self.url}/_sim/reset_stats", timeout=30).raise_for_status()

    def cpu_s(self) -> float:
        t = self.ps.cpu_times()
        return t.user + t.system

    def wait_idle(self, timeout_s: float = 120.0) -> None:
        wait_for(lambda: (lambda st: st["running"] == 0 and st["queued"] == 0)(self.stats()),
                 "the simulator to drain", timeout_s)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(STOP_TIMEOUT_S)

    def __enter__(self) -> Sim:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()



def window_figures(a: dict[str, Any], b: dict[str, Any], wall_s: float) -> dict[str, float]:
    """Output tok/s, mean running batch and finished requests between two sim snapshots."""
    sim_s = b["sim_time_s"] - a["sim_time_s"]
    integral = b["batch_size_time_integral"] - a["batch_size_time_integral"]
    return {
        "wall_s": round(wall_s, 3),
        "tokens": b["generated_tokens_total"] - a["generated_tokens_total"],
        "tok_s": (b["generated_tokens_total"] - a["generated_tokens_total"]) / wall_s,
        "mean_batch": integral / sim_s if sim_s > 0 else 0.0,
        "finished": b["finished_total"] - a["finished_total"],
    }
