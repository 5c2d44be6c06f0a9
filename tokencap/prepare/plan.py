"""Before spending GPU time: how much each cap needs (`plan`) and what is sent (`preview`).

`plan` is a pure function of the config and three measurements, so it can be checked by
hand. Per category, with ``cap`` its cap and ``avail`` the records in its sources:

- ``avg`` (counted tokens per sample): the mean ``counted_tokens`` of the committed results
  when there are any (source "measured"), else ``cfg.expected_for(cat)``, plus the mean
  prompt tokens when ``count = "total"`` (source "estimate").
- ``samples = min(ceil(cap / avg), avail)``; ``limited_by`` is "prompts" when the source
  runs out first, else "cap". An uncapped category (``cap_tokens = "none"``) takes every
  prompt: ``samples = avail``. With ``turns = "all"`` a record asks for one generation per
  turn: ``plan --check`` counts the turns of the usable records (`survey` with `check`), plain
  ``plan`` counts records.
- ``total_tokens = cap`` when limited by the cap (overshoot ignored), else
  ``samples * avg``: that is ``min(cap, avail * avg)`` up to rounding.
- ``output_tokens = total_tokens * avg_output / avg``: the tokens the engine generates
  (equal to ``total_tokens`` when output tokens are counted).
- ``hours = output_tokens / tok_s / 3600``, with `tok_s` the engine's output throughput;
  ``hours_left`` does the same for what the committed results have not generated yet.

Example: cap 10,000,000 and 2,500 tokens a sample need 4,000 samples; with only 3,000
prompts the category stops at 3,000 samples and 7,500,000 tokens, 2.08 h at 1,000 tok/s.

A sample is one generated reply, which the export writes as one training row: ``samples`` is
the rows a trainer gets (before the reply gate). `recipe_line` places the total against the
row counts published drafter recipes train on (`RECIPES`; docs/MIX.md cites them).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec

from budget_service.estimator import counts_prompt
from foundation.config import Category, Mode, RunConfig
from foundation.errors import TokencapError
from foundation.outputs import BadLine, category_dir, read_results

if TYPE_CHECKING:
    from producer.intake import Intake
    from producer.render import Renderer
    from producer.source import CategorySource

PROMPT_SAMPLE_SIZE = 64  # prompts rendered to estimate mean prompt tokens
CHECK_PROGRESS_EVERY = 5000  # records between progress lines of `survey`
CHECK_EXAMPLES = 3  # rejects shown per reason, with file:line
PREVIEW_SCAN_LIMIT = 1000  # records tried per category before preview gives up
SECONDS_PER_HOUR = 3600
DEFAULT_TOK_S = 1000.0  # output tokens per second of the engine
# published drafter recipes, in training rows: (rows, what, source); docs/MIX.md
RECIPES = (
    (68_000, "EAGLE's ShareGPT set", "SafeAILab/EAGLE#128"),
    (500_000, "speculators' from-scratch recipe, 2-3 epochs", "vllm-project/speculators#751"),
)


class Measured(NamedTuple):
    """Sums over a category's committed results."""

    samples: int
    counted_tokens: int
    output_tokens: int
    prompt_tokens: int = 0


class SourceCheck(msgspec.Struct):
    """A category's sources read and rendered as the producer does (`survey` with `check`):
    `records` in the files, `usable` ones, the `generations` these ask for (their turns with
    ``turns = "all"``, else one each) and the rejected ones by reason."""

    records: int
    usable: int
    generations: int
    rejected: dict[str, int]
    # the first rejects of each reason: "file:line (field): why"
    examples: dict[str, list[str]] = {}
    # keys with text that neither the format nor the field_map reads: key -> records
    unread: dict[str, int] = {}
    # the usable records the intake screens would refuse as `contaminated`, by benchmark
    # (their total, and the near-duplicates', are in `rejected`)
    contaminated: dict[str, int] = {}


