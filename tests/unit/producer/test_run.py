"""`producer/run.py`: the run's start. `load_renderer` checks the template against the config
(a chat-template kwarg the template never reads is refused naming its field);
`build_producer` checks the sources before Redis is touched, writes the manifest, creates
the run and rebuilds it from the output files (a resume feeds none of what is on disk);
`run_to_end` holds the run's producer lease while it runs, and a second producer on the run
is refused."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import msgspec
import pytest
from redis import Redis

from budget_service.budget import Budget
from budget_service.keys import Keys
from budget_service.lease import producer_lease
from foundation.config import RunConfig
from foundation.errors import ConfigError, ProducerBusy
from foundation.wire import Result, encode
from producer.feeder import Producer
from producer.manifest import manifest_path
from producer.run import build_producer, load_renderer, run_to_end
from sglang_sim.testing import SimServer
from testing.harness import final_marks
from tests.conftest import QWEN, write_config
from tests.faults.common import FAULT_KNOBS
from tests.helpers import result
from writer.files import CategorySink

QWEN3 = QWEN.parent / "qwen3"
CAT = "code"
PROMPTS = 6


def ids_config(tmp: Path, extra: str = "", source: str = "") -> RunConfig:
    """A run of six token-id prompts (no tokenizer), sampling left to the engine."""
    src = tmp / "ids.jsonl"
    src.write_text("".join(f'{{"input_ids": [{400 + i}, 5, 6]}}\n' for i in range(PROMPTS)))
    return write_config(tmp, f"""
run = "start"
output_dir = "{tmp / 'out'}"
{FAULT_KNOBS}
{extra}
[[category]]
name = "{CAT}"
source = "{source or src}"
format = "input_ids"
cap_tokens = "none"
sampling = {{ max_new_tokens = 16 }}
""")


def chat_config(tmp: Path, tokenizer: Path, head: str = "", cat_kwargs: str = "") -> RunConfig:
    (tmp / "src.jsonl").write_text('{"prompt": "Say hi."}\n')
    return write_config(tmp, f"""
