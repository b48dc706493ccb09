"""Verdicts per setting, what the report page leads with: for each (machine, target, dtype, T) block of a
speedup table, every method's mean speedup over vanilla with its 95% interval, and whether it pays (the whole
interval above 1×), is slower (the whole interval below) or cannot be told from vanilla."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Mapping

from specbench.analysis.report.names import block_label
from specbench.analysis.report.table import Table, finite, fmt_spd

PAYS, SLOWER, UNCLEAR = "pays", "slower", "unclear"
COLORS = {PAYS: "#1a7f37", SLOWER: "#cf222e", UNCLEAR: "#6e7781"}


@dataclass(frozen=True)
class Bar:
    """One method of one setting: its mean speedup over the benchmarks, the 95% interval, τ, T_D% and family."""

    label: str
    speedup: float
    lo: float
    hi: float
    tau: float = math.nan
    td_percent: float = math.nan
    family: str = ""

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
    """One (machine, target, dtype, T) block of a speedup table: its methods, fastest first. ``short_title``
    names the block (and the kind of table, for streams); ``machine`` is the hardware's short name
    (checks.hardware_label), empty on a one-machine page; ``title`` is both."""

    short_title: str
    table: str  # the table the setting summarises (its anchor on the page)
    bars: tuple[Bar, ...]
    temperature: float = 0.0
    machine: str = ""

    @property
    def title(self) -> str:
        return f"{self.short_title} · {self.machine}" if self.machine else self.short_title

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


def settings(table: Table | None, dtypes: Mapping[tuple[str, str], str] | None = None, machine: str = "",
             kind: str = "", families: Mapping[str, str] | None = None) -> list[Setting]:
    """The settings of a speedup table (``main_table``, ``streams_table``) from its numeric form: per block,
    every method with a mean speedup, fastest first. ``dtypes``: (target, temperature as printed) -> dtype,
    named in the title unless the target already carries it; ``machine`` (a short hardware name) and ``kind``
    extend the title; ``families``: method label -> its family."""
    if table is None or table.data.empty or "mean_spd" not in table.data:
        return []
    out = []
    for (target, temperature), part in table.data.groupby(["target", "temperature"], sort=False):
        bars = [Bar(str(r.method), float(r.mean_spd), float(r.mean_spd_lo), float(r.mean_spd_hi), float(r.mean_tau),
                    float(r.td_percent), (families or {}).get(str(r.method), ""))
                for r in part.itertuples() if finite(r.mean_spd)]
        if not bars:
            continue
        bars.sort(key=lambda b: (-b.speedup, b.label))
        dtype = (dtypes or {}).get((target, temperature), "")
        name = target if not dtype or dtype in target else f"{target} · {dtype}"
        title = block_label((name, float(temperature))) + (f" · {kind}" if kind else "")
        out.append(Setting(title, table.name, tuple(bars), float(temperature), machine))
    return out
