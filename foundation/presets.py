"""Dataset presets: `preset = "NAME"` in a category reads the layout of a dataset drafter
trainers use, from a local copy of its files (`source`) or, without one, from the dataset's
own files in the local Hugging Face cache (`hf://datasets/...`: nothing is downloaded).

A preset sets the category's `format`, `field_map` and `role_map`; giving any of them beside
a preset is refused (the preset would silently lose). What each layout holds, and where its
system prompt and tools live, is in docs/DATA.md ("Presets").
"""

from __future__ import annotations

from typing import NamedTuple


class Preset(NamedTuple):
    dataset: str  # the Hugging Face dataset id
    files: str  # the split's files in the dataset's repository (a glob)
    format: str  # one of foundation.config.FORMATS
    field_map: dict[str, str] = {}
    role_map: dict[str, str] = {}
    note: str = ""
    # the keys that tell a record of this dataset (`tokencap init`); none: told by its format
    keys: frozenset[str] = frozenset()

    @property
    def source(self) -> str:
        return f"hf://datasets/{self.dataset}/{self.files}"


PRESETS: dict[str, Preset] = {
    "sharegpt": Preset(
        "anon8231489123/ShareGPT_Vicuna_unfiltered", "ShareGPT_V3_unfiltered_cleaned_split.json",
        "sharegpt",
        note="a JSON list of {id, conversations: [{from: human|gpt, value}]}"),
    "ultrachat": Preset(
        "HuggingFaceH4/ultrachat_200k", "data/train_sft-*.parquet", "messages",
        note="{prompt, prompt_id, messages: [{role: user|assistant, content}]}, split train_sft",
        keys=frozenset({"prompt", "prompt_id", "messages"})),
    "openthoughts": Preset(
        "open-thoughts/OpenThoughts-114k", "data/train-*.parquet", "sharegpt",
        note="{system, conversations: [{from: user|assistant, value}]}: the top-level system "
             "prompt is used", keys=frozenset({"system", "conversations"})),
    "magpie": Preset(
        "Magpie-Align/Magpie-Llama-3.1-Pro-300K-Filtered", "data/train-*.parquet", "auto",
        field_map={"prompt": "instruction"},
        note="{uuid, instruction, response, conversations, ...}: the prompt is `instruction`",
        keys=frozenset({"uuid", "instruction"})),
    "nemotron": Preset(
        "nvidia/Llama-Nemotron-Post-Training-Dataset", "SFT/chat/*.jsonl", "auto",
        field_map={"messages": "input", "system": "system_prompt"},
        note="{input: [{role, content}], output, system_prompt, reasoning, ...}: the turns are "
             "`input`, the system prompt (\"detailed thinking on|off\") `system_prompt`",
        keys=frozenset({"input", "output", "system_prompt"})),
    "hermes": Preset(
        "NousResearch/hermes-function-calling-v1", "func-calling-singleturn.json", "sharegpt",
        note="{id, conversations: [{from: system|human|gpt|tool, value}], ...}: the tools are "
             "Hermes text in the system turn (<tools>); a `tools` column, where the revision "
             "has one, goes to the chat template as its tools",
        keys=frozenset({"conversations", "category", "subcategory"})),
    "opencodeinstruct": Preset(
        "nvidia/OpenCodeInstruct", "data/train-*.parquet", "auto",
        field_map={"prompt": "input"},
        note="{id, input, output, domain, unit_tests, ...}: the prompt is `input`",
        keys=frozenset({"input", "output", "domain", "generation_algorithm"})),
}


def preset_of(record: object) -> str | None:
    """The preset whose dataset `record` is from, told by its keys (the most specific
    match), or None."""
    if not isinstance(record, dict):
        return None
    found = [(len(p.keys), name) for name, p in PRESETS.items()
             if p.keys and p.keys <= record.keys()]
    return max(found)[1] if found else None
