"""The verdict chart of one setting, an inline SVG drawn here (the page needs no outside asset): one row per
method with its 95% interval as a line, its point as a dot and both as text, a dashed line at 1× (vanilla),
colours by verdict."""

from __future__ import annotations

import html
import math

from specbench.analysis.report.table import finite
from specbench.analysis.report.verdicts import COLORS, Setting


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
