"""The hidden-state stage (`tokencap hidden-states`) against plain requests of one token.

The kept rows of a written run (`bench.export.write_run`) go through the stage: the producer,
four worker processes and the writer, the simulator playing vLLM's extraction server (it
writes a bf16 safetensors file per request, as vLLM's connector does; states of 4 layers x
HIDDEN). Each worker reads the engine's file under its lock, checks it (shape, dtype, finite,
no layer all zeros, ids), writes it whole under the row's name and removes the engine's copy.
The baseline, in the same run: the same rows as prompts of a plain generation run with
`max_new_tokens = 1` (the request an extraction is) on the same simulator without extraction,
through the same pipeline (both timed from the start of their worker processes to the last
row written). The figure is the stage's rows/s against the baseline's, and the
bytes/s of states it kept. What vLLM itself spends extracting (15-45% more CPU per request on
a tiny model, measured by `make test-engine`'s server) is not here: the simulator stands in.
"""

from __future__ import annotations

import json
import time
from typing import Any

from bench.context import Bench, log, row

NAME = "hidden_states"
TOKENS = 400_000  # of rows: prompt + output
LAYERS = [2, 4, 5, 8]
HIDDEN = 128
WORKERS = 4
TARGET_RATIO = 0.5  # the stage's rows/s, at least this share of plain one-token requests'
VOCAB = 150_000  # ids the simulator takes
PROMPT, REPLY_MEAN = 200, 300


def write_run(folder: Any, tokens: int, seed: int) -> int:
    """A finished run's part file of single-turn rows, about `tokens` tokens; the rows."""
    import random

    from foundation.wire import Result, encode

    rng = random.Random(seed)
    cat = folder / "chat"
    cat.mkdir(parents=True, exist_ok=True)
    n = written = 0
    with (cat / "part-00001.jsonl").open("wb") as f:
        while written < tokens:
            prompt = [rng.randrange(VOCAB) for _ in range(PROMPT)]
            output = [rng.randrange(VOCAB) for _ in range(max(1, int(rng.expovariate(
                1 / REPLY_MEAN))))]
            f.write(encode(Result(id=f"c{n}", category="chat", prompt_ids=prompt,
                                  output_ids=output, prompt_tokens=len(prompt),
                                  completion_tokens=len(output), finish_reason="stop",
                                  text="", sampling={}, counted_tokens=len(output))) + b"\n")
            written += len(prompt) + len(output)
            n += 1
    return n


def _config(work: Any, out: Any, hs: Any, source: Any, sampling: str) -> Any:
    from foundation.config import load_config

    model = work / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 8, "hidden_size": HIDDEN, "torch_dtype": "bfloat16"}))
    path = work / f"{out.name}.toml"
    path.write_text(f"""
run = "{out.name}"
output_dir = "{out}"
sampling_defaults = "engine"
count = "total"
reply_gate = false
lease_s = 30.0
[hidden_states]
model_config = "{model / 'config.json'}"
output_dir = "{hs}"
[[category]]
name = "chat"
source = "{source}"
format = "input_ids"
cap_tokens = "none"
sampling = {sampling}
""")
    return load_config(path)


def run(bench: Bench) -> dict[str, Any]:
    from foundation.outputs import rows_file
    from sglang_sim.testing import SimServer
    from testing.harness import started
    from tokencap.stack.stage import run_hidden_states

    work = bench.sub(NAME)
    gen = work / "gen"
    rows = write_run(gen, TOKENS, 3)
    log(f"{NAME}: {rows:,} rows ({TOKENS:,} tokens) through the stage, {WORKERS} workers")
    dummy = work / "dummy.jsonl"
    dummy.write_text(json.dumps({"input_ids": [1, 2, 3]}) + "\n")
    cfg = _config(work, gen, work / "hs", dummy, "{ max_new_tokens = 1 }")
    storage = work / "engine-files"
    storage.mkdir(exist_ok=True)
    redis = bench.fresh_redis()
    with SimServer(flavor="vllm", time_scale=1000.0, extract_hidden_states=True,
                   hs_layer_ids=LAYERS, hs_hidden_size=HIDDEN, hs_dtype="bfloat16",
                   hs_storage_path=str(storage)) as sim:
        t0 = time.perf_counter()
        status = run_hidden_states(cfg, bench.redis.url, WORKERS, extract_url=sim.url,
                                      redis=redis, progress_s=1.0, say=lambda line: None)
        stage_s = time.perf_counter() - t0
    st = status.categories["chat"]
    kept = status.state_bytes(st)
    assert kept is not None  # a hidden-state stage's status says its bytes
    # the baseline: the same rows, as one-token prompts of a plain run on the same pipeline
    log(f"{NAME}: the baseline, the same rows as plain one-token requests")
    plain_out = work / "plain"
    plain_cfg = _config(work, plain_out, work / "unused",
                        rows_file(cfg.states().output_dir, "chat"), "{ max_new_tokens = 1 }")
    bench.fresh_redis()
    with SimServer(flavor="vllm", time_scale=1000.0) as sim:
        t0 = time.perf_counter()  # its workers' start counted, as the stage's are
        with started(plain_cfg, bench.redis.url, [sim.url], WORKERS) as pipe:
            plain_status = pipe.run()
        plain_s = time.perf_counter() - t0
    plain_rows = plain_status["categories"]["chat"]["samples"]
    stage_rate = st.samples / stage_s
    plain_rate = plain_rows / plain_s
    bytes_s = kept.used / stage_s
    figures = {"rows": rows, "stage_rows": st.samples, "stage_s": stage_s,
               "bytes": kept.used, "plain_rows": plain_rows, "plain_s": plain_s,
               "layers": LAYERS, "hidden": HIDDEN, "workers": WORKERS}
    return {"figures": figures, "rows": [
        row(NAME, f"stage rows/s (states of {len(LAYERS)} x {HIDDEN}, bf16, checked and "
            "kept) vs plain max_tokens = 1 requests, same pipeline and simulator",
            stage_rate, plain_rate, "rows/s", f"ratio >= {TARGET_RATIO:g}",
            stage_rate / plain_rate >= TARGET_RATIO and st.samples == rows),
        row(NAME, "bytes of states kept per second", bytes_s / 1e6, None, "MB/s"),
    ]}
