"""The part files of a run sharded over several processes: under ``torchrun`` rank r of N writes
``OUT.part-rofN`` beside ``OUT`` (results, or a trainer's regenerated answers), and whoever merges them
finds them on disk (``specbench.run.merge`` merges result parts)."""

from __future__ import annotations

import re
from pathlib import Path


def part_path(out: str | Path, rank: int, size: int) -> Path:
    out = Path(out)
    return out.with_name(f"{out.name}.part-{rank}of{size}")


def find_parts(out: str | Path) -> list[Path]:
    """Every part file of ``out`` on disk (any world size), ordered by world size, then rank."""
    out = Path(out)
    pattern = re.compile(re.escape(out.name) + r"\.part-(\d+)of(\d+)")
    if not out.parent.is_dir():
        return []
    found = [(int(m[2]), int(m[1]), p) for p in out.parent.iterdir() if (m := pattern.fullmatch(p.name))]
    return [p for _, _, p in sorted(found)]
