"""SpecBlock's own report table (registered under ``specbench.report_tables`` in pyproject.toml):
the rank head's bucket frequency and classification quality (paper Table 3) from the confusion
counts the drafter leaves in each record's ``extra``."""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np
import pandas as pd

from specbench.records import GenerationRecord
from specbench.analysis.report.names import Block
from specbench.analysis.report.table import DASH, Cell, Table, block_label, finite, fmt_pct

RANK_BUCKETS = ("b0 (rank 1)", "b1 (2–4)", "b2 (5–10)", "b3 (>10)")


def rank_head_table(blocks: Mapping[Block, list[GenerationRecord]], provenance: Sequence[str] = ()) -> Table | None:
    """SpecBlock Table 3 from decoding: per bucket, the share of valid-prefix block-1 slots whose
    target token fell in it, and the rank head's precision / recall / F1 there (records whose
    ``extra`` carries ``rank_confusion`` [true][predicted])."""
    sections, records = [], []
    for block, recs in sorted(blocks.items()):
        by_method: dict[str, np.ndarray] = {}
        for r in recs:
            if "rank_confusion" in r.extra:
                by_method.setdefault(r.method, np.zeros((4, 4)))
                by_method[r.method] += np.asarray(r.extra["rank_confusion"], dtype=float)
        rows = []
        for method, conf in sorted(by_method.items()):
            total = conf.sum()
            for c, name in enumerate(RANK_BUCKETS):
                true, pred, hit = conf[c].sum(), conf[:, c].sum(), conf[c, c]
                precision = hit / pred if pred else math.nan
                recall = hit / true if true else math.nan
                f1 = 2 * precision * recall / (precision + recall) if precision + recall > 0 else math.nan
                freq = true / total if total else math.nan
                rows.append([Cell(method if c == 0 else ""), Cell(name), Cell(fmt_pct(freq)),
                             Cell(f"{precision:.3f}" if finite(precision) else DASH),
                             Cell(f"{recall:.3f}" if finite(recall) else DASH),
                             Cell(f"{f1:.3f}" if finite(f1) else DASH), Cell(f"{int(true)}")])
                records.append(dict(target=block[0], temperature=f"{block[1]:g}", method=method, bucket=c,
                                    frequency=freq, precision=precision, recall=recall, f1=f1, positions=int(true)))
        if rows:
            sections.append((block_label(block), rows))
    if not sections:
        return None
    notes = ["positions: block-1 slots whose greedy prefix the target accepted (the valid-prefix positions); "
             "true bucket = rank of the committed token in that slot's draft distribution"]
    return Table("rank_head_table", "Rank head: bucket frequency and classification quality (SpecBlock Table 3)",
                 ["Method", "Bucket", "Freq", "Precision", "Recall", "F1", "Positions"], [("", 7)], sections,
                 pd.DataFrame(records), notes, list(provenance), align="llrrrrr")
