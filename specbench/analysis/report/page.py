"""The report's index page, read top down: the verdicts first (per setting, which methods pay and by how
much: a chart of each method's mean speedup with its 95% interval), a bar of links, then every table
(points in the cells, intervals on hover) and the figures. No script and no outside asset (the page is
read offline): charts are inline SVG drawn here, figures embedded PNG. Pure functions of the report, so
the same records give the same bytes."""

from __future__ import annotations

import base64
import html
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from specbench.analysis.report.names import block_label
from specbench.analysis.report.render import render_html
from specbench.analysis.report.table import Table, finite, fmt_spd

PAYS, SLOWER, UNCLEAR = "pays", "slower", "unclear"
COLORS = {PAYS: "#1a7f37", SLOWER: "#cf222e", UNCLEAR: "#6e7781"}


@dataclass(frozen=True)
class Bar:
    """One method of one setting: its mean speedup over the benchmarks, the 95% interval, τ and T_D%."""

    label: str
    speedup: float
    lo: float
    hi: float
    tau: float = math.nan
    td_percent: float = math.nan

    @property
    def verdict(self) -> str:
        """pays: the whole interval above 1×; slower: the whole interval below; else unclear (no interval
        included: a point alone says nothing about noise)."""
        if finite(self.lo) and finite(self.hi):
            return PAYS if self.lo > 1 else SLOWER if self.hi < 1 else UNCLEAR
        return UNCLEAR

    def text(self) -> str:
        """'1.52× [1.45, 1.60]' (the point alone without an interval)."""
        interval = f" [{self.lo:.2f}, {self.hi:.2f}]" if finite(self.lo) and finite(self.hi) else ""
        return fmt_spd(self.speedup) + interval


@dataclass(frozen=True)
class Setting:
    """One (machine, target, dtype, T) block of a speedup table: its methods, fastest first."""

    title: str
    table: str  # the table the setting summarises (its anchor on the page)
    bars: tuple[Bar, ...]
    temperature: float = 0.0

    def of(self, verdict: str) -> list[Bar]:
        return [b for b in self.bars if b.verdict == verdict]

    @property
    def anchor(self) -> str:
        return "setting-" + re.sub(r"[^a-z0-9]+", "-", f"{self.table} {self.title}".lower()).strip("-")

    def headline(self) -> str:
        """One sentence: how many pay and the best of them, or that none does."""
        pays, n = self.of(PAYS), len(self.bars)
        if not pays:
            best = self.bars[0]
            return (f"No method is faster than vanilla beyond its interval; the fastest of {n}, {best.label}, "
                    f"reaches {best.text()}.")
        return (f"{len(pays)} of {n} {'method pays' if n == 1 else 'methods pay'}: {pays[0].label} most, "
                f"{pays[0].text()}.")


def settings(table: Table | None, dtypes: dict[tuple[str, str], str] | None = None, machine: str = "",
             kind: str = "") -> list[Setting]:
    """The settings of a speedup table (``main_table``, ``streams_table``) from its numeric form: per block,
    every method with a mean speedup, fastest first. ``dtypes``: (target, temperature as printed) -> dtype,
    named in the title unless the target already carries it; ``machine``/``kind`` extend the title."""
    if table is None or table.data.empty or "mean_spd" not in table.data:
        return []
    out = []
    for (target, temperature), part in table.data.groupby(["target", "temperature"], sort=False):
        bars = [Bar(str(r.method), float(r.mean_spd), float(r.mean_spd_lo), float(r.mean_spd_hi), float(r.mean_tau),
                    float(r.td_percent)) for r in part.itertuples() if finite(r.mean_spd)]
        if not bars:
            continue
        bars.sort(key=lambda b: (-b.speedup, b.label))
        dtype = (dtypes or {}).get((target, temperature), "")
        name = target if not dtype or dtype in target else f"{target} · {dtype}"
        title = block_label((name, float(temperature))) + (f" · {kind}" if kind else "")
        title += f" — {machine}" if machine else ""
        out.append(Setting(title, table.name, tuple(bars), float(temperature)))
    return out