run = "chat"
output_dir = "{tmp / 'out'}"
tokenizer = "{tokenizer}"
{head}
[[category]]
name = "first"
source = "{tmp / 'src.jsonl'}"
sampling = {{ max_new_tokens = 8 }}
[[category]]
name = "second"
source = "{tmp / 'src.jsonl'}"
{cat_kwargs}
sampling = {{ max_new_tokens = 8 }}
""")


# -- load_renderer --------------------------------------------------------------------------

def test_a_chat_template_kwarg_the_template_never_reads_is_refused_naming_its_field(
        tmp_path: Path) -> None:
    # Qwen2.5's template has no thinking switch
    run_wide = chat_config(tmp_path, QWEN, head="chat_template_kwargs = "
                                               "{ enable_thinking = false }")
    with pytest.raises(ConfigError) as err:
        load_renderer(run_wide)
    assert err.value.path == "$.chat_template_kwargs.enable_thinking"
    assert f"the chat template of {QWEN} never reads `enable_thinking`" in err.value.message
    # Qwen3's reads `enable_thinking`, not Kimi's `thinking`: a category's own kwargs too
    kimis = chat_config(tmp_path, QWEN3, cat_kwargs="chat_template_kwargs = { thinking = true }")
    with pytest.raises(ConfigError) as err:
        load_renderer(kimis)
    assert err.value.path == "$.category[1].chat_template_kwargs.thinking"
    assert "the names it reads besides the messages and tools: " in err.value.message
    assert "enable_thinking" in err.value.message  # what it reads, named
    # the switch it reads is taken
    qwen3 = chat_config(tmp_path, QWEN3, cat_kwargs="chat_template_kwargs = "
                                                     "{ enable_thinking = false }")
    renderer = load_renderer(qwen3)
    assert renderer is not None and renderer.template_variables >= {"enable_thinking"}


def test_no_renderer_without_a_tokenizer_and_one_that_does_not_load_names_the_field(
        tmp_path: Path) -> None:
    cfg = ids_config(tmp_path)
    assert load_renderer(cfg) is None  # every category is token ids
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError) as err:
        load_renderer(msgspec.structs.replace(cfg, tokenizer=str(tmp_path / "empty")))
    assert err.value.path == "$.tokenizer"


# -- build_producer ---------------------------------------------------------------------------

def rows_on_disk(cfg: RunConfig, rows: list[Result]) -> None:
    sink = CategorySink(Path(cfg.output_dir), CAT)
    sink.write([(encode(r), r) for r in rows], [None] * len(rows))
    sink.close()


def test_build_producer_creates_the_run_and_rebuilds_it_from_the_files(
        tmp_path: Path, redis: Redis) -> None:
    cfg = ids_config(tmp_path)
    # Given two rows on disk (a run whose Redis is gone) and an empty Redis
    rows_on_disk(cfg, [result("ids:1", 10), result("ids:2", 7)])
    # When the producer is built
    producer = build_producer(cfg, redis, None)
    budget = Budget(redis, Keys(cfg.key_prefix, cfg.run))
    # Then the run exists, counted from the files, its config naming the manifest
    assert set(final_marks(budget, CAT)) == {"ids:1", "ids:2"}
    st = budget.telemetry.status()["categories"][CAT]
    assert (st["used"], st["samples"]) == (17, 2)
    made_by = producer.cfg.made_by
    assert made_by.startswith("start@") and manifest_path(Path(cfg.output_dir),
                                                          made_by).is_file()
    stored = budget.load_config()
    assert stored is not None and stored.made_by == made_by
    assert len(producer.feeds[CAT].source) == PROMPTS
    # and the first tick feeds every record but those on disk
    producer.tick()
    fed = {v.decode() for v in redis.hkeys(budget.keys.cat(CAT).pending)}
    assert fed == {f"ids:{n}" for n in range(3, PROMPTS + 1)}


def test_build_producer_sends_the_models_end_of_turn_as_stop_ids(tmp_path: Path,
                                                                 redis: Redis) -> None:
    cfg = chat_config(tmp_path, QWEN)
    producer = build_producer(cfg, redis, None)
    # Qwen2.5's <|endoftext|> and <|im_end|>; the vocabulary's size, for the workers' check
    assert [c.sampling.stop_token_ids for c in producer.cfg.category] == [[151643, 151645]] * 2
    assert producer.cfg.vocab_size == 151665


def test_a_source_that_cannot_be_read_is_refused_before_redis_is_touched(
        tmp_path: Path, redis: Redis) -> None:
    broken = tmp_path / "broken.json"
    broken.write_text('[{"input_ids": [1, 2]},, {}]')
    cfg = ids_config(tmp_path, source=str(broken))
    with pytest.raises(ConfigError) as err:
        build_producer(cfg, redis, None)
    assert err.value.path == "$.category[0].source" and "broken.json" in err.value.message
    assert redis.keys("*") == []


# -- run_to_end ---------------------------------------------------------------------------------

def test_run_to_end_holds_the_producer_lease_while_it_runs(tmp_path: Path,
                                                           redis: Redis) -> None:
    cfg = ids_config(tmp_path)
    lease = producer_lease(redis, Keys(cfg.key_prefix, cfg.run))
    held: list[tuple[str, str | None]] = []

    def before_feed(producer: Producer) -> None:
        held.append((producer.cfg.made_by, lease.holder()))

    with SimServer(time_scale=1000.0) as sim:
        status = run_to_end(cfg, redis, [sim.url], before_feed=before_feed,
                            should_stop=lambda: True)
    # the producer was built (the run made, the manifest named) under the lease...
    ((made_by, holder),) = held
    assert made_by.startswith("start@")
    assert holder is not None and holder.startswith(f"{socket.gethostname()}:{os.getpid()}:")
    # ... which is given back at the end; the engine checked is recorded
    assert lease.holder() is None
    assert [e.model for e in status.engines.values()] == ["tokencap-sglang-sim"]


def test_run_to_end_refuses_a_second_producer_on_the_run(tmp_path: Path,
                                                         redis: Redis) -> None:
    # a short lease: how long a producer waits for a killed holder's lease to run out
    cfg = msgspec.structs.replace(ids_config(tmp_path), lock_ttl_s=0.2)
    # Given another producer running the run
    other = producer_lease(redis, Keys(cfg.key_prefix, cfg.run), ttl_s=600.0)
    other.acquire()
    try:
        with SimServer(time_scale=1000.0) as sim:
            with pytest.raises(ProducerBusy, match=r"another producer is running run "
                                                   r"'start' \(lease .* held by "):
                run_to_end(cfg, redis, [sim.url])
        # Then nothing was created, and the other producer keeps its lease
        assert not Budget(redis, Keys(cfg.key_prefix, cfg.run)).has_run()
        assert other.holder() == other.token
    finally:
        other.release()
