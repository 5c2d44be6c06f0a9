"""`tokencap report` on a finished run: one self-contained HTML file with every figure, whose
numbers are the run's (status, files, time series, event log), and the PNGs beside it."""

from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import msgspec

from budget_service.server import Recorder
from sglang_sim.testing import SimServer
from testing.harness import started
from tests.conftest import ROOT
from tests.faults.common import two_category_config
from tokencap.reports.report import FIGURES


def test_the_report_of_a_finished_run_has_every_figure_with_the_runs_numbers(
        tmp_path, redis_url) -> None:
    cfg = two_category_config(tmp_path, cap_a=6000, cap_b=4000)
    with SimServer(time_scale=200.0) as sim, started(cfg, redis_url, [sim.url], 4) as pipe:
        recorder = Recorder(pipe.budget, 0.1)
        recorder.start()
        pipe.budget.operating.set_cap("b", 5000, by="test")
        try:
            status = pipe.run()
        finally:
            recorder.stop()
            recorder.join(10)
    pipe.check_invariants(status)
    dest = tmp_path / "report"
    env = {"REDIS_URL": redis_url, "TOKENCAP_RUN": cfg.run, "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-m", "tokencap.cli", "report", "--dest", str(dest)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    page = Path(done.stdout.split("report: ", 1)[1].strip())
    assert page == dest / f"{cfg.run}-report.html"
    text = page.read_text()
    # every figure is in the page, inlined, and beside it as a PNG
    for key in FIGURES:
        assert re.search(rf'<figure id="fig-{key}"[^>]*><img alt="{key}" '
                         r'src="data:image/png;base64,[A-Za-z0-9+/=]{1000,}">', text), key
        assert (dest / f"{cfg.run}-{key}.png").read_bytes()[:4] == b"\x89PNG"
    assert "src=\"http" not in text and "href=\"http" not in text  # self-contained
    # its numbers are the run's
    for name, st in status["categories"].items():
        rows = [msgspec.to_builtins(r) for r in pipe.committed(name)]
        assert f'data-category="{name}" data-samples="{st["samples"]}" ' \
               f'data-used="{st["used"]}"' in text
        assert f'data-rows-{name}="{len(rows)}"' in text and len(rows) == st["samples"]
        for reason, n in Counter(r["finish_reason"] for r in rows).items():
            assert f'data-{reason}-{name}="{n}"' in text
        assert f'data-used-{name}="{st["used"]}"' in text
        assert f'data-failed-{name}="{st["failed"] + st["rejected"]}"' in text
        kept_out = sum(st["rejected_replies"].values())
        assert f'data-kept-out-{name}="{kept_out}"' in text
        # the prefix cache per engine: what the rows say, and the status counters agree
        cached = sum(r["cached_tokens"] or 0 for r in rows)
        assert f'data-category="{name}" data-engine="{sim.url}" data-cached="{cached}" ' in text
        assert cached == st["cached_tokens"]
        # the draft vocabulary's coverage, from the output ids of the training rows
        import numpy as np

        counts = np.sort(np.bincount(np.concatenate(
            [np.asarray(r.output_ids) for r in pipe.results(name)])))[::-1]
        top = float(counts[:16384].sum()) / counts.sum()
        assert f'data-category="{name}" data-top-16384="{top}"' in text
    assert 'data-category="all categories"' in text
    points = int(re.search(r'id="fig-throughput" data-points="(\d+)"', text)[1])
    assert points >= 2
    assert "b</td><td>4000 → 5000</td><td>test</td>" in text  # the cap change


def test_the_report_has_each_mode_against_its_weight(tmp_path, redis) -> None:
    from tests.helpers import modes_budget
    from tokencap.reports.report import build_report

    page = build_report(modes_budget(redis, "rep"), tmp_path / "out", tmp_path / "r")
    text = page.read_text()
    assert '<table id="modes">' in text
    assert ('<tr data-category="conv" data-mode="think" data-rows="2" data-tokens="60">'
            "<td>conv</td><td>think</td><td>2</td><td>66.7%</td><td>60</td><td>60.0%</td>"
            "<td>75.0%</td></tr>") in text
    assert 'data-category="tok" data-mode="fast" data-rows="1" data-tokens="20"' in text


def test_the_report_counts_prompts_refused_at_intake_by_benchmark(tmp_path) -> None:
    from foundation.wire import DeadLetter, Outcome, encode
    from producer.intake import contamination_message
    from tokencap.reports.report import _collect

    def letter(sid: str, reason: str, message: str = "") -> bytes:
        return encode(DeadLetter(id=sid, category="a", outcome=Outcome.REJECTED,
                                 reason=reason, message=message)) + b"\n"

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "failed.jsonl").write_bytes(
        letter("1", "near_duplicate", "near-duplicate of a/x:1 (Jaccard 0.90 ...)")
        + letter("2", "contaminated", contamination_message("gsm8k", "test:4", 13))
        + letter("3", "contaminated", contamination_message("my_eval", "q7", 13))
        + letter("4", "contaminated", contamination_message("gsm8k", "test:9", 13))
        + letter("5", "duplicate_prompt"))
    data = _collect(None, tmp_path, ["a"])  # type: ignore[arg-type]
    assert data["a"]["screened"] == {"near_duplicate": 1, "gsm8k": 2, "my_eval": 1}
    assert data["a"]["failures"]["rejected: contaminated"] == 3
