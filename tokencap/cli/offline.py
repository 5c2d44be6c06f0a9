"""`tokencap export`, `plan`, `preview`, `init`, `audit` and `verify`: wiring only.

The logic lives in `tokencap.export` and `tokencap.prepare` (`plan`, `init`, `audit`,
`verify`). These commands need no Redis.
Each command ends an expected error as one line (`tokencap.cli.errors.Command`), registered
on the `tokencap` group or invoked alone.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import msgspec

from foundation.config import DEFAULT_CAP_TOKENS
from foundation.errors import DiskFull, SourceError, TokencapError
from tokencap.cli.errors import Command
from tokencap.cli.find_run import COUNT
from tokencap.export.exporter import (
    DEFAULT_DRAFT_VOCAB,
    DEFAULT_SEED,
    FORMATS,
    MAX_BAD_REPORTED,
)

if TYPE_CHECKING:
    from foundation.config import RunConfig
    from producer.render import Renderer

CONFIG_ENV = "TOKENCAP_CONFIG"


def _load(config: str) -> Any:
    from foundation.config import load_config

    return load_config(config)


def _renderer(path: str | None, kwargs: dict | None = None) -> Any:
    from producer.render import Renderer

    if not path:
        raise TokencapError("no tokenizer: pass --tokenizer DIR or a config that names one")
    return Renderer(path, kwargs)


def _config_renderer(cfg: RunConfig) -> Renderer | None:
    """The run's tokenizer as the producer loads it (trust_remote_code, kwargs checked)."""
    from producer.run import load_renderer

    return load_renderer(cfg)


def _export_table(summary: dict[str, Any]) -> str:
    """The export summary as a table: one line per category, a total, the files."""
    cols = ("rows", "eval_rows", "tokens", "loss_tokens", "dropped_truncated", "duplicates",
            "bad_lines")
    heads = ("rows", "eval rows", "tokens", "loss tokens", "dropped (length)", "duplicates",
             "bad lines")
    cats = summary["categories"]
    rows = [(name, *(st[c] for c in cols)) for name, st in cats.items()]
    rows.append(("total", *(summary["total"][c] for c in cols)))
    width = max(len("category"), *(len(r[0]) for r in rows))
    lines = [f"{'category':<{width}}" + "".join(f"  {h:>16}" for h in heads)]
    lines += [f"{r[0]:<{width}}" + "".join(f"  {v:>16,}" for v in r[1:]) for r in rows]
    for name, st in cats.items():
        if st.get("conversations") or st.get("conversations_in_progress"):
            lines.append(f"{name}: {st['conversations']:,} conversations written "
                         f"({st['conversations_complete']:,} complete, the others cut with a "
                         f"reason), {st['conversations_in_progress']:,} still going on "
                         "(not written)")
    for name, per_mode in (summary.get("modes") or {}).items():
        lines.append(f"{name} by mode: " + ", ".join(
            f"{m} {v['rows']:,} rows {v['tokens']:,} tokens ({v['share_tokens']:.1%} of the "
            "tokens" + (f", weight {v['weight']:.1%})" if v["weight"] is not None else ")")
            for m, v in per_mode.items()))
    if summary.get("mode"):
        lines.append(f"only mode {summary['mode']!r}: {summary['total']['other_modes']:,} "
                     "rows of other modes left out")
    lines += [f"wrote {path}" for path in summary["files"]]
    vocab = summary.get("vocab")
    if vocab:
        cover = vocab["coverage"]["merged"]
        shares = ", ".join(f"top {int(k) // 1024}K {v:.1%}" for k, v in cover.items()
                           if v is not None)
        lines.append(f"draft vocabulary {vocab['draft_vocab_size']:,} of "
                     f"{vocab['target_vocab_size']:,} ids, from "
                     f"{vocab['loss_tokens']['merged']:,} loss tokens, "
                     f"{vocab['distinct_ids']:,} distinct ids" + (f"; coverage {shares}"
                                                                   if shares else ""))
        lines.append(f"target vocabulary {vocab['target_vocab_size']:,} ids: from "
                     f"{vocab.get('target_vocab_from') or '?'} (the trainer's mapping file "
                     f"names it: vocab_mapping-{vocab['target_vocab_size']}-"
                     f"{vocab['draft_vocab_size']}.pt)")
        lines += [f"wrote {path}" for path in vocab["files"]]
    lines += [f"copied {path} (what made the rows)" for path in summary.get("manifests", [])]
    return "\n".join(lines)