class PlanRow(msgspec.Struct):
    """One category's plan (or the totals, category "total"); see the module docstring."""

    category: str
    cap_tokens: int | None  # None: uncapped
    prompts: int | None
    avg_tokens: float
    avg_output_tokens: float
    source: str
    samples: int
    total_tokens: int
    output_tokens: int
    hours: float
    limited_by: str
    done_samples: int = 0
    done_tokens: int = 0
    hours_left: float = 0.0
    checked: SourceCheck | None = None


def plan(
    cfg: RunConfig,
    measured: dict[str, Measured] | None = None,
    available: dict[str, int] | None = None,
    tok_s: float = DEFAULT_TOK_S,
    prompt_tokens: dict[str, float] | None = None,
) -> list[PlanRow]:
    """One `PlanRow` per category of `cfg`, in config order (formulas: module docstring).

    `measured` maps a category to its committed sums, `available` to its record count
    (a category missing there is taken as unbounded), `prompt_tokens` to its mean prompt
    length (used only for ``count = "total"`` without measurements; missing counts 0).
    """
    if tok_s <= 0:
        raise TokencapError(f"tok_s must be > 0, got {tok_s}")
    measured, available, prompt_tokens = measured or {}, available or {}, prompt_tokens or {}
    rows = []
    for cat in cfg.category:
        cap = cfg.cap_for(cat)
        m = measured.get(cat.name)
        if m is not None and m.samples > 0:
            source = "measured"
            avg = m.counted_tokens / m.samples
            avg_out = m.output_tokens / m.samples
        else:
            source, m = "estimate", None
            avg_out = float(cfg.expected_for(cat))
            extra = prompt_tokens.get(cat.name, 0.0) if counts_prompt(cfg) else 0.0
            avg = avg_out + extra
        avail = available.get(cat.name)
        needed = math.inf if cap is None else math.ceil(cap / avg) if avg > 0 else math.inf
        samples = needed if avail is None else min(needed, avail)
        if samples == math.inf:
            samples = 0
        limited_by = "prompts" if samples < needed else "cap"
        total = cap if limited_by == "cap" and cap is not None else round(samples * avg)
        output = round(total * avg_out / avg) if avg > 0 else 0
        done_out = m.output_tokens if m else 0
        rows.append(PlanRow(
            category=cat.name, cap_tokens=cap, prompts=avail, avg_tokens=avg,
            avg_output_tokens=avg_out, source=source, samples=int(samples),
            total_tokens=total, output_tokens=output, hours=output / tok_s / SECONDS_PER_HOUR,
            limited_by=limited_by, done_samples=m.samples if m else 0,
            done_tokens=m.counted_tokens if m else 0,
            hours_left=max(0, output - done_out) / tok_s / SECONDS_PER_HOUR,
        ))
    return rows


def totals(rows: list[PlanRow]) -> PlanRow:
    """The sum of `rows` as a row named "total" (averages are per planned sample)."""
    samples = sum(r.samples for r in rows)
    total = sum(r.total_tokens for r in rows)
    output = sum(r.output_tokens for r in rows)
    prompts = [r.prompts for r in rows]
    caps = [r.cap_tokens for r in rows]
    return PlanRow(
        category="total", cap_tokens=None if None in caps else sum(c or 0 for c in caps),
        prompts=None if None in prompts else sum(p or 0 for p in prompts),
        avg_tokens=total / samples if samples else 0.0,
        avg_output_tokens=output / samples if samples else 0.0,
        source="", samples=samples, total_tokens=total, output_tokens=output,
        hours=sum(r.hours for r in rows), limited_by="",
        done_samples=sum(r.done_samples for r in rows),
        done_tokens=sum(r.done_tokens for r in rows),
        hours_left=sum(r.hours_left for r in rows),
    )


def recipe_line(total: PlanRow) -> str:
    """One line placing the planned rows against the published recipes (`RECIPES`)."""
    rows = total.samples
    against = "; ".join(f"{_share(rows / n)} of {n:,} ({what}, {src})"
                        for n, what, src in RECIPES)
    return (f"{rows:,} rows ({total.total_tokens:,} tokens, "
            f"{total.total_tokens / rows if rows else 0:,.0f} a row) against published "
            f"drafter recipes: {against}")


