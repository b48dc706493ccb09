"""The report page in a real browser (headless Chromium at 1400 px): it loads without a console error, its
first screen holds the verdicts' chart above the first table, nothing is wider than the window, and a
screenshot of that first screen shows the chart's colours. Skipped, with the reason, without Chromium."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from specbench.analysis.report import write_report
from specbench.analysis.report.page import COLORS, PAYS, SLOWER
from test_report import method_records, vanilla_records, write_jsonl

WIDTH, HEIGHT = 1400, 900
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")
BROWSER = next((found for name in BROWSERS if (found := shutil.which(name))), None)

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(BROWSER is None, reason="no Chromium on PATH (apt-get install chromium)")]


def browse(page: Path, *flags: str) -> subprocess.CompletedProcess:
    """One headless load of ``page`` at WIDTH x HEIGHT; stderr carries the page's console messages."""
    return subprocess.run([BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           "--enable-logging=stderr", "--v=0", f"--window-size={WIDTH},{HEIGHT}",
                           "--virtual-time-budget=3000", *flags, page.as_uri()],
                          capture_output=True, text=True, timeout=120)


def console_errors(result: subprocess.CompletedProcess) -> list[str]:
    """The page's console errors and failed loads as Chromium logs them."""
    return [line for line in result.stderr.splitlines()
            if "CONSOLE" in line and ("error" in line.lower() or "Uncaught" in line or "Failed to load" in line)]


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> Path:
    """A report of one target in two dtypes (two settings), six methods each, some faster than vanilla, one slower."""
    root = tmp_path_factory.mktemp("browser")
    (root / "results").mkdir()
    for dtype, shift in (("float32", 0), ("bfloat16", 1)):
        records = vanilla_records()
        for i, method in enumerate(("sps", "eagle3", "specblock", "ddtree@budget=16", "pld")):
            records += method_records(method, quality=1 + (i + shift) % 4, draft=0.05 + 0.1 * ((i + shift) % 3))
        records += method_records("medusa", quality=1, draft=0.7)  # drafting costs more than it saves
        write_jsonl(root / "results" / f"{dtype}.jsonl", records, dtype=dtype)
    write_report(root / "results", root / "out")
    return root / "out" / "index.html"


def test_the_console_probe_sees_an_error_when_there_is_one(tmp_path: Path):
    """Negative control: without it a silent log would pass every page."""
    broken = tmp_path / "broken.html"
    broken.write_text('<!DOCTYPE html><html><body><script>console.error("probe error")</script></body></html>')
    assert any("probe error" in line for line in console_errors(browse(broken, "--dump-dom")))


def test_page_loads_without_console_errors(page: Path):
    result = browse(page, "--dump-dom")
    assert result.returncode == 0 and "Which methods pay" in result.stdout
    assert not console_errors(result), console_errors(result)


def test_first_screen_holds_the_chart_above_the_tables_and_nothing_overflows(page: Path, tmp_path: Path):
    """Measured in the browser by a probe script in a copy of the page (the page itself has none)."""
    probe = tmp_path / "probe.html"
    script = ("<script>const y=s=>document.querySelector(s).getBoundingClientRect().top;"
              "document.body.dataset.probe=JSON.stringify({chart:y('svg.chart'),table:y('#main_table'),"
              "verdicts:y('#verdicts'),scroll:document.documentElement.scrollWidth,view:innerWidth});</script>")
    probe.write_text(page.read_text(encoding="utf-8").replace("</body>", script + "</body>"), encoding="utf-8")
    dom = browse(probe, "--dump-dom").stdout
    found = json.loads(re.search(r'data-probe="([^"]+)"', dom).group(1).replace("&quot;", '"'))
    assert found["view"] == WIDTH and found["scroll"] <= WIDTH  # no sideways scrolling
    assert found["verdicts"] < found["chart"] < HEIGHT / 2 < found["table"]


def test_screenshot_of_the_first_screen_shows_the_chart(page: Path, tmp_path: Path):
    from matplotlib.image import imread

    shot = tmp_path / "first_screen.png"
    browse(page, f"--screenshot={shot}")
    pixels = imread(shot)[..., :3]
    assert pixels.shape[:2] == (HEIGHT, WIDTH)

    def share(color: str) -> float:
        rgb = np.array([int(color[i:i + 2], 16) / 255 for i in (1, 3, 5)])
        return float((np.abs(pixels - rgb).max(-1) < 0.08).mean())

    assert share(COLORS[PAYS]) > 1e-4 and share(COLORS[SLOWER]) > 1e-4  # dots, intervals and values drawn
    print(f"first screen: {shot}")
