"""One category's records as prompts: the one path from a source record to what is fed.

`CategorySource` holds a category's `SourceIndex`, its seeded shuffled order and its
chat-template kwargs (the category's merged over the run's; with `modes`, each
conversation's mode's merged over them, its sampling too: `foundation.modes`), and turns
records into prompts with every check the run makes:

1. `read` / `read_many`: the record at a position, normalised (`producer.readers.read_sample`
   with the category's format, turns, system prompt, field and role maps); a record that
   cannot be a prompt is `Rejected` (as a dead letter from `read_many`);
2. `render`: chat prompts through the model's chat template (`producer.render.Renderer`, the
   only caller of `apply_chat_template`), token-id prompts as they are; a prompt whose text
   alone could not fit the context is refused before tokenizing (a 50 MB line must not stall
   the producer);
3. `fit`: an empty prompt, or one that with `max_new_tokens` exceeds the context;
4. `prepare`: all of the above for a batch, giving the `Pending` entries to feed and the
   dead letters of what was rejected; with `turns`, each conversation's next turn, checked
   against the turn before it (`prefix`).

The producer feeds with it (`producer.feeder`, `producer.followups`); `tokencap plan
--check` counts with it, `tokencap preview` shows its prompts, `tokencap export` re-reads
records with it, and the GPU check derives its expected prompts from it: what `plan` says
fits is what the run feeds.
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import msgspec

from budget_service.ledger import now_ms
from foundation import modes
from foundation.config import Category, Mode, RunConfig, SamplingParams
from foundation.errors import ConfigError
from foundation.outputs import relative_where
from foundation.wire import DeadLetter, Outcome, Pending, turn_id
from producer.formats.records import Rejected
from producer.readers.index import Sample, SourceIndex, read_sample, sample_id, shuffled_order

if TYPE_CHECKING:
    from producer.render import Renderer

log = logging.getLogger(__name__)

# No tokenizer packs more characters than this into one token: longer prompts are rejected
# before tokenizing.
MAX_CHARS_PER_TOKEN = 32
CONTEXT_UNKNOWN_TOKENS = 1 << 20


class Prompt(NamedTuple):
    """A rendered prompt: its text (None for a pre-tokenized one) and its ids."""

    text: str | None
    ids: list[int]


class DoesNotFit(Rejected):
    """A prompt the context cannot hold (or an empty one): its message is the whole story."""

    def __str__(self) -> str:
        return self.message


class NextTurn(NamedTuple):
    """A conversation's next turn: its messages and number, the messages of the turn before
    it, that turn's output ids and assistant message, and what the replayed tool results do
    not match (`Conversation.replay_notes`)."""

    messages: list[dict]
    turn: int
    previous: list[dict]
    previous_output: list[int]
    previous_message: dict
    notes: list[str]
    engine: str = ""  # the engine that served the turn before
    # a replayed tool result answers a call of the same function with other arguments
    # (`Conversation.args_match`)
    args_match: bool | None = None


class CategorySource:
    """The records of one category, read by position and made into prompts.

    `renderer` is None when the category is pre-tokenized; `context_length` the engine's
    context (None: unknown, only the text-length guard applies)."""

    def __init__(self, cfg: RunConfig, cat: Category, index: SourceIndex, renderer: Renderer | None,
                 context_length: int | None) -> None:
        self.cfg = cfg
        self.cat = cat
        self.index = index
        self.renderer = renderer
        self.context_length = context_length
        self.kwargs: dict[str, Any] = modes.template_kwargs(cfg, cat, None)
        self.turns = cat.turns == "all"
        # a hidden-state stage: each record is a `foundation.outputs.StatesRow`, its `id` the
        # training row the sample extracts (`Pending.row_id`)
        self.extracts = cfg.stage == "hidden_states"
        self.out_dir = Path(cfg.output_dir)
        self._order: array | None = None
        self._sent: dict[str | None, dict[str, Any]] = {}  # each mode's sampling, as sent

    @classmethod
    def open(cls, cfg: RunConfig, cat: Category, renderer: Renderer | None = None,
             context_length: int | None = None) -> CategorySource:
        """Index the category's files (raises `SourceError`)."""
        return cls(cfg, cat, SourceIndex.build([Path(p) for p in cat.paths]), renderer,
                   context_length)

    def close(self) -> None:
        self.index.close()

    def __enter__(self) -> CategorySource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        return len(self.index)

    @property
    def order(self) -> array:
        """The seeded shuffled order the run visits the records in."""
        if self._order is None:
            self._order = shuffled_order(len(self.index), self.cfg.seed)
        return self._order

    @property
    def limit_chars(self) -> int:
        """Prompt text longer than this cannot fit the context, whatever the tokenizer."""
        return (self.context_length or CONTEXT_UNKNOWN_TOKENS) * MAX_CHARS_PER_TOKEN

    # -- records -----------------------------------------------------------------------
    def read(self, pos: int) -> Sample:
        """Record `pos` of the source, normalised (raises `Rejected`)."""
        cat = self.cat
        return read_sample(self.index, pos, cat.format, cat.turns, cat.system_prompt,
                           cat.field_map or None, cat.role_map or None)

    def read_many(self, positions: Sequence[int]) -> tuple[list[Sample], list[DeadLetter]]:
        """The records at `positions`, and a dead letter for each that cannot be read."""
        samples: list[Sample] = []
        rejected: list[DeadLetter] = []
        for pos in positions:
            try:
                samples.append(self.read(pos))
            except Rejected as exc:
                where = getattr(exc, "where", None) or self.index.where(pos)
                sid = sample_id(self.index, pos)
                log.warning("%s: skipped record at %s: %s", self.cat.name, where, exc)
                where = self.row_where(where)
                turn: dict[str, Any] = {"conversation_id": sid, "turn": 1} if self.turns else {}
                rejected.append(DeadLetter(id=self.first_id_of(sid), category=self.cat.name,
                                           outcome=Outcome.REJECTED, reason=exc.reason,
                                           message=str(exc), where=where, **turn))
        return samples, rejected

    def locate(self, sid: str) -> int | None:
        """The position of the record whose sample id is `sid` (None: no such record)."""
        return self.index.locate(sid)

    def where(self, pos: int) -> str:
        """``path:line`` of record `pos` as rows say it (relative to the output folder; ""
        past the end: the source shrank)."""
        return self.row_where(self.index.where(pos)) if 0 <= pos < len(self.index) else ""

    def row_where(self, where: str) -> str:
        """A record's ``path:line`` as rows say it: relative to the output folder."""
        return relative_where(where, self.out_dir)

    def sample_id_at(self, pos: int) -> str:
        """The sample id of record `pos` (its record's, before any turn)."""
        return sample_id(self.index, pos)

    def first_id_of(self, sid: str) -> str:
        """The sample id of what is fed first of record `sid`: itself, or its turn 1."""
        return turn_id(sid, 1) if self.turns else sid

    def first_id(self, sample: Sample) -> str:
        return self.first_id_of(sample.sample_id)

    # -- modes -------------------------------------------------------------------------
    def mode_of(self, sid: str) -> Mode | None:
        """The mode the conversation (or sample) of record id `sid` is made in (None: the
        category has no modes): the same for every turn and after a resume."""
        return modes.draw(self.cfg, self.cat, sid)

    def feeds(self, pos: int) -> bool:
        """Whether this category feeds record `pos`: every record, unless it is one mode's
        budget of a `share = "tokens"` category (the records drawn to its mode)."""
        return modes.feeds(self.cfg, self.cat, sample_id(self.index, pos))

    def kwargs_of(self, mode: Mode | None) -> dict[str, Any]:
        """The chat-template kwargs a prompt of `mode` is rendered with."""
        return modes.template_kwargs(self.cfg, self.cat, mode) if mode else self.kwargs

    def sampling_of(self, mode: Mode | None) -> SamplingParams:
        """The sampling params a sample of `mode` is sent with."""
        return modes.sampling(self.cat, mode)

    def sampling_sent(self, mode: Mode | None) -> dict[str, Any]:
        """`sampling_of(mode)` as a job carries it (`Pending.sampling`), made once per mode:
        every sample of one mode shares the one dict, which nothing changes."""
        key = mode.name if mode else None
        if key not in self._sent:
            self._sent[key] = msgspec.to_builtins(self.sampling_of(mode))
        return self._sent[key]

    # -- prompts -----------------------------------------------------------------------
    def render(self, prompts: Sequence[list[dict] | list[int]],
               tools: Sequence[list[dict] | None],
               mode_of: Sequence[Mode | None] | None = None) -> list[Prompt | Rejected]:
        """Each prompt rendered (chat messages) or taken as it is (token ids), in one batched
        tokenizer call per mode (`mode_of`: each prompt's; none: the category's kwargs); one
        whose text is too long for any context, or which the template refuses, gives its
        `Rejected` in its place."""
        out: list[Prompt | Rejected] = [Prompt(None, [])] * len(prompts)
        limit = self.limit_chars
        chat: list[int] = []
        for k, p in enumerate(prompts):
            if not (p and isinstance(p[0], dict)):
                out[k] = Prompt(None, list(cast(list[int], p)))
            elif chars(p) > limit:
                out[k] = DoesNotFit("prompt_too_long", f"prompt text over {limit} characters "
                                    "cannot fit the context")
            else:
                chat.append(k)
        if chat:
            if self.renderer is None:
                raise ConfigError("$.tokenizer", f"category {self.cat.name!r} has chat prompts: "
                                  "they are rendered with the model's tokenizer, name it")
            groups: dict[str | None, list[int]] = {}
            for k in chat:
                mode = mode_of[k] if mode_of else None
                groups.setdefault(mode.name if mode else None, []).append(k)
            for ks in groups.values():
                kwargs = self.kwargs_of(mode_of[ks[0]] if mode_of else None)
                rendered = self.renderer.render_many([cast(list[dict], prompts[k]) for k in ks],
                                                     kwargs or None, [tools[k] for k in ks])
                for k, r in zip(ks, rendered, strict=True):
                    out[k] = r if isinstance(r, Rejected) else Prompt(r[0], list(r[1]))
        return out

    def fit(self, ids: Sequence[int], mode: Mode | None = None) -> DoesNotFit | None:
        """Why a prompt of these ids cannot be sent (None: it can): no tokens, or more than
        the context holds with max_new_tokens (the mode's)."""
        ctx = self.context_length
        max_new = self.sampling_of(mode).max_new_tokens
        if not ids:
            return DoesNotFit("empty_prompt", "prompt has no tokens")
        if ctx is not None and len(ids) + max_new > ctx:
            return DoesNotFit("prompt_too_long", f"prompt has {len(ids)} tokens; with "
                              f"max_new_tokens={max_new} it exceeds the engine context of "
                              f"{ctx} tokens")
        return None

    def prompt(self, sample: Sample) -> Prompt:
        """The first prompt of `sample`, rendered in its mode and checked (raises
        `Rejected`)."""
        mode = self.mode_of(sample.sample_id)
        out = self.render([sample.prompt], [sample.tools], [mode])[0]
        if isinstance(out, Rejected):
            raise out
        why = self.fit(out.ids, mode)
        if why is not None:
            raise why
        return out

    def prepare(self, samples: Sequence[Sample], turns: Sequence[NextTurn] | None = None,
                affinity: Callable[[list[int]], str] | None = None,
                ) -> tuple[list[Pending], list[DeadLetter]]:
        """Render and check each sample's prompt: its first, or with `turns` (each sample's
        next turn) the given one, checked against the turn before it (`prefix`). Returns what
        is to be fed, and what is rejected (the template refused it, or it cannot fit the
        context). `affinity(ids)` gives each prompt's affinity key (`Pending.affinity`)."""
        cat = self.cat
        prompts = [t.messages for t in turns] if turns else [s.prompt for s in samples]
        tools = [s.tools for s in samples]
        numbers = [t.turn for t in turns] if turns else [1] * len(samples)
        ids_of = [turn_id(s.sample_id, j) if self.turns else s.sample_id
                  for s, j in zip(samples, numbers, strict=True)]
        mode_of = [self.mode_of(s.sample_id) for s in samples]
        outs = self.render(prompts, tools, mode_of)
        before: dict[int, Prompt | Rejected] = {}
        if turns:  # the prompts of the turns before, to check each against its own
            chat = [k for k, o in enumerate(outs) if isinstance(o, Prompt) and o.text is not None]
            prev = self.render([turns[k].previous for k in chat], [tools[k] for k in chat],
                               [mode_of[k] for k in chat])
            before = dict(zip(chat, prev, strict=True))
        fed_at = now_ms()
        prepared: list[Pending] = []
        rejected: list[DeadLetter] = []
        for k, s in enumerate(samples):
            conv = s.conversation if self.turns else None
            fields: dict[str, Any] = {} if conv is None else {
                "conversation_id": s.sample_id, "turn": numbers[k], "turns_total": conv.turns}
            out = outs[k]
            mode = mode_of[k]
            why = out if isinstance(out, Rejected) else self.fit(out.ids, mode)
            if why is not None:
                if not isinstance(why, DoesNotFit):
                    log.warning("%s: skipped record at %s: %s", cat.name, s.where, why)
                rejected.append(DeadLetter(id=ids_of[k], category=cat.name,
                                           outcome=Outcome.REJECTED, reason=why.reason,
                                           message=str(why), where=self.row_where(s.where),
                                           **fields))
                continue
            if mode is not None:
                fields["mode"] = mode.name
            assert isinstance(out, Prompt)
            prev_out = before.get(k)
            if turns and out.text is not None and isinstance(prev_out, Prompt):
                consistent, notes, shared = prefix(turns[k], prev_out.ids, out.ids, out.text)
                fields = {**fields, "prefix_consistent": consistent,
                          "history_notes": notes + turns[k].notes, "reusable_tokens": shared,
                          "tool_args_match": turns[k].args_match}
            if affinity is not None:
                fields["affinity"] = affinity(out.ids)
                if turns:
                    fields["prefer_engine"] = turns[k].engine
            if out.text is not None:
                fields["chat_template_kwargs"] = self.kwargs_of(mode)
            prepared.append(Pending(sample_id=ids_of[k], ordinal=s.ordinal, prompt_ids=out.ids,
                                    sampling=self.sampling_sent(mode),
                                    where=self.row_where(s.where), source_id=s.source_id,
                                    fed_at_ms=fed_at,
                                    row_id=s.source_id if self.extracts else None, **fields))
        return prepared, rejected