def _share(x: float) -> str:
    """A share for people: "0.036%", "48%", "2.4x"."""
    return f"{x:.1f}x" if x >= 1 else f"{100 * x:.2g}%"


def measure(out_dir: Path, categories: list[str]) -> dict[str, Measured]:
    """Sums over the committed results in ``out_dir/<category>/part-*.jsonl``.

    Lines that are not results are skipped; categories without results are left out.
    """
    found: dict[str, Measured] = {}
    for name in categories:
        n = counted = output = prompt = 0
        for item in read_results(category_dir(out_dir, name)):
            if isinstance(item, BadLine):
                continue
            n += 1
            counted += item.counted_tokens
            output += item.completion_tokens
            prompt += item.prompt_tokens
        if n:
            found[name] = Measured(n, counted, output, prompt)
    return found


class Survey(NamedTuple):
    """What `survey` found in one category's sources."""

    records: int  # records in the files (rejected ones included)
    checked: SourceCheck | None  # every record read, rendered and checked (`check`)
    prompt_tokens: float | None  # mean prompt tokens, when asked for (`prompt_tokens_of`)


def model_context_length(renderer: Renderer | None) -> int | None:
    """The context length of the tokenizer's model from a ``config.json`` beside it
    (``max_position_embeddings``, a multimodal model's ``text_config`` too; None when there
    is none): what the engine serving it takes, unless it was started with less."""
    import json

    folder = getattr(renderer, "path", None)
    if folder is None or not (folder / "config.json").is_file():
        return None
    try:
        doc = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for d in (doc, doc.get("text_config") or {}):
        n = d.get("max_position_embeddings")
        if isinstance(n, int) and n > 0:
            return n
    return None


def context_for_check(cfg: RunConfig, renderer: Renderer | None) -> tuple[int | None, str]:
    """The context the check holds prompts to, and where it came from."""
    if cfg.context_length is not None:
        return cfg.context_length, "context_length"
    found = model_context_length(renderer)
    if found is not None:
        return found, "the model's config.json (max_position_embeddings)"
    return None, ""


def survey(cfg: RunConfig, renderer: Renderer | None, check: bool = False,
           prompt_tokens_of: Collection[str] = (),
           on_progress: Callable[[str, int, int], None] | None = None,
           sample_size: int = PROMPT_SAMPLE_SIZE) -> dict[str, Survey]:
    """Each category's sources, opened once: how many records they hold; with `check`, every
    record read, rendered and checked as the producer does (`CategorySource.prompt`: the
    first prompt of a conversation, every fit check, with `context_length`, else the model's
    own from a config.json beside the tokenizer, as the engine's context), the usable ones
    counted with the generations they ask for and the rejects by reason; for the categories
    in `prompt_tokens_of`, the mean prompt tokens as the producer renders them (with `check`:
    over every usable record; else over the first `sample_size` prompts of the shuffled
    order; 0.0 when none renders). With `check`, the intake screens too (`_screen`): the
    prompts refused as near-duplicates or contaminated are counted among the rejects.
    `on_progress(category, done, total)` is called now and then while checking."""
    from producer.intake import Intake
    from producer.source import CategorySource

    out = {}
    context = context_for_check(cfg, renderer)[0] if check else cfg.context_length
    opened: dict[str, CategorySource] = {}  # with `check`, open to the end: the screens
    intake = Intake(cfg, opened.get) if check else None  # read kept prompts back
    digests: set[str] = set()
    with contextlib.ExitStack() as stack:
        for cat in cfg.category:
            mean = cat.name in prompt_tokens_of
            source = stack.enter_context(CategorySource.open(cfg, cat, renderer, context))
            opened[cat.name] = source
            checked = lengths = None
            if check:
                checked, lengths, usable = _check(source, on_progress)
                if intake is not None and intake.active:
                    checked = _screen(source, checked, usable, intake, digests)
            elif mean:
                lengths = [len(item[2]) for item in _shuffled_prompts(source, renderer,
                                                                      sample_size)
                           if len(item) == 3]
            tokens = (sum(lengths) / len(lengths) if lengths else 0.0) if mean else None
            out[cat.name] = Survey(len(source), checked, tokens)
            if not check:
                stack.close()  # nothing reads it again
    return out


