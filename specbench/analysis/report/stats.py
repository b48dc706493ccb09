"""Statistics: records -> one row per (block, method, bench) cell and per (block, method), bootstrap
intervals over prompts, and the paired tests behind the main table's bold. All numbers come from
``specbench.metrics``; the bootstrap uses a fixed seed, so the same records give the same frames."""

from __future__ import annotations

import math
from typing import Callable, Iterable, Sequence

import numpy as np
import pandas as pd

from specbench import metrics
from specbench.analysis.cost_model import CostCurve, ideal_with_source
from specbench.data.machine_load import flagged_keys
from specbench.analysis.orderings import units
from specbench.analysis.paired import percentile_interval, resampled_sums, significant_best
from specbench.records import GenerationRecord
from specbench.analysis.report.names import MEAN, VANILLA, Block, bench_key, is_stream, mean_benches
from specbench.analysis.report.records import ResultFile, files_by_block

BOOTSTRAP_REPS = 1000
BOOTSTRAP_SEED = 0
BOLD_REPS = 2000  # resamples of the paired test behind bold


def bootstrap_ci(columns: np.ndarray, statistic: Callable[[np.ndarray], np.ndarray], reps: int = BOOTSTRAP_REPS,
                 seed: int = BOOTSTRAP_SEED, level: float = 0.95) -> tuple[float, float]:
    """Percentile interval of ``statistic`` over prompt resamples.

    ``columns[i]`` holds prompt i's additive totals (tokens, seconds, ...); every metric here is a ratio
    of pooled sums, so a resample's statistic needs only the resampled column sums: draw n prompts with
    replacement per rep, count how often each was drawn, and take one matrix product."""
    if len(columns) == 0 or reps <= 0:
        return math.nan, math.nan
    with np.errstate(divide="ignore", invalid="ignore"):
        values = statistic(resampled_sums(columns, reps, seed))
    return percentile_interval(values, level)


def _by_prompt(records: Iterable[GenerationRecord]) -> dict[str, list[GenerationRecord]]:
    # The resampling unit is a prompt: its turns (MT-Bench has two) move together.
    out: dict[str, list[GenerationRecord]] = {}
    for r in records:
        out.setdefault(r.prompt_id, []).append(r)
    return dict(sorted(out.items()))


def _speedup_rows(method: Sequence[GenerationRecord], baseline: Sequence[GenerationRecord]) -> np.ndarray:
    pairs = metrics.matched(method, baseline)
    units = _by_prompt(m for m, _ in pairs)
    base = {metrics.key(b): b for _, b in pairs}
    rows = []
    for recs in units.values():
        twins = [base[metrics.key(r)] for r in recs]
        rows.append([sum(r.num_new for r in recs), sum(r.total_time for r in recs),
                     sum(b.num_new for b in twins), sum(b.total_time for b in twins)])
    return np.array(rows, dtype=float).reshape(-1, 4)


def _speedup_of(s: np.ndarray) -> np.ndarray:
    return (s[:, 0] / s[:, 1]) / (s[:, 2] / s[:, 3])


def speedup_ci(method: Sequence[GenerationRecord], baseline: Sequence[GenerationRecord], **kw) -> tuple[float, float]:
    """Bootstrap interval of metrics.speedup (end-to-end) over matched conversations (a prompt's turns
    move together)."""
    return bootstrap_ci(_speedup_rows(method, baseline), _speedup_of, **kw)


def speedup_draws(method: Sequence[GenerationRecord], baseline: Sequence[GenerationRecord], reps: int = BOOTSTRAP_REPS,
                  seed: int = BOOTSTRAP_SEED) -> np.ndarray:
    """The ``reps`` bootstrap speedups behind ``speedup_ci`` (empty without matched prompts)."""
    rows = _speedup_rows(method, baseline)
    if not len(rows) or reps <= 0:
        return np.empty(0)
    with np.errstate(divide="ignore", invalid="ignore"):
        return _speedup_of(resampled_sums(rows, reps, seed))


