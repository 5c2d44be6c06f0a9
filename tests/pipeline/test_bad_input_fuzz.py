"""Generated bad input (hypothesis): every record is either read or rejected with a named
reason, file and line; nothing else escapes. Plus the big cases: a 50 MB line, a missing
file and an unreadable tokenizer, which stop nothing or stop before anything is enqueued."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from producer.formats.records import Rejected
from producer.readers.index import SourceIndex, read_sample
from producer.readers.scan import UTF8_BOM, WHITESPACE
from sglang_sim.testing import SimServer
from testing.harness import started
from tests.conftest import QWEN, ROOT, write_config

REASONS = {
    "invalid_json", "invalid_utf8", "not_an_object", "missing_field", "wrong_type",
    "empty_turn", "unknown_role", "no_user_turn", "empty_conversation", "line_too_long",
    "unknown_format",
}  # fmt: skip
KEYS = ["question", "problem", "instruction", "input", "messages", "conversations",
        "input_ids", "role", "content", "from", "value", "system", "id"]
scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 10**6), st.text(max_size=8))
values = st.recursive(scalars, lambda c: st.one_of(st.lists(c, max_size=4),
                                                     st.dictionaries(st.sampled_from(KEYS), c,
                                                                     max_size=4)),
                      max_leaves=12)
records = st.dictionaries(st.sampled_from(KEYS), values, max_size=5)
junk_lines = st.binary(min_size=1, max_size=40).filter(lambda b: b"\n" not in b and b.strip())
lines = st.lists(st.one_of(records.map(lambda r: json.dumps(r).encode()), junk_lines),
                 min_size=1, max_size=25)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=lines, fmt=st.sampled_from(["auto", "messages", "sharegpt", "question_answer",
                                         "input_ids", "alpaca"]))
@example(lines=[b"\xef\xbb\xbf"], fmt="auto")  # a file that is only a BOM: no record
@example(lines=[b"\x0c"], fmt="auto")  # a form feed is no JSON whitespace: a bad record
def test_generated_records_are_read_or_rejected_with_file_and_line(tmp_path, lines, fmt) -> None:
    path = tmp_path / "gen.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    index = SourceIndex.build([path])
    seen_lines = []
    for i in range(len(index)):
        try:
            sample = read_sample(index, i, fmt, "first", None)
            assert sample.where == f"{path}:{index.ref(i).line}"
            assert sample.prompt
        except Rejected as exc:
            assert exc.reason in REASONS, exc.reason
            assert exc.where == f"{path}:{index.ref(i).line}"
        seen_lines.append(index.ref(i).line)
    # blank: only the reader's whitespace, after the UTF-8 BOM a file may start with
    non_blank = [n for n, raw in enumerate(lines, 1)
                 if (raw.removeprefix(UTF8_BOM) if n == 1 else raw).strip(WHITESPACE)]
    assert seen_lines == non_blank  # every line was visited, in file order


def test_a_50_mb_line_is_rejected_and_the_run_goes_on(tmp_path, redis_url) -> None:
    src = tmp_path / "big.jsonl"
    with src.open("w") as f:
        f.write(json.dumps({"question": "What is 2 + 2?"}) + "\n")
        f.write(json.dumps({"question": "x" * (50 * 1024 * 1024)}) + "\n")
        f.write(json.dumps({"question": "What is 3 + 3?"}) + "\n")
    cfg = write_config(tmp_path, f"""
run = "big"
output_dir = "{tmp_path / 'out'}"
tokenizer = "{QWEN}"
context_length = 32768
[[category]]
name = "qa"
source = "{src}"
sampling = {{ max_new_tokens = 32 }}
""")
    with SimServer(time_scale=1000.0) as sim:
        with started(cfg, redis_url, [sim.url], 1) as pipe:
            status = pipe.run()
    pipe.check_invariants(status)
    assert status["categories"]["qa"]["samples"] == 2
    (dead,) = pipe.dead_letters("qa")
    assert dead["reason"] == "prompt_too_long"
    assert dead["where"] == f"{os.path.relpath(src, cfg.output_dir)}:2"


def run_cli(cfg_path: Path, redis_url: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tokencap.cli", "run", str(cfg_path),
                           "--redis-url", redis_url], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


def test_unreadable_tokenizer_stops_before_anything_is_enqueued(tmp_path, redis_url,
                                                                 redis) -> None:
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer_config.json").write_text("{ not json")
    src = tmp_path / "q.jsonl"
    src.write_text(json.dumps({"question": "hi"}) + "\n")
    cfg_path = tmp_path / "run.toml"
    cfg_path.write_text(f"""
run = "tok"
output_dir = "{tmp_path / 'out'}"
tokenizer = "{tok}"
[[category]]
name = "qa"
source = "{src}"
sampling = {{ max_new_tokens = 8 }}
""")
    proc = run_cli(cfg_path, redis_url)
    assert proc.returncode == 2, proc.stderr
    assert str(tok) in proc.stderr and "Traceback" not in proc.stderr
    assert redis.dbsize() == 0  # nothing written to Redis, nothing enqueued


def test_missing_source_file_stops_before_anything_is_enqueued(tmp_path, redis_url,
                                                               redis) -> None:
    cfg_path = tmp_path / "run.toml"
    cfg_path.write_text(f"""
run = "missing"
output_dir = "{tmp_path / 'out'}"
tokenizer = "{QWEN}"
[[category]]
name = "qa"
source = "{tmp_path / 'nope.jsonl'}"
sampling = {{ max_new_tokens = 8 }}
""")
    proc = run_cli(cfg_path, redis_url)
    assert proc.returncode == 2
    assert "nope.jsonl" in proc.stderr and "$.category[0].source" in proc.stderr
    assert redis.dbsize() == 0
