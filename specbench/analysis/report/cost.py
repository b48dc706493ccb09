"""The forward-cost curve of the records' hardware (``bench/forward_cost.py``, stored as
``<results folder>/cost/<hardware-slug>--<target>.json``): what one target forward costs against its rows, the curve
the main table's Ideal column uses, and the notes methods add under it: functions
``note(files, curve) -> str | None`` registered under the entry-point group ``specbench.cost_notes``
(pyproject.toml), called per (target, temperature) block with its result files and its curve."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import pandas as pd

from specbench.analysis.cost_model import CHAIN, TREE, CostCurve, load_curve
from specbench.analysis.report.method_tables import plugin_functions
from specbench.analysis.report.names import Block, block_label
from specbench.analysis.report.records import ResultFile, files_by_block
from specbench.analysis.report.table import DASH, Cell, Table

COST_DIR = "cost"  # beside the result files: results/cost/<hardware-slug>--<target>.json
NOTES_GROUP = "specbench.cost_notes"
SHOWN_ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 17, 24, 32, 33, 48, 64)


def cost_root(files: Sequence[ResultFile]) -> Path:
    """Where the curves live: ``cost/`` beside the first result file."""
    return (files[0].path.parent if files else Path("results")) / COST_DIR


def block_curves(files: Sequence[ResultFile], root: str | Path | None = None) -> dict[Block, CostCurve]:
    """The measured curve of each block's hardware and dtype (blocks whose files disagree on either: none)."""
    root = Path(root) if root is not None else cost_root(files)
    out = {}
    for block, group in files_by_block(files).items():
        hardware = {str(f.meta.get("hardware")) for f in group}
        dtypes = {str(f.meta.get("dtype")) for f in group}
        if len(hardware) == 1 and len(dtypes) == 1:
            curve = load_curve(root, hardware.pop(), dtypes.pop(), str(group[0].meta.get("target", block[0])))
            if curve is not None:
                out[block] = curve
    return out


def cost_notes(files: Sequence[ResultFile], curve: CostCurve) -> list[str]:
    """What the methods registered under ``specbench.cost_notes`` say about this block's files beside its curve."""
    notes = [note(files, curve) for note in plugin_functions(NOTES_GROUP, "cost note").values()]
    return [n for n in notes if n is not None]


def cost_table(files: Sequence[ResultFile], provenance: Sequence[str] = (), root: str | Path | None = None) -> Table | None:
    """The curve per block (seconds and one-row steps at a few row counts, chain and tree), with its dips and
    the notes methods add; None when no curve was measured for the records' hardware."""
    curves = block_curves(files, root)
    if not curves:
        return None
    columns = ["Rows", "chain ms", "chain steps", "tree ms", "tree steps"]
    sections, frames, notes = [], [], []
    by_block = files_by_block(files)
    for block, curve in sorted(curves.items()):
        rows = []
        measured = sorted({r for kind in curve.seconds.values() for r in kind})
        for r in [x for x in SHOWN_ROWS if x in measured] or measured:
            cells = [Cell(str(r))]
            for kind in (CHAIN, TREE):
                t = curve.seconds.get(kind, {}).get(r)
                cells += [Cell(DASH if t is None else f"{1e3 * t:.2f}"),
                          Cell(DASH if t is None else f"{curve.steps(r, kind):.2f}")]
                frames.append(dict(block=block_label(block), hardware=curve.hardware, dtype=curve.dtype, kind=kind,
                                   rows=r, seconds=math.nan if t is None else t))
            rows.append(cells)
        sections.append((f"{block_label(block)} · {curve.dtype} · {curve.hardware}", rows))
        dips = curve.dips(CHAIN)
        if dips:
            notes.append(f"{block_label(block)}: not monotone in rows (chain): "
                         + ", ".join(f"{r} rows cost more than {s}" for r, s in dips))
        notes += [f"{block_label(block)}: {note}" for note in cost_notes(by_block.get(block, []), curve)]
    notes.insert(0, "The target's forward over N rows after a prefix, measured apart from the runs "
                    "(bench/forward_cost.py, median of its repeats); steps = t(N) / t(1). The main table's Ideal uses "
                    "this curve for the target's forwards when it exists for the records' hardware, target and dtype "
                    "(chains on the chain curve, trees on the masked tree curve), and the run's own forward times "
                    "otherwise; source: " + ", ".join(sorted({c.source for c in curves.values()})))
    return Table("cost_table", "Forward cost against rows on this hardware", columns, [], sections,
                 pd.DataFrame(frames), notes, list(provenance))
