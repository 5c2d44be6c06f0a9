"""The reasoning parsers of the `<think>` families, by SGLang's `--reasoning-parser` names
(python/sglang/srt/parser/reasoning_parser.py, DetectorMap, read in 0.5.23).

| name | tags | interrupted by | forced |
|---|---|---|---|
| qwen3, qwen3-thinking | `<think>` / `</think>` | `<tool_call>` | qwen3-thinking |
| deepseek-r1 | `<think>` / `</think>` | | always |
| deepseek-v3 | `<think>` / `</think>` (a Qwen3 parser: DeepSeek-V3.1) | `<tool_call>` | |
| glm45 | `<think>` / `</think>` | `<tool_call>` | |
| kimi_k2 | `<think>` / `</think>` | `<|tool_calls_section_begin|>` | |
| kimi | `◁think▷` / `◁/think▷` (Kimi-VL, k1.5) | | |

SGLang's server forces qwen3, glm45 and kimi_k2 while the template's thinking switch is on,
and deepseek-v3 only when `thinking = true`: here the prompt says it, `opened` being true
when the rendered prompt ends in an open `<think>` (Kimi-K2.5, DeepSeek-V3.1 and R1-0528
put it there); Qwen3 and GLM write `<think>` themselves, which starts the reasoning anyway.
"""

from __future__ import annotations

from producer.parsers.base import ReasoningParser


class Qwen3(ReasoningParser):
    name = "qwen3"
    interrupt = "<tool_call>"


class Qwen3Thinking(Qwen3):
    name = "qwen3-thinking"
    forced = True


class DeepSeekR1(ReasoningParser):
    name = "deepseek-r1"
    forced = True


class DeepSeekV3(Qwen3):
    name = "deepseek-v3"


class Glm45(ReasoningParser):
    name = "glm45"
    interrupt = "<tool_call>"


class KimiK2(ReasoningParser):
    name = "kimi_k2"
    interrupt = "<|tool_calls_section_begin|>"


class Kimi(ReasoningParser):
    name = "kimi"
    start = "\u25c1think\u25b7"
    end = "\u25c1/think\u25b7"


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    cls.name: cls for cls in (Qwen3, Qwen3Thinking, DeepSeekR1, DeepSeekV3, Glm45, KimiK2, Kimi)
}
