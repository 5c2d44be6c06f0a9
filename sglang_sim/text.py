"""Text-like outputs, for a simulator given a tokenizer (``--tokenizer DIR``).

Without a tokenizer the simulator answers random ids (`sglang_sim.outputs`). With one, each
answer is the token ids of words from a small list, so a client that decodes outputs and
renders them back into a chat (a conversation regenerated turn by turn) sees text. Still no
language model: the words are drawn from the request's seed, and a request's answer is a
pure function of its prompt ids, sampling seed and the simulator seed, as before.

A reply fault (`FaultConfig.reply_rates`, drawn from the request's seed) shapes an answer
as a model at its worst writes one: ``loop`` (one phrase over and over until max_new_tokens),
``empty`` (the reasoning block closed, then nothing), ``unclosed`` (reasoning that ends
without its closing tag).

What the answer looks like is its family's grammar (``--family NAME``, `sglang_sim.families`:
reasoning block, tool-call syntax, end-of-turn token); without one, Qwen's: qwen3 when the
vocabulary has ``<think>`` as one token, else qwen25. The natural length is drawn as before
(lognormal per category); a tool call is as long as its syntax, and reasoning takes about
half the words.
"""

from __future__ import annotations

import random
from pathlib import Path

from sglang_sim.families import FAMILIES, turn

WORDS = (
    "the model reads each line and checks the answer against a plan so that every step "
    "follows from the one before it with care for detail while the numbers add up to a "
    "total we can trust in the end because small errors grow over time"
).split()
THINK_START = "<think>"
PROMPT_TAIL_IDS = 8192  # the prompt's last ids decoded to choose the answer
LOOP_REPEATS = 2000  # a looping answer's phrase repeats: longer than any max_new_tokens
END_TOKENS = ("<|im_end|>", "<｜end▁of▁sentence｜>", "<|user|>", "<|observation|>",
              "<|return|>", "<|call|>", "<|eot_id|>", "<|eom_id|>")


class TextOutputs:
    """A tokenizer that turns a seed and a length into a text-like answer (module doc)."""

    def __init__(self, tokenizer_path: str | Path, eos_token_id: int,
                 family: str | None = None, trust_remote_code: bool = False) -> None:
        from transformers import AutoTokenizer  # heavy: only for a simulator given one

        self.tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path),
                                                       local_files_only=True,
                                                       trust_remote_code=trust_remote_code)
        vocab = self.tokenizer.get_vocab()
        name = family or ("qwen3" if THINK_START in vocab else "qwen25")
        if name not in FAMILIES:
            raise ValueError(f"unknown family {name!r}; one of {', '.join(sorted(FAMILIES))}")
        self.family = FAMILIES[name]
        self.eos_token_id = eos_token_id
        self._vocab = vocab

    def end_id(self, token: str) -> int:
        """The id of an end-of-turn token of the family (the simulator's eos without it)."""
        tid = self._vocab.get(token)
        return tid if isinstance(tid, int) else self.eos_token_id

    def natural_ids(self, seed: int, length: int, input_ids: list[int],
                    shape: str = "") -> list[int]:
        """The whole answer to a prompt (its end-of-turn id last); `length` (>= 1) is the
        natural length drawn for it; `shape` a reply fault (module docstring), "" none."""
        rng = random.Random(seed)
        prompt = str(self.tokenizer.decode(input_ids[-PROMPT_TAIL_IDS:],
                                           skip_special_tokens=False))
        content = turn(self.family, prompt, rng, WORDS, max(1, length - 1))
        if shape == "loop":  # no end: the engine stops it at max_new_tokens
            phrase = " " + " ".join(rng.choice(WORDS) for _ in range(5)) + "."
            text, _ = self.family.write(content._replace(call=None, words=phrase.strip()))
            return self.encode(text + phrase * LOOP_REPEATS)
        if shape == "empty":
            content = content._replace(reasoning=content.reasoning or "thinking", words="",
                                       call=None)
        text, end = self.family.write(content)
        if shape == "unclosed" and content.reasoning:  # cut where the reasoning ends
            text = text[: text.index(content.reasoning) + len(content.reasoning)]
        return [*self.encode(text), self.end_id(end)]

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        """The reply's ``text``: the ids without the end-of-turn id, special tokens skipped."""
        body = ids[:-1] if ids and ids[-1] in self._end_ids() else ids
        return str(self.tokenizer.decode(body, skip_special_tokens=True))

    def _end_ids(self) -> set[int]:
        return {self.eos_token_id} | {self.end_id(t) for t in END_TOKENS}