# ---- the chart ----------------------------------------------------------------------------------

def _ticks(lo: float, hi: float) -> list[float]:
    """Round tick values covering [lo, hi], about five of them."""
    span = max(hi - lo, 1e-9)
    step = next(s for s in (0.05, 0.1, 0.2, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0) if span / s <= 6)
    first = math.ceil(lo / step - 1e-9) * step
    return [round(first + i * step, 6) for i in range(int((hi - first) / step + 1e-9) + 1)]


def speedup_chart(setting: Setting, width: int = 640) -> str:
    """An inline SVG: one row per method (label, the 95% interval as a line, the point as a dot, the value),
    a dashed line at 1× (vanilla), colours by verdict; each row's full figures on hover (<title>)."""
    row, top, gutter, value_w = 17, 26, 196, 124
    plot = width - gutter - value_w
    points = [v for b in setting.bars for v in (b.speedup, b.lo, b.hi) if finite(v)] + [1.0]
    lo, hi = min(points), max(points)
    pad = 0.04 * (hi - lo or 1.0)
    lo, hi = lo - pad, hi + pad
    height = top + row * len(setting.bars) + 8

    def x(v: float) -> float:
        return round(gutter + plot * (v - lo) / (hi - lo), 1)

    esc = html.escape
    name = esc("Mean speedup over vanilla, " + setting.title)
    out = [f'<svg class="chart" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img" aria-label="{name}">']
    for t in _ticks(lo, hi):
        out.append(f'<line x1="{x(t)}" x2="{x(t)}" y1="{top - 4}" y2="{height - 6}" class="grid"/>'
                   f'<text x="{x(t)}" y="{top - 9}" class="tick" text-anchor="middle">{t:g}×</text>')
    out.append(f'<line x1="{x(1.0)}" x2="{x(1.0)}" y1="{top - 4}" y2="{height - 6}" class="one"/>')
    for i, bar in enumerate(setting.bars):
        y = top + row * i + row / 2
        color = COLORS[bar.verdict]
        label = bar.label if len(bar.label) <= 30 else bar.label[:29] + "…"
        hover = f"{bar.label}: {bar.text()} over vanilla ({bar.verdict})"
        if finite(bar.tau):
            hover += f"; τ {bar.tau:.2f}"
        if finite(bar.td_percent):
            hover += f"; T_D {bar.td_percent:.0f}%"
        out.append(f'<g><title>{esc(hover)}</title>'
                   f'<text x="{gutter - 8}" y="{y + 4}" class="label" text-anchor="end">{esc(label)}</text>')
        if finite(bar.lo) and finite(bar.hi):
            out.append(f'<line x1="{x(bar.lo)}" x2="{x(bar.hi)}" y1="{y}" y2="{y}" stroke="{color}" '
                       f'stroke-width="3" stroke-linecap="round"/>')
        out.append(f'<circle cx="{x(bar.speedup)}" cy="{y}" r="4.5" fill="{color}"/><text x="{gutter + plot + 8}" '
                   f'y="{y + 4}" class="value" fill="{color}">{esc(bar.text())}</text></g>')
    out.append("</svg>")
    return "".join(out)


# ---- the page -------------------------------------------------------------------------------------