def _screen(source: CategorySource, checked: SourceCheck,
            usable: list[tuple[int, str, int]], intake: Intake, digests: set[str]
            ) -> SourceCheck:
    """The usable records the intake screens would refuse, in the run's shuffled order (the
    categories in the config's order, each after the one before: docs/MIX.md): counted in
    `rejected` and out of `usable` and `generations`, the contaminated ones by benchmark too.
    Exact copies of a prompt (`digests`: those seen) are left out, as the producer leaves
    them to the feed script."""
    from budget_service.feeding import Seen
    from foundation.wire import CONTAMINATED, Pending, contaminated_by

    name = source.cat.name
    rank = {pos: k for k, pos in enumerate(source.order)}
    rejected, by_bench = dict(checked.rejected), dict(checked.contaminated)
    usable_n, generations = checked.usable, checked.generations
    for pos, digest, turns in sorted(usable, key=lambda u: rank[u[0]]):
        s = source.read(pos)
        p = Pending(sample_id=source.first_id(s), ordinal=pos, prompt_ids=[], sampling={})
        exact = "" if digest in digests else None
        digests.add(digest)
        out = intake.screen(name, [s], [p], Seen([digest], [exact]))
        for d in out.refused:
            rejected[d.reason] = rejected.get(d.reason, 0) + 1
            if d.reason == CONTAMINATED:
                bench = contaminated_by(d) or "?"
                by_bench[bench] = by_bench.get(bench, 0) + 1
            usable_n -= 1
            generations -= turns
    return msgspec.structs.replace(checked, usable=usable_n, generations=generations,
                                   rejected=dict(sorted(rejected.items())),
                                   contaminated=by_bench)


def _check(source: CategorySource, on_progress: Callable[[str, int, int], None] | None
           ) -> tuple[SourceCheck, list[int], list[tuple[int, str, int]]]:
    """Every record of `source` read, rendered and checked; the check, the usable records'
    prompt lengths, and each usable record's (position, prompt digest, generations)."""
    from budget_service.ledger import prompt_digest
    from producer.formats.records import Rejected

    name = source.cat.name
    rejected: dict[str, int] = {}
    examples: dict[str, list[str]] = {}
    lengths: list[int] = []
    generations = 0
    unread: dict[str, int] = {}
    usable: list[tuple[int, str, int]] = []
    for i in range(len(source)):
        try:
            s = source.read(i)
            for key in s.unread:
                unread[key] = unread.get(key, 0) + 1
            prompt = source.prompt(s)
        except Rejected as exc:
            rejected[exc.reason] = rejected.get(exc.reason, 0) + 1
            shown = examples.setdefault(exc.reason, [])
            if len(shown) < CHECK_EXAMPLES:
                shown.append(f"{exc.where or source.where(i)}: {exc}")
            continue
        lengths.append(len(prompt.ids))
        turns = s.conversation.turns if s.conversation else 1
        generations += turns
        usable.append((i, prompt_digest(prompt.ids), turns))
        if on_progress and (i + 1) % CHECK_PROGRESS_EVERY == 0:
            on_progress(name, i + 1, len(source))
    return SourceCheck(len(source), len(lengths), generations,
                       dict(sorted(rejected.items())), examples,
                       dict(sorted(unread.items()))), lengths, usable


