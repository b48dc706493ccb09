"""Renderers: a ``Table`` -> Markdown, LaTeX (booktabs), HTML, CSV; the tables and figures -> one
self-contained index.html. Pure functions of their input, so the same tables give the same bytes."""

from __future__ import annotations

import base64
import html
from pathlib import Path
from typing import Sequence

from specbench.analysis.report.table import Table


def render_markdown(table: Table) -> str:
    """A heading, one Markdown table per section, then notes and provenance."""
    heads = flat_headers(table)
    out = [f"## {table.title}", ""]
    for label, rows in table.sections:
        rule = "|" + "|".join("---" if a == "l" else "---:" for a in table.align) + "|"
        out += [f"### {label}", "", _md_row(heads), rule]
        out += [_md_row([f"**{c.text}**" if c.bold else c.text for c in row]) for row in rows]
        out.append("")
    if not table.sections:
        out += ["(no rows)", ""]
    if table.notes:
        out += ["Notes:", ""] + [f"- {n}" for n in table.notes] + [""]
    out += ["Provenance:", ""] + [f"- {p}" for p in table.provenance] + [""]
    return "\n".join(out)


def flat_headers(table: Table) -> list[str]:
    if not table.groups:
        return list(table.columns)
    labels = [g for g, span in table.groups for _ in range(span)]
    return [f"{g} {c}" if g else c for g, c in zip(labels, table.columns)]


def _md_row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


_TEX = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_", "{": r"\{",
        "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}", "×": r"$\times$", "τ": r"$\tau$",
        "Δ": r"$\Delta$", "—": "---", "−": "$-$", "·": r"$\cdot$", "–": "--", "‡": r"\ddag{}"}


def tex_escape(text: str) -> str:
    if text == "T_D%":
        return r"$T_D\%$"
    return "".join(_TEX.get(ch, ch) for ch in text)


def render_latex(table: Table) -> str:
    """A booktabs table; sections become italic spanning rows like the papers' temperature rows."""
    n = len(table.columns)
    out = [f"% {table.title}"] + [f"% provenance: {p}" for p in table.provenance]
    out += [r"\begin{table}[t]", r"\centering", r"\small", rf"\begin{{tabular}}{{{table.align}}}", r"\toprule"]
    if table.groups:
        heads, rules, col = [], [], 1
        for label, span in table.groups:
            if label:
                heads.append(rf"\multicolumn{{{span}}}{{c}}{{{tex_escape(label)}}}")
                rules.append(rf"\cmidrule(lr){{{col}-{col + span - 1}}}")
            else:
                heads += [""] * span
            col += span
        out += [" & ".join(heads) + r" \\", " ".join(rules)]
    out.append(" & ".join(tex_escape(c) for c in table.columns) + r" \\")
    for label, rows in table.sections:
        out += [r"\midrule", rf"\multicolumn{{{n}}}{{l}}{{\textit{{{tex_escape(label)}}}}} \\"]
        for row in rows:
            out.append(" & ".join(rf"\textbf{{{tex_escape(c.text)}}}" if c.bold else tex_escape(c.text)
                                  for c in row) + r" \\")
    out += [r"\bottomrule", r"\end{tabular}"]
    if table.notes:
        out += [r"\par\smallskip{\footnotesize"] + [tex_escape(note) + r"\\" for note in table.notes] + ["}"]
    out += [rf"\caption{{{tex_escape(table.title)}}}", r"\end{table}"]
    return "\n".join(out) + "\n"


def render_html(table: Table) -> str:
    """A <table> with a grouped header, section rows, notes and provenance (no external assets)."""
    esc = html.escape
    out = [f"<h2>{esc(table.title)}</h2>", "<table>", "<thead>"]
    if table.groups:
        out.append("<tr>" + "".join(f'<th colspan="{span}">{esc(label)}</th>' for label, span in table.groups)
                   + "</tr>")
    out += ["<tr>" + "".join(f"<th>{esc(c)}</th>" for c in table.columns) + "</tr>", "</thead>", "<tbody>"]
    for label, rows in table.sections:
        out.append(f'<tr class="section"><td colspan="{len(table.columns)}">{esc(label)}</td></tr>')
        for row in rows:
            cells = [(f"<b>{esc(c.text)}</b>" if c.bold else esc(c.text), a) for c, a in zip(row, table.align)]
            out.append("<tr>" + "".join(f'<td class="l">{t}</td>' if a == "l" else f"<td>{t}</td>"
                                        for t, a in cells) + "</tr>")
    out += ["</tbody>", "</table>"]
    if table.notes:
        out += ['<ul class="notes">'] + [f"<li>{esc(n)}</li>" for n in table.notes] + ["</ul>"]
    out += ['<p class="provenance">' + "<br>".join(esc(p) for p in table.provenance) + "</p>"]
    return "\n".join(out)


def render_csv(table: Table) -> str:
    """Numeric CSV (4 decimals, empty = missing) under '#' provenance lines (pandas: comment='#')."""
    head = "".join(f"# {p}\n" for p in table.provenance)
    return head + table.data.to_csv(index=False, float_format="%.4f", na_rep="", lineterminator="\n")


_CSS = """body{font-family:system-ui,sans-serif;margin:2em;color:#222;max-width:1400px}
table{border-collapse:collapse;margin:1em 0;font-size:13px}th,td{padding:3px 8px;text-align:right}
th:first-child,td:first-child,td.l{text-align:left}thead tr:last-child th{border-bottom:1px solid #444}
table{border-top:2px solid #444;border-bottom:2px solid #444}tr.section td{font-style:italic;text-align:left;
border-top:1px solid #999;background:#f4f4f4}.notes,.provenance{font-size:12px;color:#555}
figure{display:inline-block;margin:1em}figure img{max-width:640px}figcaption{font-size:12px}"""


def render_index_html(tables: Sequence[Table], figures: Sequence[Path]) -> str:
    """One self-contained page: inline CSS, every table, figures as base64 PNG."""
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8"><title>specbench report</title>',
             f"<style>{_CSS}</style></head><body>", "<h1>specbench report</h1>"]
    parts += [render_html(t) for t in tables]
    if figures:
        parts.append("<h2>Figures</h2>")
    for png in figures:
        data = base64.b64encode(png.read_bytes()).decode("ascii")
        parts.append(f'<figure><img alt="{html.escape(png.stem)}" src="data:image/png;base64,{data}">'
                     f"<figcaption>{html.escape(png.stem)}</figcaption></figure>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


