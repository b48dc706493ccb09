import os
import sys
from pathlib import Path

# Tests import the tiny-model helpers as plain modules.
sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("SPECBENCH_DATA", str(Path(__file__).resolve().parents[2] / "shared" / "datasets"))

import torch  # noqa: E402

# Tiny models and per-sample tensor ops are faster single-threaded (no pool wake-ups).
torch.set_num_threads(1)