def tau_draws(records: Sequence[GenerationRecord], reps: int = BOOTSTRAP_REPS, seed: int = BOOTSTRAP_SEED) -> np.ndarray:
    """The ``reps`` bootstrap τ behind ``tau_ci``."""
    rows = np.array([[sum(r.committed for r in recs), sum(r.n_verify for r in recs)]
                     for recs in _by_prompt(records).values()], dtype=float).reshape(-1, 2)
    if not len(rows) or reps <= 0:
        return np.empty(0)
    with np.errstate(divide="ignore", invalid="ignore"):
        s = resampled_sums(rows, reps, seed)
        return s[:, 0] / s[:, 1]


def _mean_ci(draws: list[np.ndarray]) -> tuple[float, float]:
    """Interval of a mean over benches: each bench resampled on its own (benches are independent prompt
    sets), the mean of one resample per bench taken per resample."""
    draws = [d for d in draws if len(d)]
    if not draws:
        return math.nan, math.nan
    return percentile_interval(np.mean(np.vstack(draws), axis=0))


MEAN_COLUMNS = ["target", "temperature", "method", "n_conversations", "mean_spd_lo", "mean_spd_hi", "mean_tau_lo",
                "mean_tau_hi"]


def mean_frame(blocks: dict[Block, list[GenerationRecord]], reps: int = BOOTSTRAP_REPS,
               seed: int = BOOTSTRAP_SEED) -> pd.DataFrame:
    """Per (block, method): intervals of the main table's Mean columns (mean of Spd and of τ over the mean
    benches the method ran, names.mean_benches) and the conversations behind them."""
    rows = []
    # The benches of the whole table, as its Mean point (mean_over_benches) pools them, not of one block.
    benches = mean_benches(r.bench for recs in blocks.values() for r in recs)
    for block, recs in sorted(blocks.items()):
        groups: dict[tuple[str, str], list[GenerationRecord]] = {}
        for r in recs:
            groups.setdefault((r.method, r.bench), []).append(r)
        ran = [b for b in benches if any(key[1] == b for key in groups)]  # seeds indexed by the block's benches
        for method in sorted({r.method for r in recs} - {VANILLA}):
            mine = [(i, groups[(method, b)], groups.get((VANILLA, b), [])) for i, b in enumerate(ran)
                    if (method, b) in groups]
            spd = _mean_ci([speedup_draws(ours, base, reps, seed + i) for i, ours, base in mine])
            tau = _mean_ci([tau_draws(ours, reps, seed + i) for i, ours, _ in mine])
            n = sum(len({r.prompt_id for r in ours}) for _, ours, _ in mine)
            rows.append(dict(zip(MEAN_COLUMNS, (block[0], block[1], method, n, *spd, *tau))))
    return pd.DataFrame(rows, columns=MEAN_COLUMNS)


def tau_ci(records: Sequence[GenerationRecord], **kw) -> tuple[float, float]:
    """Bootstrap interval of metrics.tau over prompts."""
    rows = [[sum(r.committed for r in recs), sum(r.n_verify for r in recs)] for recs in _by_prompt(records).values()]
    return bootstrap_ci(np.array(rows, dtype=float).reshape(-1, 2), lambda s: s[:, 0] / s[:, 1], **kw)


def half_width(point: float, lo: float, hi: float) -> float:
    """Half the interval's width relative to its point (0.05: the interval spans ±5%)."""
    return (hi - lo) / 2 / point if all(map(math.isfinite, (point, lo, hi))) and point else math.nan


CELL_COLUMNS = ["target", "temperature", "method", "bench", "n_prompts", "speedup", "speedup_lo", "speedup_hi",
                "speedup_decode", "tau", "tau_lo", "tau_hi", "tau_macro", "td", "greedy_match", "tokens_per_s",
                "tokens_per_s_decode", "vanilla_tokens_per_s", "ideal_speedup", "efficiency", "reason", "ideal_source"]


