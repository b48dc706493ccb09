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
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.text import Text
from matplotlib.ticker import MaxNLocator

from specbench import metrics
from specbench.records import DECODE_PHASES, GenerationRecord
from specbench.analysis.report.names import (VANILLA, Block, MethodInfo, bench_key, bench_label, block_label,
                                             sweep_points)
from specbench.analysis.report.stats import mean_over_benches
from specbench.analysis.report.verdicts import COLORS, Bar

# Stage colours: the engine's stages fixed; a drafter's own sub-phases of draft take the next free
# colour in order of appearance.
_ENGINE_COLORS = {"draft_fwd": "#d62728", "compile": "#2ca02c", "verify": "#1f77b4", "commit": "#7f7f7f"}
_SUBPHASE_COLORS = ("#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf")
MAX_SERIES = 10  # lines or bar groups per axes: more cannot be told apart by colour
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


def tradeoff_frame(table, block: Block) -> pd.DataFrame:
    """Per method of the block: T_D% and the mean speedup over its benches with the 95% interval, the numbers
    the main table and the page's leaderboard print (``table``: the main table)."""
    columns = ["speedup", "lo", "hi", "td_percent"]
    data = table.data if table is not None else pd.DataFrame()
    if data.empty or "mean_spd" not in data:
        return pd.DataFrame(columns=columns)
    part = data[(data.target == block[0]) & (data.temperature.astype(float) == block[1])]
    df = pd.DataFrame({"speedup": part.mean_spd.to_numpy(float), "lo": part.mean_spd_lo.to_numpy(float),
                       "hi": part.mean_spd_hi.to_numpy(float), "td_percent": part.td_percent.to_numpy(float)},
                      index=pd.Index(part.method.astype(str), name="method"))
    return df[df.speedup.notna() & df.td_percent.notna()].sort_index()


def panels(methods: Sequence[str], families: Mapping[str, str] | None = None,
           limit: int = MAX_SERIES) -> list[tuple[str, list[str]]]:
    """The methods split into panels of at most ``limit`` series, a family kept whole where it fits (a family
    larger than ``limit`` takes several panels): (the panel's families, its methods), families in name order."""
    by_family: dict[str, list[str]] = {}
    for m in methods:
        by_family.setdefault((families or {}).get(m) or m, []).append(m)
    out: list[tuple[list[str], list[str]]] = []
    for family in sorted(by_family):
        members = by_family[family]
        for start in range(0, len(members), limit):
            chunk = members[start:start + limit]
            if not out or len(out[-1][1]) + len(chunk) > limit:
                out.append(([], []))
            names, panel = out[-1]
            if family not in names:
                names.append(family)
            panel.extend(chunk)
    return [(", ".join(names), members) for names, members in out]


# --------------------------------------------------------------------------------------- figures

def _figure(title: str, ncols: int = 1, width: float = 6.4) -> tuple[Figure, list]:
    fig = Figure(figsize=(width, 4.0), layout="constrained")
    axes = fig.subplots(1, ncols, squeeze=False)[0].tolist()
    fig.suptitle(title)
    return fig, axes


