"""Export with what the trainers would prepare in a GPU pass (`tokencap export`: the eval
split, the length limit, the draft vocabulary, speculators' dataset), on a run of 10M tokens.

- **Seconds for 10M tokens**: `export` of TOKENS tokens (ROWS rows of a 300-token prompt and
  a reply of mean 700, Kimi-K2.5's 163,840-id vocabulary, draft 32,000, eval 5%, max length
  2,048) in the specforge and speculators formats with the draft vocabulary, against the same
  export of the specforge rows alone with no split, limit or vocabulary (what it did before).
- **Memory bounded**: peak RSS of the whole export process at 10M tokens against 1M (each in
  its own process): the export streams, so it must not grow with the run.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.context import Bench, log, row
from foundation.wire import Result, encode
from testing.harness import ROOT

NAME = "export"
TOKENS = 10_000_000
PROMPT = 300
REPLY_MEAN = 700
VOCAB = 163_840
DRAFT = 32_000
TARGET_S = 60.0  # 10M tokens exported with the vocabulary, at most
TARGET_MEM_RATIO = 1.5  # peak RSS at 10M over 1M tokens, at most

_CHILD = """
import json, sys, time
from pathlib import Path
from tokencap.export.exporter import Vocab, export
from tokencap.export.length import Limits
out, dest, full = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == "1"
t0 = time.perf_counter()
if full:
    s = export(out, dest, ["specforge", "speculators"], merged=True, eval_fraction=0.05,
               limits=Limits(2048), vocab=Vocab({vocab}, {draft}))
else:
    s = export(out, dest, ["specforge"], merged=True)
wall = time.perf_counter() - t0
# VmHWM: this process's own peak (ru_maxrss would carry the parent's, folded in at exec)
hwm = next(int(line.split()[1]) for line in open("/proc/self/status")
           if line.startswith("VmHWM:"))
print(json.dumps({{"wall_s": wall, "rows": s["total"]["rows"], "tokens": s["total"]["tokens"],
                  "peak_rss_mb": hwm / 1024}}))
"""


def write_run(folder: Path, tokens: int, seed: int) -> int:
    """A run's part files holding about `tokens` tokens; returns the rows."""
    rng = random.Random(seed)
    cat = folder / "chat"
    cat.mkdir(parents=True, exist_ok=True)
    block = [rng.randrange(VOCAB) for _ in range(8192)]
    n = written = 0
    with (cat / "part-00001.jsonl").open("wb") as f:
        while written < tokens:
            reply = max(1, int(rng.expovariate(1 / REPLY_MEAN)))
            start = rng.randrange(4096)
            prompt = [n % VOCAB, *block[start:start + PROMPT - 1]]
            output = block[(start + 7) % 4096:(start + 7) % 4096 + min(reply, 4000)]
            f.write(encode(Result(id=f"c{n}", category="chat", prompt_ids=prompt,
                                  output_ids=output, prompt_tokens=len(prompt),
                                  completion_tokens=len(output), finish_reason="stop",
                                  text="", sampling={}, counted_tokens=len(output),
                                  conversation_id=f"c{n // 3}", turn=n % 3 + 1,
                                  turns_total=3)) + b"\n")
            written += len(prompt) + len(output)
            n += 1
    return n


def _export(out: Path, dest: Path, full: bool) -> dict[str, Any]:
    code = _CHILD.format(vocab=VOCAB, draft=DRAFT)
    done = subprocess.run([sys.executable, "-c", code, str(out), str(dest), "1" if full else "0"],
                          cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(bench: Bench) -> dict[str, Any]:
    work = bench.sub(NAME)
    log(f"{NAME}: writing runs of {TOKENS // 10:,} and {TOKENS:,} tokens")
    small_rows = write_run(work / "small", TOKENS // 10, 1)
    big_rows = write_run(work / "big", TOKENS, 2)
    log(f"{NAME}: exporting {TOKENS:,} tokens ({big_rows:,} rows) with the vocabulary")
    full = _export(work / "big", work / "big-full", True)
    plain = _export(work / "big", work / "big-plain", False)
    small = _export(work / "small", work / "small-full", True)
    mem_ratio = full["peak_rss_mb"] / small["peak_rss_mb"]
    figures = {"rows": big_rows, "small_rows": small_rows, "full": full, "plain": plain,
               "small": small}
    rows = [
        row(NAME, f"seconds to export {TOKENS // 1_000_000}M tokens with split, limit, draft "
            "vocabulary and speculators' dataset (vs the specforge rows alone)",
            full["wall_s"], plain["wall_s"], "s", f"<= {TARGET_S:g} s",
            full["wall_s"] <= TARGET_S),
        row(NAME, f"peak RSS exporting {TOKENS // 1_000_000}M tokens vs "
            f"{TOKENS // 10_000_000}M", full["peak_rss_mb"], small["peak_rss_mb"], "MB",
            f"ratio <= {TARGET_MEM_RATIO:g}", mem_ratio <= TARGET_MEM_RATIO),
    ]
    return {"figures": figures, "rows": rows}