@click.command("export", cls=Command)
@click.argument("config_arg", metavar="[CONFIG]", required=False,
                type=click.Path(dir_okay=False))
@click.option("--config", "config_path", envvar=CONFIG_ENV, default=None,
              type=click.Path(dir_okay=False),
              help="Run config: gives the output folder, the tokenizer, the categories and "
              "(for conversations) the sources to re-read prompt messages from. "
              f"Env: {CONFIG_ENV}.")
@click.option("--out", "out_dir", envvar="TOKENCAP_OUT", default=None,
              type=click.Path(file_okay=False),
              help="Output folder of the run (<out>/<category>/part-*.jsonl); overrides the "
              "config's output_dir. Env: TOKENCAP_OUT.")
@click.option("--tokenizer", envvar="TOKENCAP_TOKENIZER", default=None,
              type=click.Path(file_okay=False),
              help="Local tokenizer folder, for --format conversations; overrides the "
              "config's. Env: TOKENCAP_TOKENIZER.")
@click.option("--dest", envvar="TOKENCAP_EXPORT_DEST", required=True,
              type=click.Path(file_okay=False),
              help="Folder to write to: <dest>/<category>/<file>, or <dest>/<file> with "
              "--merged. Env: TOKENCAP_EXPORT_DEST.")
@click.option("--format", "formats", multiple=True, type=click.Choice(FORMATS),
              default=("specforge",), show_default=True,
              help="specforge: {id, input_ids, loss_mask} JSONL; conversations: decoded text "
              "JSONL; parquet: SpecForge rows plus category, finish_reason, counted_tokens. "
              "Repeat for several.")
@click.option("--merged", is_flag=True,
              help="One file per format for all categories; ids become <category>/<id>.")
@click.option("--category", "categories", multiple=True,
              help="Export only this category (repeatable). Default: all.")
@click.option("--keep-truncated", is_flag=True,
              help="Keep samples cut at max_new_tokens (finish_reason length), with the "
              "later turns of their conversations; on a gated run (reply_gate, the default) "
              "these are the replies the gate kept out as `length`, read from "
              "rejected-replies.jsonl. By default they are dropped and counted.")
@click.option("--allow-simulated", is_flag=True,
              help="Export rows a simulator generated (synthetic outputs); refused otherwise.")
@click.option("--loss-mask", type=click.Choice(["generated", "shifted"]), default="generated",
              show_default=True,
              help="generated: loss 1 exactly over the generated ids (a trainer that shifts the "
              "mask with its targets: SpecForge PR #895, vLLM speculators); shifted: the same "
              "span one position left (SpecForge main at a6b6b02, whose trainer shifts ids and "
              "targets but not the mask, issue #885).")
@click.option("--prefix-consistent", "consistent_only", is_flag=True,
              help="Only turns whose prompt extends the previous turn's prompt and output ids "
              "exactly (and conversations made only of such turns).")
@click.option("--exact-tool-args", is_flag=True,
              help="Only turns whose history replays each tool result for a call with the "
              "source's arguments (the rows marked tool_args_match false are dropped).")
@click.option("--eval-fraction", type=click.FloatRange(0.0, 1.0, max_open=True), default=0.0,
              show_default=True,
              help="Put this share of the conversations (every turn of one on one side) in "
              "eval files beside the train files (<name>.eval.<ext>), chosen by a hash of "
              "the conversation id and --seed: the same after a resumed run or a rerun.")
@click.option("--seed", type=int, default=DEFAULT_SEED, show_default=True, help="The split's seed.")
@click.option("--max-length", type=click.IntRange(min=1), default=None,
              help="Token formats: rows longer than this many tokens are cut to it "
              "(--over-length truncate, as SpecForge's max_length and speculators' "
              "--seq-length) or left out (drop); the loss and the vocabulary count only "
              "within it. Default: no limit.")
