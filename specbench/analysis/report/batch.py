"""Speculation under load: the files decoded through the batched loop (``--batch-size B``, a sweep
``--batch-size 1,2,4,8,16``; engine/batch_loop.py) -> per (block, bench, method, B): speedup over vanilla
decoded in the same batches at the same B, with its bootstrap interval over prompts, throughput, request
latency, τ, T_D% and the ideal; the crossover B per method; the tables and the speedup-vs-B figure's data.

Every number comes from ``specbench.metrics`` (batch_throughput, request_latency) and the report's own
bootstrap (stats.speedup_ci). A file holds one B (a sweep writes one per B); method and vanilla pair inside
their file, so prompt ids are prefixed with the file name, as ``records.block_records`` does, and batch
groups with it too (each file's batch clock is its own). These files stay out of the other tables: a
request's time under load is another quantity than a request's time alone."""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

import pandas as pd

from specbench import divergence, metrics
from specbench.analysis.cost_model import CostCurve, ideal_with_source
from specbench.analysis.report.names import VANILLA, Block, bench_key, bench_label, block_label
from specbench.analysis.report.records import ResultFile
from specbench.analysis.report.stats import BOOTSTRAP_REPS, BOOTSTRAP_SEED, speedup_ci
from specbench.analysis.report.table import DASH, Cell, Table, finite, fmt_ci, fmt_pct, fmt_spd, fmt_tau, fmt_tps
from specbench.records import GenerationRecord

BATCH_COLUMNS = ["target", "temperature", "bench", "method", "batch_size", "n_prompts", "speedup", "speedup_lo",
                 "speedup_hi", "throughput_ratio", "throughput", "latency_mean", "latency_p50", "latency_p90", "tau",
                 "td_percent", "ideal", "ideal_source", "batched_drafting", "divergence"]


def is_batched(f: ResultFile) -> bool:
    """A file decoded through the batched loop (its header says so, or its records carry their batch)."""
    return f.meta.get("loop") == "batched" or any(r.batch for r in f.records)


def split_batched(files: Sequence[ResultFile]) -> tuple[list[ResultFile], list[ResultFile]]:
    """(files decoded one request at a time, files decoded through the batched loop)."""
    return [f for f in files if not is_batched(f)], [f for f in files if is_batched(f)]


def _apart(f: ResultFile) -> list[GenerationRecord]:
    """A file's batched records with its name on their prompt ids and batch groups (pairs and makespans stay
    inside the file)."""
    return [dataclasses.replace(r, prompt_id=f"{f.path.name}:{r.prompt_id}",
                                batch={**r.batch, "group": f"{f.path.name}:{r.batch['group']}"})
            for r in f.records if r.batch]


def batch_records(files: Sequence[ResultFile]) -> dict[tuple[Block, str, int], list[GenerationRecord]]:
    """Batched records per (block, bench, B), every file's kept apart (``_apart``)."""
    out: dict[tuple[Block, str, int], list[GenerationRecord]] = {}
    for f in files:
        for r in _apart(f):
            out.setdefault((f.block, r.bench, int(r.batch["size"])), []).append(r)
    return out


def crossover(intervals: Mapping[int, tuple[float, float]]) -> int | None:
    """The smallest B whose speedup interval lies entirely below 1 (speculation then costs time at that
    load), or None when no measured B's does."""
    below = [b for b, (lo, hi) in intervals.items() if finite(lo) and finite(hi) and hi < 1]
    return min(below) if below else None


def fmt_crossover(b: int | None, largest: int) -> str:
    return f"none ≤ {largest}" if b is None else str(b)


def batch_frame(files: Sequence[ResultFile], curves: Mapping[Block, CostCurve] | None = None,
                reps: int = BOOTSTRAP_REPS, seed: int = BOOTSTRAP_SEED) -> pd.DataFrame:
    """One row per (block, bench, method, B) of the batched files (vanilla's own rows carry throughput and
    latency, no speedup). The ideal prices the target's forwards by the block's curve at that B where it was
    measured (``CostCurve.at_batch``), else by the run's own batched forwards."""
    rows = []
    curves = curves or {}
    for (block, bench, size), recs in sorted(batch_records(files).items(), key=lambda kv: (kv[0][0],
                                                                                          bench_key(kv[0][1]), kv[0][2])):
        base = [r for r in recs if r.method == VANILLA]
        base_thr = metrics.batch_throughput(base)
        curve = curves[block].at_batch(size) if block in curves else None
        for method in sorted({r.method for r in recs}, key=lambda m: (m != VANILLA, m)):
            ours = [r for r in recs if r.method == method]
            latency = metrics.request_latency(ours)
            thr = metrics.batch_throughput(ours)
            row = dict(target=block[0], temperature=block[1], bench=bench, method=method, batch_size=size,
                       n_prompts=len({r.prompt_id for r in ours}), throughput=thr, latency_mean=latency["mean"],
                       latency_p50=latency["p50"], latency_p90=latency["p90"], tau=metrics.tau(ours),
                       td_percent=100 * metrics.draft_share(ours), speedup=math.nan, speedup_lo=math.nan,
                       speedup_hi=math.nan, throughput_ratio=math.nan, ideal=math.nan, ideal_source="",
                       batched_drafting=all(r.batch.get("batched_drafting", False) for r in ours),
                       divergence=divergence.summary(r.divergence for r in ours) if any(r.divergence for r in ours)
                       else "")
            if method != VANILLA and base:
                lo, hi = speedup_ci(ours, base, reps=reps, seed=seed)
                ideal, _, source = ideal_with_source(ours, base, curve)
                row.update(speedup=metrics.speedup(ours, base), speedup_lo=lo, speedup_hi=hi,
                           throughput_ratio=thr / base_thr if base_thr > 0 else math.nan, ideal=ideal,
                           ideal_source=source)
            rows.append(row)
    return pd.DataFrame(rows, columns=BATCH_COLUMNS)


