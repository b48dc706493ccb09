"""Report figures: records -> plain series (pure) -> matplotlib Figure -> PNG + PDF.

One figure of each kind per (target, temperature) block: α_k per chain depth, the accepted-length
histogram, per-stage time shares, speedup vs T_D%, τ/speedup vs node budget when a block holds a
node-budget sweep, and speedup vs batch size B when it has files decoded through the batched loop.
Figures are built on ``matplotlib.figure.Figure`` (Agg canvas for PNG), never pyplot, so no global
backend or state is touched; metadata that carries dates or versions is dropped so that the same records
give the same bytes.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Mapping, Sequence

import matplotlib
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from specbench import metrics
from specbench.records import DECODE_PHASES, GenerationRecord
from specbench.analysis.report.names import (VANILLA, Block, MethodInfo, bench_key, bench_label, block_label,
                                             sweep_points)
from specbench.analysis.report.stats import mean_over_benches

# Stage colours: the engine's stages fixed; a drafter's own sub-phases of draft take the next free
# colour in order of appearance.
_ENGINE_COLORS = {"draft_fwd": "#d62728", "compile": "#2ca02c", "verify": "#1f77b4", "commit": "#7f7f7f"}
_SUBPHASE_COLORS = ("#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf")
_RC = {"svg.hashsalt": "specbench", "font.size": 9,
       "axes.grid": True, "grid.alpha": 0.3, "figure.dpi": 100, "savefig.dpi": 100}


# ------------------------------------------------------------------------------------ data (pure)

def _methods(records: Sequence[GenerationRecord], vanilla: bool = False) -> list[str]:
    return sorted({r.method for r in records if vanilla or r.method != VANILLA})


def _of(records: Sequence[GenerationRecord], method: str) -> list[GenerationRecord]:
    return [r for r in records if r.method == method]


def acceptance_series(records: Sequence[GenerationRecord]) -> dict[str, list[float]]:
    """α_k (k = 1..) per drafting method, from metrics.acceptance_rates."""
    out = {m: metrics.acceptance_rates(_of(records, m)) for m in _methods(records)}
    return {m: rates for m, rates in out.items() if any(math.isfinite(a) for a in rates)}


def histogram_series(records: Sequence[GenerationRecord]) -> dict[str, dict[int, float]]:
    """Share of verify calls committing n tokens (accepted + bonus), per drafting method."""
    out = {}
    for m in _methods(records):
        hist = metrics.accept_length_histogram(_of(records, m))
        total = sum(hist.values())
        if total:
            out[m] = {n: c / total for n, c in hist.items()}
    return out


def stages(records: Sequence[GenerationRecord]) -> list[str]:
    """The stages of decode time the records have: draft_fwd (drafting minus the drafter's own
    sub-phases), those sub-phases, then the other decode phases that any record timed (records made
    before the engine timed ``compile`` have none)."""
    timed = [p for p in DECODE_PHASES if p != "draft" and any(p in r.times for r in records)]
    return ["draft_fwd", *metrics.draft_subphases(records)] + timed


def stage_colors(names: Sequence[str]) -> dict[str, str]:
    free = iter(_SUBPHASE_COLORS * len(names))
    return {s: _ENGINE_COLORS.get(s) or next(free) for s in names}


def stage_shares(records: Sequence[GenerationRecord]) -> dict[str, dict[str, float]]:
    """Share of decode time per stage (metrics.phase_breakdown), every method including vanilla."""
    names = stages(records)
    out = {}
    for m in _methods(records, vanilla=True):
        phases = metrics.phase_breakdown(_of(records, m))
        decode = sum(phases.get(p, 0.0) for p in DECODE_PHASES)
        if decode > 0:
            out[m] = {s: phases.get(s, 0.0) / decode for s in names}
    return out

def sweep_frame(cells: pd.DataFrame, block: Block, sides: Mapping[str, MethodInfo]) -> pd.DataFrame:
    """τ and speedup per (stem, budget, bench) for the block's budget-sweep sides (``sides``: the block's
    MethodInfo per label; a side's budget is read from its header, names.side_infos); bench 'mean'
    included. Empty unless some stem has at least two budgets."""
    points = sweep_points(sides)
    part = cells[(cells.target == block[0]) & (cells.temperature == block[1]) & (cells.n_prompts > 0)]
    part = part[part.method.isin(points)]
    if part.empty:
        return pd.DataFrame(columns=["base", "budget", "bench", "tau", "speedup"])
    # A mean line compares budgets only over the benches that every budget of the method ran.
    base_of = part.method.map(lambda m: points[m][0])
    common = {b: set.intersection(*(set(g.bench) for _, g in grp.groupby("method"))) for b, grp in part.groupby(base_of)}
    shared = part[[bench in common[base] for base, bench in zip(base_of, part.bench)]]
    means = pd.DataFrame({"tau": mean_over_benches(shared, "tau"), "speedup": mean_over_benches(shared, "speedup")})
    means = means.reset_index().assign(bench="mean")
    rows = pd.concat([part[["method", "bench", "tau", "speedup"]], means[["method", "bench", "tau", "speedup"]]])
    rows = rows.assign(base=rows.method.map(lambda m: points[m][0]), budget=rows.method.map(lambda m: points[m][1]))
    keep = rows.groupby("base").budget.transform("nunique") >= 2
    return rows[keep].sort_values(["base", "bench", "budget"]).reset_index(drop=True)[
        ["base", "budget", "bench", "tau", "speedup"]]


def tradeoff_frame(cells: pd.DataFrame, methods: pd.DataFrame, block: Block) -> pd.DataFrame:
    """Per method: T_D% and mean speedup over its benches."""
    part = cells[(cells.target == block[0]) & (cells.temperature == block[1])]
    spd = mean_over_benches(part, "speedup").droplevel([0, 1])
    td = methods[(methods.target == block[0]) & (methods.temperature == block[1])].set_index("method").td
    df = pd.DataFrame({"speedup": spd, "td_percent": 100 * td.reindex(spd.index)})
    return df[df.speedup.notna() & df.td_percent.notna()].sort_index()


# --------------------------------------------------------------------------------------- figures

def _figure(title: str, ncols: int = 1, width: float = 6.4) -> tuple[Figure, list]:
    fig = Figure(figsize=(width, 4.0), layout="constrained")
    axes = fig.subplots(1, ncols, squeeze=False)[0].tolist()
    fig.suptitle(title)
    return fig, axes


def _method_legend(fig: Figure, ax) -> None:
    """One entry per method: inside the axes while few, else below them in three columns, the figure grown to hold it
    (thirty entries inside the axes covered the data and squeezed the axes to nothing)."""
    entries = len(ax.get_legend_handles_labels()[1])
    if entries <= 6:
        ax.legend(fontsize=8)
        return
    fig.set_figheight(fig.get_figheight() + 0.2 * -(-entries // 3))  # ceil(entries / 3) legend rows
    fig.legend(loc="outside lower center", ncols=3, fontsize=7)


def acceptance_figure(series: dict[str, list[float]], title: str) -> Figure:
    fig, (ax,) = _figure(title)
    for method, rates in series.items():
        ax.plot(range(1, len(rates) + 1), rates, marker="o", label=method)
    ax.set(xlabel="chain depth k", ylabel="α_k = P(depth k accepted | k−1 accepted)", ylim=(0, 1.02))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # depths are whole numbers
    _method_legend(fig, ax)
    return fig


def histogram_figure(series: dict[str, dict[int, float]], title: str) -> Figure:
    fig, (ax,) = _figure(title)
    width = 0.8 / max(len(series), 1)
    for i, (method, shares) in enumerate(series.items()):
        xs = sorted(shares)
        ax.bar([x - 0.4 + width * (i + 0.5) for x in xs], [shares[x] for x in xs], width=width, label=method)
    ax.set(xlabel="tokens committed per verify call (accepted + bonus)", ylabel="share of verify calls")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    _method_legend(fig, ax)
    return fig


def stage_figure(shares: dict[str, dict[str, float]], title: str) -> Figure:
    fig, (ax,) = _figure(title)
    methods = list(shares)
    names = list(next(iter(shares.values())))  # every method has the block's stages, in order
    colors = stage_colors(names)
    left = [0.0] * len(methods)
    for stage in names:
        values = [shares[m][stage] for m in methods]
        ax.barh(methods, values, left=left, color=colors[stage], label=stage)
        left = [a + b for a, b in zip(left, values)]
    ax.set(xlabel="share of decode time", xlim=(0, 1))
    ax.invert_yaxis()
    ax.legend(fontsize=8, ncols=len(names), loc="lower center", bbox_to_anchor=(0.5, 1.0))
    return fig


def budget_figure(sweep: pd.DataFrame, title: str) -> Figure:
    fig, axes = _figure(title, ncols=2, width=9.0)
    for ax, column, label in zip(axes, ("tau", "speedup"), ("τ (mean accepted length)", "speedup over vanilla")):
        for (base, bench), part in sweep.groupby(["base", "bench"], sort=True):
            is_mean = bench == "mean"
            ax.plot(part.budget, part[column], marker="o" if is_mean else ".", lw=2 if is_mean else 0.8,
                    alpha=1 if is_mean else 0.6, ls="-" if is_mean else "--",
                    label=f"{base} (mean)" if is_mean else f"{base} {bench_label(bench)}")
        ax.set_xscale("log", base=2)
        budgets = sorted(sweep.budget.unique())
        ax.set_xticks(budgets, labels=[str(b) for b in budgets])
        ax.minorticks_off()
        ax.set(xlabel="node budget", ylabel=label)
    axes[0].legend(fontsize=7)
    return fig


def tradeoff_figure(points: pd.DataFrame, title: str) -> Figure:
    fig, (ax,) = _figure(title)
    ax.scatter(points.td_percent, points.speedup)
    for method, row in points.iterrows():
        ax.annotate(method, (row.td_percent, row.speedup), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.axhline(1.0, color="#777", lw=0.8)
    ax.margins(x=0.2, y=0.1)  # room for the labels
    ax.set(xlabel="T_D% (drafter share of decode time)", ylabel="mean speedup over vanilla")
    return fig


def batch_speedup_figure(frame: pd.DataFrame, title: str) -> Figure:
    """Speedup over vanilla at the same B against B (log2 axis), one line per method with its 95% interval as
    error bars, one panel per bench; the line at 1.00× is where speculation stops paying."""
    benches = sorted(frame.bench.unique(), key=bench_key)
    fig, axes = _figure(title, ncols=len(benches), width=max(6.4, 4.2 * len(benches)))
    sizes = sorted(frame.batch_size.unique())
    for ax, bench in zip(axes, benches):
        part = frame[(frame.bench == bench) & frame.speedup.notna()]
        for method, mine in part.groupby("method", sort=True):
            mine = mine.sort_values("batch_size")
            low = (mine.speedup - mine.speedup_lo).clip(lower=0).fillna(0)
            high = (mine.speedup_hi - mine.speedup).clip(lower=0).fillna(0)
            ax.errorbar(mine.batch_size, mine.speedup, yerr=[low, high], marker="o", capsize=3, label=method)
        ax.axhline(1.0, color="#777", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, labels=[str(b) for b in sizes])
        ax.minorticks_off()
        ax.set(xlabel="batch size B", ylabel="speedup over vanilla at the same B", title=bench_label(bench))
    _method_legend(fig, axes[0])
    return fig


def batch_figures(report) -> dict[str, Figure]:
    """The speedup-vs-B figure of each block with batched records, keyed by its file stem."""
    frame = report.batch_frame
    figs = {}
    for (target, temperature), part in ([] if frame.empty else frame.groupby(["target", "temperature"])):
        block = (target, float(temperature))
        figs[f"batch_speedup_{slug(block)}"] = batch_speedup_figure(part, f"Speedup under load — {block_label(block)}")
    return figs


def block_figures(report, block: Block) -> dict[str, Figure]:
    """Every figure that has data for one block of a ``build.Report``, keyed by its file stem prefix."""
    records = report.blocks[block]
    label = block_label(block)
    figs: dict[str, Figure] = {}
    if series := acceptance_series(records):
        figs["acceptance_rates"] = acceptance_figure(series, f"α_k per chain depth — {label}")
    if series := histogram_series(records):
        figs["accept_length_hist"] = histogram_figure(series, f"Accepted length per verify call — {label}")
    if shares := stage_shares(records):
        figs["stage_breakdown"] = stage_figure(shares, f"Decode time per stage — {label}")
    if not (points := tradeoff_frame(report.bench_cells, report.methods, block)).empty:
        figs["speedup_vs_td"] = tradeoff_figure(points, f"Speedup vs drafting cost — {label}")
    if not (sweep := sweep_frame(report.cells, block, report.sides.get(block, {}))).empty:
        figs["budget_sweep"] = budget_figure(sweep, f"τ and speedup vs node budget — {label}")
    return figs


def slug(block: Block) -> str:
    return f"{re.sub(r'[^A-Za-z0-9.]+', '-', block[0]).strip('-')}_T{block[1]:g}"


def save_figure(fig: Figure, stem: Path) -> list[Path]:
    """PNG and PDF without creation dates or version stamps, so reruns give the same bytes."""
    png, pdf = stem.with_name(stem.name + ".png"), stem.with_name(stem.name + ".pdf")  # a stem may hold dots
    fig.savefig(png, format="png", metadata={"Software": None})
    fig.set_layout_engine("none")  # keep the layout the PNG solved; solving it again costs as much as drawing
    fig.savefig(pdf, format="pdf", metadata={"CreationDate": None, "Producer": None, "Creator": None})
    return [png, pdf]


def write_figures(report, out_dir: Path, suffix: str = "") -> list[Path]:
    """All figures of all blocks into ``out_dir``, ``suffix`` after each file stem (another machine's
    hardware, so its figures never share a name with the first machine's); returns the written paths, sorted."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    with matplotlib.rc_context(_RC):
        for block in sorted(report.blocks):
            for kind, fig in block_figures(report, block).items():
                written += save_figure(fig, out_dir / f"{kind}_{slug(block)}{suffix}")
        for stem, fig in batch_figures(report).items():
            written += save_figure(fig, out_dir / f"{stem}{suffix}")
    return sorted(written)
