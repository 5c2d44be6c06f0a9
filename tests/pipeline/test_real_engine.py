"""tokencap against a real engine: vLLM's CPU build serving a tiny random Qwen2 model made at
test time (`make test-engine`, tests/engine/run.py), or any vLLM or SGLang server a user
points TOKENCAP_ENGINE_URL at (with TOKENCAP_ENGINE_TOKENIZER, its model's tokenizer).

The real client, a real Redis, real worker processes. Small caps: minutes, not tens of them.
Without an engine these are skipped, except under `make test-engine`, where a missing engine
fails them (TOKENCAP_ENGINE_REQUIRED).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import requests

from budget_service.telemetry import status_document
from foundation.engine.load import read_load
from foundation.errors import EngineUnusable
from producer.preflight import preflight
from producer.render import Renderer
from producer.run import load_renderer, run_to_end
from testing.harness import Pipeline, started, wait_until
from tests.conftest import DATASETS, FIXTURES, write_config
from tests.engine_protocol import differences, facts

# a request may take 600 s on a loaded CPU, the engine's restart too
pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(1500)]

GSM8K = DATASETS / "question_answer" / "gsm8k_test_first200.jsonl"
CONVERSATIONS = DATASETS / "conversations" / "tokencap_conversations.jsonl"
PHI3 = FIXTURES / "tokenizers" / "phi-3-mini"
# sampling a random model over 152K ids: top_p < 1 or a repetition penalty cost 5x on CPU
FAST = "temperature = 1.0, top_p = 1.0, top_k = -1, repetition_penalty = 1.0"
WORD_BIAS, END_BIAS = 10.0, 12.0  # about one end of turn in eight tokens


class Engine:
    def __init__(self, url: str, tokenizer: Path, restart: list[str] | None) -> None:
        self.url = url
        self.tokenizer = tokenizer
        self.restart_cmd = restart


@pytest.fixture(scope="session")
def engine() -> Engine:
    url = os.environ.get("TOKENCAP_ENGINE_URL")
    if not url:
        if os.environ.get("TOKENCAP_ENGINE_REQUIRED"):
            pytest.fail("TOKENCAP_ENGINE_URL is not set: `make test-engine` starts the engine")
        pytest.skip("no real engine (TOKENCAP_ENGINE_URL; `make test-engine` starts one)")
    tok = Path(os.environ.get("TOKENCAP_ENGINE_TOKENIZER")
               or FIXTURES / "tokenizers" / "qwen2.5-instruct")
    restart = os.environ.get("TOKENCAP_ENGINE_RESTART")
    return Engine(url.rstrip("/"), tok, json.loads(restart) if restart else None)


class _Proxy(BaseHTTPRequestHandler):
    """Forwards to the engine and records every generation request and its reply."""

    target = ""
    log: list[tuple[dict[str, Any], dict[str, Any]]] = []

    def _forward(self, method: str) -> None:
        n = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(n) if n else None
        r = requests.request(method, self.target + self.path, data=body, timeout=600,
                             headers={k: v for k, v in self.headers.items()
                                      if k.lower() in ("content-type", "authorization")})
        if method == "POST" and self.path.startswith(("/v1/completions", "/generate")) \
                and r.ok and body:
            type(self).log.append((json.loads(body), r.json()))
        self.send_response(r.status_code)
        self.send_header("Content-Type", r.headers.get("Content-Type", "application/json"))
        self.send_header("Content-Length", str(len(r.content)))
        self.end_headers()
        self.wfile.write(r.content)

    def do_GET(self) -> None:
        self._forward("GET")

    def do_POST(self) -> None:
        self._forward("POST")

    def log_message(self, *_args: Any) -> None:
        pass


@pytest.fixture
def proxy(engine: Engine) -> Iterator[tuple[str, list]]:
    handler = type("Recording", (_Proxy,), {"target": engine.url, "log": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler.log
    finally:
        server.shutdown()


def _exchange(req: dict[str, Any], rep: dict[str, Any]) -> tuple[list[int], list[int]]:
    """The prompt ids sent and the output ids answered, in SGLang's or vLLM's shape."""
    if "input_ids" in req:
        return req["input_ids"], rep["output_ids"]
    return req["prompt"], rep["choices"][0]["token_ids"]


def _is_vllm(engine: Engine) -> bool:
    card = requests.get(f"{engine.url}/v1/models", timeout=10).json()["data"][0]
    return card.get("owned_by") == "vllm"


def _config(tmp: Path, engine: Engine, body: str, head: str = "lease_s = 10.0") -> Any:
    return write_config(tmp, f"""