def _panel_figure(title: str, groups: Sequence[tuple[str, list[str]]]) -> tuple[Figure, list]:
    """One panel per group of methods (``panels``), two panels a row, each titled by its families when there are
    several."""
    n = max(len(groups), 1)
    ncols = min(n, 2)
    nrows = -(-n // ncols)
    fig = Figure(figsize=(6.4 * ncols, 3.4 * nrows + 0.6), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel().tolist()
    for ax in axes[n:]:
        ax.set_visible(False)
    if n > 1:
        for ax, (families, _) in zip(axes, groups):
            ax.set_title(families, fontsize=9)
    fig.suptitle(title)
    return fig, axes[:n]


def _legend(ax) -> None:
    """A panel's legend (at most MAX_SERIES entries): inside the axes while few, else beside them, inside the
    canvas (the constrained layout makes room for it: no entry is cut off)."""
    if len(ax.get_legend_handles_labels()[1]) <= 5:
        ax.legend(fontsize=8)
    else:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)


def acceptance_figure(series: dict[str, list[float]], title: str, families: Mapping[str, str] | None = None) -> Figure:
    groups = panels(list(series), families)
    fig, axes = _panel_figure(title, groups)
    for ax, (_, methods) in zip(axes, groups):
        for method in methods:
            rates = series[method]
            ax.plot(range(1, len(rates) + 1), rates, marker="o", label=method)
        ax.set(xlabel="chain depth k", ylabel="α_k = P(depth k accepted | k−1 accepted)", ylim=(0, 1.02))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # depths are whole numbers
        _legend(ax)
    return fig


def histogram_figure(series: dict[str, dict[int, float]], title: str,
                     families: Mapping[str, str] | None = None) -> Figure:
    groups = panels(list(series), families)
    fig, axes = _panel_figure(title, groups)
    for ax, (_, methods) in zip(axes, groups):
        width = 0.8 / len(methods)
        for i, method in enumerate(methods):
            shares = series[method]
            xs = sorted(shares)
            ax.bar([x - 0.4 + width * (i + 0.5) for x in xs], [shares[x] for x in xs], width=width, label=method)
        ax.set(xlabel="tokens committed per verify call (accepted + bonus)", ylabel="share of verify calls")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        _legend(ax)
    return fig


def stage_figure(shares: dict[str, dict[str, float]], title: str) -> Figure:
    """A bar per method, split by stage; the figure grows with the methods (a bar each stays readable) and the stage
    legend sits below the axes, inside the canvas."""
    methods = list(shares)
    fig, (ax,) = _figure(title)
    fig.set_figheight(max(3.2, 1.6 + 0.24 * len(methods)))
    names = list(next(iter(shares.values())))  # every method has the block's stages, in order
    colors = stage_colors(names)
    left = [0.0] * len(methods)
    for stage in names:
        values = [shares[m][stage] for m in methods]
        ax.barh(methods, values, left=left, color=colors[stage], label=stage)
        left = [a + b for a, b in zip(left, values)]
    ax.set(xlabel="share of decode time", xlim=(0, 1))
    ax.tick_params(axis="y", labelsize=8)
    ax.invert_yaxis()
    fig.legend(loc="outside lower center", ncols=min(len(names), 4), fontsize=8)
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
    """Each method's mean speedup (bars: its 95% interval) against T_D%, coloured by verdict as on the page; the
    labels are set apart where they would overprint each other (``_label_points``)."""
    fig, (ax,) = _figure(title, width=9.6 if len(points) > 12 else 6.4)
    if len(points) > 12:  # room for the labels of a crowded block
        fig.set_figheight(6.4)
    for method, row in points.iterrows():
        color = COLORS[Bar(str(method), row.speedup, row.lo, row.hi).verdict]
        low = max(row.speedup - row.lo, 0.0) if math.isfinite(row.lo) else 0.0
        high = max(row.hi - row.speedup, 0.0) if math.isfinite(row.hi) else 0.0
        ax.errorbar([row.td_percent], [row.speedup], yerr=[[low], [high]], fmt="o", color=color, capsize=3, ms=5)
    ax.axhline(1.0, color="#777", lw=0.8)
    ax.margins(x=0.25, y=0.12)  # room for the labels
    ax.set(xlabel="T_D% (drafter share of decode time)", ylabel="mean speedup over vanilla")
    _label_points(fig, ax, list(points.td_percent), list(points.speedup), [str(m) for m in points.index])
    return fig


def _label_points(fig: Figure, ax, xs: Sequence[float], ys: Sequence[float], labels: Sequence[str]) -> None:
    """A label beside each point, right or left of it and moved up or down (with a leader line) until it overlaps
    no label placed before it, highest points first; the layout is solved first so that pixel positions are
    final. A label with no free place within reach keeps the last one tried."""
    renderer = FigureCanvasAgg(fig).get_renderer()  # the canvas the PNG is drawn on (a bare Figure has none)
    fig.draw_without_rendering()
    steps = [0] + [s for k in range(1, 16) for s in (-k, k)]
    places = [(side, step) for step in steps for side in (1, -1)]
    placed = []
    for i in sorted(range(len(xs)), key=lambda k: (-ys[k], xs[k])):
        for n, (side, step) in enumerate(places):
            note = ax.annotate(labels[i], (xs[i], ys[i]), xytext=(7 * side, 9 * step - 3), textcoords="offset points",
                               ha="left" if side > 0 else "right", fontsize=7.5,
                               arrowprops=dict(arrowstyle="-", color="#999", lw=0.5) if step else None)
            box = label_box(note, renderer).expanded(1.02, 1.08)
            if not any(box.overlaps(other) for other in placed) or n == len(places) - 1:
                placed.append(box)
                break
            note.remove()


def label_box(note, renderer):
    """The pixel box of an annotation's text alone (an annotation's own extent includes its leader line)."""
    note.update_positions(renderer)
    return Text.get_window_extent(note, renderer)


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
    _legend(axes[0])
    return fig


# What each kind of figure shows, in a sentence; "{what}" is the block (and machine) it is drawn for.
CAPTIONS = {
    "acceptance_rates": "Acceptance per chain depth, {what}: α_k is the share of drafts that reached depth k−1 whose "
                        "token at depth k was accepted too; one panel per group of method families (at most "
                        f"{MAX_SERIES} lines each).",
    "accept_length_hist": "Tokens committed per verify call (accepted + the bonus token), {what}: the share of verify "
                          "calls that committed each count, per method; one panel per group of method families.",
    "stage_breakdown": "Where decode time goes, {what}: each method's decode time split by stage (drafting, the "
                       "drafter's own sub-phases, verify, commit).",
    "speedup_vs_td": "Speedup against drafting cost, {what}: each method's mean speedup over vanilla (bars: its 95% "
                     "interval) against T_D%, the share of decode time spent drafting; green pays, red is slower, "
                     "grey cannot be told from vanilla.",
    "budget_sweep": "τ and speedup against the node budget, {what}: per swept method, each bench (dashed) and their "
                    "mean (solid).",
    "batch_speedup": "Speedup under load, {what}: speedup over vanilla at the same batch size B (bars: 95% interval), "
                     "one panel per bench; below the line at 1× speculation no longer pays.",
}


def batch_figures(report) -> dict[str, tuple[Figure, Block]]:
    """The speedup-vs-B figure of each block with batched records, keyed by its file stem, with its block."""
    frame = report.batch_frame
    figs = {}
    for (target, temperature), part in ([] if frame.empty else frame.groupby(["target", "temperature"])):
        block = (target, float(temperature))
        figs[f"batch_speedup_{slug(block)}"] = (batch_speedup_figure(part, f"Speedup under load — {block_label(block)}"),
                                               block)
    return figs


def block_figures(report, block: Block) -> dict[str, Figure]:
    """Every figure that has data for one block of a ``build.Report``, keyed by its kind (CAPTIONS, and its file
    stem's prefix)."""
    records = report.blocks[block]
    label = block_label(block)
    families = {side: info.family for side, info in report.sides.get(block, {}).items()}
    figs: dict[str, Figure] = {}
    if series := acceptance_series(records):
        figs["acceptance_rates"] = acceptance_figure(series, f"α_k per chain depth — {label}", families)
    if series := histogram_series(records):
        figs["accept_length_hist"] = histogram_figure(series, f"Accepted length per verify call — {label}", families)
    if shares := stage_shares(records):
        figs["stage_breakdown"] = stage_figure(shares, f"Decode time per stage — {label}")
    if not (points := tradeoff_frame(report.main, block)).empty:
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


def write_figures(report, out_dir: Path, suffix: str = "", captions: dict[Path, str] | None = None,
                  machine: str = "") -> list[Path]:
    """All figures of all blocks into ``out_dir``, ``suffix`` after each file stem (another machine's
    hardware, so its figures never share a name with the first machine's); returns the written paths, sorted.
    ``captions``, when given, gets each PNG's caption (CAPTIONS, naming the block and ``machine``)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    def save(fig: Figure, stem: str, kind: str, block: Block) -> None:
        paths = save_figure(fig, out_dir / f"{stem}{suffix}")
        if captions is not None:
            what = block_label(block) + (f" on {machine}" if machine else "")
            captions[paths[0]] = CAPTIONS[kind].format(what=what)
        written.extend(paths)

    with matplotlib.rc_context(_RC):
        for block in sorted(report.blocks):
            for kind, fig in block_figures(report, block).items():
                save(fig, f"{kind}_{slug(block)}", kind, block)
        for stem, (fig, block) in batch_figures(report).items():
            save(fig, stem, "batch_speedup", block)
    return sorted(written)