def _sections(frame: pd.DataFrame):
    for (target, temperature, bench), part in frame.groupby(["target", "temperature", "bench"], sort=False):
        yield f"{block_label((target, temperature))} · {bench_label(bench)}", part


def batch_table(frame: pd.DataFrame, provenance: Sequence[str] = ()) -> Table | None:
    """Methods as rows, B as columns: speedup over vanilla at the same B [95% interval], and the crossover B.
    None without batched records."""
    if frame.empty:
        return None
    sizes = sorted(frame.batch_size.unique())
    columns = ["Method", *(f"B={b}" for b in sizes), "Crossover B"]
    sections = []
    for label, part in _sections(frame):
        rows = []
        for method, mine in part[part.method != VANILLA].groupby("method", sort=True):
            by_b = {int(r.batch_size): r for r in mine.itertuples()}
            cells = [Cell(method)]
            for b in sizes:
                r = by_b.get(b)
                point = DASH if r is None else fmt_spd(r.speedup)
                cells.append(Cell(DASH if r is None else fmt_ci(point, r.speedup_lo, r.speedup_hi, fmt_spd), short=point))
            intervals = {b: (r.speedup_lo, r.speedup_hi) for b, r in by_b.items()}
            known = any(finite(lo) and finite(hi) for lo, hi in intervals.values())  # none: a preview without bootstrap
            cells.append(Cell(fmt_crossover(crossover(intervals), max(by_b)) if known else DASH))
            rows.append(cells)
        if rows:
            sections.append((label, rows))
    if not sections:
        return None
    notes = ["Speedup of each method over vanilla decoded through the same batched loop at the same B, in the same "
             "file (its sides interleaved batch by batch): pooled tokens over the time each request was "
             "active (every step it shared is charged to it in full), end to end, with its 95% bootstrap interval "
             "over prompts.",
             "Crossover B: the smallest B whose interval lies entirely below 1.00× (speculation costs time at that "
             "load); 'none ≤ B' when no measured B's does. The detail table (batch_detail) has throughput, "
             "latency, τ, T_D% and the ideal per B."]
    return Table("batch_table", "Speedup under load: methods against B", columns, [], sections, frame, notes,
                 list(provenance))


def batch_detail_table(frame: pd.DataFrame, provenance: Sequence[str] = ()) -> Table | None:
    """Per method and B: throughput (tokens/s over all requests of the batches), request latency (mean, p50,
    p90), τ, T_D%, the throughput ratio over vanilla and the ideal."""
    if frame.empty:
        return None
    columns = ["Method", "B", "n", "Spd", "Thr ratio", "tok/s", "Lat mean s", "Lat p50 s", "Lat p90 s", "τ", "T_D%",
               "Ideal", "same/near-tie/unexpl."]
    sections = []
    for label, part in _sections(frame):
        rows = []
        for r in part.assign(first=part.method != VANILLA).sort_values(["first", "method", "batch_size"]).itertuples():
            is_base = r.method == VANILLA
            rows.append([Cell(r.method + ("" if is_base or r.batched_drafting else " (forks)")),
                         Cell(str(r.batch_size)), Cell(str(r.n_prompts)),
                         Cell(DASH if is_base else fmt_ci(fmt_spd(r.speedup), r.speedup_lo, r.speedup_hi, fmt_spd),
                              short=DASH if is_base else fmt_spd(r.speedup)),
                         Cell(DASH if is_base else fmt_spd(r.throughput_ratio)), Cell(fmt_tps(r.throughput)),
                         *(Cell(DASH if not finite(v) else f"{v:.2f}") for v in (r.latency_mean, r.latency_p50,
                                                                                   r.latency_p90)),
                         Cell(DASH if is_base else fmt_tau(r.tau)), Cell(fmt_pct(r.td_percent / 100)),
                         Cell(DASH if is_base else fmt_spd(r.ideal) + ("" if r.ideal_source != "curve" else " ᶜ")),
                         Cell(r.divergence or DASH)])
        sections.append((label, rows))
    notes = ["tok/s: new tokens of all requests over the summed makespans of their batches (first prefill to last "
             "step on the batch clock); Thr ratio: the method's over vanilla's at the same B. Latency: a request's "
             "end − start on the batch clock (its prefill, every step it shared, and the prefills of requests that "
             "joined meanwhile); p50/p90 interpolate linearly.",
             "(forks): the method drafts each request with its own drafter fork; the others draft the batch at once.",
             "Ideal: τ × vanilla's batched step over the drafter's forwards plus the batched verify forward, per B: "
             "from the forward-cost curve measured at that B (ᶜ, bench/forward_cost.py --batch) where it exists, "
             "else from the run's own forward times at that B.",
             "same/near-tie/unexpl.: at T = 0, each request's text against vanilla's in the same batches "
             "(identical, parted at a near-tie, unexplained), as the divergence table counts batch-1 turns."]
    return Table("batch_detail", "Speculation under load: throughput, latency and τ per B", columns, [], sections,
                 frame, notes, list(provenance))
