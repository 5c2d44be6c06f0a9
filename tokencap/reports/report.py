"""`tokencap report`: one self-contained HTML file of a run (its figures inlined as PNG), and
the PNG figures beside it.

What it shows, and where each number comes from:

- a summary table per category (`TelemetryLedger.snapshot`: cap, used, samples, overshoot, state,
  skipped/failed/rejected, the output tokens of training rows beside those the reply gate
  kept out, by reason);
- output lengths: a histogram per category of the committed samples' `completion_tokens`
  (the part files and rejected-replies.jsonl), `max_new_tokens` marked;
- finish reasons per category (the rows' `finish_reason`);
- tokens per category against its cap (status);
- throughput and the engines' batch over time (the run's time series, recorded by the budget
  service: tok/s between two points, running requests summed over the engines);
- the tail: each category's used/cap over time (the series), where the run slows as caps near;
- rejected and dead samples by reason (the dead-letter files, history of retried ones
  included);
- the run's event log (cap changes);
- the prefix cache per category and engine (the rows' `prompt_tokens`, `cached_tokens` and
  `reusable_tokens`): the prompt tokens the engine served from its cache, against those a
  conversation's turn shares with the turn before (what a cache could have served);
- the run's hidden-state stage when it exists (the run `<run>.hs`,
  `TelemetryLedger.stage`): per category its rows with states, bytes kept against the
  budget, rows failed, its state (`table#hidden-states`, the numbers in `data-` attributes).

Figures are drawn with matplotlib (Agg, no display). Each `<figure>` has an id
(`fig-lengths`, ...) and the numbers it was drawn from in `data-` attributes, which the
tests compare with the run's status.
"""

from __future__ import annotations

import base64
import html
import io
import time
from collections import Counter
from pathlib import Path
from typing import Any

from budget_service.budget import Budget
from budget_service.ledger import CategoryState, cap_text
from budget_service.telemetry import RunStatus, SeriesPoint
from foundation.outputs import BadLine, category_dir, read_committed, read_dead_letters
from foundation.units import size_text
from foundation.wire import NEAR_DUPLICATE, contaminated_by
from tokencap.reports.rates import tok_s

FIGURES = ("lengths", "finish", "budget", "throughput", "tail", "failures")
DPI = 110


