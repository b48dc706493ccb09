"""Both engines side by side: each method's speedup over vanilla with the eager engine and with the compiled one
(``--engine compiled``), measured on the same machine, target and bench, and which verdicts change.

A compiled file's block is its target's with " · compiled engine" (records.apart_dtypes); a method's cell in it is
paired with its cell in the same block without that suffix. A verdict is the speedup's 95% interval against 1:
*faster* (above), *slower* (below), *tie* (it holds 1). A slow baseline flatters every drafter; the compiled
engine's vanilla is the fast one, so a verdict that changes is one the eager engine's numbers overstate or hide.
"""

from __future__ import annotations

import math
from typing import Sequence

import pandas as pd

from specbench.analysis.report.names import bench_key, block_label
from specbench.analysis.report.table import Cell, Table, fmt_ci, fmt_spd, fmt_tps

COMPILED = " · compiled engine"
COLUMNS = ["Method", "Bench", "n", "Spd eager [95% CI]", "Spd compiled [95% CI]", "vanilla tok/s eager",
           "vanilla tok/s compiled", "Verdict eager", "Verdict compiled"]


def verdict(lo: float, hi: float) -> str:
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return "—"
    return "faster" if lo > 1 else "slower" if hi < 1 else "tie"


def engine_pairs(cells: pd.DataFrame) -> pd.DataFrame:
    """Cells of compiled-engine blocks joined to their eager twins (same target, dtype, temperature, method,
    bench); columns of the eager cell suffixed _eager, of the compiled one _compiled."""
    ran = cells[cells.n_prompts > 0]
    compiled = ran[ran.target.str.endswith(COMPILED)].assign(target=lambda d: d.target.str.removesuffix(COMPILED))
    eager = ran[~ran.target.str.endswith(COMPILED)]
    return eager.merge(compiled, on=["target", "temperature", "method", "bench"], suffixes=("_eager", "_compiled"))


def engine_table(cells: pd.DataFrame, provenance: Sequence[str] = ()) -> Table | None:
    """Per method and bench, the speedup in each engine with its interval and verdict; None without a pair."""
    pairs = engine_pairs(cells)
    if pairs.empty:
        return None
    sections, changed = [], []
    for (target, temp), block in pairs.groupby(["target", "temperature"], sort=True):
        rows = []
        for r in sorted(block.itertuples(), key=lambda r: (r.method, bench_key(r.bench))):
            before = verdict(r.speedup_lo_eager, r.speedup_hi_eager)
            after = verdict(r.speedup_lo_compiled, r.speedup_hi_compiled)
            if before != after:
                changed.append(f"{r.method} × {r.bench}: {before} eager, {after} compiled")
            rows.append([Cell(r.method), Cell(r.bench), Cell(f"{r.n_prompts_eager}/{r.n_prompts_compiled}"),
                         Cell(fmt_ci(fmt_spd(r.speedup_eager), r.speedup_lo_eager, r.speedup_hi_eager, fmt_spd)),
                         Cell(fmt_ci(fmt_spd(r.speedup_compiled), r.speedup_lo_compiled, r.speedup_hi_compiled,
                                     fmt_spd)),
                         Cell(fmt_tps(r.vanilla_tokens_per_s_eager)), Cell(fmt_tps(r.vanilla_tokens_per_s_compiled)),
                         Cell(before), Cell(after)])
        sections.append((block_label((target, temp)), rows))
    notes = ["verdict: the speedup's 95% interval above 1 (faster), below 1 (slower), or holding 1 (tie); "
             "n: prompts eager/compiled",
             ("verdicts that change with the engine: " + "; ".join(changed)) if changed else
             "no verdict changes with the engine"]
    data = pairs[["target", "temperature", "method", "bench", "n_prompts_eager", "n_prompts_compiled",
                  "speedup_eager", "speedup_lo_eager", "speedup_hi_eager", "speedup_compiled", "speedup_lo_compiled",
                  "speedup_hi_compiled", "vanilla_tokens_per_s_eager", "vanilla_tokens_per_s_compiled"]]
    data = data.sort_values(["target", "temperature", "method", "bench"]).reset_index(drop=True)
    return Table("engine_table", "Speedup with the eager and the compiled engine, side by side", COLUMNS, [], sections,
                 data, notes, list(provenance), align="ll" + "r" * 7)
