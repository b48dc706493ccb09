"""The report's index page: per setting the verdicts and a chart of speedup with its interval come first,
the tables show points with their intervals on hover, every link lands, and the page needs nothing from
outside (no script, no remote asset: it is read offline)."""

from __future__ import annotations

import math
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pandas as pd

from specbench.analysis.report import write_report
from specbench.analysis.report.page import COLORS, PAYS, SLOWER, UNCLEAR, Bar, settings, speedup_chart
from specbench.analysis.report.table import Table
from test_report import method_records, vanilla_records, write_jsonl

SVG = "{http://www.w3.org/2000/svg}"


def speed_table() -> Table:
    """A main table's numeric form: three methods with a mean, one without (it ran no pooled bench)."""
    rows = [("slow", 0.7, 0.6, 0.8), ("fast", 1.4, 1.2, 1.6), ("even", 1.02, 0.9, 1.1), ("none", math.nan, math.nan,
                                                                                         math.nan)]
    data = pd.DataFrame([dict(target="t", temperature="0", method=m, mean_spd=s, mean_spd_lo=lo, mean_spd_hi=hi,
                              mean_tau=2.0, td_percent=15.0) for m, s, lo, hi in rows])
    return Table("main_table", "Speedup", ["Method"], [], [("t · T = 0", [])], data)


def test_a_bar_pays_only_when_its_whole_interval_is_above_one():
    assert Bar("a", 1.3, 1.1, 1.5).verdict == PAYS
    assert Bar("b", 0.8, 0.7, 0.9).verdict == SLOWER
    assert Bar("c", 1.05, 0.95, 1.2).verdict == UNCLEAR
    assert Bar("d", 1.5, math.nan, math.nan).verdict == UNCLEAR  # a point without an interval judges nothing
    assert Bar("a", 1.3, 1.1, 1.5).text() == "1.30× [1.10, 1.50]" and Bar("d", 1.5, math.nan, math.nan).text() == "1.50×"


def test_settings_put_the_fastest_first_and_name_the_dtype():
    setting, = settings(speed_table(), {("t", "0"): "bfloat16"})
    assert setting.title == "t · bfloat16 · T = 0" and setting.table == "main_table"
    assert [b.label for b in setting.bars] == ["fast", "even", "slow"]  # "none" has no mean: no bar
    assert setting.headline() == "1 of 3 methods pay: fast most, 1.40× [1.20, 1.60]."
    slow_only, = settings(Table("s", "s", ["Method"], [], [], speed_table().data.iloc[:1]))
    assert slow_only.headline() == ("No method is faster than vanilla beyond its interval; the fastest of 1, slow, "
                                    "reaches 0.70× [0.60, 0.80].")
    assert settings(None) == [] and settings(Table("x", "x", [], [], [], pd.DataFrame())) == []


def test_chart_draws_each_method_at_its_speedup_coloured_by_its_verdict():
    setting, = settings(speed_table())
    root = ET.fromstring(speedup_chart(setting))  # well-formed SVG
    dots = root.findall(f".//{SVG}circle")
    assert [d.get("fill") for d in dots] == [COLORS[PAYS], COLORS[UNCLEAR], COLORS[SLOWER]]
    ticks = {t.text: float(t.get("x")) for t in root.findall(f".//{SVG}text[@class='tick']")}
    one = root.find(f".//{SVG}line[@class='one']")
    assert float(one.get("x1")) == ticks["1×"]  # the vanilla line sits at the 1× tick
    axis = sorted((x, float(k.rstrip("×"))) for k, x in ticks.items())
    (x0, v0), (x1, v1) = axis[0], axis[-1]
    for dot, bar in zip(dots, setting.bars):  # the axis is linear: each dot at its value (to rounding)
        assert abs(float(dot.get("cx")) - (x0 + (bar.speedup - v0) * (x1 - x0) / (v1 - v0))) < 0.5
    intervals = [line for line in root.findall(f".//{SVG}line") if line.get("stroke-width") == "3"]
    assert len(intervals) == 3 and float(intervals[0].get("x1")) < float(dots[0].get("cx")) < float(intervals[0].get("x2"))
    hovers = [t.text for t in root.findall(f".//{SVG}title")]
    assert hovers[0] == "fast: 1.40× [1.20, 1.60] over vanilla (pays); τ 2.00; T_D 15%"


def test_index_page_opens_with_the_verdicts_and_needs_nothing_from_outside(tmp_path: Path):
    (tmp_path / "results").mkdir()
    records = vanilla_records() + method_records("sps", quality=1, draft=0.3) + method_records("specblock", quality=3,
                                                                                             draft=0.1)
    write_jsonl(tmp_path / "results" / "a.jsonl", records)
    write_report(tmp_path / "results", tmp_path / "out")
    page = (tmp_path / "out" / "index.html").read_text(encoding="utf-8")
    first_table, figures = page.index('id="main_table"'), page.index('id="figures"')
    verdicts = page[page.index('id="verdicts"'):first_table]
    assert "<svg" in verdicts and "smollm2-135m · bf16 · T = 0" in verdicts and first_table < figures
    assert re.search(r"\d of 2 methods? pays?|None of 2 methods", verdicts)
    ids = set(re.findall(r'id="([^"]+)"', page))
    links = re.findall(r'href="#([^"]+)"', page)
    assert {"verdicts", "main_table", "companion_table", "figures"} <= set(links) and set(links) <= ids
    assert "<script" not in page and not re.search(r'(?:src|href)="(?:https?:)?//', page)
    # The main table shows points; the interval and n are the cell's hover text (title).
    cells = re.findall(r'<td title="([^"]+)">(?:<b>)?([^<]+)(?:</b>)?</td>', page[first_table:figures])
    spd = [(full, shown) for full, shown in cells if "(n=" in full]
    assert spd and all("[" in full and "[" not in shown and full.startswith(shown.split(" ")[0]) for full, shown in spd)
    md = (tmp_path / "out" / "main_table.md").read_text(encoding="utf-8")
    assert all(full.replace("|", "\\|") in md for full, _ in spd[:3])  # the Markdown keeps the full text
