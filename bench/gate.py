"""The reply gate (`foundation.gate`) on 2,849 replies real models wrote, and the memory of
duplicate-prompt detection at 1M prompts.

- **False positives**: each reply of `tests/fixtures/replies/real_replies.jsonl.gz` (Qwen2.5-32B
  and Sky-T1-27B math, Claude Sonnet 4.5 agent turns with thinking and tool calls, GPT-4o and
  Mistral-7B chat; provenance in tests/fixtures/PROVENANCE.md) written as Qwen3 writes a turn
  (its reasoning in a think block, its calls as `<tool_call>` JSON, `<|im_end|>`), encoded
  with the Qwen3 tokenizer of the fixtures, and gated with the markers the producer derives
  for it. The replies a person read as looping (LOOPS) and those cut at the model's
  context (CUT) are the positives; a flag on any other reply is a false positive.
- **CPU per reply**: `check` over every reply, against encoding the reply's row (msgspec JSON,
  which the worker does for each commit anyway).
- **Duplicate prompts at 1M**: what the cross-category check reads is each category's
  prompt-digest hash (digest -> sample id), one entry per fed prompt; Redis's memory for
  1,000,000 entries, per entry.
"""

from __future__ import annotations

import gzip
import json
import time
from collections import Counter
from typing import Any

import msgspec

from bench.context import Bench, log, row
from budget_service.ledger import prompt_digest
from foundation.gate import check
from foundation.wire import Result
from testing.harness import ROOT

NAME = "gate"
REPLIES = ROOT / "tests" / "fixtures" / "replies" / "real_replies.jsonl.gz"
TOKENIZER = ROOT / "tests" / "fixtures" / "tokenizers" / "qwen3"
# read by a person: the replies that end in a loop, and those that ran to the model's context
LOOPS = {
    "skythought-qwen25-32b-math500": {131, 262, 336, 357, 378, 443, 456},
    "skythought-skyt1-27b-minerva": {34, 53, 60, 153, 180, 185, 186, 241, 261},
    "alpacaeval-mistral7b": {319, 342, 481, 536, 627},
}
CUT = {"skythought-qwen25-32b-math500": {132, 289, 343}}
DEDUP_PROMPTS = 1_000_000
DEDUP_BATCH = 10_000
CPU_ROUNDS = 3
TARGET_FP = 0.001  # false positives per healthy reply, at most
TARGET_CPU_US = 500.0  # per reply, at most (a worker spends ~5 ms of CPU per job)


def _turn(r: dict[str, Any]) -> str:
    text = f"<think>\n{r['reasoning']}\n</think>\n\n" if r["reasoning"] else ""
    text += r["content"]
    for c in r["tool_calls"]:
        call = json.dumps({"name": c["name"], "arguments": c["arguments"]}, ensure_ascii=False)
        text += f"\n<tool_call>\n{call}\n</tool_call>"
    return text