_CSS = """*{box-sizing:border-box}body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;margin:0;color:#1f2328;
background:#fff;line-height:1.4}header,main{max-width:1400px;margin:0 auto;padding:0 24px}
header{padding-top:18px}h1{font-size:24px;margin:0 0 4px}.sub{color:#57606a;margin:0 0 10px;font-size:14px}
nav{position:sticky;top:0;z-index:1;background:#f6f8fa;border-bottom:1px solid #d0d7de;padding:6px 24px;font-size:13px}
nav a{margin-right:14px;color:#0969da;text-decoration:none;white-space:nowrap}nav a:hover{text-decoration:underline}
h2{font-size:19px;margin:26px 0 6px;scroll-margin-top:40px}h3{font-size:15px;margin:0 0 2px}
.how{font-size:13px;color:#57606a;margin:0 0 10px;max-width:1100px}
.glance{border-collapse:collapse;font-size:13px;margin:4px 0 14px;width:100%}
.glance th,.glance td{text-align:left;padding:4px 8px;border-bottom:1px solid #d8dee4;vertical-align:top}
.glance th{background:#f6f8fa;white-space:nowrap}.pays{color:#1a7f37;font-weight:600}.slower{color:#cf222e}
.unclear{color:#6e7781}
.cards{display:flex;flex-wrap:wrap;gap:14px}.card{border:1px solid #d0d7de;border-radius:6px;padding:10px 12px;
flex:0 1 666px;min-width:0;scroll-margin-top:40px}.card p{margin:2px 0 6px;font-size:13px}.card .more{font-size:12px}
svg.chart{display:block;max-width:100%;height:auto;font-size:11px}svg .label{text-anchor:end;fill:#1f2328}
svg .value{font-variant-numeric:tabular-nums}svg .tick{text-anchor:middle;fill:#57606a;font-size:10px}
svg .grid{stroke:#eaeef2}svg .one{stroke:#1f2328;stroke-dasharray:4 3}
.wide{overflow-x:auto;max-width:100%}table.data{border-collapse:collapse;margin:6px 0;font-size:12.5px;
font-variant-numeric:tabular-nums}table.data th,table.data td{padding:3px 7px;text-align:right;white-space:nowrap}
table.data th:first-child,table.data td:first-child,table.data .l{text-align:left}
table.data td.l{white-space:normal;min-width:7em;max-width:26em}
table.data thead tr:last-child th{border-bottom:1px solid #57606a}table.data{border-top:2px solid #57606a;
border-bottom:2px solid #57606a}table.data tr.section td{font-style:italic;text-align:left;border-top:1px solid #8c959f;
background:#f6f8fa}table.data td[title]{text-decoration:underline dotted #8c959f;cursor:help}
details{font-size:12px;color:#57606a;margin:2px 0 8px}details ul{margin:4px 0;padding-left:20px}
.figures{display:flex;flex-wrap:wrap;gap:10px}figure{margin:0;flex:0 1 660px}figure img{max-width:100%;height:auto}
figcaption{font-size:12px;color:#57606a}"""


def _glance(settings_: Sequence[Setting]) -> str:
    """One row per setting: the methods that pay (with their speedups), how many cannot be told apart from
    vanilla, how many are slower."""
    esc = html.escape
    out = ['<table class="glance"><thead><tr><th>Setting</th><th>Pays (whole interval above 1×)</th>'
           "<th>Cannot tell</th><th>Slower</th></tr></thead><tbody>"]
    for s in settings_:
        pays = ", ".join(f"{esc(b.label)} {fmt_spd(b.speedup)}" for b in s.of(PAYS)) or "none"
        out.append(f'<tr><td><a href="#{s.anchor}">{esc(s.title)}</a></td><td class="pays">{pays}</td>'
                   f'<td class="unclear">{len(s.of(UNCLEAR))}</td><td class="slower">{len(s.of(SLOWER))}</td></tr>')
    out.append("</tbody></table>")
    return "".join(out)


def _card(setting: Setting) -> str:
    esc = html.escape
    return (f'<div class="card" id="{setting.anchor}"><h3>{esc(setting.title)}</h3>'
            f"<p>{esc(setting.headline())}</p>{speedup_chart(setting)}"
            f'<p class="more"><a href="#{setting.table}">per-bench speedups and τ: {setting.table}</a></p></div>')


