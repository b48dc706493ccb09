"""The method-agnostic tables: main (per bench and mean), companion (intervals, cost model) and
ablations (grouped by what each side's method declares as ``ablation_of``)."""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import pandas as pd

from specbench.data.machine_load import MARK, TURN_LOAD
from specbench.analysis.report.names import (MEAN, VANILLA, Block, MethodInfo, bench_key, bench_label, block_label,
                                             mean_benches)
from specbench.analysis.report.records import ResultFile, files_by_block
from specbench.analysis.report.stats import (BOLD_REPS, CELL_COLUMNS, MEAN_COLUMNS, half_width, mean_over_benches,
                                    missing_reasons)
from specbench.analysis.report.table import (DASH, Cell, Table, finite, fmt_ci, fmt_delta, fmt_pct, fmt_spd, fmt_tau, fmt_tps,
                                    nanmean)

DIRTY = "†"  # printed beside numbers made by a working tree with uncommitted code changes


def _bench_groups(benches: Sequence[str], lead: Sequence[str]) -> tuple[list[str], list[tuple[str, int]]]:
    columns = list(lead)
    groups: list[tuple[str, int]] = [("", len(lead))]
    for bench in benches:
        columns += ["Spd", "τ"]
        groups.append((bench_label(bench), 2))
    return columns, groups


def provenance_lines(files: Sequence[ResultFile]) -> list[str]:
    """One line per block: result files, prompts per bench, hardware, dtype, seed, node budget (runs made
    with ``--budget``), git sha."""
    lines = []
    for block, group in sorted(files_by_block(files).items()):
        prompts: dict[str, set] = {}
        for f in group:
            for r in f.records:
                prompts.setdefault(r.bench, set()).add(r.prompt_id)

        def meta(name: str) -> str:
            values = sorted({str(f.meta.get(name)) for f in group if f.meta.get(name) is not None})
            return " / ".join(values) if values else "?"

        per_bench = ", ".join(f"{b} {len(prompts[b])}" for b in sorted(prompts, key=bench_key))
        lines.append(f"{block_label(block)}: files {', '.join(sorted(f.path.name for f in group))}; "
                     f"prompts per bench: {per_bench}; hardware {meta('hardware')}; device {meta('device')}; "
                     f"dtype {meta('dtype')}; max_new_tokens {meta('max_new_tokens')}; seed {meta('seed')}; "
                     + (f"node budget {meta('budget')}; " if any(f.meta.get("budget") for f in group) else "")
                     + f"git {meta('git_sha')}" + _dirty_note(group))
    return lines


def _dirty_note(files: Sequence[ResultFile]) -> str:
    """'; † from uncommitted code: a.jsonl (diff sha256 1a2b3c4d5e6f: methods/x.py)' for the files whose working tree
    was dirty, so every table that prints the provenance says which of its numbers no commit can reproduce."""
    dirty = [f for f in files if str(f.meta.get("git_sha", "")).endswith("-dirty")]
    if not dirty:
        return ""

    def what(f: ResultFile) -> str:
        diff = f.meta.get("git_dirty") or {}
        files = ", ".join(diff.get("files", [])) or "files not recorded"
        return f"{f.path.name} (diff sha256 {str(diff.get('diff_sha256', '?'))[:12]}: {files})"

    return f"; {DIRTY} from uncommitted code: " + "; ".join(what(f) for f in sorted(dirty, key=lambda f: f.path.name))