def false_positives() -> dict[str, Any]:
    from transformers import AutoTokenizer

    from producer.reply_parser import ReplyParser

    tok = AutoTokenizer.from_pretrained(str(TOKENIZER), local_files_only=True)
    markers = ReplyParser(tok, str(tok.chat_template)).markers()
    end = tok.convert_tokens_to_ids("<|im_end|>")
    rows = [json.loads(line) for line in gzip.open(REPLIES, "rt")]
    texts = [_turn(r) for r in rows]
    encoded = tok(texts, add_special_tokens=False)["input_ids"]
    replies = [([*ids, end], r["finish"] or "stop") for ids, r in
               zip(encoded, rows, strict=True)]
    verdicts = Counter()
    fp: list[str] = []
    loops_caught = 0
    for r, (ids, finish) in zip(rows, replies, strict=True):
        reason = check(ids, finish, markers)
        loop = r["index"] in LOOPS.get(r["source"], ())
        cut = r["index"] in CUT.get(r["source"], ())
        verdicts[f"{r['source']}: {reason or 'kept'}"] += 1
        loops_caught += int(loop and reason == "loop")
        if reason is not None and not loop and not cut:
            fp.append(f"{r['source']}#{r['index']} {reason}")
    healthy = len(rows) - sum(map(len, LOOPS.values())) - sum(map(len, CUT.values()))
    # CPU: the gate, and the row encode the worker does per commit anyway
    results = [Result(id=f"r{k}", category="c", prompt_ids=[1], output_ids=ids,
                      prompt_tokens=1, completion_tokens=len(ids), finish_reason=finish,
                      text=t, sampling={}, counted_tokens=len(ids))
               for k, ((ids, finish), t) in enumerate(zip(replies, texts, strict=True))]
    gate_s = encode_s = float("inf")
    for _ in range(CPU_ROUNDS):
        t0 = time.process_time()
        for ids, finish in replies:
            check(ids, finish, markers)
        gate_s = min(gate_s, time.process_time() - t0)
        t0 = time.process_time()
        for res in results:
            msgspec.json.encode(res)
        encode_s = min(encode_s, time.process_time() - t0)
    return {"replies": len(rows), "healthy": healthy,
            "loops": sum(map(len, LOOPS.values())), "loops_caught": loops_caught,
            "false_positives": fp, "fp_rate": len(fp) / healthy,
            "mean_tokens": sum(len(ids) for ids, _ in replies) / len(replies),
            "gate_us_per_reply": gate_s / len(replies) * 1e6,
            "encode_us_per_reply": encode_s / len(replies) * 1e6,
            "verdicts": dict(sorted(verdicts.items()))}


def dedup_memory(bench: Bench) -> dict[str, Any]:
    redis = bench.fresh_redis()
    before = int(redis.info("memory")["used_memory"])
    key = "bench:{c}:prompts"
    for start in range(0, DEDUP_PROMPTS, DEDUP_BATCH):
        pipe = redis.pipeline(transaction=False)
        pipe.hset(key, mapping={prompt_digest([i, 21, 22, 23]): f"ids:{i}"
                                for i in range(start, start + DEDUP_BATCH)})
        pipe.execute()
    after = int(redis.info("memory")["used_memory"])
    bytes_per = (after - before) / DEDUP_PROMPTS
    redis.delete(key)
    return {"prompts": DEDUP_PROMPTS, "used_memory_delta": after - before,
            "bytes_per_prompt": bytes_per, "mb_at_1m": (after - before) / 2**20}


def run(bench: Bench) -> dict[str, Any]:
    log(f"{NAME}: the reply gate on real model replies")
    fp = false_positives()
    log(f"{NAME}: duplicate-prompt digests, {DEDUP_PROMPTS:,} prompts")
    dedup = dedup_memory(bench)
    rows = [
        row(NAME, f"false positives on {fp['healthy']:,} healthy real replies",
            fp["fp_rate"] * 100, None, "%", f"<= {TARGET_FP * 100:g}%",
            fp["fp_rate"] <= TARGET_FP),
        row(NAME, f"loops caught, of {fp['loops']} a person read as loops", fp["loops_caught"],
            fp["loops"], "replies", "all", fp["loops_caught"] == fp["loops"]),
        row(NAME, f"gate CPU per reply ({fp['mean_tokens']:,.0f} tokens mean) vs encoding "
            "its row", fp["gate_us_per_reply"], fp["encode_us_per_reply"], "us",
            f"<= {TARGET_CPU_US:g} us", fp["gate_us_per_reply"] <= TARGET_CPU_US),
        row(NAME, "duplicate-prompt digests: Redis bytes per prompt (1M prompts)",
            dedup["bytes_per_prompt"], None, "B"),
        row(NAME, "duplicate-prompt digests: Redis MB at 1M prompts", dedup["mb_at_1m"], None,
            "MB"),
    ]
    return {"figures": {"replies": fp, "dedup": dedup}, "rows": rows}
