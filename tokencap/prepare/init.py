"""`tokencap init DATA... --tokenizer T`: a commented run config from the data files given.

One category per file (named after it), its format told from its first records
(`producer.formats.detect_format`; a file it cannot tell gets the `field_map` that would read
it, or says why), a cap per category, the sampling the model's generation config gives (or a
line saying it gives none), and the plan's figures as comments (records, the first prompts'
mean length), so that `tokencap plan CONFIG --check` and `make up CONFIG=...` are next.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any, NamedTuple

from foundation.config import DEFAULT_CAP_TOKENS
from foundation.errors import SourceError
from producer.formats.records import toml_table

DEFAULT_MAX_NEW = 4096
LOOKED_AT = 20  # first records read to tell a file's format
CHAT_FORMATS = {"messages", "sharegpt"}


def _name(path: Path, taken: set[str]) -> str:
    base = re.sub(r"[^A-Za-z0-9_-]+", "_", path.name.split(".")[0]).strip("_") or "data"
    name, k = base, 2
    while name in taken:
        name, k = f"{base}_{k}", k + 1
    taken.add(name)
    return name


class Found(NamedTuple):
    """What `init` read of one file."""

    format: str | None  # the format most of its first records have, "preset:NAME", or None
    note: str  # a note for the config
    records: int
    bad: list[str]  # "file:line: reason: message" of each record it could not read
    field_map: dict[str, str] = {}  # the map that reads its records, when no format does
    unread: list[str] = []  # keys with text the format (or map) never reads


def _format_of(path: Path) -> Found:
    """The format most of the first records have (None when none told; "preset:NAME" when
    every one of them is a record of a preset's dataset), or else the `field_map` that reads
    every one of them; a note for the config, the records, the bad ones among the first read
    (skipped: `plan --check` reads them all) and the keys with text never read."""
    from foundation.presets import preset_of
    from producer.formats.records import Rejected, detect_format, field_map_for, unread_keys
    from producer.formats.turns import to_conversation
    from producer.readers.index import SourceIndex

    bad: list[str] = []
    records: list[dict] = []
    with SourceIndex.build([path]) as index:
        n = len(index)
        for i in range(min(n, LOOKED_AT)):
            try:
                records.append(index.read(i))
            except Rejected as exc:
                bad.append(f"{index.where(i)}: {exc}")
    seen: Counter[str] = Counter()
    presets = Counter(preset_of(r) for r in records)
    why = ""
    for record in records:
        try:
            seen[detect_format(record)] += 1
        except Rejected as exc:
            why = why or str(exc)
    if len(presets) == 1 and None not in presets:
        return Found(f"preset:{next(iter(presets))}", "", n, bad)
    if not seen:
        mapped = field_map_for(records[0]) if records else {}
        try:
            for record in records:
                to_conversation(record, "auto", "first", None, mapped)
        except (Rejected, ValueError):
            mapped = {}
        if mapped:
            unread = sorted({k for r in records for k in unread_keys(r, "auto", mapped)})
            return Found(None, "no format fits; this field_map reads every record looked at",
                         n, bad, mapped, unread)
        why = why or (f"no readable record among the first {len(bad)}" if bad else "no record")
        return Found(None, why, n, bad)
    fmt, count = seen.most_common(1)[0]
    note = "" if count == sum(seen.values()) else (
        f"{count} of the first {sum(seen.values())} records are {fmt}")
    unread = sorted({k for r in records for k in unread_keys(r, fmt)})
    return Found(fmt, note, n, bad, {}, unread)


def _sampling(tokenizer: Path) -> tuple[str, str]:
    """The sampling line, and a comment on where it comes from."""
    cfg = tokenizer / "generation_config.json"
    found: dict[str, Any] = {}
    if cfg.is_file():
        try:
            found = json.loads(cfg.read_text())
        except (OSError, ValueError):
            found = {}
    if isinstance(found.get("temperature"), (int, float)):
        return (f"sampling = {{ max_new_tokens = {DEFAULT_MAX_NEW} }}",
                f"the model's own sampling from {cfg} (temperature "
                f"{found['temperature']}); set any parameter here to override it")
    return (f"sampling = {{ max_new_tokens = {DEFAULT_MAX_NEW}, temperature = 1.0 }}",
            "the model's generation config gives no temperature: set the sampling you "
            "serve it with")


def write_config(data: list[Path], tokenizer: Path, dest: Path, run: str,
                 cap: int = DEFAULT_CAP_TOKENS, force: bool = False) -> dict[str, Any]:
    """Write the config to `dest`; returns what it found per file (`Found`'s fields, `bad`
    the records it could not read). A file of which not one record reads is left out of the
    config (a comment says why); none readable: `SourceError`, nothing written."""
    if dest.exists() and not force:
        raise SourceError(f"{dest} exists: pass --force to replace it, or another --out")
    missing = [str(p) for p in data if not p.is_file()]
    if missing:
        raise SourceError(f"no such file: {', '.join(missing)}")
    if not tokenizer.is_dir():
        raise SourceError(f"tokenizer {tokenizer}: no such directory (a local folder with the "
                        "model's tokenizer files)")
    sampling, sampling_note = _sampling(tokenizer)
    base = dest.resolve().parent
    lines = [
        f"# tokencap run config written by `tokencap init` for {len(data)} file(s).",
        "# Next: `tokencap plan THIS --check` (reads every record as the run will), then",
        "# `make up CONFIG=THIS` (or `tokencap up THIS`). docs/CONFIGURATION.md.",
        f'run = "{run}"',
        'output_dir = "out"',
        f'tokenizer = "{tokenizer.resolve()}"',
        "",
    ]
    found: dict[str, Any] = {}
    taken: set[str] = set()
    unreadable: list[str] = []
    for path in data:
        name = _name(path, taken)
        fmt, note, n, bad, mapped, unread = _format_of(path)
        rel = path.resolve()
        source = str(rel.relative_to(base)) if rel.is_relative_to(base) else str(rel)
        none_read = bool(bad) and len(bad) == min(n, LOOKED_AT)
        found[name] = {"file": str(path), "format": fmt, "records": n, "note": note,
                       "bad": bad, "unreadable": none_read, "field_map": mapped,
                       "unread": unread}
        if none_read:
            unreadable.append(bad[0])
            lines += [f"# {path}: left out: {bad[0]}", ""]
            continue
        lines += [f"# {path}: {n:,} records" + (f"; {note}" if note else "")]
        lines += ["[[category]]", f'name = "{name}"', f'source = "{source}"']
        if fmt is None and mapped:
            lines += [f"field_map = {toml_table(mapped)}"]
        elif fmt is None:
            lines += [f"# cannot tell the format: {note}",
                      '# format = "..."  or  field_map = { prompt = "KEY" }']
        elif fmt.startswith("preset:"):
            from foundation.presets import PRESETS

            preset = fmt.split(":", 1)[1]
            lines += [f'preset = "{preset}"  # records of {PRESETS[preset].dataset}: '
                      f"{PRESETS[preset].note}"]
        else:
            lines += [f'format = "{fmt}"']
            if fmt in CHAT_FORMATS:
                lines += ['# turns = "all"  # regenerate every assistant turn, in order '
                          '(default "first": the first user turn)']
        if unread:
            lines += [f"# text in {', '.join(unread)} is never sent (no format or map reads "
                      "it): field_map can name it"]
        lines += [f"cap_tokens = {cap}  # output tokens; \"none\": the whole file",
                  f"# {sampling_note}", sampling, ""]
    if len(unreadable) == len(data):
        raise SourceError(f"no record read in any file, no config written: "
                          f"{'; '.join(unreadable)}")
    dest.write_text("\n".join(lines))
    return found


def plan_comments(dest: Path) -> list[str]:
    """The plan's figures for the config just written, as comment lines (records and mean
    prompt tokens of the first prompts), appended to it."""
    from foundation.config import load_config
    from producer.run import load_renderer
    from tokencap.prepare.plan import survey

    cfg = load_config(dest)
    renderer = load_renderer(cfg)
    names = [c.name for c in cfg.category]
    found = survey(cfg, renderer, check=False, prompt_tokens_of=names)
    out = ["# plan (tokencap init): records and mean prompt tokens of the first prompts"]
    out += [f"#   {n}: {s.records:,} records, {s.prompt_tokens or 0:,.0f} prompt tokens"
            for n, s in found.items()]
    with dest.open("a") as f:
        f.write("\n".join(out) + "\n")
    return out
