"""Renderers: a ``Table`` -> Markdown, LaTeX (booktabs), HTML, CSV (the index page that holds the HTML
tables is page.py). Pure functions of their input, so the same tables give the same bytes."""

from __future__ import annotations

import html
from typing import Sequence

from specbench.analysis.report.table import Cell, Table


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


def render_html(table: Table, under_heading: str = "") -> str:
    """A heading (anchored by the table's name), a <table> with a grouped header and section rows, then the notes
    and provenance folded away (no external assets). A cell with a compact form shows its point, and its
    interval and n in small type below it. ``under_heading``: HTML set between the heading and the table."""
    esc = html.escape
    out = [f'<h2 id="{esc(table.name)}">{esc(table.title)}</h2>' + under_heading, '<div class="wide"><table class="data">',
           "<thead>"]
    if table.groups:
        out.append("<tr>" + "".join(f'<th colspan="{span}">{esc(label)}</th>' for label, span in table.groups)
                   + "</tr>")
    heads = "".join(f'<th class="l">{esc(c)}</th>' if a == "l" else f"<th>{esc(c)}</th>"
                    for c, a in zip(table.columns, table.align))
    out += [f"<tr>{heads}</tr>", "</thead>", "<tbody>"]
    for label, rows in table.sections:
        out.append(f'<tr class="section"><td colspan="{len(table.columns)}">{esc(label)}</td></tr>')
        out += ["<tr>" + "".join(_html_cell(c, a) for c, a in zip(row, table.align)) + "</tr>" for row in rows]
    out += ["</tbody>", "</table></div>"]
    if table.notes or table.provenance:
        out += ["<details><summary>Notes and provenance</summary>"]
        if table.notes:
            out += ["<ul>"] + [f"<li>{esc(n)}</li>" for n in table.notes] + ["</ul>"]
        out += ['<p class="provenance">' + "<br>".join(esc(p) for p in table.provenance) + "</p>", "</details>"]
    return "\n".join(out)


def _html_cell(cell: Cell, align: str) -> str:
    """A cell with a compact form (a point, and its interval and n in the full text) shows the point and, below it
    in small type, the rest of the full text: intervals are read without hovering (a phone has no hover)."""
    esc = html.escape
    attrs = ' class="l"' if align == "l" else ""
    if cell.short and cell.short != cell.text:
        point = cell.short.split(" ")[0]
        rest = cell.text[len(point):].strip() if cell.text.startswith(point) else cell.text
        shown, detail = esc(point), f'<span class="ci">{esc(rest)}</span>'
    else:
        shown, detail = esc(cell.text), ""
    return f"<td{attrs}>" + (f"<b>{shown}</b>" if cell.bold else shown) + detail + "</td>"


def render_csv(table: Table) -> str:
    """Numeric CSV (4 decimals, empty = missing) under '#' provenance lines (pandas: comment='#')."""
    head = "".join(f"# {p}\n" for p in table.provenance)
    return head + table.data.to_csv(index=False, float_format="%.4f", na_rep="", lineterminator="\n")

