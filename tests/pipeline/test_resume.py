"""A run stopped midway (producer stopped, workers SIGKILLed mid-request, writer stopped) and
restarted finishes with no duplicate and no gap."""

from __future__ import annotations

import json

import pytest

from sglang_sim.testing import SimServer
from testing.harness import Pipeline
from tests.conftest import write_config

PROMPTS = 300


def config(tmp_path):
    src = tmp_path / "ids.jsonl"
    src.write_text("".join(json.dumps({"input_ids": [500 + i, 11, 12]}) + "\n"
                           for i in range(PROMPTS)))
    return write_config(tmp_path, f"""
run = "resume"
output_dir = "{tmp_path / 'out'}"
sampling_defaults = "engine"
cap_tokens = 40000
lease_s = 1.0
[[category]]
name = "a"
source = "{src}"
format = "input_ids"
sampling = {{ max_new_tokens = 512 }}
[[category]]
name = "b"
source = "{src}"
format = "input_ids"
cap_tokens = 20000
sampling = {{ max_new_tokens = 512 }}
""")


@pytest.mark.parametrize("flavor", ["sglang", "vllm"])
def test_stop_midway_and_restart(tmp_path, redis_url, flavor: str) -> None:
    cfg = config(tmp_path)
    with SimServer(time_scale=100.0, flavor=flavor) as sim:
        # the API named in the URL (`openai+`), as `SGLANG_URL=openai+http://...` does
        url = f"openai+{sim.url}" if flavor == "vllm" else sim.url
        # Given a run interrupted once 40% of category a's budget is used
        first = Pipeline(cfg, redis_url, [url])
        first.build()
        first.start_writer()
        first.start_workers(8)
        cap_a = cfg.cap_for(cfg.by_name("a"))

        def midway() -> bool:
            st = first.budget.telemetry.status()["categories"]["a"]
            return st["used"] >= 0.4 * cap_a and st["in_flight"] > 0

        mid = first.run(should_stop=midway)
        assert mid["categories"]["a"]["state"] == "open"
        first.kill_workers()  # SIGKILL: requests in flight are lost mid-way
        first.stop_writer()
        in_flight = first.budget.telemetry.status()["categories"]["a"]["in_flight"]

        # When everything is started again from scratch
        second = Pipeline(cfg, redis_url, [url])
        second.build()
        second.start_writer()
        second.start_workers(8)
        try:
            status = second.run()
        finally:
            second.close()

    # Then the run completes: no duplicate, no gap, used equals the files
    second.check_invariants(status)
    assert in_flight > 0  # samples were lost mid-request and had to be re-enqueued
    for name in ("a", "b"):
        assert status["categories"][name]["state"] == "closed"
        assert status["categories"][name]["samples"] == len(second.committed(name))
    # and the restart resumed the shuffled order where it stopped instead of starting over
    assert second.producer.feeds["a"].cursor < PROMPTS
