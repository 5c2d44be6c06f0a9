"""`make soak`: the fault tests again and again under CPU load, until each has passed RUNS
times in a row (or a round limit is reached), counting per test.

    python -m tests.soak [--runs 30] [--load 2] [--max-rounds N] [--out DIR] [PYTEST ARGS...]

Each round is one `pytest` process over the selection (default: tests/faults, the lost-feeds
test and the adaptive-gate test), with `--load` busy processes spinning beside it the whole
time. Per test it keeps passes, failures and the current and longest streak of consecutive
passes; `<out>/soak.json` is rewritten after every round (so a soak cut short still says
where it got), with the message of every failure. Exit 0 when every test reached `--runs`
consecutive passes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SELECTION = [
    "tests/faults",
    "tests/unit/producer/test_feeder.py::test_feeds_redis_lost_are_fed_again",
    "tests/pipeline/test_ops.py::test_adaptive_concurrency_keeps_the_engine_queue_short",
]


def _spin() -> None:
    while True:
        pass


def outcomes(junit: Path) -> dict[str, tuple[str, str]]:
    """test id -> (passed | failed | skipped, message) from a pytest JUnit XML report."""
    out: dict[str, tuple[str, str]] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        test_id = f"{case.get('classname')}::{case.get('name')}"
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        if bad is not None:
            out[test_id] = ("failed", (bad.get("message") or "")[:500])
        elif case.find("skipped") is not None:
            out[test_id] = ("skipped", "")
        else:
            out[test_id] = ("passed", "")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=30, help="consecutive passes wanted")
    parser.add_argument("--load", type=int, default=2, help="busy processes beside the tests")
    parser.add_argument("--max-rounds", type=int, default=None,
                        help="stop after this many rounds (default: 2 x --runs)")
    parser.add_argument("--out", type=Path, default=ROOT / ".soak", help="results folder")
    args, pytest_args = parser.parse_known_args(argv)
    selection = pytest_args or DEFAULT_SELECTION
    max_rounds = args.max_rounds or 2 * args.runs
    args.out.mkdir(parents=True, exist_ok=True)
    tests: dict[str, dict[str, Any]] = {}
    spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(args.load)]
    for s in spinners:
        s.start()
    started = time.monotonic()
    rounds = 0
    try:
        while rounds < max_rounds:
            rounds += 1
            junit = args.out / "round.xml"
            t0 = time.monotonic()
            subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            f"--junitxml={junit}", *selection], cwd=ROOT,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
            for test_id, (outcome, message) in outcomes(junit).items():
                t = tests.setdefault(test_id, {"passed": 0, "failed": 0, "skipped": 0,
                                               "streak": 0, "best_streak": 0, "failures": []})
                t[outcome] += 1
                if outcome == "passed":
                    t["streak"] += 1
                    t["best_streak"] = max(t["best_streak"], t["streak"])
                elif outcome == "failed":
                    t["streak"] = 0
                    t["failures"].append({"round": rounds, "message": message})
            done = bool(tests) and all(t["streak"] >= args.runs for t in tests.values())
            report = {"runs_wanted": args.runs, "load_processes": args.load, "rounds": rounds,
                      "wall_s": round(time.monotonic() - started), "selection": selection,
                      "done": done, "tests": tests}
            (args.out / "soak.json").write_text(json.dumps(report, indent=2) + "\n")
            worst = min(t["streak"] for t in tests.values()) if tests else 0
            failed = sum(1 for t in tests.values() if t["streak"] == 0)
            print(f"[soak] round {rounds}: {time.monotonic() - t0:.0f} s, {len(tests)} tests, "
                  f"shortest streak {worst}/{args.runs}, {failed} failing now", flush=True)
            if done:
                break
    finally:
        for s in spinners:
            s.terminate()
    for test_id, t in sorted(tests.items()):
        print(f"{t['streak']:3d} in a row ({t['passed']} passed, {t['failed']} failed)  "
              f"{test_id}")
    ok = bool(tests) and all(t["streak"] >= args.runs for t in tests.values())
    print(f"[soak] {'every test passed' if ok else 'NOT every test passed'} {args.runs} times "
          f"in a row under {args.load} busy processes; {args.out / 'soak.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
