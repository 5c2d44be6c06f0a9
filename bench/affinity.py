"""Affinity: what sending a conversation's turns (and prompts that start alike) to one engine
buys, with the simulator's prefix cache (`sglang_sim.prefix_cache`: a radix tree with a
capacity, LRU eviction, prefill only for the uncached part) on four engines.

Conversations: CONVERSATIONS agent-like traces, TURNS generated turns each, a system prompt
of SCHEMA_WORDS words shared by the conversations of one of SCHEMAS groups (tool declarations:
~700 tokens), user turns of USER_WORDS words (tool results), replies of ~OUTPUT tokens (a tool
call with a little reasoning), rendered with the repo's Qwen2.5 tokenizer; the simulator
answers in text (the next prompt renders it back). Four engines of BATCH running requests,
4 x BATCH workers, each engine's cache CACHE_TOKENS tokens: it holds the conversations one
engine serves with affinity, not all of them (without affinity every engine sees every
conversation and evicts). The same run twice, `affinity = true` and `false`, each to the
end: output tok/s while the batch can be full (from the first commit until the last
conversation's first turn is sent: after it fewer conversations are left than workers and the
run is bound by turn latency, alike with affinity or without) and over the whole run; the
share of the reusable prompt tokens (a turn's prefix shared with the turn before:
`reusable_tokens`) served from cache (`cached_tokens`, capped at the reusable); each engine's
mean running batch over the run; the delay from a turn's reply to its next turn being fed
(`fed_at_ms`: committed, written, followed, rendered, enqueued) and sent (`sent_at_ms`: the
above and the wait in the queue for a free worker).

Single turns: the saturation scenario's mix of unique token-id prompts on the same four
engines, affinity on and off, output tok/s over a window: a unique prompt has nothing to
share and gets no affinity key (`producer.affinity`), so the two agree.
"""

from __future__ import annotations

import json
import random
import time
from contextlib import ExitStack
from statistics import quantiles
from typing import Any

from bench import saturation
from bench.context import Bench, log, row
from bench.measure import Pipeline, measure_window
from bench.sim import Sim, SimSettings
from bench.sources import QWEN, config_toml, load_run_config

NAME = "affinity"
SEED = 31
ENGINES = 4
BATCH = 16
WORKERS = ENGINES * BATCH
CONVERSATIONS = 200
TURNS = 8
SCHEMAS = 16
SCHEMA_WORDS = 600
USER_WORDS = 200
OUTPUT = (100.0, 0.5)
MAX_NEW = 512
CACHE_TOKENS = 48_000
TIME_SCALE = 2.0
# prefill of the seed's engine: it decodes ~1,000 tok/s (the simulator's default step at its
# batch of 72), and a node of DeepSeek-V3/R1's published serving prefills ~5x the tokens per
# second it decodes (73.7K vs 14.8K per H800 node, cache hits included, so this is generous to
# prefill): 5,000 prompt tok/s. The simulator's default, 50,000, is a small model's. A prefill
# stalls the running batch while it lasts (no chunking mixed into decode steps).
PREFILL_S_PER_TOKEN = 2e-4
SINGLE_TIME_SCALE = 25.0
RUN_DEADLINE_S = 240.0
TARGET_CACHED = 0.9
TARGET_SPEEDUP = 1.3
TARGET_SINGLE = 0.99
TARGET_SPREAD = 1.10
TARGET_DELAY_S = 1.0
WORDS = ("account amount answer balance booking change check city code confirm cost date "
         "detail device email error flight hotel issue item list message name number order "
         "plan policy price record refund request reservation result room search seat "
         "service status step ticket time total travel update user value weather").split()


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def write_conversations(path: Any) -> Any:
    rng = random.Random(SEED)
    schemas = [f"You can call these tools (schema {g}): " + _text(rng, SCHEMA_WORDS)
               for g in range(SCHEMAS)]
    with path.open("w") as f:
        for i in range(CONVERSATIONS):
            msgs = [{"role": "system", "content": schemas[i % SCHEMAS]}]
            for t in range(TURNS):
                msgs += [{"role": "user", "content": f"Turn {t} of {i}: " + _text(rng, USER_WORDS)},
                         {"role": "assistant", "content": "placeholder"}]
            f.write(json.dumps({"id": f"c{i}", "messages": msgs}) + "\n")
    return path


def _settings(time_scale: float, tokenizer: str | None, lengths: dict,
              prefill_s_per_token: float | None = None) -> SimSettings:
    return SimSettings(time_scale=time_scale, lengths=lengths, max_running_requests=BATCH,
                       prefix_cache_tokens=CACHE_TOKENS, tokenizer=tokenizer,
                       prefill_s_per_token=prefill_s_per_token)


def _mean_batches(sims: list[Sim]) -> list[float]:
    out = []
    for s in sims:
        st = s.stats()
        out.append(st["batch_size_time_integral"] / st["sim_time_s"] if st["sim_time_s"] else 0.0)
    return out


