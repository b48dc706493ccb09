"""Tables against the papers: ours beside the numbers the papers printed (CSV files that method
packages declare under ``specbench.paper_numbers``), and the
paper's own metric for runs made by a paper preset.

A printed method name joins our sides through the CSV's ``specbench_method`` column where it names
a registered method (aliases such as a paper's name for a baseline), else through the label a method
class declares (``Drafter.label``, recorded in the results header), else as a registered name would
spell it (``names.normalise_method``)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Mapping, Sequence

import numpy as np
import pandas as pd

from specbench import metrics
from specbench.errors import SpecbenchError
from specbench.analysis.report.names import (MEAN, VANILLA, Block, MethodInfo, sweep_points, bench_label, block_label, normalise_bench,
                                    normalise_method)
from specbench.analysis.report.records import ResultFile
from specbench.analysis.report.table import DASH, Cell, Table, fmt_pct, fmt_spd, fmt_tau
from specbench.analysis.report.tables import provenance_lines
from specbench.data.plugin_files import declared_paths

PAPER_NUMBERS_GROUP = "specbench.paper_numbers"  # entry points naming CSV files of the papers' printed numbers
DEFAULT_PAPER_NUMBERS = "declared"  # build_report's default: every CSV a method package declares in that group


def declared_paper_numbers() -> list[Path]:
    """The CSV files of papers' numbers that installed method packages declare (group ``specbench.paper_numbers``)."""
    return declared_paths(PAPER_NUMBERS_GROUP)


def paper_files(spec: str | Path | Sequence[str | Path] | None) -> list[Path]:
    """The existing CSV files ``spec`` names: None = none, DEFAULT_PAPER_NUMBERS = the declared ones."""
    if spec is None:
        return []
    paths = declared_paper_numbers() if spec == DEFAULT_PAPER_NUMBERS else \
        [spec] if isinstance(spec, (str, Path)) else list(spec)
    return [Path(p) for p in paths if Path(p).is_file()]


def load_paper_numbers(path: str | Path | Sequence[str | Path] = DEFAULT_PAPER_NUMBERS,
                       known: Iterable[MethodInfo] = ()) -> pd.DataFrame:
    """The papers' printed numbers (one CSV, several, or the declared ones), kept as text (exactly as
    printed), plus normalised join keys:
    ``method_key`` from the CSV's ``specbench_method``, else a ``known`` method whose label is the printed
    name (case aside), else the printed name normalised."""
    frames = [pd.read_csv(p, dtype=str, keep_default_na=False) for p in paper_files(path)]
    if not frames:
        raise SpecbenchError(f"no paper numbers found at {path}; pass a CSV file of the papers' numbers")
    df = pd.concat(frames, ignore_index=True)
    by_label = {info.label.strip().lower(): info.method for info in known}
    alias = df.specbench_method if "specbench_method" in df else pd.Series("", index=df.index)
    keys = [a.strip() or by_label.get(m.strip().lower()) or normalise_method(m) for a, m in zip(alias, df.method)]
    return df.assign(bench_key=df.bench.map(normalise_bench), method_key=keys)


def attention_variants(files: Sequence[ResultFile]) -> dict[str, tuple[str, str]]:
    """Side label -> (its base label, attention implementation) for sides a paper preset ran again under
    another attention implementation (``dflash-fa2`` beside ``dflash``), so the report can take the faster of
    the two as the method's row, as papers that run both report the faster. The base is the SDPA side of the
    same preset and setting with the same method and options (from the headers, not the labels)."""
    def key(f: ResultFile, info) -> tuple:
        return f.meta.get("preset"), f.block, info.method, info.given

    def attention(f: ResultFile) -> str:
        return str(f.meta.get("attn_implementation") or "sdpa")

    def sides(f: ResultFile):
        return [(label, info) for label, info in f.sides().items() if info.method != VANILLA]

    base = {key(f, info): label for f in files if attention(f) == "sdpa" for label, info in sides(f)}
    return {label: (base[key(f, info)], attention(f)) for f in files if attention(f) != "sdpa"
            for label, info in sides(f) if base.get(key(f, info), label) != label}


