"""The report's index page, read top down: one headline sentence, the leaderboard (methods × settings, sorted
by speedup, intervals in plain view), the verdicts per setting (which methods pay, with a chart of each
method's speedup and its interval), then every table (each with links to its CSV, Markdown and LaTeX files)
and the figures with their captions. No outside asset and nothing from the network: the charts are inline
SVG drawn here, the figures are the PNG files written beside the page, and the only script is the few lines
that sort a table by a clicked column. Pure functions of the report, so the same records give the same bytes."""

from __future__ import annotations

import html
import os
from pathlib import Path
from typing import Mapping, Sequence

from specbench.analysis.report.chart import speedup_chart
from specbench.analysis.report.checks import hardware_label, machine_slug
from specbench.analysis.report.leaderboard import headline_sentence, leaderboard_html
from specbench.analysis.report.render import render_html
from specbench.analysis.report.table import Table, fmt_spd
from specbench.analysis.report.verdicts import PAYS, SLOWER, UNCLEAR, Setting, settings

_CSS = """*{box-sizing:border-box}body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;margin:0;color:#1f2328;
background:#fff;line-height:1.4}header,main{max-width:1400px;margin:0 auto;padding:0 24px}
header{padding-top:18px}h1{font-size:24px;margin:0 0 4px}.sub{color:#57606a;margin:0 0 10px;font-size:13px}
.headline{font-size:17px;margin:4px 0 8px;max-width:1100px}
nav{background:#f6f8fa;border-top:1px solid #d0d7de;border-bottom:1px solid #d0d7de;padding:4px 24px;font-size:13px}
nav a{color:#0969da;text-decoration:none;white-space:nowrap;margin-right:12px}nav .group{color:#57606a;margin-right:8px}
nav a:hover{text-decoration:underline}
h2{font-size:19px;margin:26px 0 6px;scroll-margin-top:64px}h3{font-size:15px;margin:0 0 2px}
.how{font-size:13px;color:#57606a;margin:0 0 10px;max-width:1100px}.files{font-size:12px;margin:-2px 0 4px}
.glance{border-collapse:collapse;font-size:13px;margin:4px 0 14px;width:100%}
.glance th,.glance td{text-align:left;padding:4px 8px;border-bottom:1px solid #d8dee4;vertical-align:top}
.glance th{background:#f6f8fa;white-space:nowrap}.pays{color:#1a7f37;font-weight:600}.slower{color:#cf222e}
.unclear{color:#6e7781}
.cards{display:flex;flex-wrap:wrap;gap:14px}.card{border:1px solid #d0d7de;border-radius:6px;padding:10px 12px;
flex:0 1 666px;min-width:0;scroll-margin-top:64px}.card p{margin:2px 0 6px;font-size:13px}.card .more{font-size:12px}
svg.chart{display:block;max-width:100%;height:auto;font-size:11px}svg .label{text-anchor:end;fill:#1f2328}
svg .value{font-variant-numeric:tabular-nums}svg .tick{text-anchor:middle;fill:#57606a;font-size:10px}
svg .grid{stroke:#eaeef2}svg .one{stroke:#1f2328;stroke-dasharray:4 3}
.wide{overflow-x:auto;max-width:100%}table.data{border-collapse:collapse;margin:6px 0;font-size:12.5px;
font-variant-numeric:tabular-nums}table.data th,table.data td{padding:3px 7px;text-align:right;white-space:nowrap;
vertical-align:top}table.data th:first-child,table.data td:first-child,table.data .l{text-align:left}
table.data td.l{white-space:normal;min-width:7em;max-width:26em}
table.data thead tr:last-child th{border-bottom:1px solid #57606a}table.data{border-top:2px solid #57606a;
border-bottom:2px solid #57606a}table.data tr.section td{font-style:italic;text-align:left;border-top:1px solid #8c959f;
background:#f6f8fa}.ci{display:block;white-space:normal;font-size:10.5px;color:#57606a;font-weight:400}
th.sort{cursor:pointer}th.sort:after{content:" ⇅";color:#8c959f;font-weight:400}
th[data-dir=down]:after{content:" ↓"}th[data-dir=up]:after{content:" ↑"}
table.leaderboard th{white-space:normal;min-width:6.5em;max-width:11em;vertical-align:bottom}
table.leaderboard th a{color:#1f2328;text-decoration:none}.nw{white-space:nowrap}.hw{display:block;color:#57606a;font-weight:400;font-size:11px}
table.leaderboard td .pt{font-weight:600}table.leaderboard .fam{color:#57606a}
details{font-size:12px;color:#57606a;margin:2px 0 8px}details ul{margin:4px 0;padding-left:20px}
.figures{display:flex;flex-wrap:wrap;gap:14px}figure{margin:0;flex:0 1 660px}figure img{max-width:100%;height:auto}
figcaption{font-size:12.5px;color:#1f2328;margin-top:2px}"""

