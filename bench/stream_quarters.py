"""τ, speedup and update cost over a query stream, first vs last quarter, per method; for a stream
of several passes (``--passes N``) also the cumulative figures after 1, 2, ..., N passes.

    python bench/stream_quarters.py results/specblock-adapt_natural_questions_*.jsonl

Records are ordered by ``query_index``; speedup pairs each record with the vanilla record of the
same prompt turn in the same file (a query cut off before its vanilla record is left out)."""

from __future__ import annotations

import json
import sys
from collections import defaultdict

from specbench import metrics
from specbench.records import GenerationRecord


def load(path: str) -> list[GenerationRecord]:
    with open(path) as fh:
        return [GenerationRecord.from_dict(d) for d in map(json.loads, fh) if d.get("type") == "record"]


def summarise(path: str) -> None:
    records = load(path)
    base = {(r.prompt_id, r.turn): r for r in records if r.method == "vanilla"}
    by_method = defaultdict(list)
    for r in records:
        if r.method != "vanilla" and (r.prompt_id, r.turn) in base:
            by_method[r.method].append(r)
    print(f"\n{path}")
    print("| method | queries | τ all | speedup all | τ Q1 → Q4 | speedup Q1 → Q4 | T_D% | adapt % of decode | updates |")
    print("|---|---|---|---|---|---|---|---|---|")
    for method, recs in sorted(by_method.items()):
        recs.sort(key=lambda r: (r.query_index, r.turn))
        q = max(len(recs) // 4, 1)
        first, last = recs[:q], recs[-q:]

        def spd(part):
            return metrics.speedup(part, [base[(r.prompt_id, r.turn)] for r in part])

        adapt = sum(r.times.get("adapt", 0.0) for r in recs) / max(sum(r.decode_time for r in recs), 1e-9)
        updates = [r.extra.get("adapt", {}).get("update") for r in recs]
        print(f"| {method} | {len(recs)} | {metrics.tau(recs):.2f} | {spd(recs):.2f}× | "
              f"{metrics.tau(first):.2f} → {metrics.tau(last):.2f} | "
              f"{spd(first):.2f}× → {spd(last):.2f}× | {100 * metrics.draft_share(recs):.0f}% | {100 * adapt:.1f}% | "
              f"{', '.join(u for u in updates if u) or '—'} |")
    passes = max((pass_of(r) for recs in by_method.values() for r in recs), default=1)
    if passes > 1:
        print("\n| method (cumulative) | " + " | ".join(f"τ, speedup after pass {n}" for n in range(1, passes + 1)) + " |")
        print("|---" * (passes + 1) + "|")
        for method, recs in sorted(by_method.items()):
            cells = []
            for n in range(1, passes + 1):
                part = [r for r in recs if pass_of(r) <= n]
                speed = metrics.speedup(part, [base[(r.prompt_id, r.turn)] for r in part])
                cells.append(f"{metrics.tau(part):.2f}, {speed:.2f}×")
            print(f"| {method} | " + " | ".join(cells) + " |")


def pass_of(record: GenerationRecord) -> int:
    """1 for the first pass; streams tag later passes' prompt ids with ``#passN``."""
    _, sep, n = record.prompt_id.rpartition("#pass")
    return int(n) if sep and n.isdigit() else 1


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        summarise(arg)