def faster_attention(cells: pd.DataFrame, variants: dict[str, tuple[str, str]]) -> tuple[pd.DataFrame, list[str]]:
    """Of a side run under several attention implementations, only the faster per bench (more tokens/s),
    joined under the base label's ``key``; and a note per choice saying which ran faster."""
    if not variants or cells.empty:
        return cells, []
    cells = cells.assign(key=cells.key.map(lambda k: variants.get(k, (k, ""))[0]))
    bases = {base for base, _ in variants.values()}
    has = cells.key.isin(bases)
    ranked = cells[has].sort_values(["key", "bench", "tokens_per_s", "method"], ascending=[True, True, False, True])
    notes = []
    for (key, bench), group in ranked.groupby(["key", "bench"], sort=True):
        if len(group) > 1:
            shown = ", ".join(f"{r.method} {r.tokens_per_s:.1f}" for r in group.itertuples())
            notes.append(f"{key} × {bench}: the faster attention implementation is the {group.method.iloc[0]} side "
                         f"(tokens/s: {shown}); that side is the {key} row, as the paper reports the faster")
    return pd.concat([cells[~has], ranked.groupby(["key", "bench"], sort=True).head(1)]), notes


def paper_comparison_table(cells: pd.DataFrame, methods: pd.DataFrame, papers: pd.DataFrame,
                           files: Sequence[ResultFile], provenance: Sequence[str] = (),
                           sides: Mapping[Block, Mapping[str, MethodInfo]] | None = None) -> Table:
    """Ours vs paper where method and bench match. The points of a budget sweep (``sides``: each block's
    MethodInfo per label) match the paper's method under their stem."""
    columns = ["Method", "Bench", "Spd", "τ", "T_D%", "Source", "Model", "Hardware", "T", "Spd", "τ", "T_D%"]
    groups = [("", 2), ("ours", 3), ("paper", 7)]
    td = methods.set_index(["target", "temperature", "method"])["td"]
    hardware = {f.block: f.meta.get("hardware", "?") for f in files if f.records}
    paper_td = {(r.paper, r.table, r.model, r.temperature, r.method_key): r.td_percent
                for r in papers[papers.bench_key == MEAN].itertuples() if r.td_percent}
    ran = cells[cells.n_prompts > 0]
    variants = attention_variants(files)
    sections, records, attn_notes = [], [], []
    for (target, temp), block in ran.groupby(["target", "temperature"], sort=True):
        rows = []
        chosen, why = faster_attention(best_of_sweeps(block, sweep_points((sides or {}).get((target, temp), {}))),
                                       variants)
        attn_notes += [f"{note} ({block_label((target, temp))})" for note in why]
        for r in chosen.sort_values(["method", "bench"]).itertuples():
            hits = papers[(papers.method_key == r.key) & (papers.bench_key == r.bench)]
            same_t = np.array([t == "" or float(t) == temp for t in hits.temperature], dtype=bool)  # "": unstated
            hits = hits[same_t]
            for p in hits.sort_values(["paper", "table", "model", "temperature"]).itertuples():
                p_td = paper_td.get((p.paper, p.table, p.model, p.temperature, p.method_key), "")
                ours_td = td[(target, temp, r.method)]
                rows.append([Cell(r.method), Cell(r.bench), Cell(fmt_spd(r.speedup)), Cell(fmt_tau(r.tau)),
                             Cell(fmt_pct(ours_td)), Cell(_source(p.paper, p.table)), Cell(p.model), Cell(p.hardware),
                             Cell(p.temperature or "?"), Cell(f"{p.speedup}×" if p.speedup else DASH),
                             Cell(p.tau or DASH), Cell(f"{p_td}%" if p_td else DASH)])
                records.append(dict(target=target, temperature=f"{temp:g}", method=r.method, bench=r.bench,
                                    hardware=hardware.get((target, temp), "?"), speedup=r.speedup, tau=r.tau,
                                    td_percent=100 * ours_td, paper=p.paper, paper_table=p.table,
                                    paper_model=p.model, paper_hardware=p.hardware,
                                    paper_temperature=p.temperature, paper_method=p.method,
                                    paper_speedup=p.speedup, paper_tau=p.tau, paper_td_percent=p_td))
        if rows:
            label = f"{block_label((target, temp))} on {hardware.get((target, temp), '?')}"
            sections.append((label, rows))
    notes = ["Models and hardware differ: our rows ran the target and hardware named in each section; the "
             "papers' rows are their own models on their own GPUs. Compare orderings and trade-offs, not absolute "
             "values.",
             "Paper numbers are copied as printed into the CSV files method packages ship (see their notes column); "
             "a paper T_D% is its per-method share, printed once per row; T ? = the paper does not state it."]
    if not records:
        notes.insert(0, "No method and benchmark of ours appears in the papers' tables.")
    notes.append("A budget sweep (x@budget=B) is compared at its best-speedup budget per benchmark, as the "
                 "papers that sweep it report each cell at its best node budget.")
    notes += attn_notes
    return Table("paper_comparison", "Ours vs published numbers (same method and benchmark)", columns, groups,
                 sections, pd.DataFrame(records), notes, list(provenance), align="llrrrllllrrr")


