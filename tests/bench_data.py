"""Where the real benchmark files are: SPECBENCH_DATA (CI sets it). Tests that read them skip without it."""

import os
from pathlib import Path

import pytest

_SET = os.environ.get("SPECBENCH_DATA")
DATA = Path(_SET) if _SET else None
needs_data = pytest.mark.skipif(DATA is None or not DATA.is_dir(),
                                reason="needs the real benchmark files: set SPECBENCH_DATA to their folder")
