"""The report page in a real browser (headless Chromium at 1400 px): it loads without a console error, its
first screen holds the headline sentence and the leaderboard, nothing is wider than the window (the menu wraps),
a click on a heading sorts the table, and a screenshot of that first screen shows the verdicts' colours.
Skipped, with the reason, without Chromium (CI installs it)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from specbench.analysis.report import write_report
from specbench.analysis.report.verdicts import COLORS, PAYS, SLOWER
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


MACHINES = ("Intel(R) Xeon(R) Processor [family 6 model 167, avx512_bf16/amx_bf16] (2 threads)",
            "AMD EPYC [family 25 model 1, avx2 only] (2 threads)")


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> Path:
    """A report of one target in two dtypes on two machines (four settings, tables named apart per machine: a
    long menu), eleven methods each, some faster than vanilla, one slower."""
    root = tmp_path_factory.mktemp("browser")
    (root / "results").mkdir()
    methods = ("sps", "eagle3", "specblock", "ddtree@budget=16", "pld", "suffix", "lookahead", "dflash", "pacer",
               "hydra")
    for m, hardware in enumerate(MACHINES):
        for dtype, shift in (("float32", 0), ("bfloat16", 1)):
            records = vanilla_records()
            for i, method in enumerate(methods):
                records += method_records(method, quality=1 + (i + shift + m) % 4,
                                          draft=0.05 + 0.1 * ((i + shift) % 3))
            records += method_records("medusa", quality=1, draft=0.7)  # drafting costs more than it saves
            write_jsonl(root / "results" / f"{dtype}_{m}.jsonl", records, dtype=dtype, hardware=hardware)
    write_report(root / "results", root / "out", figures=False)  # the figures' own tests are in test_report_package
    return root / "out" / "index.html"


def probe(page: Path, tmp_path: Path, script: str) -> dict:
    """Run ``script`` (which sets ``out``, a JSON-able object) in a copy of the page after it loaded; its result."""
    copy = page.parent / f"probe-{tmp_path.name}.html"
    code = f"<script>addEventListener('load',()=>{{let out;{script};document.body.dataset.probe=JSON.stringify(out)}})</script>"
    copy.write_text(page.read_text(encoding="utf-8").replace("</body>", code + "</body>"), encoding="utf-8")
    dom = browse(copy, "--dump-dom").stdout
    copy.unlink()
    return json.loads(re.search(r'data-probe="([^"]+)"', dom).group(1).replace("&quot;", '"'))


def test_the_console_probe_sees_an_error_when_there_is_one(tmp_path: Path):
    """Negative control: without it a silent log would pass every page."""
    broken = tmp_path / "broken.html"
    broken.write_text('<!DOCTYPE html><html><body><script>console.error("probe error")</script></body></html>')
    assert any("probe error" in line for line in console_errors(browse(broken, "--dump-dom")))


def test_page_loads_without_console_errors(page: Path):
    result = browse(page, "--dump-dom")
    assert result.returncode == 0 and "Leaderboard" in result.stdout
    assert not console_errors(result), console_errors(result)


def test_first_screen_holds_the_headline_and_the_leaderboard_and_nothing_overflows(page: Path, tmp_path: Path):
    """Measured in the browser by a probe script in a copy of the page."""
    found = probe(page, tmp_path, "const r=s=>document.querySelector(s).getBoundingClientRect();"
                  "out={headline:r('#headline').bottom,board:r('table.leaderboard').top,nav:r('nav').height,"
                  "scroll:document.documentElement.scrollWidth,view:innerWidth,links:document.querySelectorAll('nav a').length}")
    assert found["view"] == WIDTH and found["scroll"] <= WIDTH  # no sideways scrolling: the menu wraps
    assert found["links"] >= 8 and found["nav"] < HEIGHT / 4  # a menu of two machines' tables, in a few lines
    assert found["headline"] < found["board"] < HEIGHT * 0.6  # the headline, then the leaderboard, on the first screen


def test_a_click_on_a_heading_sorts_the_table(page: Path, tmp_path: Path):
    """The leaderboard's second setting column, clicked once (largest first) and again (smallest first); the
    methods that setting lacks stay last."""
    found = probe(page, tmp_path, "const t=document.querySelector('table.leaderboard');const h=t.tHead.rows[0].cells[3];"
                  "const col=()=>[...t.tBodies[0].rows].map(r=>r.cells[3].dataset.v);"
                  "const before=col();h.click();const down=col();h.click();out={before,down,up:col()}")
    values = [float(v) for v in found["before"] if v]
    down = [float(v) for v in found["down"] if v]
    up = [float(v) for v in found["up"] if v]
    assert down == sorted(values, reverse=True) and up == sorted(values) and down != found["before"]


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
