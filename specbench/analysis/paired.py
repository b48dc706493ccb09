"""Paired bootstrap over conversations: is one side's speedup (or τ, or T_D%) really above another's?

Each side contributes one row of additive totals per prompt turn (``unit_columns``); two sides are
paired on the turns both ran, and the turns of one conversation (MT-Bench's two; one elsewhere) are
summed into one row (``by_conversation``): turn 2 is rendered over turn 1's answer and timed right after
it, so the two are not independent draws, and resampling them apart would narrow the interval below
the noise. One resample draws the same conversations for both sides, so prompt difficulty cancels out
of the ratio. Every metric is a ratio of pooled sums, so a resample needs only the resampled column
sums (``resampled_sums``)."""

from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np

from specbench.records import GenerationRecord

REPS = 2000
SEED = 0
LEVEL = 0.95
MIN_UNITS = 5  # fewer paired conversations than this: a verdict would rest on one or two prompts

# Column order of a unit row.
TOK, SEC, VTOK, VSEC, COMMITTED, CALLS, DRAFT, DECODE = range(8)
METRICS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "speedup": lambda s: (s[..., TOK] / s[..., SEC]) / (s[..., VTOK] / s[..., VSEC]),
    "tau": lambda s: s[..., COMMITTED] / s[..., CALLS],
    "td": lambda s: s[..., DRAFT] / s[..., DECODE],
}
METRIC_LABELS = {"speedup": "Spd", "tau": "τ", "td": "T_D%"}


def unit_columns(record: GenerationRecord, vanilla: GenerationRecord | None) -> list[float]:
    """One prompt turn's additive totals; the vanilla twin's columns are NaN when it has none."""
    vtok, vsec = (vanilla.num_new, vanilla.total_time) if vanilla is not None else (math.nan, math.nan)
    return [record.num_new, record.total_time, vtok, vsec, record.committed, record.n_verify,
            record.times.get("draft", 0.0), record.decode_time]


def resampled_sums(columns: np.ndarray, reps: int = REPS, seed: int = SEED) -> np.ndarray:
    """(reps, k) column sums of ``reps`` resamples (n rows drawn with replacement) of an (n, k) array:
    how often each row was drawn, times the rows, in one matrix product."""
    n = len(columns)
    draws = np.random.default_rng(seed).integers(0, n, size=(reps, n))
    counts = np.bincount((draws + n * np.arange(reps)[:, None]).ravel(), minlength=reps * n).reshape(reps, n)
    return counts @ columns


def percentile_interval(values: np.ndarray, level: float = LEVEL) -> tuple[float, float]:
    values = values[np.isfinite(values)]
    if not len(values):
        return math.nan, math.nan
    lo, hi = np.percentile(values, [50 * (1 - level), 50 * (1 + level)])
    return float(lo), float(hi)


def usable(metric: str, rows: np.ndarray) -> np.ndarray:
    """Rows a metric can use: a speedup needs the vanilla twin."""
    return np.isfinite(rows[:, VSEC]) if metric == "speedup" else np.ones(len(rows), dtype=bool)


def paired_ratio(a: np.ndarray, b: np.ndarray, metric: str, reps: int = REPS,
                 seed: int = SEED) -> tuple[float, float, float]:
    """metric(a) / metric(b) on paired rows (row i of both = the same conversation): point, 95% interval."""
    fn = METRICS[metric]
    with np.errstate(divide="ignore", invalid="ignore"):
        point = float(fn(a.sum(0)) / fn(b.sum(0)))
        if reps <= 0 or not len(a):
            return point, math.nan, math.nan
        both = resampled_sums(np.hstack([a, b]), reps, seed)
        k = a.shape[1]
        lo, hi = percentile_interval(fn(both[:, :k]) / fn(both[:, k:]))
    return point, lo, hi