@click.option("--over-length", type=click.Choice(["truncate", "drop"]), default="truncate",
              show_default=True, help="What --max-length does to a longer row.")
@click.option("--min-loss-tokens", type=click.IntRange(min=0), default=1, show_default=True,
              help="Token formats: leave out rows with fewer loss tokens (after the limit).")
@click.option("--draft-vocab-size", type=click.IntRange(min=0),
              default=DEFAULT_DRAFT_VOCAB,
              show_default=True,
              help="Write the draft vocabulary for an EAGLE-3 draft of this size: token "
              "frequencies (token_freq.npy / .pt) and the d2t/t2d mapping (d2t-N.npy, "
              "t2d-N.npy, vocab_mapping-<target>-N.pt), from the loss-masked tokens of the "
              "train rows within --max-length. 0: none.")
@click.option("--target-vocab-size", type=click.IntRange(min=1), default=None,
              help="The target model's vocabulary size (its config's vocab_size; t2d's "
              "length). Default: a config.json beside the tokenizer, else the tokenizer's "
              "length.")
@click.option("--hidden-states", "with_states", is_flag=True,
              help="Add the hidden states the config's [hidden_states] stage kept (`tokencap "
              "hidden-states`): speculators' hs_<i> files in its folder, SpecForge's offline "
              ".ckpt files (torch) beside specforge.jsonl; rows without states are left out. "
              "Each category's files are checked against the manifest its stage wrote at its "
              "end: one that disagrees (or no manifest) stops the export, exit 2.")
@click.option("--skip-bad-states", is_flag=True,
              help="With --hidden-states: leave out the rows whose states file disagrees with "
              "its category's manifest (or every row with states of a category without one), "
              "counted as dropped_bad_states, instead of stopping (`tokencap verify` lists "
              "them).")
