"""Launch a command under torchrun with 2 CPU processes (gloo) from a test."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def torchrun(args: list[str], timeout: int = 240, nproc: int = 2) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run --standalone`` (a free rendezvous port) from the repo root;
    returns the finished process (stdout, stderr as text)."""
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
