"""The fault suite on conversations regenerated turn by turn (turns = "all"): workers killed
mid-request, the producer killed and restarted, Redis killed -9 and restarted from its AOF
(and empty). After each: no turn twice, no conversation with a gap (turn j+1 committed
without turn j), used == the counted tokens on disk, and every conversation complete, ended
by a rejected or dead turn, or held back by its cap (`Pipeline.check_invariants`)."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from foundation.config import RunConfig
from sglang_sim.config import LengthDist
from sglang_sim.testing import SimServer
from testing.harness import Pipeline, RedisServer, ledger_state, started, wait_until
from tests.conftest import DATASETS, QWEN, ROOT, write_config
from tests.faults.common import FAULT_KNOBS, Background, worker_killer

pytestmark = pytest.mark.slow

GLAIVE = DATASETS / "agent" / "glaive_toolcall_en_demo.json"
CONVERSATIONS = DATASETS / "conversations" / "tokencap_conversations.jsonl"
SHORT = LengthDist(mean_tokens=48.0, sigma=0.5)
KILLS = 5


def conversation_config(tmp: Path, cap_agent: int = 5000, cap_chat: int = 3000) -> RunConfig:
    """Two turns = "all" categories: 60 glaive agent traces, and the 52 multi-turn chats of
    the FastChat fixture that start differently."""
    agent = tmp / "agent.json"
    agent.write_text(json.dumps(json.loads(GLAIVE.read_text())[:60]))
    chats = tmp / "chats.json"
    dummy = json.loads((DATASETS / "sharegpt" / "fastchat_dummy_conversation.json").read_text())
    multi: dict[str, dict] = {}  # multi-turn, and no two alike at turn 1 (duplicate prompts)
    for r in dummy:
        if len(r["conversations"]) >= 4:
            multi.setdefault(r["conversations"][0]["value"], r)
    chats.write_text(json.dumps(list(multi.values())))
    return write_config(tmp, f"""
run = "convfaults"
output_dir = "{tmp / 'out'}"
tokenizer = "{QWEN}"
{FAULT_KNOBS}
[[category]]
name = "agent"
source = "{agent}"
turns = "all"
cap_tokens = {cap_agent}
sampling = {{ max_new_tokens = 192 }}
[[category]]
name = "chat"
source = "{chats}"
turns = "all"
cap_tokens = {cap_chat}
sampling = {{ max_new_tokens = 192 }}
""")


@pytest.fixture
def sim():
    with SimServer(time_scale=60.0, tokenizer=str(QWEN), default_length=SHORT) as s:
        yield s


def used_total(pipe: Pipeline) -> int:
    return sum(int(ledger_state(pipe.budget, c)["used"] or 0) for c in ("agent", "chat"))


def later_turns(pipe: Pipeline) -> int:
    return sum(1 for c in ("agent", "chat") for r in pipe.results(c) if r.turn > 1)


def check(pipe: Pipeline, status: dict) -> None:
    pipe.check_invariants(status)
    for name in ("agent", "chat"):
        st = status["categories"][name]
        assert st["state"] == "closed", (name, st)
    assert later_turns(pipe) > 0, "no conversation reached its second turn"


def test_workers_killed_mid_request_on_conversations(tmp_path, redis_url, sim) -> None:
    cfg = conversation_config(tmp_path)
    kills: list[int] = []
    with started(cfg, redis_url, [sim.url], 6) as pipe:
        # every ~1,000 committed tokens, SIGKILL a worker in the middle of a turn
        status = pipe.run(should_stop=worker_killer(pipe, kills, KILLS, 1000))
    assert len(kills) == KILLS
    check(pipe, status)


@pytest.mark.timeout(480)  # the producer's rerun may take 300 s, after 120 s of waiting
def test_producer_killed_and_restarted_on_conversations(tmp_path, redis_url, sim) -> None:
    cfg = conversation_config(tmp_path)
    argv = [sys.executable, "-m", "tokencap.cli", "run", str(tmp_path / "run.toml"),
            "--redis-url", redis_url, "--sglang-url", sim.url]
    pipe = Pipeline(cfg, redis_url, [sim.url])
    try:
        pipe.start_writer()
        pipe.start_workers(4)
        first = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)
        # killed once conversations are under way (later turns fed from written ones)
        wait_until(lambda: used_total(pipe) >= 3000 and later_turns(pipe) >= 5,
                   timeout_s=120, what="conversations under way")
        first.send_signal(signal.SIGKILL)
        assert first.wait(30) == -signal.SIGKILL
        second = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert second.returncode == 0, second.stderr[-2000:]
        pipe.build()  # for the shuffled order and cursor of the gap check
        status = pipe.budget.telemetry.status()
    finally:
        pipe.close()
    check(pipe, status)


@pytest.mark.parametrize("lose_data", [False, True], ids=["aof-restart", "restart-empty"])
def test_redis_killed_and_restarted_on_conversations(tmp_path, sim, lose_data) -> None:
    server = RedisServer(tmp_path / "redis", aof=True).start()
    cfg = conversation_config(tmp_path)
    try:
        with started(cfg, server.url, [sim.url], 4) as pipe:
            bg = Background(pipe).start()
            wait_until(lambda: used_total(pipe) >= 3500 and later_turns(pipe) >= 5,
                       timeout_s=120, what="conversations under way")
            server.kill()  # kill -9
            if lose_data:
                shutil.rmtree(server.data_dir)
            server = RedisServer(server.data_dir, aof=True, port=server.port).start()
            status = bg.join(240)
        check(pipe, status)
    finally:
        server.kill()
