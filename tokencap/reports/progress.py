"""Plain-text progress lines and the end-of-run summary (safe without a TTY), of the run's
typed status (`budget_service.telemetry.RunStatus`)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

from budget_service.ledger import cap_text
from budget_service.telemetry import RunStatus
from foundation.units import size_text
from tokencap.reports.rates import tok_s


def since_text(since_ms: int, now_ms: int | None = None) -> str:
    """"for N s (since HH:MM:SS)" of a time in ms since the epoch."""
    now = int(time.time() * 1000) if now_ms is None else now_ms
    return (f"for {max(0, now - since_ms) // 1000} s (since "
            f"{time.strftime('%H:%M:%S', time.localtime(since_ms / 1000))})")


def trouble_lines(status: RunStatus, now_ms: int | None = None) -> list[str]:
    """The engines that do not answer (the producer's engine watch records them), then the
    states folders a hidden-state stage pauses on (its workers record them), each with why
    and since when: "engine URL: WHY, for N s (since HH:MM:SS)", "states paused, FOLDER:
    WHY, for N s (since ...)"."""
    return ([f"engine {url}: {t.why}, {since_text(t.since_ms, now_ms)}"
             for url, t in sorted(status.trouble.items())]
            + [f"states paused, {t.why}, {since_text(t.since_ms, now_ms)}"
               for _folder, t in sorted(status.disk_trouble.items())])


def writer_trouble_lines(status: RunStatus, now_ms: int | None = None) -> list[str]:
    """The writer's trouble, with since when ([] when none)."""
    w = status.writer
    if not w.error:
        return []
    at = w.error_at_ms
    return [f"writer: {w.error}" + (f", {since_text(at, now_ms)}" if at else "")]


class ProgressPrinter:
    """Prints one line per category every call, with tok/s since the previous call, and what
    holds the end back once every category is done (the writer); a line that would repeat
    the previous one is not printed. An engine that does not answer (the status's
    `trouble`), or a full states folder a stage pauses on, is in every line until it is
    over, with since when. Each line starts with `[tag]` (`up` tags the hidden-state
    stage's beside generation's)."""

    def __init__(self, out: TextIO = sys.stdout,
                 clock_ms: Callable[[], int] = lambda: int(time.time() * 1000),
                 tag: str = "progress") -> None:
        self.out = out
        self.clock_ms = clock_ms
        self.tag = f"[{tag}]"
        self._last: dict[str, tuple[float, int]] = {}
        self._line = ""
        self._down: dict[str, int] = {}  # engine -> since (ms)

    def _engines_line(self, status: RunStatus) -> str:
        """What the engines' trouble adds to the line ("" when none is known)."""
        now = self.clock_ms()
        down = {url: t.since_ms for url, t in status.trouble.items()}
        for url, since in self._down.items():
            if url not in down:
                self.out.write(f"{self.tag} engine {url} answers again, after "
                               f"{max(0, now - since) // 1000} s\n")
        self._down = down
        return "; ".join(trouble_lines(status, now))

    def __call__(self, status: RunStatus) -> None:
        now = time.monotonic()
        cats = status.categories
        parts = []
        engines = self._engines_line(status)
        for name, st in cats.items():
            t, used = self._last.get(name, (now, st.used))
            rate = tok_s(used, t, st.used, now)
            self._last[name] = (now, st.used)
            b = status.state_bytes(st)
            size = (f" [{size_text(b.used)} of states"
                    + (f" of {size_text(b.cap)}" if b.cap else "") + "]"
                    if b is not None else "")
            if st.cap is None:
                parts.append(f"{name} {st.used} (uncapped){size} {rate:.0f} tok/s {st.state}")
            else:
                pct = 100.0 * st.used / st.cap if st.cap else 100.0
                parts.append(f"{name} {st.used}/{st.cap} ({pct:.0f}%){size} {rate:.0f} "
                             f"tok/s {st.state}")
        line = f"{self.tag} " + " | ".join(parts)
        writer = status.writer
        unwritten = writer.unwritten
        trouble = writer.error or ("" if writer.holder else "no writer runs")
        if cats and all(st.state in ("closed", "exhausted") for st in cats.values()) \
                and unwritten:
            line = f"{self.tag} waiting for the writer ({unwritten} results unwritten)"
        if unwritten and trouble:
            line += f"; writer: {trouble}"
        if engines:
            line += f"; {engines}"
        if line != self._line:
            self._line = line
            self.out.write(line + "\n")
            self.out.flush()


SIMULATED_TEXT = "SIMULATED: an engine of this run is the simulator; its outputs are synthetic"


def cache_lines(status: RunStatus) -> list[str]:
    """The prefix cache per category and engine (a status read `by_engine`): prompt tokens
    served from cache, of all and of those shared with the turn before."""
    out = []
    for name in status.categories:
        for url, e in status.cache.get(name, {}).items():
            if not e["prompt_tokens"]:
                continue
            line = (f"prefix cache {name} @ {url}: {e['cached_tokens']:,} of "
                    f"{e['prompt_tokens']:,} prompt tokens "
                    f"({100 * e['cached_tokens'] / e['prompt_tokens']:.1f}%)")
            if e["reusable_tokens"]:
                line += f"; {e['reusable_tokens']:,} reusable (shared with the turn before)"
            out.append(line)
    return out


def mode_lines(status: RunStatus) -> list[str]:
    """Per category with modes (as the config names it): each mode's rows and tokens, their
    shares, against the mode's weight (`budget_service.telemetry.mode_table`)."""
    from budget_service.telemetry import mode_table

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x:.1%}"

    out = []
    for name, modes in mode_table(status).items():
        parts = [f"{m} {v['rows']:,} rows ({pct(v['share_rows'])}), {v['tokens']:,} tokens "
                 f"({pct(v['share_tokens'])}), weight {pct(v['weight'])}"
                 for m, v in modes.items()]
        out.append(f"{name} by mode: " + "; ".join(parts))
    return out


