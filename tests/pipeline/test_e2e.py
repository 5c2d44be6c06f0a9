"""The whole pipeline end to end on the shipped fixture data and the real Qwen2.5 tokenizer."""

from __future__ import annotations

import pytest
from rq import Queue

from sglang_sim.testing import SimServer
from testing.harness import started
from tests.conftest import DATASETS, QWEN, write_config

SIM_TIME_SCALE = 400.0


@pytest.fixture(params=["sglang", "vllm"])
def sim(request):
    """The engine: SGLang's native /generate, or vLLM's OpenAI-compatible /v1/completions
    (the API found out from /v1/models, as with a real server)."""
    with SimServer(time_scale=SIM_TIME_SCALE, flavor=request.param) as s:
        yield s


def test_three_categories_close_at_their_caps(tmp_path, redis_url, sim) -> None:
    # Given three categories of real data with small caps
    cfg = write_config(tmp_path, f"""
run = "e2e"
output_dir = "{tmp_path / 'out'}"
tokenizer = "{QWEN}"
cap_tokens = 6000
seed = 7
[[category]]
name = "qa"
source = "{DATASETS / 'question_answer' / 'gsm8k_test_first200.jsonl'}"
sampling = {{ max_new_tokens = 512, temperature = 0.7 }}
[[category]]
name = "chat"
source = "{DATASETS / 'sharegpt' / 'fastchat_dummy_conversation.json'}"
turns = "last"
sampling = {{ max_new_tokens = 512 }}
[[category]]
name = "proofs"
source = "{DATASETS / 'problem_solution' / 'qwen25math_minerva_math_test.jsonl'}"
cap_tokens = 4000
sampling = {{ max_new_tokens = 1024 }}
""")
    with started(cfg, redis_url, [sim.url], 6) as pipe:
        # When the producer runs to the end
        status = pipe.run()
    # Then every category closed at its cap with exactly-once accounting
    pipe.check_invariants(status)
    for cat in cfg.category:
        st = status["categories"][cat.name]
        assert st["state"] == "closed"
        assert 0 <= st["overshoot"] < cat.sampling.max_new_tokens
        assert st["used"] >= cfg.cap_for(cat)
    # and RQ shows one queue per category
    names = {q.name for q in Queue.all(connection=pipe.redis)}
    assert names == {"tokencap:e2e.qa", "tokencap:e2e.chat", "tokencap:e2e.proofs"}
    # and each output line carries what training needs
    rec = pipe.records("qa")[0]
    for field in ("id", "category", "prompt_ids", "output_ids", "prompt_tokens",
                  "completion_tokens", "finish_reason", "text", "sampling"):
        assert field in rec
    assert rec["completion_tokens"] == len(rec["output_ids"])
    assert rec["prompt_tokens"] == len(rec["prompt_ids"])
    assert rec["sampling"]["max_new_tokens"] == 512
    # made by the engine the run was pointed at, through its own API (the vLLM flavour has
    # no /generate: every sample went through /v1/completions)
    assert rec["model"] == "tokencap-sglang-sim" and rec["simulated"] is True
    assert sim.stats()["requests_total"] >= sum(
        status["categories"][c.name]["samples"] for c in cfg.category)
