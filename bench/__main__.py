"""`python -m bench [SCENARIO ...]`: run the benchmark scenarios, print one table, write
bench/results.json. Without arguments every scenario runs, in the order below.

Each scenario measures its figure and its baseline side by side in the same run; the table
shows both and their ratio. Absolute timings depend on the machine and its load: judge the
ratios.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from bench import (
    adaptive,
    affinity,
    cap,
    ceiling,
    context,
    export,
    footprint,
    gate,
    hidden_states,
    near_dups,
    saturation,
    tail,
    tokenize,
)
from testing.harness import ROOT

SCENARIOS: dict[str, Callable[[context.Bench], dict[str, Any]]] = {
    "saturation": saturation.run,
    "ceiling": ceiling.run,
    "cap": cap.run,
    "tail": tail.run,
    "footprint": footprint.run,
    "tokenize": tokenize.run,
    "adaptive": adaptive.run,
    "affinity": affinity.run,
    "gate": gate.run,
    "export": export.run,
    "hidden_states": hidden_states.run,
    "near_dups": near_dups.run,
}
RESULTS = Path(__file__).resolve().parent / "results.json"
DESCRIPTION = "Run tokencap's benchmark scenarios; print one table; write bench/results.json."


def _git() -> dict[str, Any]:
    """The commit measured, and whether the tree had changes outside bench/."""
    import subprocess

    def git(*args: str) -> str:  # (not strip(): a status line starts with a space)
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True,
                              text=True, check=False).stdout.rstrip("\n")

    dirty = [line[3:] for line in git("status", "--porcelain").splitlines()
             if not line[3:].startswith("bench/")]
    return {"commit": git("rev-parse", "--short", "HEAD"), "changed_outside_bench": dirty}


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        if v == 0:
            return "0"
        if abs(v) >= 100:
            return f"{v:,.0f}"
        if abs(v) >= 1:
            return f"{v:.2f}"
        return f"{v:.4f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def table(rows: list[dict[str, Any]]) -> str:
    head = ["scenario", "figure", "value", "baseline", "ratio", "unit", "target", "ok"]
    body = [[r["scenario"], r["metric"], _fmt(r["value"]), _fmt(r["baseline"]),
             _fmt(r["ratio"]), r["unit"], r["target"], _fmt(r["ok"])] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=True)]
    line = "  ".join("-" * w for w in widths)
    out = ["  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)), line]
    for b in body:
        out.append("  ".join(
            c.rjust(w) if i in (2, 3, 4) else c.ljust(w)
            for i, (c, w) in enumerate(zip(b, widths, strict=True))))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=DESCRIPTION)
    parser.add_argument("scenarios", nargs="*", metavar="SCENARIO",
                        help=f"any of {', '.join(SCENARIOS)} (default: all)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results JSON (%(default)s)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    args = parser.parse_args(argv)
    names = args.scenarios or list(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario(s) {', '.join(unknown)}; pick from {', '.join(SCENARIOS)}")
    workdir = Path(tempfile.mkdtemp(prefix="tokencap-bench-"))
    logging.basicConfig(filename=workdir / "bench.log", level=logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    t0 = time.monotonic()
    results: dict[str, Any] = {"meta": {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                        "scenarios": names, "workdir": str(workdir),
                                        "git": _git(),
                                        "machine_before": context.machine()},
                               "scenarios": {}}
    # SIGTERM (timeout, CI) unwinds like Ctrl-C, so every scenario stops what it started.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    bench = context.Bench(workdir)
    failed = False
    try:
        for name in names:
            context.log(f"== {name}")
            ts = time.monotonic()
            try:
                res = SCENARIOS[name](bench)
            except Exception as exc:  # one scenario's failure must not hide the others
                failed = True
                traceback.print_exc()
                res = {"error": f"{type(exc).__name__}: {exc}",
                       "rows": [context.row(name, "ERROR", None, target=str(exc)[:60],
                                           ok=False)]}
            res["wall_s"] = round(time.monotonic() - ts, 1)
            results["scenarios"][name] = res
            context.log(f"== {name} done in {res['wall_s']} s")
    finally:
        bench.close(args.keep)
    results["meta"]["wall_s"] = round(time.monotonic() - t0, 1)
    results["meta"]["machine_after"] = context.machine()
    rows = [r for res in results["scenarios"].values() for r in res["rows"]]
    print(table(rows))
    print(f"\ntotal wall time {results['meta']['wall_s']} s at commit "
          f"{results['meta']['git']['commit']}; "
          f"load average {results['meta']['machine_after']['loadavg_1m']} on "
          f"{results['meta']['machine_after']['cpus']} CPUs; results in {args.out}")
    args.out.write_text(json.dumps(results, indent=1, default=str) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
