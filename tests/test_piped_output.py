"""Output into a pipe or a file is never cut to a terminal's width (rich assumes 80 columns there)."""

import subprocess
import sys

from specbench.console import make_console
from specbench.engine.registry import available_methods


def test_piped_list_names_every_method_whole():
    out = subprocess.run([sys.executable, "-m", "specbench", "list", "methods"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "…" not in out.stdout
    cells = {cell.strip() for line in out.stdout.splitlines() for cell in line.split("│")}
    assert set(available_methods()) <= cells  # each name whole, in one cell of one line


def test_a_long_line_into_a_file_is_not_wrapped(tmp_path):
    console = make_console()  # stdout is captured here: not a terminal
    with (tmp_path / "out.txt").open("w") as fh:
        console.file = fh
        console.print("x" * 300)
    assert (tmp_path / "out.txt").read_text() == "x" * 300 + "\n"