def _started(bench: Bench, cfg: Any, sims: list[Sim], d: Any) -> Pipeline:
    """The pipeline on `sims`, its writer and WORKERS workers started, the engines idle."""
    pipe = Pipeline(cfg, bench.redis.url, [s.url for s in sims], d / "workers.log")
    try:
        pipe.start(WORKERS, *sims)
    except BaseException:
        pipe.close()
        raise
    return pipe


def conversations(bench: Bench, sims: list[Sim], affinity: bool) -> dict[str, Any]:
    bench.fresh_redis()
    d = bench.run_dir(f"aff-{'on' if affinity else 'off'}")
    src = bench.cache.get("aff:src") or write_conversations(bench.sub("src-aff") / "conv.jsonl")
    bench.cache["aff:src"] = src
    cfg = load_run_config(d / "run.toml", f"""
run = "aff{int(affinity)}"
output_dir = "{d / 'out'}"
tokenizer = "{QWEN}"
sampling_defaults = "engine"
cap_tokens = "none"
seed = {SEED}
affinity = {"true" if affinity else "false"}
context_length = 32768
[[category]]
name = "agent"
source = "{src}"
turns = "all"
sampling = {{ max_new_tokens = {MAX_NEW}, temperature = 0.7 }}
""")
    pipe = _started(bench, cfg, sims, d)
    try:
        for s in sims:
            s.reset()
        deadline = time.monotonic() + RUN_DEADLINE_S
        status = pipe.run(should_stop=lambda: time.monotonic() > deadline)
        batches = _mean_batches(sims)
        rows = pipe.results("agent")
    finally:
        pipe.close()
    return _figures(rows, status["categories"]["agent"], batches, time.monotonic() > deadline)


def _figures(rows: list, st: dict, batches: list[float], stopped: bool) -> dict[str, Any]:
    first = min(r.sent_at_ms + r.latency_s * 1000 for r in rows)
    last = max(r.sent_at_ms + r.latency_s * 1000 for r in rows)
    tokens = sum(r.completion_tokens for r in rows)
    # steady state: until the last conversation's first turn is sent
    opened = max(r.sent_at_ms for r in rows if r.turn == min(x.turn for x in rows))
    steady = sum(r.completion_tokens for r in rows
                 if r.sent_at_ms + r.latency_s * 1000 <= opened)
    later = [r for r in rows if r.reusable_tokens]
    reusable = sum(r.reusable_tokens for r in later)
    served = sum(min(r.cached_tokens or 0, r.reusable_tokens) for r in later)
    by_turn = {(r.conversation_id, r.turn): r for r in rows}
    pairs = [(b, r) for r in rows if (b := by_turn.get((r.conversation_id, r.turn - 1)))]
    delays = [(r.sent_at_ms - (b.sent_at_ms + b.latency_s * 1000)) / 1000 for b, r in pairs]
    # the pipeline's part (the reply committed, written, followed, rendered, fed) and the
    # wait in the queue for a free worker
    fed = [(r.fed_at_ms - (b.sent_at_ms + b.latency_s * 1000)) / 1000 for b, r in pairs]
    queued = [(r.sent_at_ms - r.fed_at_ms) / 1000 for _b, r in pairs]

    def p(values: list[float], q: int) -> float:
        return quantiles(values, n=100)[q - 1] if len(values) > 1 else 0.0

    same = sum(1 for r in rows if (b := by_turn.get((r.conversation_id, r.turn - 1)))
               and b.engine == r.engine)
    mean = sum(batches) / len(batches) if batches else 0.0
    return {
        "rows": len(rows), "tokens": tokens, "wall_s": (last - first) / 1000,
        "tok_s_whole_run": tokens * 1000 / (last - first) if last > first else 0.0,
        "tok_s": steady * 1000 / (opened - first) if opened > first else 0.0,
        "steady_s": (opened - first) / 1000,
        "cached_of_reusable": served / reusable if reusable else 0.0,
        "reusable_tokens": reusable, "cached_tokens": st["cached_tokens"],
        "prompt_tokens": st["prompt_tokens"],
        "same_engine_as_turn_before": same / len(delays) if delays else 0.0,
        "engine_mean_batch": [round(b, 2) for b in batches],
        "busiest_over_mean": max(batches) / mean if mean else 0.0,
        "delay_p50_s": p(delays, 50), "delay_p99_s": p(delays, 99),
        "delay_max_s": max(delays or [0]), "pipeline_delay_p50_s": p(fed, 50),
        "pipeline_delay_p99_s": p(fed, 99), "queue_wait_p50_s": p(queued, 50),
        "queue_wait_p99_s": p(queued, 99),
        "stopped_early": stopped,
    }


