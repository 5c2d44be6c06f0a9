"""The tokenizer folders of the model families tokencap's users train drafters for, assembled
at test time from `tests/fixtures/tokenizers/` (provenance in its PROVENANCE.md).

The vocabularies are stored as the tiktoken rank files the models ship or that their
tokenizer.json is built from (a few MB each, where a tokenizer.json is 10-28 MB); a
`tokenizer.json` is built from one with transformers' `TikTokenConverter`, the family's
pre-tokenizer pattern and its special tokens at their ids, then saved beside the family's
own configs and chat template. gpt-oss's and Llama 3.1's come out byte-identical to the
published files (`UPSTREAM_SHA256`, checked in tests/pipeline/test_families.py); Kimi-K2.5's encode
as the model's own tokenizer does (`kimi-k2.5/reference_encodings.json`).

`folder(name, dest)` makes one; `kimi_with_code(dest)` the Kimi folder as a user has it,
with a `tokenization_kimi.py` (a stand-in written here, not Moonshot's file: see its
docstring), loadable only with `trust_remote_code`.
"""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.conftest import FIXTURES

TOKENIZERS = FIXTURES / "tokenizers"

# the pre-tokenizer patterns, as the families' own tokenizers state them
CL100K_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}"
                  r"\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
O200K_PATTERN = "|".join([
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n/]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+",
])
KIMI_PATTERN = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}"
    r"&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}"
    r"&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+",
])
DEEPSEEK_SPLITS = [
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}"
    "\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
]
UPSTREAM_SHA256 = {
    # tokenizer.json of openai/gpt-oss-20b (its Git LFS pointer) and of
    # meta-llama/Llama-3.1-8B-Instruct @0e9e39f
    "gpt-oss-20b": "0614fe83cadab421296e664e1f48f4261fa8fef6e03e63bb75c20f38e37d07d3",
    "llama-3.1-instruct": "79e3e522635f3171300913bb421464a87de6222182a0570b9b2ccba2a964b2b4",
}


def _converted(ranks: Path, pattern: str, specials: list[str] | None) -> Any:
    from transformers.convert_slow_tokenizer import TikTokenConverter

    return TikTokenConverter(vocab_file=str(ranks), pattern=pattern,
                             extra_special_tokens=specials).converted()


def _copy(src: Path, dest: Path, names: list[str]) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for name in names:
        shutil.copy(src / name, dest / name)


def _kimi_specials() -> list[str]:
    cfg = json.loads((TOKENIZERS / "kimi-k2.5" / "tokenizer_config.json").read_text())
    named = {int(k): v["content"] for k, v in cfg["added_tokens_decoder"].items()}
    return [named.get(i, f"<|reserved_token_{i}|>") for i in range(163584, 163840)]