def main_table(cells: pd.DataFrame, methods: pd.DataFrame, provenance: Sequence[str] = (),
               bold: frozenset = frozenset(), loaded: frozenset = frozenset(), means: pd.DataFrame | None = None,
               aa: bool = True, dirty: frozenset = frozenset()) -> Table:
    """SpecBlock Table 1 layout: a block per (target, T), a row per method, Spd (n)/τ per bench, Mean with the
    cost model's ideal speedup and efficiency, T_D%, greedy match. ``cells``/``methods``: the single
    benchmarks' (stats.of_kind, stats.blocks_of_kind); ``bold``: (target, T, method, bench or 'mean') whose
    speedup's paired interval excludes the runner-up's; ``loaded``: (target, T, method, bench) recorded under
    load; ``means``: stats.mean_frame, the Mean columns' intervals; ``dirty``: (target, T, method, bench) made by a
    working tree with uncommitted changes (stats.dirty_cells)."""
    return _speedup_table("main_table", "Speedup (Spd) over vanilla and mean accepted length τ per benchmark",
                          "Spd [95% interval] (n=conversations) = end-to-end speedup over the same file's vanilla; "
                          "Mean = mean over the mission benchmarks each method ran (n summed; mixed streams are in "
                          "streams_table)", cells, methods, provenance, bold, loaded, means, aa, dirty)


def streams_table(cells: pd.DataFrame, methods: pd.DataFrame, provenance: Sequence[str] = (),
                  bold: frozenset = frozenset(), loaded: frozenset = frozenset(),
                  means: pd.DataFrame | None = None, aa: bool = True, dirty: frozenset = frozenset()) -> Table:
    """The main table's layout for the mixed query streams (``--bench mixed --passes N``), where the methods
    that learn while serving are measured: one column per stream, its own mean, T_D% and greedy match over
    the stream records only."""
    return _speedup_table("streams_table", "Speedup (Spd) over vanilla and mean accepted length τ on mixed "
                          "query streams (methods that learn while serving, and their static baselines)",
                          "Spd [95% interval] (n=queries over all passes) = end-to-end speedup over the same "
                          "file's vanilla on the same stream; Mean = mean over the streams each method ran",
                          cells, methods, provenance, bold, loaded, means, aa, dirty)


def _spd_cell(spd: float, lo: float, hi: float, n, loaded: bool, dirty: bool = False, bold: bool = False) -> Cell:
    """'0.91× [0.88, 0.94] (n=24)', with the under-load and dirty-tree marks; on the page '0.91×' and the marks
    (the interval and n in small type below it)."""
    if not finite(spd):
        return Cell(DASH, bold)
    marks = (f" {MARK}" if loaded else "") + (f" {DIRTY}" if dirty else "")
    return Cell(f"{fmt_ci(fmt_spd(spd), lo, hi, fmt_spd)} (n={int(n)})" + marks, bold, fmt_spd(spd) + marks)


def _tau_cell(tau: float, lo: float, hi: float) -> Cell:
    return Cell(fmt_ci(fmt_tau(tau), lo, hi, fmt_tau), False, fmt_tau(tau))


def resolution_note(cells: pd.DataFrame, aa: bool = True) -> str | None:
    """How big an effect the speedup intervals can resolve: the median (and widest) half-width of the
    per-bench intervals, relative to their point; ``aa``: whether the files hold A/A rows to point to."""
    widths = [half_width(r.speedup, r.speedup_lo, r.speedup_hi) for r in cells.itertuples()]
    widths = [w for w in widths if finite(w)]
    if not widths:
        return None
    widths.sort()
    return (f"Resolution: a per-bench speedup interval spans ±{100 * widths[len(widths) // 2]:.1f}% around its point "
            f"(median; widest ±{100 * widths[-1]:.1f}%), so two methods whose speedups differ by less than about "
            "that cannot be told apart here, and a speedup within it of 1.00× is no gain or loss; "
            + ("the A/A rows (aa_table) show the same spread for vanilla against itself" if aa else
               "these files hold no A/A side (a second vanilla side), so nothing here shows vanilla's spread "
               "against itself"))


