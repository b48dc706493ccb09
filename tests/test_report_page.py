"""The report's index page: a headline sentence and the leaderboard (methods × settings, intervals in plain view)
come first, then per setting the verdicts and a chart of speedup with its interval; the tables show points with
their intervals below them and link their files; every link lands; the page needs nothing from outside (one
inline script, the sort; no remote asset: it is read offline)."""

from __future__ import annotations

import math
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pandas as pd

from specbench.analysis.report import write_report
from specbench.analysis.report.chart import speedup_chart
from specbench.analysis.report.checks import hardware_label
from specbench.analysis.report.leaderboard import headline_sentence, leaderboard_html
from specbench.analysis.report.verdicts import COLORS, PAYS, SLOWER, UNCLEAR, Bar, Setting, settings
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


def test_index_page_opens_with_the_headline_and_the_leaderboard_and_needs_nothing_from_outside(tmp_path: Path):
    (tmp_path / "results").mkdir()
    records = vanilla_records() + method_records("sps", quality=1, draft=0.3) + method_records("specblock", quality=3,
                                                                                             draft=0.1)
    write_jsonl(tmp_path / "results" / "a.jsonl", records)
    write_report(tmp_path / "results", tmp_path / "out")
    page = (tmp_path / "out" / "index.html").read_text(encoding="utf-8")
    headline, board, verdicts = page.index('id="headline"'), page.index('id="leaderboard"'), page.index('id="verdicts"')
    first_table, figures = page.index('id="main_table"'), page.index('id="figures"')
    assert headline < board < verdicts < first_table < figures
    assert re.search(r'id="headline">smollm2-135m · bf16 · T = 0 — (\d of 2 methods? pays?|No method)', page)
    assert "<svg" in page[verdicts:first_table] and "smollm2-135m · bf16 · T = 0" in page[verdicts:first_table]
    ids = set(re.findall(r'id="([^"]+)"', page))
    links = re.findall(r'href="#([^"]+)"', page)
    assert {"leaderboard", "verdicts", "main_table", "companion_table", "figures"} <= set(links) and set(links) <= ids
    # nothing from outside: no remote link, one inline script (the sort), figures and files beside the page
    assert not re.search(r'(?:src|href)="(?:https?:)?//', page) and len(re.findall("<script", page)) == 1
    assert "<script src" not in page and "base64," not in page
    local = re.findall(r'(?:src|href)="([^"#][^"]*)"', page)
    assert local and all((tmp_path / "out" / ref).is_file() for ref in local if not ref.startswith("data:"))
    assert 'href="main_table.csv"' in page and 'href="main_table.md"' in page
    # Each figure has a caption that says what it shows (not its file name).
    captions = re.findall(r"<figcaption>([^<]+)</figcaption>", page)
    assert captions and all(" " in c and not c.endswith(".png") and "smollm2-135m" in c for c in captions)
    # The main table shows each point with its interval and n below it (no hover needed).
    cells = re.findall(r'<td>(?:<b>)?([^<]+)(?:</b>)?<span class="ci">([^<]+)</span></td>', page[first_table:figures])
    spd = [(point, rest) for point, rest in cells if "(n=" in rest]
    assert spd and all(point.endswith("×") and rest.startswith("[") for point, rest in spd)
    md = (tmp_path / "out" / "main_table.md").read_text(encoding="utf-8")
    assert all(f"{point} {rest}".replace("|", "\\|") in md for point, rest in spd[:3])  # the Markdown: full text


def two_settings() -> list[Setting]:
    a, b = (Setting("t · T = 0", "main_table", tuple(bars), 0.0, machine) for bars, machine in (
        ([Bar("fast", 1.4, 1.2, 1.6, 2.0, family="f"), Bar("slow", 0.7, 0.6, 0.8, 1.1, family="s")], "Xeon 6/167 AMX"),
        ([Bar("only-here", 1.1, 0.9, 1.3, family="o"), Bar("slow", 0.9, 0.85, 0.95)], "EPYC 25/1 AVX2")))
    return [a, b]


def test_leaderboard_rows_follow_the_first_setting_with_intervals_in_plain_view():
    html_ = leaderboard_html(two_settings())
    root = ET.fromstring(html_)
    rows = root.findall(".//tbody/tr")
    assert [r[0].text for r in rows] == ["fast", "slow", "only-here"]  # the first setting's order, then the rest
    heads = root.findall(".//thead/tr/th")
    assert [h.findtext("span") for h in heads[2:]] == ["Xeon 6/167 AMX", "EPYC 25/1 AVX2"]  # the machine, short
    fast = rows[0][2]
    assert fast.get("class") == PAYS and fast.get("data-v") == "1.4000"
    assert fast.findtext("span[@class='pt']") == "1.40×"
    assert [span.text for span in fast.findall("span[@class='ci']")] == ["[1.20, 1.60]", "τ 2.00"]
    assert rows[0][3].text == "—" and rows[0][3].get("data-v") == ""  # not run in that setting
    assert rows[2][1].text == "o" and rows[1][3].get("class") == SLOWER


def test_headline_names_the_first_setting_and_counts_the_rest():
    assert headline_sentence(two_settings()) == ("t · T = 0 · Xeon 6/167 AMX — 1 of 2 methods pay: fast most, "
                                                 "1.40× [1.20, 1.60]. The leaderboard adds 1 more setting on 2 "
                                                 "machines.")
    assert headline_sentence([]) == "No method has a mean speedup in these records."


def test_hardware_label_is_short_and_keeps_the_cpu_class():
    assert hardware_label("Intel(R) Xeon(R) Processor [family 6 model 167, avx512_bf16/amx_bf16] (2 threads)") == \
        "Xeon 6/167 AMX"
    assert hardware_label("AMD EPYC [family 25 model 1, avx2 only] (2 threads)") == "EPYC 25/1 AVX2"
    assert hardware_label("AMD EPYC [family 26 model 2, avx512_bf16] (2 threads)") == "EPYC 26/2 AVX512-BF16"
    assert len(hardware_label("NVIDIA H200 with a very long marketing name indeed (cuda)")) <= 28