def unread_text(name: str, unread: dict[str, int], of: int) -> str:
    """The line that names the keys whose text is never sent ("" when none)."""
    if not unread:
        return ""
    keys = ", ".join(f"{k} ({n:,} of {of:,} records)" for k, n in unread.items())
    return (f"{name}: text in keys that neither the format nor field_map reads, never sent: "
            f"{keys}; an instruction's passage is read from `input` or `context`, any other "
            "key with field_map (docs/CONFIGURATION.md)")


def _first_prompts(cfg: RunConfig, cat: Category, renderer: Renderer | None, want: int,
                   mode: str | None = None):
    """`_shuffled_prompts` of the category's sources, opened for it (of `mode` only)."""
    from producer.source import CategorySource

    with CategorySource.open(cfg, cat, renderer, cfg.context_length) as source:
        yield from _shuffled_prompts(source, renderer, want, mode)


def _shuffled_prompts(source: CategorySource, renderer: Renderer | None, want: int,
                      mode: str | None = None):
    """Yield ``(sample, text | None, ids)`` or ``(where, Rejected)`` in the shuffled order
    (of the records drawn to `mode`, when given), each prompt rendered in its own mode (fit
    not checked: `CategorySource.fit` says), stopping after `want` rendered prompts or
    `PREVIEW_SCAN_LIMIT` records."""
    from producer.formats.records import Rejected

    good = 0
    for pos in source.order[:PREVIEW_SCAN_LIMIT]:
        if not source.feeds(pos):
            continue
        try:
            s = source.read(pos)
            drawn = source.mode_of(s.sample_id)
            if mode is not None and (drawn is None or drawn.name != mode):
                continue
            prompt = source.render([s.prompt], [s.tools], [drawn])[0]
            if isinstance(prompt, Rejected):
                raise prompt
        except Rejected as exc:
            yield (exc.where or source.index.where(pos), exc)
            continue
        text = prompt.text
        if text is None and renderer is not None:
            text = renderer.decode(prompt.ids)
        yield (s, text, prompt.ids)
        good += 1
        if good >= want:
            return


class Preview(msgspec.Struct):
    """The first prompt(s) of a category as the engine will get them.

    `text` is the rendered prompt with special tokens (for pre-tokenized sources, the
    decoded ids); `prompt_tokens == len(prompt_ids)`; `skipped` lists ``where: reason`` of
    records rejected before it; `warnings` flags template kwargs the template never reads
    and prompts that do not fit `context_length` with `max_new_tokens`.
    """

    category: str
    sample_id: str | None
    where: str | None
    messages: list[dict] | None
    text: str | None
    prompt_tokens: int
    prompt_ids: list[int]
    sampling: dict[str, Any]
    chat_template_kwargs: dict[str, Any]
    skipped: list[str] = []
    warnings: list[str] = []
    # the decode mode it is made in ("": the category has none)
    mode: str = ""
    # with turns = "all": how its generated turns enter the next prompt, and why
    parsers: str = ""


def unused_kwargs(renderer: Renderer | None, kwargs: dict[str, Any]) -> list[str]:
    """Keys of `kwargs` that the chat template never reads (they do nothing, e.g.
    `enable_thinking` for a template that reads `thinking`)."""
    return [] if renderer is None else renderer.unread_kwargs(kwargs)


def preview(
    cfg: RunConfig, n: int = 1, renderer: Renderer | None = None,
    categories: list[str] | None = None,
) -> list[Preview]:
    """The first `n` prompts of each category in the seeded shuffled order, rendered with
    the category's system prompt and chat-template kwargs (merged over the run's); for a
    category with modes, the first `n` drawn to each mode, with its kwargs and sampling.

    Loads the config's tokenizer unless `renderer` is given or no category needs one.
    A category whose first records are all rejected gives one `Preview` with no text.
    """
    if renderer is None and any(c.format != "input_ids" for c in cfg.category):
        from producer.run import load_renderer

        renderer = load_renderer(cfg)

    parsers = ""
    if renderer is not None:  # the stop ids and reply parsers the run would use
        from foundation.config import with_stop_ids
        from producer.reply_parser import reply_parser

        replies = reply_parser(cfg, renderer)
        cfg = with_stop_ids(cfg, set(replies.end_of_turn_ids))
        parsers = replies.describe()
    out: list[Preview] = []
    for cat in cfg.category:
        if categories is not None and cat.name not in categories \
                and cat.split_of not in categories:
            continue
        drawn: list[Mode | None] = [m for m in cat.modes
                                    if cat.only_mode in (None, m.name)] or [None]
        for mode in drawn:
            out += _preview_mode(cfg, cat, mode, renderer, n, parsers)
    return out