def single_turn(bench: Bench, sims: list[Sim], affinity: bool) -> dict[str, Any]:
    bench.fresh_redis()
    d = bench.run_dir(f"aff-single-{int(affinity)}")
    cats = saturation.CATS
    sources = bench.sources("saturation", cats, *saturation.PROMPT_TOKENS)
    cfg = load_run_config(d / "run.toml", config_toml(
        f"affs{int(affinity)}", d / "out", cats, sources, seed=saturation.SEED,
        context_length=32768, affinity=affinity))
    pipe = _started(bench, cfg, sims, d)
    try:
        def snap() -> dict[str, float]:
            stats = [s.stats() for s in sims]
            return {"tokens": sum(x["generated_tokens_total"] for x in stats),
                    "batch": [x["batch_size_time_integral"] for x in stats],
                    "sim": [x["sim_time_s"] for x in stats]}

        a, b, wall, _samples, _ = measure_window(pipe, snap, saturation.WARMUP_S,
                                                 saturation.WINDOW_S)
    finally:
        pipe.close()
    for s in sims:
        s.wait_idle()
    batches = [(bb - ab) / (bs - as_) for ab, bb, as_, bs in
               zip(a["batch"], b["batch"], a["sim"], b["sim"], strict=True) if bs > as_]
    mean = sum(batches) / len(batches)
    return {"tok_s": (b["tokens"] - a["tokens"]) / wall, "wall_s": wall,
            "engine_mean_batch": [round(x, 2) for x in batches],
            "busiest_over_mean": max(batches) / mean if mean else 0.0}


def run(bench: Bench) -> dict[str, Any]:
    lengths = {"agent": OUTPUT}
    with ExitStack() as stack:
        sims = [stack.enter_context(Sim(bench.dir, f"aff-{i}", _settings(
            TIME_SCALE, str(QWEN), lengths, PREFILL_S_PER_TOKEN))) for i in range(ENGINES)]
        out: dict[str, Any] = {}
        for aff in (True, False):
            log(f"{NAME}: {CONVERSATIONS} conversations x {TURNS} turns on {ENGINES} engines, "
                f"affinity {'on' if aff else 'off'}")
            out["on" if aff else "off"] = conversations(bench, sims, aff)
    single_lengths = {c.name: (c.mean, c.sigma) for c in saturation.CATS}
    with ExitStack() as stack:
        sims = [stack.enter_context(Sim(bench.dir, f"affs-{i}", _settings(
            SINGLE_TIME_SCALE, None, single_lengths))) for i in range(ENGINES)]
        for aff in (True, False):
            log(f"{NAME}: single turns on {ENGINES} engines, affinity {'on' if aff else 'off'}")
            out["single_on" if aff else "single_off"] = single_turn(bench, sims, aff)
    on, off = out["on"], out["off"]
    s_on, s_off = out["single_on"], out["single_off"]
    speedup = on["tok_s"] / off["tok_s"] if off["tok_s"] else 0.0
    single = s_on["tok_s"] / s_off["tok_s"] if s_off["tok_s"] else 0.0
    spread = on["busiest_over_mean"] / off["busiest_over_mean"] if off["busiest_over_mean"] \
        else 0.0
    rows = [
        row(NAME, "reusable prompt tokens served from cache, affinity vs without",
            100 * on["cached_of_reusable"], 100 * off["cached_of_reusable"], "%",
            f">= {100 * TARGET_CACHED:g}%", on["cached_of_reusable"] >= TARGET_CACHED),
        row(NAME, "conversation tok/s while the batch can be full, affinity vs without",
            on["tok_s"], off["tok_s"], "tok/s", f">= {TARGET_SPEEDUP}x",
            speedup >= TARGET_SPEEDUP),
        row(NAME, "conversation tok/s over the whole run (latency-bound end included)",
            on["tok_s_whole_run"], off["tok_s_whole_run"], "tok/s"),
        row(NAME, "busiest engine's mean batch / the engines' mean, affinity vs without",
            on["busiest_over_mean"], off["busiest_over_mean"], "",
            f"<= {TARGET_SPREAD}x", spread <= TARGET_SPREAD),
        row(NAME, f"reply to next turn fed, p99 at {WORKERS} workers (affinity vs without)",
            on["pipeline_delay_p99_s"], off["pipeline_delay_p99_s"], "s",
            f"<= {TARGET_DELAY_S:g} s", on["pipeline_delay_p99_s"] <= TARGET_DELAY_S),
        row(NAME, "reply to next turn sent, p99 (the above + the wait for a free worker)",
            on["delay_p99_s"], off["delay_p99_s"], "s"),
        row(NAME, "single-turn tok/s, affinity vs without (nothing to share)", s_on["tok_s"],
            s_off["tok_s"], "tok/s", f">= {TARGET_SINGLE}x", single >= TARGET_SINGLE),
        row(NAME, "single turns: busiest engine's mean batch / mean (affinity vs without)",
            s_on["busiest_over_mean"], s_off["busiest_over_mean"], ""),
    ]
    return {"figures": {**out, "targets": {
        "cached_of_reusable": f">= {TARGET_CACHED}", "speedup": f">= {TARGET_SPEEDUP}",
        "single_turn_ratio": f">= {TARGET_SINGLE}", "spread_ratio": f"<= {TARGET_SPREAD}",
        "delay_p99_s": f"<= {TARGET_DELAY_S}"}},
        "settings": {"engines": ENGINES, "batch": BATCH, "workers": WORKERS,
                     "conversations": CONVERSATIONS, "turns": TURNS, "schemas": SCHEMAS,
                     "cache_tokens": CACHE_TOKENS, "time_scale": TIME_SCALE},
        "rows": rows}