# Click a column's heading to sort every section of its table by that column (numbers by value, the rest as
# text; a cell's data-v, where set, is what is compared); a second click reverses. Sections keep their place.
_SORT = """document.querySelectorAll("table.data thead").forEach(head=>{const ths=head.rows[head.rows.length-1].cells;
[...ths].forEach((th,i)=>{th.classList.add("sort");th.addEventListener("click",()=>{const down=th.dataset.dir!=="down";
[...ths].forEach(t=>delete t.dataset.dir);th.dataset.dir=down?"down":"up";const key=r=>{const c=r.cells[i];
const t=c?(c.dataset.v??c.textContent).trim():"";const n=parseFloat(t.replace("\\u2212","-"));return[t,n]};
const cmp=(a,b)=>{const[ta,na]=key(a),[tb,nb]=key(b);if(isNaN(na)!==isNaN(nb))return isNaN(na)?1:-1;
const d=isNaN(na)?ta.localeCompare(tb):na-nb;return down?-d:d};for(const body of th.closest("table").tBodies){
const groups=[[]];for(const r of [...body.rows]){if(r.classList.contains("section"))groups.push([r]);
else groups[groups.length-1].push(r)}for(const g of groups){const top=g.length&&g[0].classList.contains("section")?
[g.shift()]:[];g.sort(cmp);for(const r of [...top,...g])body.appendChild(r)}}})})});"""


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


def _table_section(table: Table) -> str:
    """A table with links to the files the report wrote for it (beside the page)."""
    name = html.escape(table.name)
    files = " · ".join(f'<a href="{name}.{ext}">{label}</a>' for ext, label in (("csv", "CSV"), ("md", "Markdown"),
                                                                               ("tex", "LaTeX")))
    links = f'<p class="files">This table as {files}</p>'
    return f'<section class="table">{render_html(table, links)}</section>'


def _figure(png: Path, caption: str, base: Path | None) -> str:
    src = os.path.relpath(png, base).replace(os.sep, "/") if base else f"{png.parent.name}/{png.name}"
    stem = html.escape(png.stem)
    return (f'<figure id="figure-{stem}"><a href="{html.escape(src)}"><img alt="{html.escape(caption or stem)}" '
            f'loading="lazy" src="{html.escape(src)}"></a><figcaption>{html.escape(caption or stem)}</figcaption>'
            "</figure>")


def page_settings(report) -> list[Setting]:
    """Every setting of a ``build.Report`` and its other machines: benchmarks before streams, T = 0 first, the
    setting comparing the most methods first; each named by its machine's short name when there are several."""
    reports = [report, *report.others]
    found: list[Setting] = []
    for r in reports:
        dtypes = _dtypes(r.files)
        machine = hardware_label(r.hardware) if len(reports) > 1 else ""
        families = {label: info.family for block in r.sides.values() for label, info in block.items()}
        found += sorted(settings(r.main, dtypes, machine, families=families), key=_order) + sorted(
            settings(r.streams, dtypes, machine, "mixed streams", families), key=_order)
    return found