@click.option("--mode", "mode", default=None,
              help="Export only the rows made in this decode mode (a category's `modes`); "
              "every turn of a conversation is in one mode, so whole conversations are kept "
              "or left out (counted as other_modes).")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def export_cmd(config_arg: str | None, config_path: str | None, out_dir: str | None,
               tokenizer: str | None, dest: str,
               formats: tuple[str, ...], merged: bool, categories: tuple[str, ...],
               keep_truncated: bool, allow_simulated: bool, loss_mask: str,
               consistent_only: bool, exact_tool_args: bool, eval_fraction: float, seed: int,
               max_length: int | None, over_length: str, min_loss_tokens: int,
               draft_vocab_size: int, target_vocab_size: int | None, with_states: bool,
               skip_bad_states: bool, mode: str | None, as_json: bool) -> None:
    """Export committed results as training data (SpecForge rows, conversations, Parquet,
    speculators' prepared dataset), with what the trainers would otherwise prepare in a
    GPU pass: an eval split by conversation, length limits, the draft vocabulary.

    Streams <out>/<category>/part-*.jsonl (the training rows: the replies the reply gate
    kept out are in rejected-replies.jsonl, never exported), with the run manifests the rows
    name; drops truncated samples unless --keep-truncated;
    skips duplicate ids and unreadable lines (reported as file:line); writes each file under
    a temporary name and renames it into place only when the whole export succeeded; writes
    export-manifest.json (formats, split, limits, counts per reason, vocabulary coverage).
    """
    from tokencap.export.conversations import SourceMessages
    from tokencap.export.exporter import export
    from tokencap.export.length import Limits

    if config_arg and config_path and config_arg != config_path:
        raise TokencapError(f"two configs: {config_arg} and --config {config_path}; give one")
    config_path = config_arg or config_path
    cfg = _load(config_path) if config_path else None
    out = out_dir or (cfg.output_dir if cfg else None)
    if out is None:
        raise TokencapError("no output folder: pass CONFIG (or --config CONFIG) or --out DIR")
    names = list(categories) or ([c.name for c in cfg.category] if cfg else None)
    if cfg is not None and names:  # a `share = "tokens"` category: its budgets' folders
        names = [n for name in names for n in ([c.name for c in cfg.category
                                                if c.split_of == name] or [name])]
    decoder = messages = None
    if "conversations" in formats:
        if cfg is not None and not tokenizer:
            from producer.run import load_renderer

            renderer = load_renderer(cfg)
        else:
            renderer = _renderer(tokenizer or (cfg.tokenizer if cfg else None))
        if renderer is None:
            raise TokencapError("the conversations export decodes the token ids: name a "
                                "tokenizer (--tokenizer, or `tokenizer` in the config)")
        decoder = renderer.tokenizer
        messages = SourceMessages(cfg, renderer) if cfg else None
    vocab = None
    if draft_vocab_size:
        vocab = _vocab(cfg, tokenizer, target_vocab_size, draft_vocab_size)
        if vocab is None:
            click.echo("no draft vocabulary written: it needs the target's vocabulary size "
                       "(--target-vocab-size, or a tokenizer: --tokenizer or --config)",
                       err=True)
    limits = Limits(max_length, "drop" if over_length == "drop" else "truncate",
                    min_loss_tokens)
    states = None
    if skip_bad_states and not with_states:
        raise TokencapError("--skip-bad-states is for --hidden-states: give both")
    if with_states:
        if cfg is None or cfg.hidden_states is None:
            raise TokencapError("--hidden-states needs CONFIG with a [hidden_states] section "
                                "(its output_dir holds the states `tokencap hidden-states` "
                                "kept)")
        states = cfg.states()
    try:
        summary = export(Path(out), Path(dest), list(formats), names, merged, keep_truncated,
                         decoder, messages, allow_simulated, loss_mask, consistent_only,
                         exact_tool_args, eval_fraction, seed, limits, vocab, states,
                         skip_bad_states, mode, *_mode_weights(cfg))
    finally:
        if messages is not None:
            messages.close()
    if messages is not None:
        summary["rows_without_prompt_messages"] = messages.unmatched
    for name, st in summary["categories"].items():
        for bad in st["bad"]:
            click.echo(f"{bad['where']}: bad line skipped: {bad['error']}", err=True)
        if st["bad_lines"] > MAX_BAD_REPORTED:
            click.echo(f"{name}: ... and {st['bad_lines'] - MAX_BAD_REPORTED} more bad lines",
                       err=True)
        if st["dropped_truncated"]:
            after = st["dropped_after_truncated"]
            click.echo(f"{name}: dropped {st['dropped_truncated']} truncated samples "
                       "(finish_reason length)" + (f" and {after} later turns of their "
                       "conversations" if after else "") + "; --keep-truncated keeps them",
                       err=True)
        if st["dropped_tool_args"]:
            click.echo(f"{name}: dropped {st['dropped_tool_args']} turns whose history replays "
                       "a tool result for a call with other arguments (--exact-tool-args)",
                       err=True)
        if st["dropped_inconsistent"]:
            click.echo(f"{name}: dropped {st['dropped_inconsistent']} turns whose prompt does "
                       "not extend the previous turn's (--prefix-consistent)", err=True)
        if st["dropped_over_length"] or st["truncated_to_limit"]:
            click.echo(f"{name}: {st['truncated_to_limit']} rows cut and "
                       f"{st['dropped_over_length']} left out at --max-length {max_length}",
                       err=True)
        if st["dropped_no_states"]:
            click.echo(f"{name}: left out {st['dropped_no_states']} rows without kept hidden "
                       "states (run `tokencap hidden-states` to make them)", err=True)
        if st["dropped_bad_states"]:
            click.echo(f"{name}: left out {st['dropped_bad_states']} rows whose states file "
                       "disagrees with the category's manifest (--skip-bad-states; `tokencap "
                       "verify` names them)", err=True)
        if st["dropped_too_few_loss_tokens"]:
            click.echo(f"{name}: left out {st['dropped_too_few_loss_tokens']} rows with fewer "
                       f"than {min_loss_tokens} loss tokens", err=True)
    for name in summary["missing"]:
        click.echo(f"{name}: no part files, nothing exported", err=True)
    hs = summary.get("hidden_states")
    if hs:
        trainers = hs["trainers"]
        click.echo(f"hidden states: train speculators with {trainers['speculators']['args']}; "
                   "SpecForge's draft config: eagle_config.eagle_aux_hidden_state_layer_ids = "
                   f"{trainers['specforge']['eagle_aux_hidden_state_layer_ids']} "
                   "(export-manifest.json says why)", err=True)
    click.echo(json.dumps(summary, indent=2) if as_json else _export_table(summary))


