"""The formatted table every renderer takes (``Table`` of ``Cell``s) and the number formats in its cells.

Table builders outside the package (``specbench.analysis.orderings``, method report tables registered under
``specbench.report_tables``) import ``Cell``, ``Table`` and the bench/block labels from here."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Sequence

import pandas as pd

from specbench.data.machine_load import MARK
from specbench.analysis.report.names import bench_label, block_label  # noqa: F401 (part of this module's interface)

DASH = "—"


def finite(x) -> bool:
    try:
        return math.isfinite(float(x))
    except (TypeError, ValueError):
        return False


def fmt_spd(x: float) -> str:
    return DASH if not finite(x) else f"{x:.2f}×"


def fmt_tau(x: float) -> str:
    return DASH if not finite(x) else f"{x:.2f}"


def fmt_pct(fraction: float) -> str:
    return DASH if not finite(fraction) else f"{100 * fraction:.0f}%"


def fmt_delta(x: float, unit: str = "") -> str:
    return DASH if not finite(x) else f"{x:+.2f}{unit}".replace("-", "−")


def fmt_ci(point: str, lo: float, hi: float, fmt: Callable[[float], str]) -> str:
    if point == DASH or not (finite(lo) and finite(hi)):
        return point
    return f"{point} [{fmt(lo).rstrip('×')}, {fmt(hi).rstrip('×')}]"


def fmt_spd_n(x: float, n, loaded: bool = False) -> str:
    """A speedup with the prompts behind it, and the under-load mark when its file was recorded under load."""
    if not finite(x):
        return DASH
    return f"{fmt_spd(x)} (n={int(n)})" + (f" {MARK}" if loaded else "")


def fmt_tps(x: float) -> str:
    return DASH if not finite(x) else f"{x:.1f}"


def nanmean(values: Sequence[float]) -> float:
    kept = [v for v in values if finite(v)]
    return sum(kept) / len(kept) if kept else math.nan


class Cell(NamedTuple):
    text: str
    bold: bool = False
    short: str = ""  # the page's compact form (the point first, its interval and n in small type below); "" = text


@dataclass
class Table:
    """A formatted table: the one input of every renderer."""
    name: str  # output file stem
    title: str
    columns: list[str]  # leaf header
    groups: list[tuple[str, int]]  # top header spans (label, n columns); "" for none
    sections: list[tuple[str, list[list[Cell]]]]  # (section label, rows)
    data: pd.DataFrame  # numeric form, written as CSV
    notes: list[str] = field(default_factory=list)
    provenance: list[str] = field(default_factory=list)
    align: str = ""  # one of l/r per column; default: names left in the first column, numbers right

    def __post_init__(self) -> None:
        self.align = self.align or "l" + "r" * (len(self.columns) - 1)
