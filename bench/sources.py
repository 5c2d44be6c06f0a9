"""The benchmark's categories and prompt sources: `Cat`, pre-tokenized sources written in
milliseconds, the producer's order of a source, run configs over them."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import msgspec

from testing.harness import ROOT

FIXTURES = ROOT / "tests" / "fixtures"
QWEN = FIXTURES / "tokenizers" / "qwen2.5-instruct"
SHAREGPT = FIXTURES / "datasets" / "sharegpt" / "fastchat_dummy_conversation.json"
VOCAB = 150_000


@dataclass(frozen=True)
class Cat:
    """One benchmark category: output-length lognormal, max_new_tokens, cap, prompt count."""

    name: str
    mean: float
    sigma: float
    max_new: int
    cap: int = 10**12
    prompts: int = 1000


def write_ids_source(path: Path, n: int, seed: int, min_len: int, max_len: int) -> Path:
    """`n` pre-tokenized prompts (format input_ids), each unique, lengths uniform in range.

    A prompt is a unique 2-id head plus a slice of one random block, so writing a few
    thousand 1,000-token prompts takes milliseconds rather than seconds.
    """
    rng = random.Random(seed)
    block = [rng.randrange(1000, VOCAB) for _ in range(max_len + 4096)]
    enc = msgspec.json.Encoder()
    with path.open("wb") as f:
        for i in range(n):
            length = rng.randint(min_len, max_len)
            start = rng.randrange(4096)
            ids = [seed % VOCAB, 1000 + i, *block[start : start + length - 2]]
            f.write(enc.encode({"input_ids": ids}) + b"\n")
    return path


def ordered_prompts(path: Path, seed: int) -> list[list[int]]:
    """The prompts of an input_ids source in the producer's seeded shuffled order, read as
    the producer reads them (`CategorySource`)."""
    from producer.source import CategorySource

    body = "\n".join([
        'run = "order"', f"output_dir = {json.dumps(str(path.parent))}", f"seed = {seed}",
        'sampling_defaults = "engine"', "[[category]]", 'name = "c"',
        f"source = {json.dumps(str(path))}", 'format = "input_ids"', 'cap_tokens = "none"',
        "sampling = { max_new_tokens = 1 }"]) + "\n"
    cfg = load_run_config(path.with_suffix(".order.toml"), body)
    with CategorySource.open(cfg, cfg.category[0]) as source:
        return [cast(list[int], source.read(i).prompt) for i in source.order]


def config_toml(run: str, out: Path, cats: list[Cat], sources: dict[str, Path],
                **top: Any) -> str:
    # token-id prompts, no tokenizer and no generation config: the engine's sampling
    lines = [f'run = "{run}"', f'output_dir = "{out}"', 'sampling_defaults = "engine"']
    lines += [f"{k} = {json.dumps(v)}" for k, v in top.items()]
    for c in cats:
        lines += ["[[category]]", f'name = "{c.name}"', f'source = "{sources[c.name]}"',
                  'format = "input_ids"', f"cap_tokens = {c.cap}",
                  f"sampling = {{ max_new_tokens = {c.max_new} }}"]
    return "\n".join(lines) + "\n"


def load_run_config(path: Path, body: str) -> Any:
    from foundation.config import load_config

    path.write_text(body)
    return load_config(path)