def prefix(nxt: NextTurn, previous_ids: list[int], ids: list[int], text: str
           ) -> tuple[bool, list[str], int]:
    """Whether turn j+1's prompt ids start with turn j's prompt ids and output ids (what a
    drafter trains on is then one sequence), and if not, where and why it departs; and how
    many of its ids it shares with them (what the engine that served turn j may have cached)."""
    expected = list(previous_ids) + nxt.previous_output
    if ids[:len(expected)] == expected:
        return True, [], len(expected)
    at = next((i for i, (a, b) in enumerate(zip(ids, expected, strict=False)) if a != b),
              min(len(ids), len(expected)))
    reasoning = (nxt.previous_message.get("reasoning_content") or "").strip()
    if reasoning and reasoning not in text:
        why = "the template dropped its reasoning"
    elif at >= len(previous_ids):
        why = "the template renders the generated turn other than the model wrote it"
    else:
        why = "the template rewrote the history before it"
    return False, [f"turn {nxt.turn - 1}: not a prefix of this prompt: {why} (from token "
                   f"{at} of {len(expected)})"], at


def chars(messages: list[dict]) -> int:
    """The characters the messages bring to the template."""
    total = 0
    for m in messages:
        total += len(text_of(m))
    return total


def text_of(message: dict) -> str:
    """The text a message brings to the template (content, reasoning, tool calls)."""
    parts = [message.get("content") or "", message.get("reasoning_content") or ""]
    for call in message.get("tool_calls") or ():
        parts.append(str(call))
    return "".join(p if isinstance(p, str) else str(p) for p in parts)