def _collect(budget: Budget, out_dir: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """Per category: output lengths, finish reasons, failure reasons (from the files): every
    committed sample, the replies the gate kept out of training with theirs."""
    data: dict[str, dict[str, Any]] = {}
    for name in names:
        cat_dir = category_dir(out_dir, name)
        lengths: list[int] = []
        finish: Counter[str] = Counter()
        cache: dict[str, Counter[str]] = {}
        failures: Counter[str] = Counter()
        gated: Counter[str] = Counter()  # replies the gate kept out of training, by reason
        freq = _Freq()  # the output ids of training rows: what a draft trains on
        for r in read_committed(cat_dir):
            if not isinstance(r, BadLine):
                if r.gate:
                    gated[f"reply kept out: {r.gate}"] += 1
                else:
                    freq.add(r.output_ids)
                lengths.append(r.completion_tokens)
                finish[r.finish_reason] += 1
                c = cache.setdefault(r.engine, Counter())
                c["samples"] += 1
                c["prompt"] += r.prompt_tokens
                c["cached"] += r.cached_tokens or 0
                if r.reusable_tokens:
                    c["reusable"] += r.reusable_tokens
                    c["reused"] += min(r.cached_tokens or 0, r.reusable_tokens)
        screened: Counter[str] = Counter()  # refused at intake: near_duplicate, benchmarks
        for d in read_dead_letters(cat_dir):
            if not isinstance(d, BadLine) and d.outcome != "cut":
                failures[f"{d.outcome}: {d.reason}"] += 1
                bench = contaminated_by(d)
                if bench is not None or d.reason == NEAR_DUPLICATE:
                    screened[bench or d.reason] += 1
        data[name] = {"lengths": lengths, "finish": finish, "failures": failures, "gated": gated,
                      "cache": cache, "freq": freq, "screened": screened}
    return data


class _Freq:
    """Counts of token ids over a vocabulary that grows to the largest id seen."""

    def __init__(self) -> None:
        import numpy as np

        self.np = np
        self.counts = np.zeros(0, dtype=np.int64)

    def add(self, ids: list[int]) -> None:
        if ids:
            self._add_counts(self.np.bincount(self.np.asarray(ids, dtype=self.np.int64)))

    def _add_counts(self, got: Any) -> None:
        if got.size > self.counts.size:
            got = got.copy()
            got[: self.counts.size] += self.counts
            self.counts = got
        else:
            self.counts[: got.size] += got

    def merged(self, others: list[_Freq]) -> _Freq:
        out = _Freq()
        for other in [self, *others]:
            out._add_counts(other.counts)
        return out

    def coverage(self) -> dict[str, float | None]:
        """Share of the output tokens inside the top 16K / 32K / 64K ids (the draft
        vocabulary's candidates: `tokencap.export.vocab.coverage`)."""
        from tokencap.export.vocab import coverage

        return coverage(self.counts)


def _kept_out(c: CategoryState) -> str:
    """The output tokens the reply gate kept out of training, by reason ("none")."""
    return ", ".join(f"{reason} {n:,}" for reason, n in c.rejected_tokens.items()) or "none"


def _stage_section(stage: RunStatus | None) -> str:
    """The hidden-state stage's table ("" when the run has none)."""
    if stage is None:
        return ""
    rows = []
    for name, c in stage.categories.items():
        b = stage.state_bytes(c)
        used, cap = (b.used, b.cap) if b is not None else (c.used, c.cap)
        rows.append(
            f'<tr data-category="{_esc(name)}" data-rows="{c.samples}" data-bytes="{used}" '
            f'data-state="{_esc(c.state)}"><td>{_esc(name)}</td><td>{c.samples:,}</td>'
            f"<td>{_esc(size_text(used))}</td>"
            f"<td>{_esc('none' if cap is None else size_text(cap))}</td>"
            f"<td>{c.failed:,}</td><td>{_esc(c.state)}</td></tr>")
    return (f"<h2>Hidden states (run {_esc(stage.run)})</h2>\n"
            '<table id="hidden-states"><tr><th>category</th><th>rows with states</th>'
            "<th>bytes kept</th><th>byte budget</th><th>failed</th><th>state</th></tr>"
            + "".join(rows) + "</table>")


def _modes_section(status: RunStatus) -> str:
    """The decode modes of the categories that have them: each mode's rows and tokens, their
    shares, against its weight ("" when no category has modes)."""
    from budget_service.telemetry import mode_table

    table = mode_table(status)
    if not table:
        return ""

    def pct(x: float | None) -> str:
        return "–" if x is None else f"{100 * x:.1f}%"

    rows = "".join(
        f'<tr data-category="{_esc(n)}" data-mode="{_esc(m)}" data-rows="{v["rows"]}" '
        f'data-tokens="{v["tokens"]}"><td>{_esc(n)}</td><td>{_esc(m)}</td>'
        f"<td>{v['rows']:,}</td><td>{pct(v['share_rows'])}</td><td>{v['tokens']:,}</td>"
        f"<td>{pct(v['share_tokens'])}</td><td>{pct(v['weight'])}</td></tr>"
        for n, modes in table.items() for m, v in modes.items())
    return ("<h2>Modes</h2><p>Rows and counted tokens made in each decode mode, against the "
            "mode's weight (a <code>share = \"tokens\"</code> category's budgets added up "
            "under its name).</p><table id=\"modes\"><tr><th>category</th><th>mode</th>"
            "<th>rows</th><th>share of rows</th><th>tokens</th><th>share of tokens</th>"
            f"<th>weight</th></tr>{rows}</table>")


def _png(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return buf.getvalue()


def _figures(status: RunStatus, data: dict[str, dict[str, Any]],
             max_new: dict[str, int], series: list[SeriesPoint]) -> dict[str, bytes]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(status.categories)
    out: dict[str, bytes] = {}
    cols = min(3, len(names)) or 1
    rows = (len(names) + cols - 1) // cols or 1
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 2.8 * rows), squeeze=False)
    for k, ax in enumerate(axes.flat):
        if k >= len(names):
            ax.axis("off")
            continue
        name = names[k]
        ax.hist(data[name]["lengths"] or [0], bins=40, color="#2f6fdf")
        ax.axvline(max_new[name], color="#b54708", linestyle="--", label="max_new_tokens")
        ax.set_title(f"{name} ({len(data[name]['lengths'])} rows)", fontsize=10)
        ax.set_xlabel("output tokens", fontsize=8)
        ax.legend(fontsize=7)
    fig.suptitle("Output lengths")
    fig.tight_layout()
    out["lengths"] = _png(fig)

    reasons = sorted({r for d in data.values() for r in d["finish"]})
    fig, ax = plt.subplots(figsize=(7, 3))
    bottom = [0] * len(names)
    for reason in reasons:
        counts = [data[n]["finish"][reason] for n in names]
        ax.bar(names, counts, bottom=bottom, label=reason)
        bottom = [b + c for b, c in zip(bottom, counts, strict=True)]
    ax.set_ylabel("rows")
    ax.set_title("Finish reasons")
    if reasons:
        ax.legend(fontsize=8)
    out["finish"] = _png(fig)

    fig, ax = plt.subplots(figsize=(7, 3))
    used = [status.categories[n].used for n in names]
    ax.bar(names, used, color="#2e9d5b", label="used")
    capped = [(i, c) for i, n in enumerate(names)
              if (c := status.categories[n].cap) is not None]
    for k, (i, cap) in enumerate(capped):
        ax.hlines(cap, i - 0.4, i + 0.4, colors="#b54708", label="cap" if k == 0 else "_cap")
    ax.set_ylabel("tokens")
    ax.set_title("Tokens per category against its cap")
    ax.legend(fontsize=8)
    out["budget"] = _png(fig)

    t0 = series[0].at if series else 0
    times = [(p.at - t0) / 1000 for p in series]
    fig, ax = plt.subplots(figsize=(7, 3))
    if len(series) >= 2:
        total = [sum(c.used for c in p.categories.values()) for p in series]
        rate = [tok_s(total[i - 1], series[i - 1].at / 1000, total[i], series[i].at / 1000)
                for i in range(1, len(series))]
        ax.plot(times[1:], rate, color="#2f6fdf", label="tok/s counted")
        ax.set_ylim(bottom=0)
        ax2 = ax.twinx()
        batch = [sum(e.running or 0 for e in p.engines.values()) for p in series]
        ax2.plot(times, batch, color="#b54708", label="running requests", alpha=0.7)
        ax2.set_ylim(bottom=0)
        ax2.set_ylabel("running requests")
        ax.legend(loc="upper left", fontsize=8)
        ax2.legend(loc="upper right", fontsize=8)
    else:
        ax.text(0.5, 0.5, "no time series recorded (the budget service records it)",
                ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("seconds")
    ax.set_ylabel("tok/s")
    ax.set_title("Throughput and engine batch over time")
    out["throughput"] = _png(fig)

    fig, ax = plt.subplots(figsize=(7, 3))
    for name in names:
        pts = [(t, p.categories[name]) for t, p in zip(times, series, strict=True)
               if name in p.categories]
        of_cap = [(t, c.used / c.cap * 100) for t, c in pts if c.cap]
        if of_cap:
            ax.plot([t for t, _ in of_cap], [v for _, v in of_cap], label=name)
    ax.axhline(100, color="#667085", linestyle=":")
    ax.set_xlabel("seconds")
    ax.set_ylabel("used / cap (%)")
    ax.set_title("The tail: each category nearing its cap")
    if any(ax.get_lines()[:-1]):
        ax.legend(fontsize=8)
    out["tail"] = _png(fig)

    fig, ax = plt.subplots(figsize=(7, 3))
    kinds = sorted({r for d in data.values() for r in (*d["failures"], *d["gated"])})
    bottom = [0] * len(names)
    for kind in kinds:
        counts = [data[n]["failures"][kind] + data[n]["gated"][kind] for n in names]
        ax.bar(names, counts, bottom=bottom, label=kind)
        bottom = [b + c for b, c in zip(bottom, counts, strict=True)]
    if kinds:
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "none", ha="center", va="center", transform=ax.transAxes)
    ax.set_ylabel("samples")
    ax.set_title("Left out of training, by reason: samples rejected, dead or stopped, and "
                 "replies the gate kept out", fontsize=9)
    out["failures"] = _png(fig)
    return out