def _mode_weights(cfg: Any) -> tuple[dict[str, dict[str, float]], dict[str, str]]:
    """Each category's modes' shares of it, and the category of each folder (a
    `share = "tokens"` category's budgets `<category>.<mode>` are its)."""
    from foundation.config import mode_shares

    if cfg is None:
        return {}, {}
    cats = [c for c in cfg.category if c.modes]
    return ({c.split_of or c.name: mode_shares(c) for c in cats},
            {c.name: c.split_of for c in cats if c.split_of})


def _vocab(cfg: Any, tokenizer: str | None, explicit: int | None, draft_size: int) -> Any:
    """The draft vocabulary's sizes (None when the target's is unknown)."""
    from tokencap.export.exporter import Vocab
    from tokencap.export.vocab import target_vocab_size

    if tokenizer:
        renderer = _renderer(tokenizer)
    elif cfg is not None and cfg.tokenizer:
        renderer = _config_renderer(cfg)
    elif explicit is None:
        return None
    else:
        renderer = None
    tok = renderer.tokenizer if renderer is not None else None
    folder = renderer.path if renderer is not None else None
    size, origin = target_vocab_size(explicit, tok, folder)
    return Vocab(size, draft_size, origin)


def _plan_table(rows: list[Any], total: Any, tok_s: float) -> str:
    from tokencap.prepare.plan import recipe_line, unread_text

    heads = ("cap", "prompts", "tok/row", "from", "rows", "tokens", "hours", "hours left",
             "limit")
    table = []
    for r in [*rows, total]:
        prompts = "?" if r.prompts is None else f"{r.prompts:,}"
        cap = "uncapped" if r.cap_tokens is None else f"{r.cap_tokens:,}"
        table.append((r.category, cap, prompts, f"{r.avg_tokens:,.0f}",
                      r.source, f"{r.samples:,}", f"{r.total_tokens:,}", f"{r.hours:.2f}",
                      f"{r.hours_left:.2f}", r.limited_by))
    width = max(len("category"), *(len(t[0]) for t in table))
    lines = [f"{'category':<{width}}" + "".join(f"  {h:>11}" for h in heads)]
    lines += [f"{t[0]:<{width}}" + "".join(f"  {v:>11}" for v in t[1:]) for t in table]
    for r in rows:
        if r.checked is not None:
            c = r.checked
            why = ", ".join(f"{k} {v:,}" for k, v in c.rejected.items()) or "none"
            lines.append(f"{r.category}: {c.usable:,} of {c.records:,} records usable, "
                         f"{c.generations:,} generations; rejected: {why}")
            if c.contaminated:
                lines.append(f"{r.category}: contaminated, by benchmark: " + ", ".join(
                    f"{b} {n:,}" for b, n in c.contaminated.items()))
            lines += [f"  {example}" for shown in c.examples.values() for example in shown]
            if c.unread:
                lines.append(unread_text(r.category, c.unread, c.records))
    lines.append(recipe_line(total))
    lines.append(f"hours at {tok_s:,.0f} output tok/s; a row is one generated reply (one "
                 "training row); tok/row counts what the budget counts, measured from "
                 "committed results or estimated from the config")
    if any(r.checked is None for r in rows):
        lines.append("prompts counts records (rejected ones and a conversation's later turns "
                     "unseen); plan --check reads and renders every record to count them")
    return "\n".join(lines)


@click.command("plan", cls=Command)
@click.argument("config", type=click.Path(dir_okay=False))
@click.option("--tok-s", type=click.FloatRange(min=0, min_open=True), default=1000.0,
              envvar="TOKENCAP_TOK_S", show_default=True,
              help="Engine output throughput in tokens/s, for the hours. Env: TOKENCAP_TOK_S.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@click.option("--check", is_flag=True,
              help="Read and render every record as the producer does, and plan with the "
                   "usable ones only (their turns, with turns = \"all\"); prints the rejects "
                   "per reason, the near-duplicates and the contaminated prompts (by "
                   "benchmark) the producer would refuse among them. Slower: it tokenizes "
                   "the whole source.")
