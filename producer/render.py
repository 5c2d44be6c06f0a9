"""Render chat prompts with a model's own chat template and tokenize the rendered text.

The prompt ids are the ids of exactly the rendered text (``add_special_tokens=False``),
so special tokens written by the template keep their ids and nothing is added twice.
Decoding them gives back the rendered text for tokenizers whose added tokens do not strip
whitespace (Qwen); Phi-3's special tokens swallow the newline after them, so there only the
ids round-trip. Prompts that are already token ids need no rendering.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import jinja2

from foundation.errors import TokencapError
from producer.formats import Rejected

log = logging.getLogger(__name__)

# Errors a template raises for one conversation (raise_exception() raises TemplateError;
# a missing key or a None content surfaces as UndefinedError or TypeError).
TEMPLATE_ERRORS = (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError)


class TokenizerError(TokencapError, ValueError):
    """A tokenizer that cannot be loaded from a local path or has no chat template."""

    exit_code = 2  # like ConfigError: the path comes from the run config


class Renderer:
    """A local tokenizer plus the chat-template keyword arguments every render passes."""

    def __init__(
        self, tokenizer_path: str | Path, chat_template_kwargs: dict[str, Any] | None = None
    ) -> None:
        self.path = Path(tokenizer_path)
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self._tok = _load_tokenizer(self.path)
        self._developer: bool | None = None

    @property
    def tokenizer(self) -> Any:
        """The underlying transformers tokenizer."""
        return self._tok

    @property
    def name(self) -> str:
        """The tokenizer directory's name, e.g. ``qwen2.5-instruct``."""
        return self.path.name

    @property
    def eos_token_id(self) -> int | None:
        return self._tok.eos_token_id

    @property
    def vocab_size(self) -> int:
        """Size of the vocabulary including added tokens (``len(tokenizer)``)."""
        return len(self._tok)

    @property
    def chat_template_sha256(self) -> str:
        """sha256 hex digest of the chat template text, to detect template drift."""
        template = self._tok.chat_template
        if not isinstance(template, str):  # named templates: {name: text}
            template = json.dumps(template, sort_keys=True)
        return hashlib.sha256(template.encode("utf-8")).hexdigest()

    @property
    def template(self) -> str:
        """The chat template's text (named templates joined)."""
        template = self._tok.chat_template
        return template if isinstance(template, str) else "\n".join(template.values())

    def knows_role(self, role: str) -> bool:
        """Does the chat template mention `role` (as ``'role'`` or ``"role"``)?"""
        return f"'{role}'" in self.template or f'"{role}"' in self.template

    def prepare(self, messages: list[dict]) -> list[dict]:
        """`messages` as the template gets them: a ``developer`` turn becomes a ``system``
        turn unless the template knows the developer role."""
        if self._developer is None:
            self._developer = self.knows_role("developer")
        if self._developer or not any(m["role"] == "developer" for m in messages):
            return messages
        return [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]

    def render_text(self, messages: list[dict], extra_kwargs: dict | None = None,
                    tools: list[dict] | None = None) -> str:
        """The chat template applied to `messages` (and `tools`, passed as ``tools=``) with
        the generation prompt appended.

        Raises `Rejected` (reason ``template_error``) when the template refuses them.
        """
        kwargs = {**self.chat_template_kwargs, **(extra_kwargs or {})}
        if tools:
            kwargs["tools"] = tools
        try:
            text = self._tok.apply_chat_template(
                self.prepare(messages), tokenize=False, add_generation_prompt=True, **kwargs
            )
        except TEMPLATE_ERRORS as exc:
            raise Rejected("template_error", f"{type(exc).__name__}: {exc}") from None
        if not isinstance(text, str):
            raise Rejected("template_error", f"template returned {type(text).__name__}")
        return text

    def render(
        self, messages: list[dict], extra_kwargs: dict | None = None,
        tools: list[dict] | None = None,
    ) -> tuple[str, list[int]]:
        """Render `messages` and return the text and the ids of exactly that text."""
        text = self.render_text(messages, extra_kwargs, tools)
        return text, self.encode(text)

    def encode(self, text: str) -> list[int]:
        """The ids of exactly `text` (no special tokens added)."""
        return list(self._tok(text, add_special_tokens=False)["input_ids"])

    def render_many(
        self, list_of_messages: list[list[dict]], extra_kwargs: dict | None = None,
        tools: list[list[dict] | None] | None = None,
    ) -> list[tuple[str, list[int]] | Rejected]:
        """`render` each conversation (with its `tools`), encoding all texts in one batched
        tokenizer call. A conversation the template refuses gives its `Rejected` in its place.
        """
        results: list[tuple[str, list[int]] | Rejected] = []
        texts: list[str] = []
        for k, messages in enumerate(list_of_messages):
            try:
                text = self.render_text(messages, extra_kwargs, tools[k] if tools else None)
            except Rejected as exc:
                results.append(exc)
                continue
            results.append((text, []))
            texts.append(text)
        if not texts:
            return results
        encoded = iter(self._tok(texts, add_special_tokens=False)["input_ids"])
        return [r if isinstance(r, Rejected) else (r[0], next(encoded)) for r in results]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids` (special tokens included unless `skip_special_tokens`)."""
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


def _load_tokenizer(path: Path) -> Any:
    """Load a tokenizer from a local directory only; errors become `TokenizerError`."""
    if not path.is_dir():
        raise TokenizerError(f"tokenizer {path}: no such directory")
    # transformers is a heavy import: only where a tokenizer is loaded.
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - transformers raises OSError, ValueError, ...
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TokenizerError(f"tokenizer {path}: cannot load: {reason}") from None
    if not getattr(tok, "chat_template", None):
        raise TokenizerError(f"tokenizer {path}: has no chat template")
    log.info("loaded tokenizer %s (%s, %d tokens)", path, type(tok).__name__, len(tok))
    return tok