def kimi(dest: Path) -> Path:
    """Kimi-K2.5 without the model's code: a fast tokenizer of the same ids."""
    src = TOKENIZERS / "kimi-k2.5"
    _converted(src / "tiktoken.model", KIMI_PATTERN, _kimi_specials()).save(
        str(dest / "tokenizer.json"))
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    cfg.pop("auto_map")
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    (dest / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    _copy(src, dest, ["chat_template.jinja", "generation_config.json"])
    return dest


def kimi_with_code(dest: Path) -> Path:
    """Kimi-K2.5's folder as a user has it: tiktoken.model, its tokenizer_config.json
    (auto_map: tokenization_kimi.TikTokenTokenizer) and a tokenization_kimi.py."""
    src = TOKENIZERS / "kimi-k2.5"
    _copy(src, dest, ["tiktoken.model", "tokenizer_config.json", "chat_template.jinja",
                      "generation_config.json"])
    shutil.copy(FIXTURES / "code" / "tokenization_kimi.py", dest / "tokenization_kimi.py")
    return dest


def gpt_oss(dest: Path) -> Path:
    src = TOKENIZERS / "gpt-oss-20b"
    named = {199998: "<|startoftext|>", 199999: "<|endoftext|>", 200002: "<|return|>",
             200003: "<|constrain|>", 200005: "<|channel|>", 200006: "<|start|>",
             200007: "<|end|>", 200008: "<|message|>", 200012: "<|call|>",
             200018: "<|endofprompt|>"}
    specials = [named.get(i, f"<|reserved_{i}|>") for i in range(199998, 200019)]
    _converted(src / "o200k_base.tiktoken", O200K_PATTERN, specials).save(
        str(dest / "tokenizer.json"))
    _copy(src, dest, ["tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                      "special_tokens_map.json"])
    return dest


def llama(dest: Path) -> Path:
    src = TOKENIZERS / "llama-3.1-instruct"
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>",
                "<|reserved_special_token_2|>", "<|start_header_id|>", "<|end_header_id|>",
                "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"] + [
        f"<|reserved_special_token_{i}|>" for i in range(3, 248)]
    doc = json.loads(_converted(src / "llama3.tiktoken", CL100K_PATTERN, specials).to_str())
    bos = "<|begin_of_text|>"
    byte_level = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False,
                  "use_regex": True}
    doc["post_processor"] = {"type": "Sequence", "processors": [byte_level, {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": bos, "type_id": 0}},
                   {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": bos, "type_id": 0}},
                 {"Sequence": {"id": "A", "type_id": 0}},
                 {"SpecialToken": {"id": bos, "type_id": 1}},
                 {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {bos: {"id": bos, "ids": [128000], "tokens": [bos]}}}]}
    doc["model"]["merges"] = [" ".join(m) for m in doc["model"]["merges"]]
    (dest / "tokenizer.json").write_text(json.dumps(doc, indent=2, ensure_ascii=False))
    _copy(src, dest, ["tokenizer_config.json", "generation_config.json",
                      "special_tokens_map.json"])
    return dest


DEEPSEEK_TOKENS = (
    ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"],
    [f"<｜place▁holder▁no▁{i}｜>" for i in range(798)] + [
        "<think>", "</think>", "<｜fim▁hole｜>", "<｜fim▁begin｜>", "<｜fim▁end｜>", "<｜User｜>",
        "<｜Assistant｜>", "<|EOT|>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
        "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁outputs▁begin｜>",
        "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>",
        "<｜tool▁sep｜>"],
)
# not special (they survive skip_special_tokens, as DeepSeek's own tokenizer.json has them)
DEEPSEEK_PLAIN = {"<think>", "</think>", "<｜fim▁hole｜>", "<｜fim▁begin｜>", "<｜fim▁end｜>",
                  "<｜User｜>", "<｜Assistant｜>"} | {t for t in DEEPSEEK_TOKENS[1] if "tool" in t}


def _raw_ranks(src: Path, dest: Path) -> Path:
    """A rank file of raw token bytes, from one whose tokens are the byte-level strings of
    a tokenizer.json vocabulary (as ml-rust/splintr extracted DeepSeek's)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    unbyte = {c: b for b, c in bytes_to_unicode().items()}
    lines = []
    for line in src.read_bytes().splitlines():
        token, rank = line.split()
        text = base64.b64decode(token).decode("utf-8")
        raw = bytes(unbyte[c] for c in text) if all(c in unbyte for c in text) else \
            text.encode("utf-8")
        lines.append(base64.b64encode(raw) + b" " + rank)
    dest.write_bytes(b"\n".join(lines) + b"\n")
    return dest


def deepseek(dest: Path, variant: str) -> Path:
    """DeepSeek's 128K vocabulary (ids 0-2 and 128000-128814 its special tokens) with the
    configs of `variant` (r1, v3, v3.1, v3.2: a template written here from V3.2's Python
    encoder's output, V3.2 shipping none)."""
    from tokenizers import Regex, Tokenizer, pre_tokenizers, processors

    ranks = _raw_ranks(TOKENIZERS / "deepseek" / "deepseek_v3.tiktoken", dest / "ranks")
    tok = _converted(ranks, CL100K_PATTERN, None)
    ranks.unlink()
    doc = json.loads(tok.to_str())
    first, later = DEEPSEEK_TOKENS
    # the rank file holds ranks 0-2 as the bytes of the three first special tokens: they are
    # the special tokens themselves, not byte-level pieces to merge into
    vocab = doc["model"]["vocab"]
    pieces = {piece for piece, i in vocab.items() if i < len(first)}
    doc["model"]["vocab"] = {p: i for p, i in vocab.items() if p not in pieces}
    doc["model"]["merges"] = [m for m in doc["model"]["merges"] if "".join(m) not in pieces]
    for i, content in enumerate(first):
        doc["model"]["vocab"][content] = i
    added = [(i, t) for i, t in enumerate(first)] + [(128000 + i, t) for i, t in enumerate(later)]
    doc["added_tokens"] = [{"id": i, "content": t, "single_word": False, "lstrip": False,
                            "rstrip": False, "normalized": False,
                            "special": t not in DEEPSEEK_PLAIN} for i, t in added]
    tok = Tokenizer.from_str(json.dumps(doc))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in DEEPSEEK_SPLITS]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    bos = first[0]
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A",
                                                       pair=f"{bos} $A {bos} $B",
                                                       special_tokens=[(bos, 0)])
    tok.save(str(dest / "tokenizer.json"))
    src = TOKENIZERS / "deepseek" / variant
    _copy(src, dest, sorted(p.name for p in src.iterdir()))
    return dest


def glm(dest: Path, version: str = "4.5") -> Path:
    from tokenizers import AddedToken

    src = TOKENIZERS / "glm-4.5"
    tok = _converted(src / "tokenizer.model", CL100K_PATTERN, None)
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    added = sorted(cfg["added_tokens_decoder"].items(), key=lambda kv: int(kv[0]))
    tok.add_tokens([AddedToken(v["content"], normalized=False, special=v["special"])
                    for _, v in added])
    tok.save(str(dest / "tokenizer.json"))
    _copy(src, dest, ["tokenizer_config.json", "generation_config.json", "chat_template.jinja"])
    if version != "4.5":
        shutil.copy(TOKENIZERS / f"glm-{version}" / "chat_template.jinja",
                    dest / "chat_template.jinja")
    return dest


def qwen3_coder(dest: Path) -> Path:
    src = TOKENIZERS / "qwen3-coder"
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json", "generation_config.json"):
        shutil.copy((src / name).resolve(), dest / name)
    return dest


BUILDERS: dict[str, Callable[[Path], Path]] = {
    "kimi-k2.5": kimi,
    "deepseek-r1": lambda d: deepseek(d, "r1"),
    "deepseek-v3": lambda d: deepseek(d, "v3"),
    "deepseek-v3.1": lambda d: deepseek(d, "v3.1"),
    "deepseek-v3.2": lambda d: deepseek(d, "v3.2"),
    "glm-4.5": glm,
    "glm-4.7": lambda d: glm(d, "4.7"),
    "gpt-oss-20b": gpt_oss,
    "llama-3.1-instruct": llama,
    "qwen3-coder": qwen3_coder,
}


def folder(name: str, dest: Path) -> Path:
    """The tokenizer folder of family `name`, assembled under `dest` (once)."""
    target = dest / name
    if not (target / "tokenizer_config.json").exists():
        target.mkdir(parents=True, exist_ok=True)
        BUILDERS[name](target)
    return target


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