def plan_cmd(config: str, tok_s: float, as_json: bool, check: bool) -> None:
    """Plan CONFIG: per category the prompts available, tokens per row, the rows (generated
    replies, one training row each) and tokens its cap needs (an uncapped category: its
    whole source), and hours at --tok-s; then the totals, and the rows against the sizes
    published drafter recipes train on.

    Tokens per row are measured from committed results in output_dir when there are
    any, else taken from expected_tokens (plus rendered prompt lengths when count = total).
    Prompts are the records in the sources, or with --check the generations the usable
    records ask for.
    """
    from tokencap.prepare.plan import RECIPES, measure, plan, survey, totals

    cfg = _load(config)
    names = [c.name for c in cfg.category]
    measured = measure(Path(cfg.output_dir), names)
    chat = any(c.format != "input_ids" for c in cfg.category)
    # prompt lengths matter where nothing was measured yet and the prompt counts, or a
    # hidden-state stage will keep states of its tokens
    from budget_service.estimator import counts_prompt

    priced = counts_prompt(cfg) or cfg.hidden_states is not None
    estimate = [n for n in names if n not in measured] if priced else []
    renders = check or any(cfg.by_name(n).format != "input_ids" for n in estimate)
    renderer = _config_renderer(cfg) if chat and renders else None
    if check:
        from tokencap.prepare.plan import context_for_check

        context, origin = context_for_check(cfg, renderer)
        click.echo(f"prompts checked against a context of {context:,} tokens ({origin})"
                   if context else "no context_length in the config and no config.json "
                   "beside the tokenizer: prompts are not checked against the engine's "
                   "context here (the run's preflight asks the engine)", err=True)
    found = survey(cfg, renderer, check, estimate, lambda name, done, n: click.echo(
        f"{name}: checked {done:,} of {n:,} records", err=True))  # each source opened once
    checked = {n: s.checked for n, s in found.items() if s.checked is not None} or None
    available = {n: s.checked.generations if s.checked else s.records
                 for n, s in found.items()}
    prompt_tokens = {n: s.prompt_tokens for n, s in found.items()
                     if s.prompt_tokens is not None} or None
    rows = plan(cfg, measured, available, tok_s, prompt_tokens)
    if checked is not None:
        rows = [msgspec.structs.replace(r, checked=checked[r.category]) for r in rows]
    total = totals(rows)
    if as_json:
        doc = {"run": cfg.run, "count": cfg.count, "tok_s": tok_s,
               "categories": msgspec.to_builtins(rows), "total": msgspec.to_builtins(total),
               "recipes": [{"rows": n, "what": what, "source": src,
                            "share": total.samples / n} for n, what, src in RECIPES]}
        click.echo(json.dumps(doc, indent=2))
    else:
        click.echo(_plan_table(rows, total, tok_s))
    if cfg.hidden_states is not None:
        _states_plan(cfg, rows, prompt_tokens or {}, check)
    empty = [name for name, c in (checked or {}).items() if c.usable == 0]
    if empty:  # a run of it would feed nothing there
        what = "category" if len(empty) == 1 else "categories"
        raise SourceError(f"{config}: no usable record in {what} {', '.join(empty)} (the "
                          "rejects above say why)")


def _states_plan(cfg: Any, rows: list[Any], prompt_tokens: dict[str, float],
                 check: bool) -> None:
    """The hidden states the planned rows would make ([hidden_states]): bytes per token, per
    category and in all, against the free space of their folder less the states already
    kept (`extraction.say_plan`; `--check`: `DiskFull`, exit 10, when they would not fit)."""
    from tokencap import extraction

    stage = extraction.StatesStage.of(cfg)
    planned = {r.category: (r.samples, r.avg_output_tokens, prompt_tokens.get(r.category, 0.0))
               for r in rows}
    tokens, how = extraction.row_token_plan(stage, planned)
    refused: DiskFull | None = None
    try:
        extraction.say_plan(stage, extraction.plan_of(stage, tokens), click.echo)
    except DiskFull as exc:
        refused = exc
    click.echo("  states are of row tokens (prompt + output of every kept turn): "
               + "; ".join(f"{name} {ratio}" for name, ratio in how.items()))
    if not prompt_tokens and any("assumed" in r for r in how.values()):
        click.echo("  (prompt tokens not measured here: `plan --check` measures them)")
    if refused is not None:
        if check:
            raise refused
        click.echo(f"warning: {refused}", err=True)