def _ideal_note(cells: pd.DataFrame) -> str:
    """Where the Ideal column's target forward times came from: the hardware's measured cost curve, or the run."""
    sources = set(cells.get("ideal_source", pd.Series(dtype=str)).dropna()) - {""}
    if sources == {"curve"}:
        where = ("the target's forwards priced by this hardware's measured cost curve (cost_table: t(rows) after a "
                 "prefix, measured apart from the runs), the drafter's from the run; Eff. = measured decode-only "
                 "speedup / ideal: how close the method comes to what this machine allows")
    elif "curve" in sources:
        where = ("the target's forwards from this hardware's measured cost curve where it covers the verify sizes "
                 "(cost_table), else from the run's own forward times (ideal_source in the CSV); Eff. = measured "
                 "decode-only speedup / ideal")
    else:
        where = ("the run's own measured forward times (no cost curve for this hardware and target: bench/forward_cost.py); "
                 "Eff. = measured decode-only speedup / ideal (overhead beyond the run's model forwards only)")
    return f"Ideal = τ · t_vanilla_step / (t_draft + t_verify) per verify call (specbench/analysis/cost_model.py), {where}; " \
           "both means over benchmarks"


def _speedup_table(name: str, title: str, spd_note: str, cells: pd.DataFrame, methods: pd.DataFrame,
                   provenance: Sequence[str], bold: frozenset, loaded: frozenset,
                   means: pd.DataFrame | None = None, aa: bool = True, dirty: frozenset = frozenset()) -> Table:
    benches = sorted(cells.bench.unique(), key=bench_key)
    pooled = mean_benches(benches)
    columns, groups = _bench_groups(benches, ["Method"])
    columns += ["Spd", "τ", "Ideal", "Eff.", "T_D%", "Greedy"]
    groups += [("Mean", 4), ("", 2)]
    pooled_means = {column: mean_over_benches(cells, column, pooled).to_dict()
                    for column in ("speedup", "tau", "ideal_speedup", "efficiency")}
    per_method = methods.set_index(["target", "temperature", "method"])
    mean_ci = (means if means is not None else pd.DataFrame(columns=MEAN_COLUMNS)).set_index(
        ["target", "temperature", "method"])

    def mean_of(key, column):
        return mean_ci.at[key, column] if key in mean_ci.index else math.nan

    sections, records = [], []
    for (target, temp), block in cells.groupby(["target", "temperature"], sort=True):
        rows = []
        for method, part in block.groupby("method", sort=True):
            part = part.set_index("bench")
            key = (target, temp, method)
            row = [Cell(method)]
            data = dict(target=target, temperature=f"{temp:g}", method=method)
            n_all = 0
            for bench in benches:
                spd, tau, n = part.at[bench, "speedup"], part.at[bench, "tau"], part.at[bench, "n_prompts"]
                lo, hi = part.at[bench, "speedup_lo"], part.at[bench, "speedup_hi"]
                tlo, thi = part.at[bench, "tau_lo"], part.at[bench, "tau_hi"]
                n_all += int(n) if finite(spd) and bench in pooled else 0
                row += [_spd_cell(spd, lo, hi, n, (*key, bench) in loaded, (*key, bench) in dirty,
                                  (*key, bench) in bold),
                        _tau_cell(tau, tlo, thi)]
                data.update({f"{bench}_spd": spd, f"{bench}_spd_lo": lo, f"{bench}_spd_hi": hi, f"{bench}_tau": tau,
                             f"{bench}_tau_lo": tlo, f"{bench}_tau_hi": thi, f"{bench}_n": n})
            greedy, greedy_n = per_method.at[key, "greedy_match"], per_method.at[key, "greedy_n"]
            any_loaded = any((*key, b) in loaded for b in pooled)
            any_dirty = any((*key, b) in dirty for b in pooled)
            # A method that ran none of the pooled benches has no Mean (NaN, printed as a dash).
            mean_spd, mean_tau, mean_ideal, mean_eff = (pooled_means[c].get(key, math.nan) for c in pooled_means)
            row += [_spd_cell(mean_spd, mean_of(key, "mean_spd_lo"), mean_of(key, "mean_spd_hi"), n_all, any_loaded,
                              any_dirty, (*key, MEAN) in bold),
                    _tau_cell(mean_tau, mean_of(key, "mean_tau_lo"), mean_of(key, "mean_tau_hi")),
                    Cell(fmt_spd(mean_ideal)), Cell(fmt_pct(mean_eff)),
                    Cell(fmt_pct(per_method.at[key, "td"])),
                    Cell(f"{fmt_pct(greedy)} ({int(greedy_n)})" if greedy_n else DASH)]
            data.update(mean_spd=mean_spd, mean_spd_lo=mean_of(key, "mean_spd_lo"),
                        mean_spd_hi=mean_of(key, "mean_spd_hi"), mean_tau=mean_tau,
                        mean_tau_lo=mean_of(key, "mean_tau_lo"), mean_tau_hi=mean_of(key, "mean_tau_hi"),
                        mean_ideal_spd=mean_ideal,
                        mean_efficiency=mean_eff, td_percent=100 * per_method.at[key, "td"],
                        greedy_match=greedy, greedy_n=greedy_n, under_load=any_loaded, dirty_tree=any_dirty)
            rows.append(row)
            records.append(data)
        sections.append((block_label((target, temp)), rows))
    notes = [f"{spd_note}; intervals: percentile bootstrap over conversations (a conversation's turns are "
             "resampled together; the Mean's: each benchmark resampled on its own); T_D% = drafter share of decode "
             "time over all its prompts in this table; bold = the best speedup of its column within a block whose "
             f"paired bootstrap interval (over conversations, {BOLD_REPS} resamples) against the runner-up of the "
             "same results file lies above 1 (Mean: pooled over the benchmarks); a runner-up from another file "
             "(another run) leaves the column without bold",
             _ideal_note(cells),
             "Greedy = share of T = 0 turns (n) whose text equals vanilla's token for token"]
    if outside := [bench_label(b) for b in benches if b not in pooled]:
        notes.append(f"Mean = over {', '.join(map(bench_label, pooled))} only; {', '.join(outside)} "
                     f"{'stands' if len(outside) == 1 else 'stand'} outside it, so a method's Mean does not depend on "
                     f"whether it ran {' or '.join(outside)}")
    if (resolution := resolution_note(cells, aa)) is not None:
        notes.append(resolution)
    if loaded:
        notes.append(f"{MARK} = a turn of this cell was recorded under load: other work above {TURN_LOAD:g} CPU "
                     "(the 1-minute load after the turn, record load_avg, minus the run's own threads) for any side "
                     "of it; its timings are suspect: re-time them (bench/reference_set.py --retime-flagged)")
    shown = zip(cells.target, cells.temperature, cells.method, cells.bench)
    if used := sorted({key[2] for key in shown if key in dirty}):
        notes.append(f"{DIRTY} = made by a working tree with uncommitted code changes (the header's git_sha ends in "
                     "-dirty; its git_dirty field holds the diff's sha256 and file names): no commit holds the code "
                     f"that made it, so it cannot be reproduced as it stands ({', '.join(used)})")
    notes += [f"{m} × {b} ({block_label((t, temp))}): {why}" for (t, temp, m, b), why in missing_reasons(cells).items()]
    return Table(name, title, columns, groups, sections, pd.DataFrame(records), notes, list(provenance))


