"""`tokencap verify STATES_DIR`: a hidden-state stage's files reread against the manifests its
end wrote (`foundation.states_manifest`), after a copy, a partial rsync, months on a shared
filesystem, or a file replaced by hand.

STATES_DIR is the config's `[hidden_states] output_dir`: one folder per category, each with
its `states/` files and, once the category's stage ended, its `manifest.json`. Every file a
manifest names is reread (its size, the CRC32 of each tensor and of its header) and every
file of a `states/` folder it does not name is extra. A category with states and no manifest
is a problem too: its stage has not ended (or was stopped), and nothing proves its files.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from foundation import states_manifest
from foundation.errors import SourceError
from foundation.outputs import STATES_DIR
from foundation.units import size_text

PROGRESS_EVERY_S = 5.0  # a progress line at most this often, on long work


class CategoryCheck(NamedTuple):
    """One category verified: its manifest's files and bytes, the bytes read, each problem
    (`no_manifest`: the words saying why there is none to check against)."""

    category: str
    files: int
    bytes: int
    read: int
    problems: list[states_manifest.Problem]
    no_manifest: str = ""

    @property
    def clean(self) -> bool:
        return not self.problems and not self.no_manifest

    def line(self) -> str:
        if self.no_manifest:
            return f"{self.category}: {self.no_manifest}"
        head = f"{self.category}: {self.files:,} files, {size_text(self.bytes)}"
        if self.clean:
            return f"{head}, every file as the manifest says"
        kinds: dict[str, int] = {}
        for p in self.problems:
            kinds[p.kind] = kinds.get(p.kind, 0) + 1
        n = len(self.problems)
        return (f"{head}: {n:,} problem{'s' if n != 1 else ''} ("
                + ", ".join(f"{k} {v:,}" for k, v in kinds.items()) + ")")

    def document(self) -> dict[str, Any]:
        return {"files": self.files, "bytes": self.bytes, "read": self.read,
                "clean": self.clean, "no_manifest": self.no_manifest or None,
                "problems": [p._asdict() for p in self.problems]}


def chosen(states_dir: Path, names: list[str] | None) -> list[str]:
    """The categories to verify: `names`, else every folder of `states_dir` with states or a
    manifest. `SourceError` (exit 2) for a folder that is not there, holds none, or lacks a
    category asked for."""
    if not states_dir.exists():
        raise SourceError(f"{states_dir}: no such folder (give the [hidden_states] output_dir "
                          "of the run: one folder per category)")
    if not states_dir.is_dir():
        raise SourceError(f"{states_dir}: a file, not a folder (give the [hidden_states] "
                          "output_dir of the run: one folder per category)")
    found = states_manifest.categories(states_dir)
    if names:
        unknown = [n for n in names if n not in found]
        if unknown:
            raise SourceError(f"{states_dir}: no states of category {', '.join(unknown)} "
                              f"(found: {', '.join(found) or 'none'})")
        return list(dict.fromkeys(names))
    if not found:
        raise SourceError(f"{states_dir}: no category folder with a {STATES_DIR}/ folder or a "
                          f"{states_manifest.MANIFEST_FILE} (is it the [hidden_states] "
                          "output_dir?)")
    return found


def no_manifest_words(states_dir: Path, category: str) -> str:
    files = sum(1 for _ in states_manifest.state_files(states_dir, category))
    return (f"{files:,} states files and no {states_manifest.MANIFEST_FILE}: its stage has not "
            "ended (or was stopped), so nothing proves them; run `tokencap hidden-states "
            "CONFIG` to its end (it writes the manifest of each category that ended)")


def verify_states(states_dir: Path, names: list[str] | None = None,
                  say: Callable[[str], None] | None = None,
                  every_s: float = PROGRESS_EVERY_S,
                  clock: Callable[[], float] = time.monotonic) -> list[CategoryCheck]:
    """Each category of `states_dir` (or `names`) verified (module docstring); `say` gets a
    progress line at most every `every_s` seconds: files done of all, bytes read, the rate.
    Raises `SourceError` as `chosen` does, or `ManifestError` for a manifest that cannot be
    read."""
    cats = chosen(states_dir, names)
    manifests = {}
    for name in cats:
        path = states_manifest.manifest_path(states_dir, name)
        if path.is_file():
            manifests[name] = states_manifest.read(path, name)
    total = sum(len(m.files) for m in manifests.values())
    start = last = clock()
    done_before = read_before = 0

    def progress(done: int, read: int) -> None:
        nonlocal last
        now = clock()
        if say is None or now - last < every_s:
            return
        last = now
        files, nbytes = done_before + done, read_before + read
        rate = nbytes / (now - start) if now > start else 0.0
        say(f"verified {files:,} of {total:,} files, {nbytes / 1e9:,.1f} GB read, "
            f"{rate / 1e9:,.2f} GB/s")

    out = []
    for name in cats:
        if name not in manifests:
            out.append(CategoryCheck(name, 0, 0, 0, [], no_manifest_words(states_dir, name)))
            continue
        got = states_manifest.verify(states_dir, name, progress)
        done_before += got.files
        read_before += got.read
        out.append(CategoryCheck(name, got.files, got.bytes, got.read, got.problems))
    return out


def report_lines(checks: list[CategoryCheck]) -> list[str]:
    """Per category its line, then one per problem naming the file."""
    lines = []
    for c in checks:
        lines.append(c.line())
        lines += [p.line() for p in c.problems]
    return lines