def _source(paper: str, table: str) -> str:
    return f"{paper} Table {table}" if table.isdigit() else f"{paper} {table}"


def best_of_sweeps(cells: pd.DataFrame, points: Mapping[str, tuple[str, int]]) -> pd.DataFrame:
    """Other labels as they are; of each budget sweep (``points``: label -> (stem, budget), names.sweep_points)
    only the best-speedup label per bench. Adds the join column ``key`` (the stem for a sweep's point, the
    label otherwise)."""
    cells = cells.assign(key=cells.method.map(lambda m: points[m][0] if m in points else m))
    sweep = cells.method.isin(points)
    best = (cells[sweep].sort_values(["key", "bench", "speedup", "method"], ascending=[True, True, False, True])
            .groupby(["key", "bench"], sort=True).head(1))
    return pd.concat([cells[~sweep], best])


# ------------------------------------------------------------------------------- paper metrics (presets)

PAPER_METRIC_LABELS = {
    "end_to_end_speedup": "end-to-end tokens/s ratio, pooled; τ pooled",
    "faster_baseline_tpot_speedup": "decode-only mean time/token vs the faster vanilla; τ per response (macro)",
    "spec_bench_speedup": "Spec-Bench speed.py: mean per-question tokens/s ratio; MAT pooled",
}


def paper_metric_cells(files: Sequence[ResultFile]) -> pd.DataFrame:
    """For runs made by a paper preset (header ``preset``): each method's speedup and τ computed the way
    that paper computes them, beside our headline (end-to-end pooled speedup, pooled τ). Vanilla runs
    are told apart by the header's attention implementation (DDTree takes the faster one)."""
    from specbench.data.preset_files import load_preset  # presets load lazily: only runs made by one need them

    groups: dict[tuple, dict[str, list]] = {}
    for f in files:
        preset = f.meta.get("preset")
        if not preset or not f.records:
            continue
        attn = str(f.meta.get("attn_implementation", "sdpa"))
        for r in f.records:
            g = groups.setdefault((preset, *f.block, r.bench), {"methods": {}, "baselines": {}})
            if r.method == VANILLA:
                g["baselines"].setdefault(attn, []).append(r)
            else:
                g["methods"].setdefault(r.method, []).append(r)
    rows: list[dict] = []
    for (preset, target, temp, bench), g in sorted(groups.items()):
        try:
            metric = load_preset(preset)["metric"]["name"]
        except SpecbenchError:
            metric = "unknown preset"
        sdpa = g["baselines"].get("sdpa") or next(iter(g["baselines"].values()), [])
        for method, recs in sorted(g["methods"].items()):
            used = "sdpa" if "sdpa" in g["baselines"] else next(iter(g["baselines"]), "")
            if metric == "faster_baseline_tpot_speedup":
                spd, used = metrics.faster_baseline_tpot_speedup(recs, g["baselines"])
                tau = metrics.tau_macro(recs)
                if len(g["baselines"]) < 2:
                    used += " (only baseline run)"
            elif metric == "spec_bench_speedup":
                spd, tau = metrics.spec_bench_speedup(recs, sdpa), metrics.tau(recs)
            else:
                spd, tau = metrics.speedup(recs, sdpa), metrics.tau(recs)
            rows.append(dict(preset=preset, target=target, temperature=temp, bench=bench, method=method,
                             metric=metric, paper_speedup=spd, paper_tau=tau, speedup=metrics.speedup(recs, sdpa),
                             tau=metrics.tau(recs), baseline=used, n_turns=len(recs), side=method, other_sides=""))
    return _faster_side_rows(pd.DataFrame(rows), attention_variants(files))


