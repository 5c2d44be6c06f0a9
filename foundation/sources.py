"""Where prompts and tokenizers come from: local paths, globs, folders of shards, compressed
files, and the local Hugging Face cache (offline; nothing is downloaded).

A category's `source` (or each of its `sources`) is one of

- a file: ``.jsonl``, ``.json``, ``.csv`` or ``.tsv`` (a header row), ``.parquet``, or one of
  the first four compressed with gzip
  (``.gz``) or Zstandard (``.zst``);
- a glob (``data/train-*.parquet``): its matches, sorted;
- a folder: every file of those types under it, sorted (a dataset's shards);
- ``hf://datasets/ORG/NAME[@REVISION][/PATH]``: the dataset's snapshot in the local Hugging
  Face cache (the layout `huggingface_hub` writes under ``$HF_HOME/hub``), then PATH in it
  as a file, folder or glob (default: the whole snapshot).

`tokenizer` is a local folder, or a model id (``ORG/NAME[@REVISION]``) found in the same
cache. A missing entry names what to download and how. `expand_source` and
`resolve_tokenizer` raise `SourceMissing` (a message for the config's error).
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

from foundation.errors import TokencapError

JSON_TYPES = (".jsonl", ".json")
TABLE_TYPES = (".csv", ".tsv")  # a header row, then one record a row (text values)
PARQUET_TYPES = (".parquet",)
COMPRESSIONS = (".gz", ".zst")
HF_DATASETS = "hf://datasets/"
SUPPORTED = (".jsonl, .json, .csv, .tsv, .parquet, and .jsonl/.json/.csv/.tsv with .gz "
             "or .zst")


class SourceMissing(TokencapError):
    """A source or tokenizer that cannot be found or read as given."""


def source_type(path: str | Path) -> tuple[str, str] | None:
    """(container suffix, compression suffix or "") of a supported file, else None."""
    suffixes = [s.lower() for s in Path(path).suffixes]
    if not suffixes:
        return None
    if suffixes[-1] in COMPRESSIONS:
        if len(suffixes) >= 2 and suffixes[-2] in JSON_TYPES + TABLE_TYPES:
            return suffixes[-2], suffixes[-1]
        return None
    if suffixes[-1] in JSON_TYPES + TABLE_TYPES + PARQUET_TYPES:
        return suffixes[-1], ""
    return None


def logical_stem(path: str | Path) -> str:
    """The file name without its type and compression suffixes (``x.jsonl.gz`` -> ``x``)."""
    name = Path(path).name
    kind = source_type(path)
    if kind is None:
        return Path(name).stem
    return name[: len(name) - len(kind[0]) - len(kind[1])]


def _checked_file(p: Path, item: str) -> str:
    if source_type(p) is None:
        suffix = "".join(p.suffixes[-2:]) or "(none)"
        raise SourceMissing(f"unsupported file type {suffix} ({p}): use {SUPPORTED}")
    return str(p)


def _expand_local(spec: str, shown: str) -> list[str]:
    if glob.has_magic(spec):
        found = sorted(p for p in glob.glob(spec, recursive=True) if Path(p).is_file())
        if not found:
            raise SourceMissing(f"no file matches {shown}")
        return [_checked_file(Path(p), shown) for p in found]
    p = Path(spec)
    if p.is_dir():
        found = sorted(str(f) for f in p.rglob("*")
                       if f.is_file() and not f.name.startswith(".") and source_type(f))
        if not found:
            raise SourceMissing(f"no {SUPPORTED} file in the folder {shown}")
        return found
    if not p.is_file():
        raise SourceMissing(f"no such file: {shown}")
    return [_checked_file(p, shown)]


def _split_revision(repo: str) -> tuple[str, str | None]:
    name, _, revision = repo.partition("@")
    return name, revision or None


def hub_cache() -> str | None:
    """The Hub cache folder as the environment says now (HF_HUB_CACHE, else $HF_HOME/hub;
    None: huggingface_hub's default)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return str(Path(os.environ["HF_HOME"]) / "hub")
    return None


# what a model's tokenizer needs from its Hub repository (no weights): the download hint's
# --include patterns
TOKENIZER_FILES = ("*.json", "*.model", "*.tiktoken", "*.txt", "*.jinja", "*.py")


def hf_snapshot(repo_id: str, repo_type: str, revision: str | None) -> Path:
    """The local snapshot folder of a Hub repository, from the cache only."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, repo_type=repo_type, revision=revision,
                                      cache_dir=hub_cache(), local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError, OSError):
        home = hub_cache() or "~/.cache/huggingface/hub"
        flag = " --repo-type dataset" if repo_type == "dataset" else ""
        at = f" --revision {revision}" if revision else ""
        hf = cli = at
        if repo_type == "model":  # the tokenizer, its config and template: not the weights
            hf += "".join(f" --include '{p}'" for p in TOKENIZER_FILES)  # typer: repeated
            cli += " --include " + " ".join(f"'{p}'" for p in TOKENIZER_FILES)  # argparse
        raise SourceMissing(
            f"{repo_type} {repo_id}{'@' + revision if revision else ''} is not in the local "
            f"Hugging Face cache ({home}); download it first on a machine with network: "
            f"`hf download{flag} {repo_id}{hf}` (or `huggingface-cli download{flag} "
            f"{repo_id}{cli}`), with the same HF_HOME") from None


def expand_source(item: str, base: Path) -> list[str]:
    """The files a `source` item names (module docstring), in a stable order."""
    if item.startswith(HF_DATASETS):
        rest = item[len(HF_DATASETS):]
        parts = rest.split("/")
        if len(parts) < 2 or not parts[0] or not parts[1]:
            raise SourceMissing(f"{item}: want hf://datasets/ORG/NAME[@REVISION][/PATH]")
        repo, revision = _split_revision("/".join(parts[:2]))
        root = hf_snapshot(repo, "dataset", revision)
        inner = "/".join(parts[2:])
        return _expand_local(str(root / inner) if inner else str(root), item)
    spec = item if Path(item).is_absolute() else str(base / item)
    return _expand_local(spec, spec)


def resolve_tokenizer(name: str, base: Path) -> str:
    """A tokenizer folder: `name` as a local folder (relative to `base`), else a model id
    in the local Hugging Face cache."""
    local = Path(name) if Path(name).is_absolute() else base / name
    if local.is_dir():
        return str(local.resolve())
    repo, revision = _split_revision(name)
    if Path(name).is_absolute() or repo.count("/") != 1 or local.exists():
        raise SourceMissing(f"not a directory: {local}")
    try:
        return str(hf_snapshot(repo, "model", revision))
    except SourceMissing as exc:
        raise SourceMissing(f"not a directory ({local}), and {exc}") from None
