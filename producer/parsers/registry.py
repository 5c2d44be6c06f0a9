"""Reply parsers by SGLang's names, and `"auto"`: which ones a tokenizer's template calls for.

`reasoning_parser(name)` and `tool_call_parser(name)` give the parser of a name SGLang's
`--reasoning-parser` / `--tool-call-parser` take (aliases included: `qwen` = `qwen25`,
`glm` = `glm45`); "none" gives None. `choose(setting, template, vocab)` resolves "auto" from
the chat template's text and the vocabulary, saying why; where two parsers fit it raises
`Ambiguous` (the run asks for the name instead of guessing).

| family | reasoning | tool calls | told by |
|---|---|---|---|
| Kimi-K2, K2.5 | kimi_k2 | kimi_k2 | `<|tool_calls_section_begin|>` |
| DeepSeek-V3, R1 | deepseek-r1 (R1) | deepseekv3 | `<｜tool▁calls▁begin｜>`, a json fence |
| DeepSeek-V3.1 | deepseek-v3 | deepseekv31 | the same without the fence; reads `thinking` |
| DeepSeek-V3.2 | deepseek-v3 | deepseekv32 | `｜DSML｜` |
| GLM-4.5, 4.6 | glm45 | glm45 | `<arg_key>`, a newline after the name |
| GLM-4.7 | glm45 | glm47 | `<arg_key>` right after the name |
| gpt-oss | gpt-oss | gpt-oss | `<|channel|>` |
| Qwen3 | qwen3 | qwen25 | `<tool_call>`; reads `reasoning_content` |
| Qwen3-Coder | | qwen3_coder | `<function=` |
| Qwen2.5 | | qwen25 | `<tool_call>` |
| Llama 3.1-3.3 | | llama3 | `<|python_tag|>` |
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple

from foundation.errors import TokencapError
from producer.parsers.base import Call, ReasoningParser, ToolCallParser, Unparsed
from producer.parsers.deepseek import DSML, DeepSeekV3, DeepSeekV31, DeepSeekV32
from producer.parsers.glm import Glm45, Glm47
from producer.parsers.harmony import GptOssReasoning, GptOssTools
from producer.parsers.kimi import KimiK2
from producer.parsers.llama import Llama3
from producer.parsers.qwen import Qwen3Coder, Qwen25
from producer.parsers.reasoning import REASONING_PARSERS

__all__ = ["Ambiguous", "Call", "Choice", "ReasoningParser", "ToolCallParser", "Unparsed",
           "choose", "reasoning_parser", "tool_call_parser"]

AUTO, NONE = "auto", "none"
_REASONING: dict[str, type[ReasoningParser]] = {**REASONING_PARSERS,
                                                "gpt-oss": GptOssReasoning}
_TOOLS: dict[str, type[ToolCallParser]] = {
    cls.name: cls for cls in (KimiK2, DeepSeekV3, DeepSeekV31, DeepSeekV32, Glm45, Glm47,
                              GptOssTools, Qwen25, Qwen3Coder, Llama3)
}
ALIASES = {"qwen": "qwen25", "glm": "glm45"}


class Ambiguous(TokencapError, ValueError):
    """Two parsers fit a template; the config must name one."""


class Choice(NamedTuple):
    """A resolved parser name (or "none") and why it was chosen."""

    name: str
    why: str


def reasoning_parser(name: str) -> ReasoningParser | None:
    return None if name == NONE else _REASONING[ALIASES.get(name, name)]()


def tool_call_parser(name: str) -> ToolCallParser | None:
    return None if name == NONE else _TOOLS[ALIASES.get(name, name)]()


Rule = tuple[str, str, Callable[[str, set[str]], bool]]

_REASONING_RULES: list[Rule] = [
    ("gpt-oss", "the template writes harmony channels (<|channel|>)",
     lambda t, v: "<|channel|>" in t),
    ("kimi_k2", "Kimi's tool-call section and <think> are in the vocabulary",
     lambda t, v: "<|tool_calls_section_begin|>" in v and "<think>" in v),
    ("kimi", "the vocabulary has ◁think▷", lambda t, v: "\u25c1think\u25b7" in v),
    ("deepseek-v3", "a DeepSeek template with a `thinking` switch (V3.1 and later)",
     lambda t, v: "<\uff5cAssistant\uff5c>" in t and "thinking" in t and "<think>" in v),
    ("deepseek-r1", "a DeepSeek template that handles </think> (R1)",
     lambda t, v: "<\uff5cAssistant\uff5c>" in t and "thinking" not in t and "</think>" in t),
    ("glm45", "a GLM template ([gMASK], <|assistant|>) and <think> in the vocabulary",
     lambda t, v: "<|assistant|>" in t and "<think>" in v),
    ("qwen3", "the template reads reasoning_content and </think> is one token",
     lambda t, v: "<|im_start|>" in t and "reasoning_content" in t and "</think>" in v),
]

_TOOL_RULES: list[Rule] = [
    ("gpt-oss", "the template writes harmony channels (<|channel|>)",
     lambda t, v: "<|channel|>" in t),
    ("kimi_k2", "the template writes <|tool_calls_section_begin|>",
     lambda t, v: "<|tool_calls_section_begin|>" in t),
    ("deepseekv3", "the template writes <｜tool▁calls▁begin｜> with a ```json fence",
     lambda t, v: "<\uff5ctool\u2581calls\u2581begin\uff5c>" in t and "```json" in t),
    ("deepseekv31", "the template writes <｜tool▁calls▁begin｜> without a fence",
     lambda t, v: "<\uff5ctool\u2581calls\u2581begin\uff5c>" in t and "```json" not in t),
    ("deepseekv32", "the template writes DSML calls", lambda t, v: DSML in t),
    ("glm45", "GLM's <arg_key> calls, a newline after the function name",
     lambda t, v: "<arg_key>" in t and not _after_name(t).startswith("<arg_key>")),
    ("glm47", "GLM's <arg_key> calls, arguments right after the function name",
     lambda t, v: "<arg_key>" in t and not _after_name(t).startswith("\n")),
    ("qwen3_coder", "the template writes <function=NAME> calls",
     lambda t, v: "<function=" in t),
    ("qwen25", "the template writes <tool_call> JSON calls",
     lambda t, v: "<tool_call>" in t and "<function=" not in t and "<arg_key>" not in t),
    ("llama3", "the template knows <|python_tag|>", lambda t, v: "<|python_tag|>" in t),
]


GLM_FORMAT = "<tool_call>{function-name}"  # how GLM's system prompt describes its calls


def _after_name(template: str) -> str:
    """What GLM's own description of its call format puts after the function's name ("" when
    the template does not describe it: then glm45 and glm47 both fit)."""
    at = template.find(GLM_FORMAT)
    return template[at + len(GLM_FORMAT):] if at >= 0 else ""


def choose(kind: str, setting: str, template: str, vocab: Iterable[str]) -> Choice:
    """The parser `setting` names, or for "auto" the one the template and vocabulary call
    for ("none" when none does); `Ambiguous` when two fit."""
    if setting != AUTO:
        return Choice(ALIASES.get(setting, setting), "named in the config")
    rules = _REASONING_RULES if kind == "reasoning" else _TOOL_RULES
    words = set(vocab)
    fits = [(name, why) for name, why, test in rules if test(template, words)]
    names = list(dict.fromkeys(name for name, _ in fits))
    if len(names) > 1:
        raise Ambiguous(f"both the {names[0]} and the {names[1]} {kind} parsers fit the chat "
                        f"template ({fits[0][1]}; {fits[1][1]}): name one with "
                        f"{'reasoning_parser' if kind == 'reasoning' else 'tool_call_parser'}"
                        " = \"...\"")
    if not names:
        return Choice(NONE, f"auto: the template shows no {kind} syntax tokencap knows")
    return Choice(names[0], f"auto: {fits[0][1]}")


def known_names() -> tuple[set[str], set[str]]:
    """(reasoning names, tool-call names) the parsers answer to, aliases and none included."""
    return ({*_REASONING, NONE, AUTO}, {*_TOOLS, *ALIASES, NONE, AUTO})