def _faster_side_rows(cells: pd.DataFrame, variants: dict[str, tuple[str, str]]) -> pd.DataFrame:
    """A method run under several attention implementations (dflash and dflash-fa2) is one row, its faster
    side's: the one with the higher paper speedup, which for every paper metric here is measured against the
    same baseline for both sides, so higher means faster. ``side`` names the side taken, ``other_sides``
    the ones left with their speedups."""
    if cells.empty or not variants:
        return cells
    cells = cells.assign(method=cells.method.map(lambda m: variants.get(m, (m, ""))[0]))
    keys = ["preset", "target", "temperature", "bench", "method"]
    out = []
    for _, group in cells.groupby(keys, sort=True):
        group = group.sort_values(["paper_speedup", "side"], ascending=[False, True], na_position="last")
        best = group.iloc[0].copy()
        best["other_sides"] = "; ".join(f"{r.side} {fmt_spd(r.paper_speedup)}" for r in group.iloc[1:].itertuples())
        out.append(best)
    return pd.DataFrame(out).reset_index(drop=True)


def paper_metric_table(files: Sequence[ResultFile]) -> Table | None:
    """The 'paper metric' table: one section per preset, target and temperature; None without preset runs."""
    cells = paper_metric_cells(files)
    if cells.empty:
        return None
    columns = ["Bench", "Method", "Turns", "Spd", "τ", "Spd", "τ", "Baseline"]
    groups = [("", 3), ("paper's metric", 2), ("ours", 2), ("", 1)]
    sections = []
    for (preset, target, temp), block in cells.groupby(["preset", "target", "temperature"], sort=True):
        rows = [[Cell(bench_label(r.bench)), Cell(r.method if r.side == r.method else f"{r.method} ({r.side})"),
                 Cell(str(r.n_turns)), Cell(fmt_spd(r.paper_speedup)),
                 Cell(fmt_tau(r.paper_tau)), Cell(fmt_spd(r.speedup)), Cell(fmt_tau(r.tau)), Cell(r.baseline or DASH)]
                for r in block.sort_values(["bench", "method"], key=lambda s: s.map(str)).itertuples()]
        metric = block.metric.iloc[0]
        sections.append((f"{preset}: {target}, T = {temp:g}; paper metric {metric} "
                         f"({PAPER_METRIC_LABELS.get(metric, '?')})", rows))
    notes = ["'paper's metric' is computed the way the preset's paper computes it (its metric is named in each "
             "section); 'ours' is specbench's headline: end-to-end pooled tokens/s ratio and pooled τ, against the "
             "SDPA vanilla side. Baseline = the vanilla run the paper's speedup used."]
    for r in cells[cells.other_sides != ""].itertuples():
        notes.append(f"{r.method} ({r.preset}, {r.target}, T = {r.temperature:g}, {bench_label(r.bench)}): run under "
                     f"several attention implementations; the row is the faster, the {r.side} side "
                     f"({fmt_spd(r.paper_speedup)}; also ran: {r.other_sides}), as the paper reports the faster")
    return Table("paper_metric", "Runs of paper presets: the paper's metric beside ours", columns, groups, sections,
                 cells, notes, provenance_lines(files), align="llrrrrrl")