def companion_table(cells: pd.DataFrame, provenance: Sequence[str] = ()) -> Table:
    """Per method and bench: end-to-end vs decode-only speedup with 95% CIs, greedy match, tokens/s, n."""
    columns = ["Method", "Bench", "n", "Spd [95% CI]", "Spd decode", "Ideal", "Eff.", "τ [95% CI]", "τ macro", "T_D%",
               "Greedy match", "tok/s", "vanilla tok/s"]
    ran = cells[cells.n_prompts > 0]
    sections, notes = [], []
    for (target, temp), block in ran.groupby(["target", "temperature"], sort=True):
        rows = []
        for r in sorted(block.itertuples(), key=lambda r: (r.method, bench_key(r.bench))):
            greedy = DASH if not finite(r.greedy_match) else f"{100 * r.greedy_match:.0f}%"
            rows.append([Cell(r.method), Cell(r.bench), Cell(str(r.n_prompts)),
                         Cell(fmt_ci(fmt_spd(r.speedup), r.speedup_lo, r.speedup_hi, fmt_spd), False,
                              fmt_spd(r.speedup)),
                         Cell(fmt_spd(r.speedup_decode)), Cell(fmt_spd(r.ideal_speedup)), Cell(fmt_pct(r.efficiency)),
                         _tau_cell(r.tau, r.tau_lo, r.tau_hi),
                         Cell(fmt_tau(r.tau_macro)), Cell(fmt_pct(r.td)), Cell(greedy),
                         Cell(fmt_tps(r.tokens_per_s)), Cell(fmt_tps(r.vanilla_tokens_per_s))])
            if r.reason:
                notes.append(f"{r.method} × {r.bench} ({block_label((target, temp))}): {r.reason}")
        sections.append((block_label((target, temp)), rows))
    if (ran.temperature > 0).any():
        notes.append("greedy match is reported at T = 0 only; at T > 0 outputs are samples")
    notes.append("Ideal = the cost model's speedup from measured forward times (specbench/analysis/cost_model.py); "
                 "Eff. = Spd decode / Ideal")
    data = ran.assign(temperature=ran.temperature.map(lambda t: f"{t:g}"), td_percent=100 * ran.td)
    data = data.sort_values(["target", "temperature", "method", "bench"]).reset_index(drop=True)
    data = data[[c if c != "td" else "td_percent" for c in CELL_COLUMNS]]
    return Table("companion_table", "Speedup end-to-end vs decode-only, with bootstrap 95% intervals over prompts",
                 columns, [], sections, data, notes, list(provenance), align="ll" + "r" * 11)