def unpaired_ratio(a: np.ndarray, b: np.ndarray, metric: str, reps: int = REPS,
                   seed: int = SEED) -> tuple[float, float, float]:
    """metric(a) / metric(b) for two independent sets of turns (e.g. the first and last quarter of a
    stream): each resampled on its own."""
    fn = METRICS[metric]
    with np.errstate(divide="ignore", invalid="ignore"):
        point = float(fn(a.sum(0)) / fn(b.sum(0)))
        if reps <= 0 or not len(a) or not len(b):
            return point, math.nan, math.nan
        lo, hi = percentile_interval(fn(resampled_sums(a, reps, seed)) / fn(resampled_sums(b, reps, seed + 1)))
    return point, lo, hi


def verdict(lo: float, hi: float, direction: str, threshold: float = 1.0, n: int = 0,
            min_units: int = MIN_UNITS) -> str:
    """'holds' when the whole interval lies on the claimed side of ``threshold``, 'reversed' when it lies
    on the other side, else 'inconclusive'; 'no data' without paired conversations."""
    if n == 0 or not (math.isfinite(lo) and math.isfinite(hi)):
        return "no data"
    if n < min_units:
        return "inconclusive"
    if direction == ">":
        return "holds" if lo > threshold else "reversed" if hi < threshold else "inconclusive"
    if direction == ">=":
        return "holds" if lo >= threshold else "reversed" if hi < threshold else "inconclusive"
    if direction == "<":
        return "holds" if hi < threshold else "reversed" if lo > threshold else "inconclusive"
    raise ValueError(f"unknown direction {direction!r}")


def conversation(key: tuple) -> tuple:
    """A unit key without its last element, the turn: (bench, prompt_id) or (file, bench, prompt_id)."""
    return tuple(key[:-1])


def by_conversation(rows: dict) -> dict:
    """Unit rows keyed by turn -> one summed row per conversation (a NaN in any turn stays NaN: a
    conversation missing a vanilla twin cannot give a speedup)."""
    out: dict = {}
    for key in sorted(rows, key=str):
        row = np.asarray(rows[key], dtype=float)
        conv = conversation(key)
        out[conv] = out[conv] + row if conv in out else row
    return out


def pair_rows(a: dict, b: dict) -> tuple[np.ndarray, np.ndarray, list]:
    """Rows of two sides on the turns both ran, summed per conversation (``by_conversation``), as aligned
    arrays over the conversation keys (sorted)."""
    turns = set(a) & set(b)
    a, b = by_conversation({k: a[k] for k in turns}), by_conversation({k: b[k] for k in turns})
    keys = sorted(a, key=str)
    shape = (0, 8)
    return (np.array([a[k] for k in keys], dtype=float).reshape(shape if not keys else (len(keys), -1)),
            np.array([b[k] for k in keys], dtype=float).reshape(shape if not keys else (len(keys), -1)), keys)


def significant_best(sides: dict[str, dict], metric: str = "speedup", reps: int = REPS,
                     seed: int = SEED) -> str | None:
    """The side whose metric is highest and whose paired interval against the runner-up lies above 1
    (None if no side is that clearly first). ``sides`` maps a label to its unit rows by key; keys that
    name the file keep two runs apart: a best and a runner-up from different files share no key, so
    nothing is bold."""
    points = {}
    for label, rows in sides.items():
        arr = np.array(list(rows.values()), dtype=float).reshape(-1, 8)
        arr = arr[usable(metric, arr)]
        if len(arr):
            with np.errstate(divide="ignore", invalid="ignore"):
                points[label] = float(METRICS[metric](arr.sum(0)))
    ranked = sorted((p, label) for label, p in points.items() if math.isfinite(p))
    if not ranked:
        return None
    best = ranked[-1][1]
    if len(ranked) == 1:
        return None  # nothing to beat: bold would say nothing
    runner_up = ranked[-2][1]
    a, b, keys = pair_rows(sides[best], sides[runner_up])
    keep = usable(metric, a) & usable(metric, b)
    a, b = a[keep], b[keep]
    if len(a) < MIN_UNITS:
        return None
    _, lo, _ = paired_ratio(a, b, metric, reps, seed)
    return best if math.isfinite(lo) and lo > 1 else None