def _cell(block: Block, method: str, bench: str, ours: Sequence[GenerationRecord], base: Sequence[GenerationRecord],
          reps: int, seed: int, curve: CostCurve | None = None) -> dict:
    """Every statistic of one (block, method, bench) cell; ``base`` = the block's vanilla records there."""
    row = dict.fromkeys(CELL_COLUMNS, math.nan)
    row.update(target=block[0], temperature=block[1], method=method, bench=bench, n_prompts=0, reason="",
               ideal_source="")
    if not ours:
        row["reason"] = f"not run on {bench}"
        return row
    row.update(n_prompts=len({r.prompt_id for r in ours}), tau=metrics.tau(ours), tau_macro=metrics.tau_macro(ours),
               td=metrics.draft_share(ours), tokens_per_s=metrics.tokens_per_second(ours),
               tokens_per_s_decode=metrics.tokens_per_second(ours, decode_only=True))
    row["tau_lo"], row["tau_hi"] = tau_ci(ours, reps=reps, seed=seed)
    matched_base = [b for _, b in metrics.matched(ours, base)]
    if not matched_base:
        row["reason"] = f"no vanilla baseline for {bench} in the same file"
        return row
    row.update(speedup=metrics.speedup(ours, base), speedup_decode=metrics.speedup(ours, base, decode_only=True),
               vanilla_tokens_per_s=metrics.tokens_per_second(matched_base))
    row["speedup_lo"], row["speedup_hi"] = speedup_ci(ours, base, reps=reps, seed=seed)
    row["ideal_speedup"], row["efficiency"], row["ideal_source"] = ideal_with_source(ours, base, curve)
    if block[1] == 0:  # exact match is only expected under greedy decoding
        row["greedy_match"] = metrics.greedy_match_rate(ours, base)
    return row


def cell_frame(blocks: dict[Block, list[GenerationRecord]], reps: int = BOOTSTRAP_REPS,
               seed: int = BOOTSTRAP_SEED, curves: dict[Block, CostCurve] | None = None) -> pd.DataFrame:
    """One row per (block, method, bench) over the full grid; missing cells carry a reason. ``curves``: the
    measured forward-cost curve of a block's hardware and dtype (report/cost.py), for its ideal speedup."""
    curves = curves or {}
    benches = sorted({r.bench for recs in blocks.values() for r in recs}, key=bench_key)
    rows = []
    for block, recs in sorted(blocks.items()):
        groups: dict[tuple[str, str], list[GenerationRecord]] = {}
        for r in recs:
            groups.setdefault((r.method, r.bench), []).append(r)
        for method in sorted({r.method for r in recs} - {VANILLA}):
            rows.extend(_cell(block, method, bench, groups.get((method, bench), []), groups.get((VANILLA, bench), []),
                              reps, seed, curves.get(block)) for bench in benches)
    return pd.DataFrame(rows, columns=CELL_COLUMNS)


def method_frame(blocks: dict[Block, list[GenerationRecord]]) -> pd.DataFrame:
    """Per (block, method): T_D over all its records; at T = 0 the share of its turns whose text equals
    vanilla's (greedy_match) and how many turns paired (greedy_n)."""
    rows = []
    for block, recs in sorted(blocks.items()):
        base = [r for r in recs if r.method == VANILLA]
        for method in sorted({r.method for r in recs}):
            ours = [r for r in recs if r.method == method]
            greedy_n = len(metrics.matched(ours, base)) if block[1] == 0 and method != VANILLA else 0
            rows.append(dict(target=block[0], temperature=block[1], method=method, td=metrics.draft_share(ours),
                             n_records=len(ours), greedy_match=metrics.greedy_match_rate(ours, base) if greedy_n
                             else math.nan, greedy_n=greedy_n))
    return pd.DataFrame(rows, columns=["target", "temperature", "method", "td", "n_records", "greedy_match",
                                       "greedy_n"])


def missing_reasons(cells: pd.DataFrame) -> dict[tuple[str, float, str, str], str]:
    """(target, temperature, method, bench) -> why that cell shows "—" (in cell_frame order)."""
    return {(r.target, r.temperature, r.method, r.bench): r.reason for r in cells.itertuples() if r.reason}


