"""The run's manifest: what made its rows, written beside them, named in each.

`<out>/manifest-<digest>.json` holds tokencap's version, the config's digest (the effective
config the workers read, sampling and derived fields included), the tokenizer's name and the
sha256 of each of its files, the chat template's sha256, and each engine's model, version and
API as the preflight found them. Its `made_by`, `<run>@<digest>` (the first 12 hex of the
sha256 of all that), is stored with the run's config and written in every row
(`Result.made_by`): a row says which tokenizer, template, config and engine made it. A resume
with anything of that changed writes a second manifest, and the rows after it name that one.
`tokencap export` copies the manifests its rows name.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from foundation.config import RunConfig, config_to_json
from foundation.engine.api import display
from foundation.engine.info import EngineInfo

if TYPE_CHECKING:
    from producer.render import Renderer

MANIFEST_PREFIX = "manifest-"
DIGEST_HEX = 12  # of the sha256 of the manifest, in `made_by` and the file's name


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def tokenizer_identity(cfg: RunConfig, renderer: Renderer | None) -> dict[str, Any] | None:
    """The tokenizer's name, the sha256 of each file of its folder, and its template's."""
    if cfg.tokenizer is None:
        return None
    folder = Path(cfg.tokenizer)
    files = {p.name: sha256_file(p) for p in sorted(folder.iterdir()) if p.is_file()} \
        if folder.is_dir() else {}
    template = renderer.template if renderer is not None else ""
    return {"name": folder.name, "files": files,
            "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest()}


def manifest(cfg: RunConfig, renderer: Renderer | None, engines: Sequence[EngineInfo]
             ) -> dict[str, Any]:
    """What made the run's rows (module docstring), `made_by` not yet in it."""
    config = config_to_json(msgspec.structs.replace(cfg, made_by=""))
    try:
        version = metadata.version("tokencap")
    except metadata.PackageNotFoundError:
        version = "unknown"
    return {
        "run": cfg.run,
        "tokencap_version": version,
        "config_sha256": hashlib.sha256(config).hexdigest(),
        "tokenizer": tokenizer_identity(cfg, renderer),
        "engines": [{"url": display(e.url), "api": e.api, "model": e.model,
                     "version": e.version, "simulated": e.simulated} for e in engines],
        "config": json.loads(config),
    }


def write_manifest(cfg: RunConfig, renderer: Renderer | None, engines: Sequence[EngineInfo]
                   ) -> tuple[str, Path]:
    """Write the run's manifest beside its output (once per identity); returns its
    `made_by` and path."""
    doc = manifest(cfg, renderer, engines)
    body = json.dumps(doc, sort_keys=True, ensure_ascii=False).encode()
    digest = hashlib.sha256(body).hexdigest()[:DIGEST_HEX]
    made_by = f"{cfg.run}@{digest}"
    out = Path(cfg.output_dir)
    path = out / f"{MANIFEST_PREFIX}{digest}.json"
    if not path.exists():
        out.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"made_by": made_by, **doc}, indent=2, sort_keys=True,
                                  ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    return made_by, path


def manifest_path(out_dir: Path, made_by: str) -> Path:
    """Where the manifest a row names (`Result.made_by`) lies."""
    return out_dir / f"{MANIFEST_PREFIX}{made_by.rpartition('@')[2]}.json"