def ablation_key(info: MethodInfo, method: str) -> tuple:
    """What a side of ``method`` (its own, or the method it ablates) is compared like with like by, all from the
    header: how long each of its drafters trained (``MethodInfo.trained``, from their recipes), the node budget it
    ran with, and the other options its run set (values as it ran them; its weights options aside, since its
    drafters are compared by their recipes)."""
    budget = info.option(info.budget_option) if info.budget_option else None
    apart = {*info.weight_options, info.budget_option}
    options = tuple(sorted((key, info.option(key)) for key, _ in info.given if key not in apart))
    return method, info.trained, budget, options


def _group_name(key: tuple) -> str:
    """A group without a base side is shown as its base method, node budget, options and training."""
    method, trained, budget, options = key
    return (method + (f"@budget={budget}" if budget is not None else "") + "".join(f"@{k}={v}" for k, v in options)
            + (f" ({', '.join(dict(trained).values())})" if trained else ""))


def ablation_groups(sides: Mapping[str, MethodInfo]) -> dict[str, list[str]]:
    """Side labels grouped for the ablation table, keyed by the group's base side (the label of a side of the
    base method itself, e.g. ``specblock (400 steps)``; ``_group_name`` when none ran): every side whose method
    declares ``ablation_of`` joins the sides of its base method with the same ``ablation_key`` (drafters trained
    as long, the same node budget and options), read from the header, never from a label; groups without an
    ablation are left out. Sides differing only in budget form a sweep (its own figure), not an ablation."""
    groups: dict[tuple, set[str]] = {}
    for label, info in sides.items():
        if info.ablation_of:
            groups.setdefault(ablation_key(info, info.ablation_of), set()).add(label)
    bases: dict[tuple, list[str]] = {}
    for label, info in sides.items():
        if not info.ablation_of and info.method != VANILLA and (key := ablation_key(info, info.method)) in groups:
            bases.setdefault(key, []).append(label)
    out = {}
    for key, labels in groups.items():
        name = min(bases[key]) if key in bases else _group_name(key)
        out[name] = sorted(labels | set(bases.get(key, ())), key=lambda m: (m != name, m))
    return dict(sorted(out.items()))