def render_index_html(report, figures: Sequence[Path], captions: Mapping[Path, str] | None = None,
                      base: Path | None = None) -> str:
    """The whole page for a ``build.Report`` (its machine first, then the others) and the figure PNGs
    (``captions``: PNG -> its caption; ``base``: the page's folder, what the figures' links are relative to)."""
    reports = [report, *report.others]
    found = page_settings(report)
    tables = [t for t in report.tables if t.sections]
    esc = html.escape
    machines = "; ".join((f"{hardware_label(r.hardware)} = {r.hardware}" if len(reports) > 1 else r.hardware)
                         for r in reports if r.hardware) or "unknown hardware"
    shas = sorted({str(f.meta["git_sha"]) for r in reports for f in r.files if f.meta.get("git_sha")})
    code = f"git {', '.join(shas)}" if len(shas) <= 3 else f"{len(shas)} git commits"
    sub = (f"Speculative decoding against vanilla decoding of the same target, interleaved in one process. "
           f"Measured on {machines}; {sum(len(r.files) for r in reports)} result files"
           + (f", made with the code at {code}" if shas else "") + ".")
    first = ['<a href="#leaderboard">Leaderboard</a>', '<a href="#verdicts">Which methods pay</a>']
    if figures:
        first.append('<a href="#figures">Figures</a>')
    nav = [" ".join(first)]
    for r in reports:  # the tables, a line per machine
        if mine := [t for t in r.own_tables if t.sections]:
            label = f"Tables, {hardware_label(r.hardware)}:" if len(reports) > 1 else "Tables:"
            nav.append(f'<span class="group">{esc(label)}</span> ' + " ".join(
                f'<a href="#{esc(t.name)}">{esc(_short_title(t, r.hardware))}</a>' for t in mine))
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             '<meta name="viewport" content="width=device-width, initial-scale=1">',
             '<link rel="icon" href="data:,"><title>specbench report</title>', f"<style>{_CSS}</style></head><body>",
             f'<header><h1>specbench report</h1><p class="headline" id="headline">{esc(headline_sentence(found))}'
             f'</p><p class="sub">{esc(sub)}</p></header>',
             "<nav>" + "".join(f"<div>{line}</div>" for line in nav) + "</nav><main>"]
    if found:
        parts += ['<section id="leaderboard"><h2>Leaderboard</h2>',
                  '<p class="how">Each method\'s speedup over vanilla decoding of the same target, the mean over the '
                  "benchmarks it ran, per setting (target · dtype · temperature · machine); below each point its 95% "
                  "bootstrap interval over conversations and τ, the mean accepted length. Green: the whole interval "
                  "is above 1× (it pays); red: below (slower); grey: it cannot be told from vanilla. Sorted by the "
                  "first setting; click a column's heading to sort by it.</p>", leaderboard_html(found), "</section>"]
    parts.append('<section id="verdicts"><h2>Which methods pay</h2>')
    if found:
        parts += ['<p class="how">Per setting, the same speedups drawn: the dot is the point, the line its 95% '
                  "interval; the tables below have every bench.</p>", _glance(found), '<div class="cards">']
        parts += [_card(s) for s in found] + ["</div>"]
    else:
        parts.append('<p class="how">No method has a mean speedup in these records.</p>')
    parts.append("</section>")
    parts += [_table_section(t) for t in tables]
    if figures:
        parts += ['<section id="figures"><h2>Figures</h2><div class="figures">']
        parts += [_figure(png, (captions or {}).get(png, ""), base) for png in figures] + ["</div></section>"]
    parts.append(f"</main><script>{_SORT}</script></body></html>")
    return "\n".join(parts) + "\n"


def _order(setting: Setting) -> tuple:
    return setting.temperature, -len(setting.bars), setting.title


def _short_title(table: Table, hardware: str = "") -> str:
    """The nav's name of a table: its file stem without '_table' and without the machine's suffix (name_apart),
    words spaced ('main', 'paper comparison')."""
    name = table.name.removesuffix(f"_{machine_slug(hardware)}") if hardware else table.name
    return name.replace("_table", "").replace("_", " ")


def _dtypes(files) -> dict[tuple[str, str], str]:
    """(target, temperature as the tables print it) -> the dtype(s) its files ran in."""
    found: dict[tuple[str, str], set[str]] = {}
    for f in files:
        if f.records and f.meta.get("dtype"):
            target, temperature = f.block
            found.setdefault((target, f"{temperature:g}"), set()).add(str(f.meta["dtype"]))
    return {key: " / ".join(sorted(values)) for key, values in found.items()}
