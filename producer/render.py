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
from producer.formats.records import Rejected

log = logging.getLogger(__name__)

# Errors a template raises for one conversation (raise_exception() raises TemplateError;
# a missing key or a None content surfaces as UndefinedError or TypeError).
TEMPLATE_ERRORS = (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError)


class TokenizerError(TokencapError, ValueError):
    """A tokenizer that cannot be loaded from a local path or has no chat template."""

    exit_code = 2  # like ConfigError: the path comes from the run config


# What `apply_chat_template` passes a template besides a user's kwargs: a kwarg of these names
# is not one "the template reads" in the sense of a switch
TEMPLATE_BUILTINS = frozenset({
    "messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "raise_exception", "strftime_now", "bos_token", "eos_token", "unk_token", "pad_token",
    "sep_token", "cls_token", "mask_token", "additional_special_tokens", "namespace", "range",
    "dict", "lipsum", "cycler", "joiner", "true", "false", "none", "True", "False", "None",
})
_ARGUMENTS_PROBE = {"k": 1}


class Renderer:
    """A local tokenizer plus the chat-template keyword arguments every render passes."""

    def __init__(
        self, tokenizer_path: str | Path, chat_template_kwargs: dict[str, Any] | None = None,
        trust_remote_code: bool = False,
    ) -> None:
        self.path = Path(tokenizer_path)
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self._tok = _load_tokenizer(self.path, trust_remote_code)
        self._developer: bool | None = None
        self._variables: frozenset[str] | None = None
        self._variables_read = False
        self._arguments_as_string: bool | None = None

    @property
    def template_variables(self) -> frozenset[str]:
        """The names the chat template reads that `apply_chat_template` does not always pass
        (its switches: ``thinking``, ``enable_thinking``, ...), from the template's source;
        empty when it cannot be parsed here."""
        if self._variables is None:
            from jinja2 import meta
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols",
                                                            "jinja2.ext.do"])
            try:
                found = meta.find_undeclared_variables(env.parse(self.template))
                self._variables_read = True
            except jinja2.TemplateError as exc:
                log.warning("cannot read the chat template's variables: %s", exc)
                found = set()
            self._variables = frozenset(found - TEMPLATE_BUILTINS)
        return self._variables

    def unread_kwargs(self, kwargs: dict[str, Any]) -> list[str]:
        """The keys of `kwargs` the chat template never reads (a switch of another family:
        ``enable_thinking`` given to Kimi's template, which reads ``thinking``); none when
        the template cannot be parsed here."""
        names = self.template_variables
        if not self._variables_read:
            return []
        return sorted(k for k in kwargs if k not in names and k not in TEMPLATE_BUILTINS)

    @property
    def arguments_as_string(self) -> bool:
        """Whether the template writes a tool call's arguments as text (DeepSeek's: an object
        would come out as a Python dict), found by rendering one call as an object."""
        if self._arguments_as_string is None:
            function: dict[str, Any] = {"name": "f", "arguments": dict(_ARGUMENTS_PROBE)}
            call = {"id": "call_0", "type": "function", "function": function}
            messages: list[dict] = [{"role": "user", "content": "u"},
                                    {"role": "assistant", "content": "", "tool_calls": [call]},
                                    {"role": "user", "content": "v"}]
            tools = [{"type": "function", "function": {
                "name": "f", "description": "d", "parameters": {
                    "type": "object", "properties": {"k": {"type": "integer", "description": "d"}},
                    "required": ["k"]}}}]
            try:
                text = self.render_text(messages, tools=tools)
                self._arguments_as_string = repr(_ARGUMENTS_PROBE) in text
            except Rejected:  # refused as an object: is text what it takes?
                function["arguments"] = json.dumps(_ARGUMENTS_PROBE)
                try:
                    self.render_text(messages, tools=tools)
                    self._arguments_as_string = True
                except Rejected:
                    self._arguments_as_string = False
        return self._arguments_as_string

    def opens_reasoning(self, start: str, extra_kwargs: dict | None = None) -> bool:
        """Whether the generation prompt ends in an open reasoning block (`start`, e.g.
        ``<think>``): the model's turn is reasoning from its first token."""
        try:
            text = self.render_text([{"role": "user", "content": "u"}], extra_kwargs)
        except Rejected:
            return False
        return text.rstrip().endswith(start)

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


def _custom_code(path: Path) -> str | None:
    """The model's own tokenizer code a folder names (`auto_map` of tokenizer_config.json),
    e.g. ``tokenization_kimi.TikTokenTokenizer``; None when it names none."""
    try:
        cfg = json.loads((path / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    auto = cfg.get("auto_map", {}).get("AutoTokenizer") if isinstance(cfg, dict) else None
    if isinstance(auto, list):
        auto = next((a for a in auto if a), None)
    return auto if isinstance(auto, str) else None


# a folder holding none of these is no tokenizer (transformers' own message says it badly)
TOKENIZER_FILE_NAMES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                        "vocab.json", "tiktoken.model", "spiece.model")


def _load_tokenizer(path: Path, trust_remote_code: bool = False) -> Any:
    """Load a tokenizer from a local directory only; errors become `TokenizerError`. A
    folder whose tokenizer is the model's own code loads only with `trust_remote_code`."""
    if not path.is_dir():
        raise TokenizerError(f"tokenizer {path}: no such directory")
    if not any((path / name).exists() for name in TOKENIZER_FILE_NAMES) and not any(
            path.glob("*.tiktoken")):
        raise TokenizerError(f"tokenizer {path}: no tokenizer file in it (none of "
                             f"{', '.join(TOKENIZER_FILE_NAMES)}): point `tokenizer` at the "
                             "model's folder, or a copy of its tokenizer files")
    code = _custom_code(path)
    if code and not trust_remote_code:
        raise TokenizerError(f"tokenizer {path}: its tokenizer is the model's own code "
                             f"({code}); set `trust_remote_code = true` in the run config to "
                             "run it (as SGLang's --trust-remote-code does)")
    # transformers is a heavy import: only where a tokenizer is loaded.
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True,
                                            trust_remote_code=trust_remote_code)
    except Exception as exc:  # transformers raises OSError, ValueError, ...
        # the whole message on one line (transformers puts the useful part on the next ones)
        reason = " ".join(str(exc).split())[:400] or type(exc).__name__
        if "trust_remote_code" in str(exc) and not trust_remote_code:
            reason = "it needs the model's own code: set `trust_remote_code = true`"
        raise TokenizerError(f"tokenizer {path}: cannot load: {reason}") from None
    if not getattr(tok, "chat_template", None):
        raise TokenizerError(f"tokenizer {path}: has no chat template")
    log.info("loaded tokenizer %s (%s, %d tokens)", path, type(tok).__name__, len(tok))
    return tok
