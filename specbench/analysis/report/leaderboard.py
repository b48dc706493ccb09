"""The page's leaderboard, in Spec-Bench's layout: one row per method, one column per setting (target, dtype,
temperature, and the machine by its short name), each cell the method's mean speedup over vanilla with its 95%
interval and τ in plain view (a phone has no hover), coloured by verdict. Rows are sorted by the headline
setting's speedup; the page's script sorts any column on a click."""

from __future__ import annotations

import html
import math
from typing import Sequence

from specbench.analysis.report.verdicts import Setting
from specbench.analysis.report.table import finite, fmt_spd


def headline_sentence(found: Sequence[Setting]) -> str:
    """One sentence for the top of the page: the first setting's verdict (settings come ordered: T = 0 first, most
    methods first), and how much more there is."""
    if not found:
        return "No method has a mean speedup in these records."
    head = found[0]
    machines = {s.machine for s in found if s.machine}
    rest = len(found) - 1
    more = (f" The leaderboard adds {rest} more setting{'s' if rest != 1 else ''}"
            + (f" on {len(machines)} machines" if len(machines) > 1 else "") + ".") if rest else ""
    return f"{head.title} — {head.headline()}{more}"


def _rows(found: Sequence[Setting]) -> list[str]:
    """Every method label, sorted by its speedup in the headline setting (fastest first), then the methods that
    setting lacks by their best speedup elsewhere."""
    head = {b.label: b.speedup for b in found[0].bars}
    best: dict[str, float] = {}
    for s in found:
        for b in s.bars:
            best[b.label] = max(best.get(b.label, -math.inf), b.speedup)
    return sorted(best, key=lambda m: (m not in head, -head.get(m, best[m]), m))


def _stacked(title: str) -> str:
    """A setting's title as a column heading: one line per part (target, dtype, temperature), none broken inside."""
    return "<br/>".join(f'<span class="nw">{html.escape(part)}</span>' for part in title.split(" · "))


def leaderboard_html(found: Sequence[Setting]) -> str:
    """The leaderboard table (class ``data leaderboard``; each cell's ``data-v`` is its speedup, what the sort
    compares); each heading links the setting's verdict card."""
    if not found:
        return ""
    esc = html.escape
    heads = "".join(f'<th><a href="#{s.anchor}">{_stacked(s.short_title)}</a>'
                    + (f'<span class="hw">{esc(s.machine)}</span>' if s.machine else "") + "</th>" for s in found)
    out = ['<div class="wide"><table class="data leaderboard"><thead>',
           f'<tr><th class="l">Method</th><th class="l">Family</th>{heads}</tr></thead><tbody>']
    by_setting = [{b.label: b for b in s.bars} for s in found]
    families: dict[str, str] = {}
    for s in found:  # a family named by any setting (files made before the header recorded it name none)
        for b in s.bars:
            families[b.label] = families.get(b.label) or b.family
    for label in _rows(found):
        cells = []
        for bars in by_setting:
            bar = bars.get(label)
            if bar is None:
                cells.append('<td data-v="">—</td>')
                continue
            interval = f"[{bar.lo:.2f}, {bar.hi:.2f}]" if finite(bar.lo) and finite(bar.hi) else "no interval"
            tau = f'<span class="ci">τ {bar.tau:.2f}</span>' if finite(bar.tau) else ""
            cells.append(f'<td data-v="{bar.speedup:.4f}" class="{bar.verdict}"><span class="pt">'
                         f'{fmt_spd(bar.speedup)}</span><span class="ci">{interval}</span>{tau}</td>')
        out.append(f'<tr><td class="l">{esc(label)}</td><td class="l fam">{esc(families.get(label, ""))}</td>'
                   + "".join(cells) + "</tr>")
    out.append("</tbody></table></div>")
    return "".join(out)