def mean_over_benches(cells: pd.DataFrame, column: str, benches: Iterable[str] | None = None) -> pd.Series:
    """Mean of a per-bench value over the benches a method has (NaN cells skipped), per (block, method); by
    default over the mean benches of ``cells`` (names.mean_benches), as the main table's Mean."""
    part = cells[cells.bench.isin(mean_benches(cells.bench) if benches is None else list(benches))]
    return part.groupby(["target", "temperature", "method"], sort=True)[column].mean()


def of_kind(cells: pd.DataFrame, streams: bool) -> pd.DataFrame:
    """The cells of the single benchmarks (``streams=False``) or of the mixed streams, with only the methods
    that ran on at least one of them: a stream-only learner has no row in the benchmark table, and a
    stream run never enters a benchmark mean."""
    part = cells[cells.bench.map(is_stream) == streams]
    ran = part.groupby(["target", "temperature", "method"]).n_prompts.transform("sum") > 0
    return part[ran]


def blocks_of_kind(blocks: dict[Block, list[GenerationRecord]], streams: bool) -> dict[Block, list[GenerationRecord]]:
    """``blocks`` with only the records of the single benchmarks (or only those of the mixed streams)."""
    kept = {block: [r for r in recs if is_stream(r.bench) == streams] for block, recs in blocks.items()}
    return {block: recs for block, recs in kept.items() if recs}


def loaded_cells(files: Sequence[ResultFile]) -> frozenset:
    """(target, T, method, bench) of every cell with a turn recorded under load: other work above
    ``machine_load.TURN_LOAD`` CPUs at the reading of any side's record of that turn (flagged_keys)."""
    out = set()
    for f in files:
        flagged = flagged_keys(f.meta, f.records)
        out.update((*f.block, r.method, r.bench) for r in f.records if metrics.key(r) in flagged)
    return frozenset(out)


def dirty_cells(files: Sequence[ResultFile]) -> frozenset:
    """(target, T, method, bench) of every cell from a file made by a working tree with uncommitted code changes
    (its header's git_sha ends in -dirty): no commit holds the code that made it."""
    return frozenset((*f.block, r.method, r.bench) for f in files if str(f.meta.get("git_sha", "")).endswith("-dirty")
                     for r in f.records)


def flagged_turns(files: Sequence[ResultFile]) -> dict[str, tuple[int, int]]:
    """File name -> (turns recorded under load, turns), for files with any: what to re-time."""
    out = {}
    for f in files:
        flagged = flagged_keys(f.meta, f.records)
        if flagged:
            out[f.path.name] = (len(flagged), len({metrics.key(r) for r in f.records}))
    return out


def significant_cells(files: Sequence[ResultFile], reps: int = BOLD_REPS, seed: int = BOOTSTRAP_SEED,
                      streams: bool = False) -> frozenset:
    """(target, T, method, bench or 'mean') whose speedup is the column's best with a paired bootstrap interval
    (over conversations) against the runner-up of the same file above 1 (``paired.significant_best``; a
    runner-up from another file: no bold), over the single benchmarks (or, with ``streams``, the mixed streams;
    'mean' pools the mean benches of that kind, names.mean_benches); nothing when ``reps`` is 0."""
    if not reps:
        return frozenset()
    out = set()
    # The Mean column pools the table's mean benches (all blocks), as the Mean point does.
    mean_pool = mean_benches(r.bench for f in files for r in f.records if is_stream(r.bench) == streams)
    for block, group in files_by_block(files).items():
        labels = sorted({r.method for f in group for r in f.records} - {VANILLA})
        benches = sorted({r.bench for f in group for r in f.records if is_stream(r.bench) == streams})
        columns = [(bench, [bench]) for bench in benches] + ([(MEAN, mean_pool)] if benches else [])
        for column, pooled in columns:
            # Keys name the file: a best and a runner-up from different runs share no key, so no bold.
            sides = {label: {key: row for b in pooled for key, row in units(group, label, b, True).items()}
                     for label in labels}
            best = significant_best({k: v for k, v in sides.items() if v}, "speedup", reps, seed)
            if best:
                out.add((*block, best, column))
    return frozenset(out)


