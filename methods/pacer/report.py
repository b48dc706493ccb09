"""PACER's own report table (registered under ``specbench.report_tables`` in pyproject.toml): how
often each draft length γ was chosen, from the ``gamma_hist`` the drafter leaves in each record's
``extra``. A stopping rule that always stops at the same block is a fixed γ with an extra forward,
so this table shows whether the pre-verifier adapts at all."""

from __future__ import annotations

from collections import Counter
from typing import Mapping, Sequence

import pandas as pd

from specbench.records import GenerationRecord
from specbench.analysis.report.names import Block
from specbench.analysis.report.table import Cell, Table, block_label

SHOWN_SHARE = 0.005  # lengths chosen on fewer calls than this are counted, not listed


def gamma_histogram_table(blocks: Mapping[Block, list[GenerationRecord]],
                          provenance: Sequence[str] = ()) -> Table | None:
    """Per PACER side: verify calls, mean γ, how many lengths it used (any / on ≥ 1% of calls), and the
    share of calls at each length."""
    sections, records = [], []
    for block, recs in sorted(blocks.items()):
        by_method: dict[str, Counter] = {}
        for r in recs:
            if "gamma_hist" in r.extra:
                by_method.setdefault(r.method, Counter()).update(
                    {int(gamma): int(n) for gamma, n in r.extra["gamma_hist"].items() if int(n) > 0})
        rows = []
        for method, hist in sorted(by_method.items()):
            calls = sum(hist.values())
            if not calls:
                continue
            shares = {gamma: n / calls for gamma, n in sorted(hist.items())}
            mean = sum(gamma * n for gamma, n in hist.items()) / calls
            common = sum(share >= 0.01 for share in shares.values())
            listed = ", ".join(f"{gamma}: {100 * share:.1f}%" for gamma, share in shares.items() if share >= SHOWN_SHARE)
            rows.append([Cell(method), Cell(f"{calls}"), Cell(f"{mean:.2f}"), Cell(f"{len(shares)} / {common}"),
                         Cell(listed)])
            records += [dict(target=block[0], temperature=f"{block[1]:g}", method=method, gamma=gamma,
                             calls=hist[gamma], share=share) for gamma, share in shares.items()]
        if rows:
            sections.append((block_label(block), rows))
    if not sections:
        return None
    notes = ["γ = drafts verified in one call; Lengths = distinct γ chosen / those on ≥ 1% of calls; "
             f"Share lists every γ chosen on ≥ {SHOWN_SHARE:.1%} of calls",
             "the issue's goal for the shipped pre-verifier: a histogram spread over ≥ 3 lengths"]
    return Table("pacer_gamma_table", "PACER: draft length γ chosen per verify call",
                 ["Method", "Calls", "Mean γ", "Lengths", "Share of calls by γ"], [("", 5)], sections,
                 pd.DataFrame(records), notes, list(provenance), align="lrrrl")