def _esc(v: Any) -> str:
    return html.escape(str(v), quote=True)


def build_report(budget: Budget, out_dir: Path, dest: Path) -> Path:
    """Write `<dest>/<run>-report.html` and `<dest>/<run>-<figure>.png`; return the HTML
    file's path."""
    status = budget.telemetry.snapshot()
    cfg = budget.load_config()
    names = list(status.categories)
    max_new = {c.name: c.sampling.max_new_tokens for c in cfg.category} if cfg else {}
    max_new = {n: max_new.get(n, 0) for n in names}
    data = _collect(budget, out_dir, names)
    series = budget.telemetry.series()
    events = budget.operating.events(names)
    pngs = _figures(status, data, max_new, series)
    dest.mkdir(parents=True, exist_ok=True)
    run = status.run
    for key, png in pngs.items():
        (dest / f"{run}-{key}.png").write_bytes(png)

    rows = "".join(
        f'<tr data-category="{_esc(n)}" data-samples="{c.samples}" data-used="{c.used}">'
        f"<td>{_esc(n)}</td><td>{_esc(cap_text(c.cap))}</td><td>{c.used:,}</td>"
        f"<td>{c.samples:,}</td><td>{c.overshoot:,}</td><td>{_esc(c.state)}</td>"
        f"<td>{c.skipped}/{c.failed}/{c.rejected}</td>"
        f"<td>{c.kept_tokens:,}</td><td>{_esc(_kept_out(c))}</td></tr>"
        for n, c in status.categories.items())
    attrs = {
        "lengths": " ".join(f'data-rows-{_esc(n)}="{len(data[n]["lengths"])}"' for n in names),
        "finish": " ".join(f'data-{_esc(k)}-{_esc(n)}="{v}"' for n in names
                           for k, v in data[n]["finish"].items()),
        "budget": " ".join(f'data-used-{_esc(n)}="{status.categories[n].used}"'
                           for n in names),
        "throughput": f'data-points="{len(series)}"',
        "tail": f'data-points="{len(series)}"',
        "failures": " ".join(f'data-failed-{_esc(n)}="{sum(data[n]["failures"].values())}" '
                             f'data-kept-out-{_esc(n)}="{sum(data[n]["gated"].values())}"'
                             for n in names),
    }
    figures = "".join(
        f'<figure id="fig-{key}" {attrs[key]}><img alt="{key}" '
        f'src="data:image/png;base64,{base64.b64encode(pngs[key]).decode()}"></figure>'
        for key in FIGURES)
    event_rows = "".join(
        f"<tr><td>{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(e['at'] / 1000))}</td>"
        f"<td>{_esc(e['category'])}</td><td>{_esc(e.get('old'))} → {_esc(e.get('new'))}</td>"
        f"<td>{_esc(e.get('by'))}</td></tr>" for e in events) or \
        '<tr><td colspan="4">no cap change</td></tr>'
    # what an engine did not say (model, version: "") shows as None
    engines = "".join(f"<li>{_esc(u)}: {_esc(e.model or None)} ({_esc(e.api)} "
                      f"{_esc(e.version or None)})</li>"
                      for u, e in status.engines.items()) or "<li>none recorded</li>"
    def share(n: int, d: int) -> str:
        return f"{100 * n / d:.1f}%" if d else "–"

    cache_rows = "".join(
        f'<tr data-category="{_esc(n)}" data-engine="{_esc(u)}" data-cached="{c["cached"]}" '
        f'data-reusable="{c["reusable"]}"><td>{_esc(n)}</td><td>{_esc(u)}</td>'
        f"<td>{c['samples']:,}</td><td>{c['prompt']:,}</td><td>{c['cached']:,} "
        f"({share(c['cached'], c['prompt'])})</td><td>{c['reusable']:,}</td>"
        f"<td>{share(c['reused'], c['reusable'])}</td></tr>"
        for n in names for u, c in sorted(data[n]["cache"].items())) or \
        '<tr><td colspan="7">no rows</td></tr>'
    def pct(v: float | None) -> str:
        return "–" if v is None else f"{100 * v:.2f}%"

    freqs = {n: data[n]["freq"] for n in names}
    if names:
        freqs["all categories"] = freqs[names[0]].merged([freqs[n] for n in names[1:]])
    vocab_rows = "".join(
        f'<tr data-category="{_esc(n)}" '
        + " ".join(f'data-top-{k}="{v if v is not None else ""}"'
                   for k, v in f.coverage().items())
        + f"><td>{_esc(n)}</td><td>{int(f.counts.sum()):,}</td>"
        f"<td>{int((f.counts > 0).sum()):,}</td>"
        + "".join(f"<td>{pct(v)}</td>" for v in f.coverage().values()) + "</tr>"
        for n, f in freqs.items())
    benches = sorted({b for n in names for b in data[n]["screened"]} - {NEAR_DUPLICATE})
    intake_rows = "".join(
        f'<tr data-category="{_esc(n)}"><td>{_esc(n)}</td>'
        + "".join(f"<td>{data[n]['screened'][k]:,}</td>" for k in [NEAR_DUPLICATE, *benches])
        + "</tr>" for n in names)
    intake_heads = "".join(f"<th>contaminated: {_esc(b)}</th>" for b in benches)
    simulated = ('<p class="warn">SIMULATED: an engine of this run is the simulator; its '
                 "outputs are synthetic.</p>") if status.simulated else ""
    modes = _modes_section(status)
    stage = budget.telemetry.stage()
    states = _stage_section(stage.snapshot() if stage is not None else None)
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>tokencap report: {_esc(run)}</title>
<style>body{{font:15px/1.4 system-ui,sans-serif;margin:16px;max-width:1100px;color:#1d2330}}
table{{border-collapse:collapse}}td,th{{padding:3px 12px 3px 0;text-align:left}}
figure{{margin:16px 0}}img{{max-width:100%}}.warn{{color:#b54708;font-weight:600}}</style>
</head><body>
<h1>tokencap report: {_esc(run)}</h1>
<p>written {_esc(time.strftime('%Y-%m-%d %H:%M:%S'))} from Redis and {_esc(out_dir)}</p>
{simulated}
<table id="summary"><tr><th>category</th><th>cap</th><th>used</th><th>samples</th>
<th>overshoot</th><th>state</th><th>skipped/failed/rejected</th>
<th>output tokens in training rows</th><th>kept out of training (tokens, by reason)</th></tr>
{rows}</table>
{modes}
{states}
<h2>Refused at intake</h2>
<p>Prompts refused before generation (docs/MIX.md): near-duplicates of a prompt kept, and
prompts sharing a word n-gram with a benchmark's item, by benchmark.</p>
<table id="intake"><tr><th>category</th><th>near_duplicate</th>{intake_heads}</tr>
{intake_rows}</table>
<h2>Engines</h2><ul>{engines}</ul>
<h2>Prefix cache</h2>
<p>Prompt tokens the engine served from its prefix cache, and those a conversation's turn
shares with the turn before it (reusable: what the engine that served that turn could still
hold); the last column is the share of the reusable tokens that were served from cache.</p>
<table id="cache"><tr><th>category</th><th>engine</th><th>samples</th><th>prompt tokens</th>
<th>cached</th><th>reusable</th><th>reusable served from cache</th></tr>{cache_rows}</table>
<h2>Draft vocabulary coverage</h2>
<p>Share of the output tokens of training rows inside the most frequent 16K, 32K and 64K ids:
what an EAGLE-3 draft of that vocabulary can predict (`tokencap export` writes the mapping,
from the train rows within its length limit).</p>
<table id="vocab"><tr><th>category</th><th>output tokens</th><th>distinct ids</th>
<th>top 16K</th><th>top 32K</th><th>top 64K</th></tr>{vocab_rows}</table>
{figures}
<h2>Cap changes</h2><table id="events">{event_rows}</table>
</body></html>
"""
    path = dest / f"{run}-report.html"
    path.write_text(page, encoding="utf-8")
    return path