@click.command("init", cls=Command)
@click.argument("data", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--tokenizer", "tokenizer", envvar="TOKENCAP_TOKENIZER", required=True,
              type=click.Path(file_okay=False),
              help="The model's local tokenizer folder. Env: TOKENCAP_TOKENIZER.")
@click.option("--out", "dest", default="run.toml", show_default=True,
              type=click.Path(dir_okay=False), help="The config file to write.")
@click.option("--run", "run_name", default="run", show_default=True, help="The run's name.")
@click.option("--cap", "cap", type=COUNT, default=DEFAULT_CAP_TOKENS,
              show_default=True, help="Output tokens per category.")
@click.option("--force", is_flag=True, help="Replace the config file if it exists.")
def init_cmd(data: tuple[str, ...], tokenizer: str, dest: str, run_name: str, cap: int,
             force: bool) -> None:
    """Write a commented run config for DATA files: one category per file, its format told
    from its records (or the field_map that would read it), a cap, the model's sampling, and
    the plan's figures as comments. Then `tokencap plan CONFIG --check` and `make up
    CONFIG=...`. Needs no Redis."""
    from tokencap.prepare.init import plan_comments, write_config

    out = Path(dest)
    found = write_config([Path(d) for d in data], Path(tokenizer), out, run_name, cap, force)
    unreadable = []
    for name, f in found.items():
        fmt = f["format"] or "not told (see the config)"
        for bad in f["bad"]:
            click.echo(f"skipped {bad}", err=True)
        if f["unreadable"]:
            unreadable.append(f["bad"][0])
            continue
        if f["field_map"]:
            fmt = f"none fits: field_map = {f['field_map']} reads it (written in the config)"
        click.echo(f"{name}: {f['file']}, {f['records']:,} records, format {fmt}")
        if f["unread"]:
            click.echo(f"{name}: text in {', '.join(f['unread'])} is never sent: no format or "
                       "map reads it (field_map can name it)")
    usable = [f for f in found.values() if f["format"] or f["field_map"]]
    if len(usable) == len(found):
        for line in plan_comments(out):
            click.echo(line.removeprefix("# "))
    click.echo(f"wrote {out}; next: tokencap plan {out} --check, then make up CONFIG={out}")
    if unreadable:
        raise SourceError(f"no record read in {len(unreadable)} file(s), left out of {out}: "
                          f"{'; '.join(unreadable)}")


@click.command("preview", cls=Command)
@click.argument("config", type=click.Path(dir_okay=False))
@click.option("-n", "n", type=click.IntRange(min=1), default=1, show_default=True,
              help="Prompts to show per category.")
@click.option("--category", "categories", multiple=True,
              help="Show only this category (repeatable). Default: all.")
@click.option("--json", "as_json", is_flag=True,
              help="Print the previews as JSON (with the prompt ids).")
def preview_cmd(config: str, n: int, categories: tuple[str, ...], as_json: bool) -> None:
    """Show the first prompt(s) of each category of CONFIG exactly as they will be sent:
    the rendered chat template with special tokens, the token count and the sampling params,
    so that a wrong template or setting is seen before GPU time is spent; a category with
    modes shows the first prompt(s) drawn to each mode, with its kwargs and sampling. Needs
    no Redis.
    """
    from tokencap.prepare.plan import preview, preview_text

    cfg = _load(config)
    # a `share = "tokens"` category by its name, or its budgets `<category>.<mode>`
    known = {cat.name for cat in cfg.category} | {cat.split_of for cat in cfg.category}
    unknown = [c for c in categories if c not in known]
    if unknown:
        raise TokencapError(f"no category {', '.join(map(repr, unknown))} in {config}")
    from tokencap.prepare.plan import PREVIEW_SCAN_LIMIT

    previews = preview(cfg, n, categories=list(categories) or None)
    if as_json:
        click.echo(json.dumps(msgspec.to_builtins(previews), indent=2, ensure_ascii=False))
    else:
        click.echo(preview_text(previews))
    empty = [p.category for p in previews if p.sample_id is None]
    if empty:  # a run would feed nothing there (or nothing soon): a CI gate sees it
        what = "category" if len(empty) == 1 else "categories"
        raise SourceError(f"{config}: no usable record in {what} {', '.join(empty)} among "
                          f"the first {PREVIEW_SCAN_LIMIT:,} of its order (the rejects above "
                          "say why, file:line each)")


