"""32 concurrent worker processes on one category: `used` equals the sum, exactly."""

from __future__ import annotations

import json

import pytest
from rq import Queue, Worker

from sglang_sim.testing import SimServer
from testing.harness import started, wait_until
from tests.conftest import write_config

pytestmark = pytest.mark.slow

WORKERS = 32
PROMPTS = 400


def test_32_workers_one_category_count_exactly(tmp_path, redis_url) -> None:
    # Given a pre-tokenized source (no tokenizer in the way) and a cap far below the source
    src = tmp_path / "ids.jsonl"
    src.write_text("".join(json.dumps({"input_ids": [1000 + i, 7, 8, 9]}) + "\n"
                           for i in range(PROMPTS)))
    cfg = write_config(tmp_path, f"""
run = "conc"
sampling_defaults = "engine"
output_dir = "{tmp_path / 'out'}"
cap_tokens = 30000
high_water = 64
[[category]]
name = "one"
source = "{src}"
format = "input_ids"
sampling = {{ max_new_tokens = 256 }}
""")
    with SimServer(time_scale=2000.0, max_running_requests=64) as sim:
        with started(cfg, redis_url, [sim.url], WORKERS) as pipe:
            queue = Queue(pipe.keys.queue_name("one"), connection=pipe.redis)
            wait_until(lambda: Worker.count(connection=pipe.redis, queue=queue) == WORKERS,
                       timeout_s=120, what="32 workers to register")
            # When 32 workers commit concurrently
            status = pipe.run()
            engine = sim.stats()
    # Then used is exactly the sum of the committed samples, with nothing lost or doubled
    pipe.check_invariants(status)
    st = status["categories"]["one"]
    assert st["state"] == "closed"
    assert st["used"] == sum(r["completion_tokens"] for r in pipe.records("one"))
    assert st["overshoot"] < 256
    # and the workers really ran side by side on the engine
    assert max(int(b) for b, s in engine["batch_size_sim_s"].items() if s > 0) >= 8