def ablation_table(cells: pd.DataFrame, sides: Mapping[Block, Mapping[str, MethodInfo]],
                   provenance: Sequence[str] = ()) -> Table | None:
    """SpecBlock Table 2 layout: rows = a method and its ablations (``ablation_groups`` over each block's
    ``sides``); Spd/τ per bench, Mean, Δ vs the base."""
    ran = cells[cells.n_prompts > 0]
    sections, records, notes = [], [], []
    benches_all: set[str] = set()
    plan = []
    for (target, temp), block in ran.groupby(["target", "temperature"], sort=True):
        here = sides.get((target, temp), {})
        present = set(block.method)
        for fam, labels in ablation_groups(here).items():
            labels = [label for label in labels if label in present]
            ablations = [label for label in labels if here[label].ablation_of]
            if not ablations:  # its ablations did not run
                continue
            # Only the benches an ablation ran: the base's other runs (e.g. a mixed stream) are no comparison.
            ablation_benches = set(block[block.method.isin(ablations)].bench)
            part = block[block.method.isin(labels) & block.bench.isin(ablation_benches)]
            benches_all.update(part.bench)
            plan.append(((target, temp), fam, labels, part))
    if not plan:
        return None
    benches = sorted(benches_all, key=bench_key)
    columns, groups = _bench_groups(benches, ["Variant"])
    columns += ["Spd", "τ", "ΔSpd", "Δτ"]
    groups += [("Mean", 2), ("vs base", 2)]
    for block, fam, labels, part in plan:
        by = {(r.method, r.bench): r for r in part.itertuples()}
        base_benches = {b for (m, b) in by if m == fam}
        rows = []
        for label in labels:
            mine = {b for (m, b) in by if m == label}
            common = mine & base_benches  # deltas compare like with like: benches both ran
            spd = [by[(label, b)].speedup if (label, b) in by else math.nan for b in benches]
            tau = [by[(label, b)].tau if (label, b) in by else math.nan for b in benches]
            mean = (nanmean(spd), nanmean(tau))
            if fam in labels and common:
                d_spd = nanmean([by[(label, b)].speedup - by[(fam, b)].speedup for b in sorted(common)])
                d_tau = nanmean([by[(label, b)].tau - by[(fam, b)].tau for b in sorted(common)])
            else:
                d_spd = d_tau = math.nan
                if label != fam:
                    notes.append(f"{label} ({block_label(block)}): no '{fam}' run on the same benches to compare with")
            row = [Cell(label)]
            for s, t in zip(spd, tau):
                row += [Cell(fmt_spd(s)), Cell(fmt_tau(t))]
            deltas = [Cell(""), Cell("")] if label == fam else [Cell(fmt_delta(d_spd, "×")), Cell(fmt_delta(d_tau))]
            row += [Cell(fmt_spd(mean[0])), Cell(fmt_tau(mean[1]))] + deltas
            rows.append(row)
            data = dict(target=block[0], temperature=f"{block[1]:g}", family=fam, method=label)
            for b, s, t in zip(benches, spd, tau):
                data.update({f"{b}_spd": s, f"{b}_tau": t})
            data.update(mean_spd=mean[0], mean_tau=mean[1], delta_spd=d_spd, delta_tau=d_tau)
            records.append(data)
        sections.append((f"{block_label(block)} · {fam}", rows))
    notes.append("Δ = variant minus base method, averaged over the benches both ran")
    return Table("ablation_table", "Ablations: variants of one method", columns, groups, sections,
                 pd.DataFrame(records), notes, list(provenance))


