"""Replay: a conversation's history with the model's own earlier turns, the one copy.

With ``turns = "all"`` turn j+1 is prompted with the source up to its generation point, each
earlier assistant turn replaced by the model's: its output ids read into an assistant message
by the run's `ReplyParser` (reasoning and tool calls split where the family's parsers find
them; a reasoning block is open from the start when the category's generation prompt opens
it), and the source's tool results re-keyed to the model's calls (`Conversation.prompt`).
The producer feeds next turns from it (`producer.followups`); the conversations export
writes whole regenerated conversations from it (`tokencap.export.conversations`): both read
a generated turn the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from foundation import modes
from foundation.config import Category, Mode, RunConfig
from producer.formats.conversation import Conversation
from producer.reply_parser import ReplyParser, Unparsed, reply_parser

if TYPE_CHECKING:
    from producer.render import Renderer


class Replay:
    """How the run's generated turns enter a conversation's history.

    With a `renderer` (the producer, and an export that has the run's config) the parsers are
    the run's (`reply_parser`); with a `tokenizer` only (an export without the config), its
    chat template's, chosen "auto"."""

    def __init__(self, cfg: RunConfig | None, renderer: Renderer | None = None,
                 tokenizer: Any = None) -> None:
        self.cfg = cfg
        self.renderer = renderer
        self.tokenizer = tokenizer
        self._parser: ReplyParser | None = None
        self._opened: dict[tuple[str, str], bool] = {}

    @property
    def parser(self) -> ReplyParser:
        if self._parser is None:
            if self.renderer is not None and self.cfg is not None:
                self._parser = reply_parser(self.cfg, self.renderer)
            else:
                template = getattr(self.tokenizer, "chat_template", "") or ""
                if isinstance(template, dict):
                    template = "\n".join(template.values())
                self._parser = ReplyParser(
                    self.tokenizer, str(template),
                    self.cfg.reasoning_parser if self.cfg else "auto",
                    self.cfg.tool_call_parser if self.cfg else "auto")
        return self._parser

    def opened(self, cat: Category | None, mode: Mode | None = None) -> bool:
        """Whether `cat`'s generation prompt opens a reasoning block (its chat-template
        kwargs over the run's, `mode`'s over them): a reply then starts inside it, and one
        cut before its end of reasoning is reasoning. False without a renderer (nothing to
        render it with)."""
        name = (cat.name if cat is not None else "", mode.name if mode is not None else "")
        if name not in self._opened:
            start = self.parser.reasoning.start if self.parser.reasoning else None
            opened = False
            if start is not None and self.renderer is not None and self.cfg is not None:
                kwargs = modes.template_kwargs(self.cfg, cat, mode) if cat \
                    else self.cfg.chat_template_kwargs
                opened = self.renderer.opens_reasoning(start, kwargs or None)
            self._opened[name] = opened
        return self._opened[name]

    def turns(self, outputs: Sequence[Sequence[int]], tools: list[dict] | None,
              conversation_id: str, stop_ids: Sequence[int], opened: bool) -> list[dict]:
        """The assistant messages of the generated turns, in order (`Unparsed` at the first
        that does not parse)."""
        return self.parser.messages(outputs, tools, conversation_id, stop_ids, opened)

    def history(self, conv: Conversation, generated: Sequence[dict],
                conversation_id: str) -> list[dict]:
        """The messages of turn ``len(generated) + 1``: the source's, with the model's turns
        and the tool results re-keyed to its calls."""
        return conv.prompt(generated, self.parser.result_ids(conversation_id))

    def transcript(self, conv: Conversation | None, outputs: Sequence[Sequence[int]],
                   conversation_id: str, stop_ids: Sequence[int], opened: bool) -> list[dict]:
        """A whole regenerated conversation as the trainer reads it: the history of its last
        turn and that turn's message. A last turn that does not parse (the conversation
        stopped there) is kept as its text, marked ``unparsed``; without the source
        conversation, the model's turns alone."""
        tools = conv.tools if conv is not None else None
        try:
            generated = self.turns(outputs, tools, conversation_id, stop_ids, opened)
        except Unparsed as exc:
            generated = self.turns(outputs[:-1], tools, conversation_id, stop_ids, opened)
            generated.append({"role": "assistant", "unparsed": exc.reason,
                              "content": self.parser.text(outputs[-1], stop_ids)})
        if conv is None or len(outputs) > conv.turns:
            return generated
        return [*self.history(conv, generated[:-1], conversation_id), generated[-1]]