run = "real"
output_dir = "{tmp / 'out'}"
tokenizer = "{engine.tokenizer}"
{head}
{body}""")


def _run(cfg: Any, redis_url: str, url: str, workers: int) -> tuple[dict[str, Any], Pipeline]:
    """`run_to_end` as `tokencap run` does it (the preflight, the engine's context length),
    the writer and `workers` worker processes started before the first feed; the status as
    JSON (`tokencap status --json`'s)."""
    pipe = Pipeline(cfg, redis_url, [url])

    def start(_producer: Any) -> None:
        pipe.start_writer()
        pipe.start_workers(workers)

    try:
        status = run_to_end(cfg, pipe.redis, [url], before_feed=start)
    finally:
        pipe.close()
    return status_document(status), pipe


def test_the_engine_answers_the_protocol_as_the_simulator_plays_it(engine: Engine) -> None:
    if not _is_vllm(engine):
        pytest.skip("the protocol facts are vLLM's /v1/completions answers")
    renderer = Renderer(engine.tokenizer)
    found = facts(engine.url, int(renderer.eos_token_id), int(renderer.vocab_size))
    assert differences(found) == {}


def test_preflight_reads_the_engine_and_refuses_another_tokenizer(tmp_path, engine) -> None:
    cfg = _config(tmp_path, engine, f"""
[[category]]
name = "math"
source = "{GSM8K}"
sampling = {{ max_new_tokens = 16, {FAST} }}""")
    (info,) = preflight(cfg, [engine.url], load_renderer(cfg))
    assert info.api == "openai" and info.model and info.version and not info.simulated
    assert info.context_length and info.context_length >= 1024
    other = write_config(tmp_path, cfg_text(cfg_path=tmp_path, tokenizer=PHI3), "phi.toml")
    with pytest.raises(EngineUnusable, match="does not serve the tokenizer's model"):
        preflight(other, [engine.url], load_renderer(other))


def cfg_text(cfg_path: Path, tokenizer: Path) -> str:
    return f"""
run = "phi"
output_dir = "{cfg_path / 'out-phi'}"
tokenizer = "{tokenizer}"
preflight_wait_s = 1
[[category]]
name = "math"
source = "{GSM8K}"
sampling = {{ max_new_tokens = 16, temperature = 0.0 }}"""


def test_a_run_end_to_end_keeps_the_engines_own_ids(tmp_path, engine, proxy, redis_url) -> None:
    url, log = proxy
    cfg = _config(tmp_path, engine, f"""
[[category]]
name = "math"
source = "{GSM8K}"
cap_tokens = 1500
sampling = {{ max_new_tokens = 48, {FAST} }}""")
    status, pipe = _run(cfg, redis_url, url, 4)
    rows = pipe.committed("math")
    load, _source = read_load(requests.get, engine.url, None, (3.05, 10.0))
    replies = {tuple(sent): answered for sent, answered in (_exchange(*x) for x in log)}
    assert rows and len(replies) >= len(rows)
    for row in rows:  # exactly what the engine answered, and the prompt it was sent
        assert replies[tuple(row.prompt_ids)] == row.output_ids, row.id
    st = status["categories"]["math"]
    assert st["used"] == sum(r.counted_tokens for r in rows) >= 1500
    assert st["state"] == "closed" and st["in_flight"] == 0 and st["reserved"] == 0
    pipe.check_invariants(status)
    (info,) = status["engines"].values()
    assert info["api"] == "openai" and not info.get("simulated")
    assert {(r.model, r.engine_version, r.simulated) for r in rows} == {
        (info["model"], info["version"], False)}
    assert load is not None and load["running"] is not None and load["queued"] is not None


def test_a_prompt_that_cannot_fit_the_context_is_rejected_before_the_engine(
        tmp_path, engine, proxy, redis_url) -> None:
    url, log = proxy
    src = tmp_path / "long.jsonl"
    words = " ".join(["tokens"] * 3990)
    src.write_text(json.dumps({"question": words}) + "\n" + json.dumps({"question": "hi"}) + "\n")
    cfg = _config(tmp_path, engine, f"""
[[category]]
name = "edge"
source = "{src}"
cap_tokens = "none"
sampling = {{ max_new_tokens = 200, {FAST} }}""")
    status, pipe = _run(cfg, redis_url, url, 2)
    dead = pipe.dead("edge")
    assert [d.reason for d in dead] == ["prompt_too_long"]
    assert "exceeds the engine context" in dead[0].message
    # vLLM would have accepted it and cut its output silently: it never saw it
    assert all(len(_exchange(*x)[0]) < 3000 for x in log)
    assert status["categories"]["edge"]["samples"] == 1


def test_killed_midway_and_finished_again_nothing_twice(tmp_path, engine, redis_url) -> None:
    cfg = _config(tmp_path, engine, f"""
[[category]]
name = "math"
source = "{GSM8K}"
cap_tokens = 2000
sampling = {{ max_new_tokens = 48, {FAST} }}""", head="lease_s = 4.0")
    # the engine's context length, as the preflight reads it
    pipe = Pipeline(cfg, redis_url, [engine.url])
    try:
        pipe.build()
        pipe.start_writer()
        pipe.start_workers(3)
        stop = threading.Event()
        done: dict[str, Any] = {}
        t = threading.Thread(target=lambda: done.setdefault("st", pipe.run(
            should_stop=stop.is_set)))
        t.start()
        wait_until(lambda: pipe.budget.telemetry.status()["categories"]["math"]["samples"] >= 5,
                   timeout_s=240, what="samples to commit")
        stop.set()  # the producer stops mid-way
        t.join(60)
        pipe.kill_worker(pipe.workers[0].pid, signal.SIGKILL)  # a worker dies mid-sample
        if engine.restart_cmd:  # the engine goes away and comes back
            _restart(engine)
        pipe.build()  # a new producer: it reaps the dead worker's sample and finishes
        status = pipe.run()
        pipe.check_category(status, "math")
    finally:
        pipe.close()
    rows = pipe.committed("math")
    assert len({r.id for r in rows}) == len(rows)
    assert status["categories"]["math"]["used"] == sum(r.counted_tokens for r in rows)


def _restart(engine: Engine) -> None:
    assert engine.restart_cmd is not None
    subprocess.run(engine.restart_cmd, check=True, timeout=600)


def test_conversations_on_the_engine_extend_each_turn(tmp_path, engine, redis_url) -> None:
    # a random model: its logits favour whole words (each one token with its space) and the
    # end of turn, so that what it writes decodes and renders back to the ids it generated
    renderer = Renderer(engine.tokenizer)
    words = ["the", "model", "reads", "each", "line", "and", "checks", "answer", "plan",
             "step", "care", "numbers", "total", "time", "small", "errors"]
    bias = {str(ids[0]): WORD_BIAS for ids in (renderer.encode(" " + w) for w in words)
            if len(ids) == 1}
    bias[str(renderer.eos_token_id)] = END_BIAS
    table = "{ " + ", ".join(f'"{k}" = {v}' for k, v in bias.items()) + " }"
    # min_new_tokens: with the end of turn this likely, a reply can be the end of turn alone;
    # the gate rejects it as empty and its conversation stops there. Only three of the
    # fixture's conversations can reach a second turn without tools, so by chance none may.
    cfg = _config(tmp_path, engine, f"""
[[category]]
name = "chat"
source = "{CONVERSATIONS}"
turns = "all"
role_map = {{ customer = "user", agent = "assistant" }}
cap_tokens = "none"
sampling = {{ max_new_tokens = 40, min_new_tokens = 2, {FAST}, logit_bias = {table} }}""")
    with started(cfg, redis_url, [engine.url], 3) as pipe:
        status = pipe.run()
        pipe.check_category(status, "chat")
        rows = pipe.committed("chat")
    later = [r for r in rows if r.turn > 1 and "<tools>" not in renderer.decode(r.prompt_ids)]
    by_turn = {(r.conversation_id, r.turn): r for r in rows}

    def canonical(ids: list[int]) -> bool:
        """Whether the text of these output ids encodes back to them. The bias makes most
        replies whole words, but at temperature 1 the model can still pick a split a text
        never encodes to (" an" + "swer"); no template can render that turn back."""
        body = [i for i in ids if i != renderer.eos_token_id]
        return renderer.encode(renderer.decode(body)) == body

    assert later, "no conversation without tools reached a second turn"
    split = {r.id: canonical(by_turn[(r.conversation_id, r.turn - 1)].output_ids)
             for r in later}
    assert any(split.values()), "no reply of whole words: the bias did not hold"
    # a reply that re-encodes to its ids extends the conversation; one that cannot is flagged
    # with the reason, never passed off as consistent
    wrong = [(r.id, r.history_notes) for r in later
             if r.prefix_consistent != split[r.id] or (not split[r.id] and not r.history_notes)]
    assert not wrong, wrong


def test_cached_tokens_are_the_engines_prefix_cache_hits(tmp_path, engine, redis_url) -> None:
    if not _is_vllm(engine):
        pytest.skip("vllm:prefix_cache_hits_total is vLLM's counter")
    def hits() -> float:
        page = requests.get(f"{engine.url}/metrics", timeout=10).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
                   if line.startswith("vllm:prefix_cache_hits_total"))

    src = tmp_path / "shared.jsonl"
    system = "You are a careful assistant. " * 60  # a long system prompt the samples share
    src.write_text("".join(json.dumps({"messages": [
        {"role": "system", "content": system}, {"role": "user", "content": f"Question {i}?"}]})
        + "\n" for i in range(12)))
    cfg = _config(tmp_path, engine, f"""
[[category]]
name = "shared"
source = "{src}"
cap_tokens = "none"
sampling = {{ max_new_tokens = 8, {FAST} }}""")
    pipe = Pipeline(cfg, redis_url, [engine.url])
    try:
        pipe.build()
        before = hits()  # after the preflight's own requests
        pipe.start_writer()
        pipe.start_workers(1)  # one at a time: each finds the one before in the cache
        status = pipe.run()
        after = hits()
    finally:
        pipe.close()
    rows = pipe.committed("shared")
    assert len(rows) == 12 and all(r.cached_tokens is not None for r in rows)
    assert sum(r.cached_tokens or 0 for r in rows) == after - before > 0
    assert status["categories"]["shared"]["cached_tokens"] == after - before
