"""The forward-cost curve of the records' hardware (``bench/forward_cost.py``, stored as
``<results folder>/cost/<hardware-slug>--<target>.json``): what one target forward costs against its rows, the curve
the main table's Ideal column uses, and what it says about SpS's verify cost across γ."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import pandas as pd

from specbench.analysis.cost_model import CHAIN, TREE, CostCurve, cost_model, load_curve
from specbench.analysis.report.names import VANILLA, Block, block_label
from specbench.analysis.report.records import ResultFile, files_by_block
from specbench.analysis.report.table import DASH, Cell, Table

COST_DIR = "cost"  # beside the result files: results/cost/<hardware-slug>--<target>.json
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


def _gamma(f: ResultFile, label: str) -> int | None:
    options = (f.meta.get("method_options") or {}).get(label) or {}
    try:
        return int(options["gamma"])
    except (KeyError, TypeError, ValueError):
        return None


def sps_gamma_note(files: Sequence[ResultFile], curve: CostCurve) -> str | None:
    """SpS's verify cost in one-row steps per γ, from the run (verify seconds per call / vanilla's step) beside
    the curve's t(γ+1)/t(1), and what the curve says about a cost that is not monotone in γ."""
    run: dict[int, float] = {}
    for f in files:
        base = [r for r in f.records if r.method == VANILLA]
        for label, info in f.sides().items():
            gamma = _gamma(f, label)
            if info.method != "sps" or gamma is None or gamma in run:
                continue
            model = cost_model([r for r in f.records if r.method == label], base)
            if model is not None and model.step > 0:
                run[gamma] = model.verify / model.step
    if len(run) < 2:
        return None
    gammas = sorted(run)
    curve_steps = {g: curve.steps(g + 1, CHAIN) for g in gammas}
    shown = ", ".join(f"γ={g}: run {run[g]:.2f}, curve {curve_steps[g]:.2f}" for g in gammas)
    run_dips = [(a, b) for a, b in zip(gammas, gammas[1:]) if run[b] < run[a] * 0.95]
    curve_dips = [(r, s) for r, s in curve.dips(CHAIN) if gammas[0] + 1 <= r <= gammas[-1] + 1]
    text = f"SpS verify cost in one-row steps (verify forward over γ+1 rows / one-row step): {shown}. "
    if curve_dips:
        where = ", ".join(f"{r} rows cost more than {s}" for r, s in curve_dips)
        text += (f"The curve itself is not monotone here ({where}): the machine's matrix kernels cost a forward by "
                 "its row count in blocks (rows padded to the kernel's tile, another code path above a size), so "
                 "on this hardware a longer chain can verify for fewer steps; the run's non-monotone steps follow the "
                 "machine, not the method.")
    elif run_dips:
        text += ("The curve rises monotonically over these rows, so the run's dips "
                 f"({', '.join(f'γ={b} below γ={a}' for a, b in run_dips)}) are not the machine's cost: they are timing "
                 "noise of the run (load, drift between its turns); re-time it on an idle machine.")
    else:
        text += "Both rise monotonically with γ."
    return text


def cost_table(files: Sequence[ResultFile], provenance: Sequence[str] = (), root: str | Path | None = None) -> Table | None:
    """The curve per block (seconds and one-row steps at a few row counts, chain and tree), with its dips and
    the SpS note; None when no curve was measured for the records' hardware."""
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
        if (note := sps_gamma_note(by_block.get(block, []), curve)) is not None:
            notes.append(f"{block_label(block)}: {note}")
    notes.insert(0, "The target's forward over N rows after a prefix, measured apart from the runs "
                    "(bench/forward_cost.py, median of its repeats); steps = t(N) / t(1). The main table's Ideal uses "
                    "this curve for the target's forwards when it exists for the records' hardware, target and dtype "
                    "(chains on the chain curve, trees on the masked tree curve), and the run's own forward times "
                    "otherwise; source: " + ", ".join(sorted({c.source for c in curves.values()})))
    return Table("cost_table", "Forward cost against rows on this hardware", columns, [], sections,
                 pd.DataFrame(frames), notes, list(provenance))