def _preview_mode(cfg: RunConfig, cat: Category, mode: Mode | None,
                  renderer: Renderer | None, n: int, parsers: str) -> list[Preview]:
    """`preview` of one category in one of its modes (None: it has none): its first `n`
    prompts drawn to it, rendered with its kwargs and sampling."""
    from foundation import modes as modes_of

    kwargs = modes_of.template_kwargs(cfg, cat, mode)
    params = modes_of.sampling(cat, mode)
    sampling = msgspec.to_builtins(params)
    common_warnings = [f"chat_template_kwargs key {k!r} is never read by the template"
                       for k in unused_kwargs(renderer, kwargs)]
    out: list[Preview] = []
    skipped: list[str] = []
    name = mode.name if mode else ""
    for item in _first_prompts(cfg, cat, renderer, n, mode.name if mode else None):
        if len(item) == 2:
            skipped.append(f"{item[0]}: {item[1]}")
            continue
        sample, text, ids = item
        warnings = list(common_warnings)
        if sample.unread:
            warnings.append(f"text in {', '.join(sample.unread)} is never sent: neither the "
                            "format nor field_map reads it")
        need = len(ids) + params.max_new_tokens
        if cfg.context_length is not None and need > cfg.context_length:
            warnings.append(f"prompt ({len(ids)}) + max_new_tokens exceeds context_length "
                            f"{cfg.context_length}: it would be rejected")
        messages = sample.prompt if sample.prompt and isinstance(sample.prompt[0], dict) \
            else None
        out.append(Preview(
            category=cat.name, sample_id=sample.sample_id, where=sample.where,
            messages=messages, text=text, prompt_tokens=len(ids), prompt_ids=ids,
            sampling=sampling, chat_template_kwargs=kwargs, skipped=skipped,
            warnings=warnings, mode=name, parsers=parsers if cat.turns == "all" else "",
        ))
        skipped = []
    if not out:
        out.append(Preview(
            category=cat.name, sample_id=None, where=None, messages=None, text=None,
            prompt_tokens=0, prompt_ids=[], sampling=sampling, chat_template_kwargs=kwargs,
            skipped=skipped, mode=name,
            warnings=[*common_warnings, "no record could be rendered"],
        ))
    return out


def preview_text(previews: list[Preview]) -> str:
    """`preview`'s result for people: per prompt its sampling, kwargs, token count and the
    rendered text (special tokens shown, nothing escaped) between two markers; the end
    marker follows the last character, so whether the prompt ends in a newline shows."""
    enc = msgspec.json.encode
    blocks = []
    for p in previews:
        head = f"=== {p.category}" + (f" · mode {p.mode}" if p.mode else "") + (
            f" · {p.sample_id} ({p.where})" if p.sample_id else "")
        lines = [head + " ===",
                 f"sampling: {enc(p.sampling).decode()}",
                 f"chat_template_kwargs: {enc(p.chat_template_kwargs).decode()}",
                 f"prompt tokens: {p.prompt_tokens}"]
        if p.parsers:
            lines.append(f"replies: {p.parsers}")
        lines += [f"skipped {s}" for s in p.skipped]
        lines += [f"warning: {w}" for w in p.warnings]
        if p.text is not None:
            # The end marker follows the text directly: a trailing newline stays visible.
            lines += ["--- rendered prompt (special tokens shown) ---",
                      p.text + "--- end of prompt ---"]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)