def gate_lines(status: RunStatus) -> list[str]:
    """Per category, the output tokens of its training rows beside those of the replies the
    reply gate kept out, by reason (what of the budget a trainer can use)."""
    out = []
    for name, st in status.categories.items():
        if not st.rejected_tokens:
            continue
        why = ", ".join(f"{reason} {n:,} ({st.rejected_replies.get(reason, 0):,} replies)"
                        for reason, n in st.rejected_tokens.items())
        out.append(f"{name}: {st.kept_tokens:,} output tokens in training rows; kept out "
                   f"of training: {why}")
    return out


def nothing_usable(status: RunStatus, out_dir: str) -> str:
    """Why the run made nothing in a category whose every record was rejected ("" when every
    category made something or was never fed): a run that ends so is a mistake (a wrong
    format, a field map, a too-small context), not a success."""
    lines = []
    for name, st in status.categories.items():
        if st.state == "exhausted" and st.samples == 0 and st.rejected > 0:
            reasons = ", ".join(f"{r} {n:,}" for r, n in sorted(
                st.reasons.items(), key=lambda kv: -kv[1])[:3])
            lines.append(f"{name}: every record was rejected ({st.rejected:,}: {reasons}); "
                         f"{out_dir}/{name}/failed.jsonl says which and why, file:line each "
                         "(`tokencap plan CONFIG --check` shows the same before a run)")
    return "\n".join(lines)


def reason_lines(status: RunStatus) -> list[str]:
    """Per category with samples rejected or failed, how many for each reason, the most
    first ("a: rejected 240, failed 3: duplicate_prompt 151, tool_divergence 89, ...")."""
    out = []
    for name, st in status.categories.items():
        if not st.reasons or not (st.rejected or st.failed):
            continue
        why = ", ".join(f"{reason} {n:,}" for reason, n in
                        sorted(st.reasons.items(), key=lambda kv: (-kv[1], kv[0])))
        out.append(f"{name}: rejected {st.rejected:,}, failed {st.failed:,}: {why}")
    return out


def summary_table(status: RunStatus) -> str:
    cols = ("cap", "used", "reserved", "overshoot", "samples", "skipped", "failed", "rejected",
            "waste_tokens", "state")
    names = list(status.categories)
    width = max([len("category")] + [len(n) for n in names])
    head = "category".ljust(width) + "  " + "  ".join(c.rjust(10) for c in cols)
    rows = [f"run {status.run}", head, "-" * len(head)]
    for n, st in status.categories.items():
        cells = [cap_text(st.cap), *(str(getattr(st, c)) for c in cols[1:])]
        rows.append(n.ljust(width) + "  " + "  ".join(c.rjust(10) for c in cells))
    rows += reason_lines(status)
    rows += mode_lines(status)
    rows += gate_lines(status)
    rows += cache_lines(status)
    for n, st in status.categories.items():
        b = status.state_bytes(st)
        if b is not None:
            rows.append(f"hidden states {n}: {size_text(b.used)}"
                        + (f" of {size_text(b.cap)}" if b.cap is not None else ""))
    rows += trouble_lines(status) + writer_trouble_lines(status)
    if status.simulated:
        rows.append(SIMULATED_TEXT)
    return "\n".join(rows)
