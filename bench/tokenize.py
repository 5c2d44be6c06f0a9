"""Tokenization: producer prompts/s through the chat template and the tokenizer
(`producer.render.Renderer.render_many`, as the producer calls it per feed batch) against
the same tokenizer's plain batch encode of the already rendered strings, and the template
alone. Prompts: the ShareGPT fixture (fastchat dummy conversations) read through the
producer's own reader, repeated to PROMPTS; Qwen2.5 fixture tokenizer; batches of BATCH.
Each variant runs ROUNDS times interleaved with the others; the best round counts.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from bench.context import Bench, log, row
from bench.sources import QWEN, SHAREGPT, load_run_config

NAME = "tokenize"
PROMPTS = 4000
BATCH = 32
ROUNDS = 5


def _prompts(path: Path, work: Path) -> list[list[dict]]:
    """The first prompts of a ShareGPT source, read as the producer reads them."""
    from producer.source import CategorySource

    body = "\n".join([
        'run = "tokenize"', f"output_dir = {json.dumps(str(work))}",
        f"tokenizer = {json.dumps(str(QWEN))}",
        'sampling_defaults = "engine"', "[[category]]", 'name = "c"',
        f"source = {json.dumps(str(path))}", 'format = "sharegpt"', 'cap_tokens = "none"',
        "sampling = { max_new_tokens = 1 }"]) + "\n"
    cfg = load_run_config(work / "tokenize.toml", body)
    with CategorySource.open(cfg, cfg.category[0]) as source:
        convs = [cast(list[dict], source.read(i).prompt) for i in range(len(source))]
    return [convs[i % len(convs)] for i in range(PROMPTS)]


def _rate(fn: Callable[[list[Any]], Any], items: list[Any]) -> float:
    t0 = time.perf_counter()
    for i in range(0, len(items), BATCH):
        fn(items[i : i + BATCH])
    return len(items) / (time.perf_counter() - t0)


def run(bench: Bench) -> dict[str, Any]:
    from producer.render import Renderer

    log(f"{NAME}: loading the Qwen2.5 fixture tokenizer")
    t0 = time.perf_counter()
    renderer = Renderer(QWEN)
    load_s = time.perf_counter() - t0
    prompts = _prompts(SHAREGPT, bench.sub(NAME))
    texts = [renderer.render_text(m) for m in prompts]
    tok = renderer.tokenizer
    variants: dict[str, Callable[[list[Any]], Any]] = {
        "render_many": renderer.render_many,
        "batch_encode": lambda batch: tok(batch, add_special_tokens=False)["input_ids"],
        "template_only": lambda batch: [renderer.render_text(m) for m in batch],
    }
    inputs = {"render_many": prompts, "batch_encode": texts, "template_only": prompts}
    best = dict.fromkeys(variants, 0.0)
    log(f"{NAME}: {PROMPTS} prompts, batches of {BATCH}, {ROUNDS} rounds")
    for _ in range(ROUNDS):
        for name, fn in variants.items():
            best[name] = max(best[name], _rate(fn, inputs[name]))
    ids = renderer.render_many(prompts[:BATCH])
    mean_tokens = sum(len(r[1]) for r in ids) / len(ids)
    ratio = best["render_many"] / best["batch_encode"]
    rows = [
        row(NAME, "prompts/s render_many vs batch encode of rendered text",
            best["render_many"], best["batch_encode"], "prompt/s"),
        row(NAME, "prompts/s chat template alone vs batch encode", best["template_only"],
            best["batch_encode"], "prompt/s"),
        row(NAME, "render_many vs template+encode run back to back", best["render_many"],
            1 / (1 / best["template_only"] + 1 / best["batch_encode"]), "prompt/s"),
        row(NAME, "tokenizer load time", load_s, None, "s"),
    ]
    return {"figures": {"prompts_s": best, "ratio_render_many_vs_encode": ratio,
                        "mean_prompt_tokens": mean_tokens, "tokenizer_load_s": load_s},
            "settings": {"prompts": PROMPTS, "batch": BATCH, "rounds": ROUNDS,
                         "source": str(SHAREGPT), "tokenizer": str(QWEN)},
            "rows": rows}