def _figure(png: Path) -> str:
    data = base64.b64encode(png.read_bytes()).decode("ascii")
    stem = html.escape(png.stem)
    return (f'<figure id="figure-{stem}"><img alt="{stem}" loading="lazy" src="data:image/png;base64,{data}">'
            f"<figcaption>{stem}</figcaption></figure>")


def render_index_html(report, figures: Sequence[Path]) -> str:
    """The whole page for a ``build.Report`` (its machine first, then the others) and the figure PNGs."""
    reports = [report, *report.others]
    several = len(reports) > 1
    found: list[Setting] = []
    for r in reports:
        dtypes = _dtypes(r.files)
        machine = r.hardware if several else ""
        # benchmarks before streams; T = 0 first; the setting comparing the most methods first
        found += sorted(settings(r.main, dtypes, machine), key=_order) + sorted(
            settings(r.streams, dtypes, machine, "mixed streams"), key=_order)
    tables = [t for t in report.tables if t.sections]
    esc = html.escape
    machines = "; ".join(r.hardware for r in reports if r.hardware) or "unknown hardware"
    shas = sorted({str(f.meta["git_sha"]) for r in reports for f in r.files if f.meta.get("git_sha")})
    code = f"git {', '.join(shas)}" if len(shas) <= 3 else f"{len(shas)} git commits"
    sub = (f"Speculative decoding against vanilla decoding of the same target, interleaved in one process. "
           f"Measured on {machines}; {sum(len(r.files) for r in reports)} result files"
           + (f", made with the code at {code}" if shas else "") + ".")
    nav = ['<a href="#verdicts">Which methods pay</a>'] + [f'<a href="#{t.name}">{esc(_short_title(t))}</a>'
                                                             for t in tables]
    if figures:
        nav.append('<a href="#figures">Figures</a>')
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             '<meta name="viewport" content="width=device-width, initial-scale=1">',
             '<link rel="icon" href="data:,"><title>specbench report</title>', f"<style>{_CSS}</style></head><body>",
             f'<header><h1>specbench report</h1><p class="sub">{esc(sub)}</p></header>',
             f"<nav>{''.join(nav)}</nav><main>", '<section id="verdicts"><h2>Which methods pay</h2>']
    if found:
        parts += ['<p class="how">Per setting (target, dtype, temperature), each method\'s speedup over vanilla, '
                  "the mean over the benchmarks it ran: the dot is the point, the line its 95% bootstrap interval "
                  "over conversations. Green: the whole interval is above 1× (it pays); red: below (slower); grey: "
                  "it cannot be told from vanilla here. Hover a row for τ and the drafting share; the tables below "
                  "have every bench.</p>", _glance(found), '<div class="cards">']
        parts += [_card(s) for s in found] + ["</div>"]
    else:
        parts.append('<p class="how">No method has a mean speedup in these records.</p>')
    parts.append("</section>")
    parts += [f'<section class="table">{render_html(t)}</section>' for t in tables]
    if figures:
        parts += ['<section id="figures"><h2>Figures</h2><div class="figures">']
        parts += [_figure(png) for png in figures] + ["</div></section>"]
    parts.append("</main></body></html>")
    return "\n".join(parts) + "\n"


def _order(setting: Setting) -> tuple:
    return setting.temperature, -len(setting.bars), setting.title


def _short_title(table: Table) -> str:
    """The nav's name of a table: its file stem without '_table', words spaced ('main', 'paper comparison')."""
    return table.name.replace("_table", "").replace("_", " ")


def _dtypes(files) -> dict[tuple[str, str], str]:
    """(target, temperature as the tables print it) -> the dtype(s) its files ran in."""
    found: dict[tuple[str, str], set[str]] = {}
    for f in files:
        if f.records and f.meta.get("dtype"):
            target, temperature = f.block
            found.setdefault((target, f"{temperature:g}"), set()).add(str(f.meta["dtype"]))
    return {key: " / ".join(sorted(values)) for key, values in found.items()}
