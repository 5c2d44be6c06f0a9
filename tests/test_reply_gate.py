"""The reply gate end to end: the simulator (Qwen3's grammar) answers some prompts with a
loop, an empty answer or reasoning that never closes; the workers keep each of those out of
training (`rejected-replies.jsonl`, whole, with its reason), and status shows kept and
rejected tokens side by side; a training export holds none of them."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from foundation.gate import check
from sglang_sim.config import FaultConfig, LengthDist
from sglang_sim.testing import SimServer
from testing.harness import started
from tests.conftest import DATASETS, FIXTURES, write_config
from tokencap.export import export

pytestmark = pytest.mark.slow

QWEN3 = FIXTURES / "tokenizers" / "qwen3"
GSM8K = DATASETS / "question_answer" / "gsm8k_test_first200.jsonl"
SHORT = LengthDist(mean_tokens=40.0, sigma=0.4)
FAULTS = FaultConfig(reply_rates={"loop": 0.15, "empty": 0.15, "unclosed": 0.15})


def _config(tmp: Path, count_rejected: bool):
    src = tmp / "q.jsonl"
    src.write_text("".join(GSM8K.read_text().splitlines(keepends=True)[:80]))
    return write_config(tmp, f"""
run = "gate"
output_dir = "{tmp / 'out'}"
tokenizer = "{QWEN3}"
cap_tokens = "none"
count_rejected = {str(count_rejected).lower()}
[[category]]
name = "math"
source = "{src}"
sampling = {{ max_new_tokens = 400, temperature = 0.6 }}
""")


@pytest.mark.parametrize("count_rejected", [True, False])
def test_loops_empty_and_unclosed_replies_are_kept_out_of_training(tmp_path, redis_url,
                                                                   count_rejected) -> None:
    cfg = _config(tmp_path, count_rejected)
    with SimServer(time_scale=500.0, tokenizer=str(QWEN3), default_length=SHORT,
                   faults=FAULTS) as sim, started(cfg, redis_url, [sim.url], 3) as pipe:
        status = pipe.run()
        pipe.check_invariants(status)
        injected = sim.stats()["faults_injected"]
    rows, rejected = pipe.results("math"), pipe.rejected("math")
    by_reason = Counter(r.gate for r in rejected)
    # each shape the simulator wrote is caught, with its own reason
    assert by_reason == {"loop": injected["reply_loop"], "empty": injected["reply_empty"],
                         "unclosed_reasoning": injected["reply_unclosed"]}
    assert min(by_reason.values()) > 0
    st = status["categories"]["math"]
    stored = pipe.budget.telemetry.load_config()
    assert stored is not None
    markers = stored.category[0].reply_markers
    assert markers is not None and markers.reasoning_end  # the producer set them
    for r in rows:  # every training row passes the gate the workers ran
        assert not r.gate and check(r.output_ids, r.finish_reason, markers) is None
    for r in rejected:  # written whole: its ids, its text, its reason
        assert check(r.output_ids, r.finish_reason, markers) == r.gate
        assert r.completion_tokens == len(r.output_ids) > 0
    # kept and rejected tokens side by side; rejected ones count only when told to
    assert st["kept_tokens"] == sum(r.completion_tokens for r in rows)
    assert st["rejected_tokens"] == {
        reason: sum(r.completion_tokens for r in rejected if r.gate == reason)
        for reason in by_reason}
    assert st["rejected_replies"] == dict(by_reason)
    counted = sum(r.counted_tokens for r in rejected)
    assert counted == (st["waste_tokens"] if count_rejected else 0)
    assert st["used"] == st["kept_tokens"] + counted
    # a training export holds the rows only
    dest = tmp_path / "export"
    export(Path(cfg.output_dir), dest, ["specforge"], allow_simulated=True)
    exported = [json.loads(x)["id"] for x in
                (dest / "math" / "specforge.jsonl").read_text().splitlines()]
    assert sorted(exported) == sorted(r.id for r in rows)
