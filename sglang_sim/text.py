"""Text-like outputs, for a simulator given a tokenizer (``--tokenizer DIR``).

Without a tokenizer the simulator answers random ids (`sglang_sim.outputs`). With one, each
answer is the token ids of words from a small list, so a client that decodes outputs and
renders them back into a chat (a conversation regenerated turn by turn) sees text. Still no
language model: the words are drawn from the request's seed, and a request's answer is a
pure function of its prompt ids, sampling seed and the simulator seed, as before.

What the answer looks like, from the rendered prompt (decoded; Qwen/Hermes chat syntax):

- a reasoning model (the vocabulary has ``<think>`` as one token) thinks first,
  ``<think>\\n...\\n</think>\\n\\n``, unless the prompt already ends with an empty think block
  (``enable_thinking = false``);
- a prompt that offers tools (``<tools>...</tools>``) and whose last message is the user's
  answers with one tool call in the template's syntax,
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, for a tool the prompt
  lists, with an argument for each required parameter; after a tool result
  (``<tool_response>``) it answers in words;
- the answer ends with the end-of-turn id (the simulator's ``eos_token_id``).
The natural length is drawn as before (lognormal per category); a tool call is as long as
its JSON, and reasoning takes about half the words.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

WORDS = (
    "the model reads each line and checks the answer against a plan so that every step "
    "follows from the one before it with care for detail while the numbers add up to a "
    "total we can trust in the end because small errors grow over time"
).split()
THINK_START, THINK_END = "<think>", "</think>"
EMPTY_THINK_TAIL = "<think>\n\n</think>\n\n"
_TOOLS = re.compile(r"<tools>\n(.*?)\n</tools>", re.DOTALL)
_LAST_TURN = "<|im_start|>"
_ARG_VALUES: dict[str, Any] = {"integer": 3, "number": 2.5, "boolean": True,
                               "array": [1, 2], "object": {}}


class TextOutputs:
    """A tokenizer that turns a seed and a length into a text-like answer (module doc)."""

    def __init__(self, tokenizer_path: str | Path, eos_token_id: int) -> None:
        from transformers import AutoTokenizer  # heavy: only for a simulator given one

        self.tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path),
                                                       local_files_only=True)
        self.eos_token_id = eos_token_id
        self.reasoning = THINK_START in self.tokenizer.get_vocab()

    def natural_ids(self, seed: int, length: int, input_ids: list[int]) -> list[int]:
        """The whole answer to a prompt (its end-of-turn id last); `length` (>= 1) is the
        natural length drawn for it."""
        rng = random.Random(seed)
        prompt = str(self.tokenizer.decode(input_ids[-4096:], skip_special_tokens=False))
        text = ""
        words = max(1, length - 1)
        if self.reasoning and not prompt.endswith(EMPTY_THINK_TAIL):
            half = max(1, words // 2)
            text = f"{THINK_START}\n{self._words(rng, half)}\n{THINK_END}\n\n"
            words = max(1, words - half)
        call = self._tool_call(rng, prompt)
        text += call if call is not None else self._words(rng, words)
        return [*self.encode(text), self.eos_token_id]

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        """The reply's ``text``: the ids without the end-of-turn id, special tokens skipped."""
        return str(self.tokenizer.decode([t for t in ids if t != self.eos_token_id],
                                         skip_special_tokens=True))

    @staticmethod
    def _words(rng: random.Random, n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    @staticmethod
    def _tool_call(rng: random.Random, prompt: str) -> str | None:
        """One call to a tool the prompt offers, when the last message is the user's."""
        found = _TOOLS.search(prompt)
        if found is None:
            return None
        last_turn = prompt[prompt.rfind(_LAST_TURN, 0, max(0, prompt.rfind(_LAST_TURN))):]
        if "<tool_response>" in last_turn:
            return None
        tools = []
        for line in found.group(1).splitlines():
            try:
                tool = json.loads(line)
            except json.JSONDecodeError:
                continue
            fn = tool.get("function", tool) if isinstance(tool, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("name"), str):
                tools.append(fn)
        if not tools:
            return None
        fn = rng.choice(tools)
        params = fn.get("parameters") or {}
        props = params.get("properties") or {} if isinstance(params, dict) else {}
        required = params.get("required") or list(props) if isinstance(params, dict) else []
        args = {}
        for name in required:
            kind = (props.get(name) or {}).get("type", "string") if isinstance(props, dict) \
                else "string"
            args[name] = _ARG_VALUES.get(kind, rng.choice(WORDS))
        body = json.dumps({"name": fn["name"], "arguments": args}, ensure_ascii=False)
        return f"<tool_call>\n{body}\n</tool_call>"
