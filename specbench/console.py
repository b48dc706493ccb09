"""The command line's consoles. Output into a pipe or a file is never cut to a terminal's width: a
table takes the width its cells need and a line is never wrapped (``specbench list methods | cat``)."""

from __future__ import annotations

import sys

from rich.console import Console

UNBOUNDED = 100_000  # columns for a pipe or a file; rich sizes tables to their content, so nothing is padded


def make_console(stderr: bool = False) -> Console:
    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr, width=None if stream.isatty() else UNBOUNDED)


console = make_console()
err = make_console(stderr=True)