@click.command("audit", cls=Command)
@click.argument("rows", nargs=-1, required=True, type=click.Path(exists=True))
@click.option("--tokenizer", envvar="TOKENCAP_TOKENIZER", default=None,
              help="Tokenizer folder of the model that wrote the rows (its markers, its "
              "parsers). Default: the config's. Env: TOKENCAP_TOKENIZER.")
@click.option("--config", "config_path", envvar=CONFIG_ENV, default=None,
              type=click.Path(dir_okay=False),
              help=f"Run config: its tokenizer and parsers. Env: {CONFIG_ENV}.")
@click.option("--json", "as_json", is_flag=True, help="Print the counts as JSON.")
def audit_cmd(rows: tuple[str, ...], tokenizer: str | None, config_path: str | None,
              as_json: bool) -> None:
    """Run the reply gate (loop, length, unclosed_reasoning, empty) and the tool checks on
    ROWS already written: tokencap's rows (part-*.jsonl, rejected-replies.jsonl, or their
    folder) or regenerated conversations as SpecForge's and speculators' regeneration write
    them ({"id", "conversations": [{role, content}, ...]} JSONL). Prints counts per reason
    with examples (file:line); exits 1 when any reply or row is flagged.
    """
    from producer.reply_parser import ReplyParser, reply_parser
    from tokencap.prepare.audit import audit

    cfg = _load(config_path) if config_path else None
    if cfg is not None and not tokenizer:
        renderer = _config_renderer(cfg)
        if renderer is None:
            raise TokencapError("the audit reads replies with the model's tokenizer: name one "
                                "(--tokenizer, or `tokenizer` in the config)")
        replies = reply_parser(cfg, renderer)
    else:
        renderer = _renderer(tokenizer)
        replies = ReplyParser(renderer.tokenizer, renderer.template)
    report = audit([Path(r) for r in rows], replies)
    if as_json:
        click.echo(json.dumps(report, indent=2, ensure_ascii=False))
    else:
        click.echo(f"{report['rows']:,} rows, {report['replies']:,} replies; "
                   + ("nothing flagged" if not report["reasons"] else "flagged:"))
        for reason, n in report["reasons"].items():
            click.echo(f"  {reason}: {n:,}")
            for example in report["examples"].get(reason, []):
                click.echo(f"    {example}")
    if report["reasons"]:
        sys.exit(1)


@click.command("verify", cls=Command)
@click.argument("states_dir", metavar="STATES_DIR", type=click.Path(file_okay=True))
@click.option("--category", "categories", multiple=True,
              help="Verify only this category (repeatable). Default: every folder of "
              "STATES_DIR with states or a manifest.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def verify_cmd(states_dir: str, categories: tuple[str, ...], as_json: bool) -> None:
    """Reread the hidden-state files of STATES_DIR (the config's [hidden_states] output_dir)
    against the manifest each category's stage wrote at its end: every file's size and the
    CRC32 of each tensor and of its header. Names every missing, extra, torn, changed or
    swapped file (one line each); exits 2 when any, or when a category has states and no
    manifest (its stage has not ended). Reads only; a progress line every few seconds on
    stderr. Needs no Redis.
    """
    from tokencap.prepare.verify import report_lines, verify_states

    root = Path(states_dir)
    checks = verify_states(root, list(categories) or None,
                           lambda line: click.echo(line, err=True))
    if as_json:
        doc = {"states_dir": str(root), "clean": all(c.clean for c in checks),
               "categories": {c.category: c.document() for c in checks}}
        click.echo(json.dumps(doc, indent=2))
    else:
        for line in report_lines(checks):
            click.echo(line)
    if not all(c.clean for c in checks):
        sys.exit(2)
