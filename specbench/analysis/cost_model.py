"""The speedup a method would reach if a decode iteration cost only its model forwards: from a cost
curve measured apart from the run (``bench/forward_cost.py``: the target's forward time against the number
of rows after a realistic prefix, per dtype, stored per hardware), or else from the forward times the
engine measured in the run itself (decode phase only).

With a curve t(r) for the run's hardware and dtype, a verify call over r_i = rows_i + 1 rows costs t(r_i)
and vanilla's step t(1), so ideal = τ · t(1) / (t_draft + mean_i t(r_i)) with t_draft still the run's
drafter forwards (the curve measures the target only): efficiency then says how close a method comes to
what this machine allows, not only how much bookkeeping sits outside the run's own forwards.

Per verify call the method commits τ tokens and spends ``t_draft`` in drafter forwards (every owner
but the target: draft model, heads, pre-verifier, the target's own shallow layers) and ``t_verify`` in one target
forward over the bonus token and the drafted rows. Vanilla commits one token per target forward of
``t_step``. So

    ideal = τ · t_step / (t_draft + t_verify)

and the verify cost per drafted row is (t_verify − t_step) / rows. Efficiency = measured decode-only
speedup / ideal: both are decode-phase figures over the same prompt turns, so the gap is only what is
not a model forward (tree building, the walk, KV compaction, Python); prefill, which the end-to-end
speedup also counts, is left out of both."""

from __future__ import annotations

import bisect
import json
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Sequence

from specbench import metrics
from specbench.records import GenerationRecord

TARGET = "target"


@dataclass(frozen=True)
class CostModel:
    tau: float  # committed tokens per verify call
    step: float  # vanilla: seconds per target forward (one token)
    draft: float  # method: drafter-forward seconds per verify call
    verify: float  # method: target-forward seconds per verify call
    rows: float  # drafted nodes per verify call (the verify forward has rows + 1)

    @property
    def per_row(self) -> float:
        """Verify seconds per drafted row beyond a one-token forward."""
        return (self.verify - self.step) / self.rows if self.rows > 0 else math.nan

    @property
    def ideal(self) -> float:
        cost = self.draft + self.verify
        return self.tau * self.step / cost if cost > 0 else math.nan


def _sum(records: Sequence[GenerationRecord], table: str, target: bool) -> float:
    return sum(v for r in records for k, v in getattr(r, table).items() if (k == TARGET) == target)


def cost_model(method: Sequence[GenerationRecord], baseline: Sequence[GenerationRecord]) -> CostModel | None:
    """The cost model on the prompt turns both sides ran; None without forward times (older records)."""
    pairs = metrics.matched(method, baseline)
    ours, base = [m for m, _ in pairs], [b for _, b in pairs]
    calls = sum(r.n_verify for r in ours)
    base_forwards = sum(r.forwards.get(TARGET, 0) for r in base)
    if not calls or not base_forwards or not any(r.forward_times for r in ours + base):
        return None
    step = sum(r.forward_times.get(TARGET, 0.0) for r in base) / base_forwards
    return CostModel(tau=metrics.tau(ours), step=step, draft=_sum(ours, "forward_times", False) / calls,
                     verify=_sum(ours, "forward_times", True) / calls,
                     rows=sum(sum(r.tree_sizes) for r in ours) / calls)


CHAIN, TREE = "chain", "tree"  # a chain verifies with the causal kernel, a tree with an explicit mask


def batch_kind(kind: str, size: int) -> str:
    """The stored name of a kind measured over ``size`` requests per forward (batch 1 keeps the plain name)."""
    return kind if size == 1 else f"{kind}@B{size}"


@dataclass(frozen=True)
class CostCurve:
    """The target's forward seconds against rows (one verify forward over ``rows`` rows after the prefix),
    per kind (chain / tree), for one hardware and dtype."""

    hardware: str
    dtype: str
    seconds: dict[str, dict[int, float]]  # kind -> rows -> median seconds
    prefix: int = 0
    source: str = ""
    meta: dict = field(default_factory=dict)

    def time(self, rows: float, kind: str = CHAIN) -> float:
        """Seconds of one forward over ``rows`` rows: measured, or linear between the measured neighbours
        (NaN outside the measured range)."""
        curve = self.seconds.get(kind) or self.seconds.get(CHAIN) or {}
        xs = sorted(curve)
        if not xs or rows < xs[0] or rows > xs[-1]:
            return math.nan
        i = bisect.bisect_left(xs, rows)
        if xs[i] == rows:
            return curve[xs[i]]
        lo, hi = xs[i - 1], xs[i]
        return curve[lo] + (curve[hi] - curve[lo]) * (rows - lo) / (hi - lo)

    def steps(self, rows: float, kind: str = CHAIN) -> float:
        """Cost of a ``rows``-row forward in one-row steps: t(rows) / t(1)."""
        return self.time(rows, kind) / self.time(1, kind)

    def at_batch(self, size: int) -> "CostCurve | None":
        """The curve of one verify forward over ``size`` requests at once, each with the rows on the x axis
        (``bench/forward_cost.py --batch``, kinds ``chain@B4``, ``tree@B4``): batch 1 is this curve itself;
        None where that B was not measured. Its t(1) is vanilla's batched step at that B, so the ideal it
        gives compares a method with vanilla at the same B."""
        if size == 1:
            return self
        seconds = {kind: self.seconds[batch_kind(kind, size)] for kind in (CHAIN, TREE)
                   if batch_kind(kind, size) in self.seconds}
        return replace(self, seconds=seconds) if CHAIN in seconds else None

    def dips(self, kind: str = CHAIN, tolerance: float = 0.05) -> list[tuple[int, int]]:
        """(r, s) with r < s where s rows cost over ``tolerance`` less than r rows: where the curve is not
        monotone (each r reported once, with the larger row count that undercuts it most)."""
        curve = self.seconds.get(kind) or {}
        xs = sorted(curve)
        out = []
        for i, r in enumerate(xs):
            later = [s for s in xs[i + 1:] if curve[s] < curve[r] * (1 - tolerance)]
            if later:
                out.append((r, min(later, key=lambda s: curve[s])))
        return out


def slug(hardware: str) -> str:
    """A file name for a hardware string: 'AMD EPYC [family 25 model 1, avx2 only] (2 threads)' ->
    'amd-epyc-family-25-model-1-avx2-only-2-threads'."""
    return re.sub(r"[^a-z0-9]+", "-", hardware.lower()).strip("-") or "unknown"


def curve_path(root: str | Path, hardware: str, target: str) -> Path:
    """One file per machine and target: ``<hardware-slug>--<target-slug>.json`` (a target's forward cost
    says nothing about another's, so a pair's 1.5B target and the embedded 135M one keep separate curves)."""
    return Path(root) / f"{slug(hardware)}--{slug(target)}.json"


def load_curve(root: str | Path, hardware: str, dtype: str, target: str) -> CostCurve | None:
    """The curve measured on ``hardware`` for ``target`` in ``dtype``, or None."""
    path = curve_path(root, hardware, target)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    if data.get("hardware") != hardware or data.get("target") != target:
        return None
    curves = (data.get("curves") or {}).get(str(dtype))
    if not curves:
        return None
    seconds = {kind: {int(r): float(t) for r, t in rows.items()} for kind, rows in curves.items()}
    return CostCurve(hardware, str(dtype), seconds, int(data.get("prefix") or 0), str(path),
                     {k: v for k, v in data.items() if k != "curves"})


def curve_model(method: Sequence[GenerationRecord], baseline: Sequence[GenerationRecord],
                curve: CostCurve) -> CostModel | None:
    """The cost model with the target's forwards taken from ``curve``: each verify call's rows (its tree plus
    the bonus row) priced by the curve, chains on the chain curve and trees on the tree curve; the drafter's
    forwards from the run."""
    pairs = metrics.matched(method, baseline)
    ours = [m for m, _ in pairs]
    calls = sum(r.n_verify for r in ours)
    if not calls:
        return None
    verify = 0.0
    for r in ours:
        # A record counts its chain calls, not which ones they were: each call is priced at the record's mix
        # (a chain method's records are all chains, a tree method's all trees; older records: trees).
        share = max(r.chain_calls, 0) / max(len(r.tree_sizes), 1)
        for size in r.tree_sizes:
            verify += share * curve.time(size + 1, CHAIN) + (1 - share) * curve.time(size + 1, TREE)
    if not math.isfinite(verify):
        return None
    return CostModel(tau=metrics.tau(ours), step=curve.time(1, CHAIN), draft=_sum(ours, "forward_times", False) / calls,
                     verify=verify / calls, rows=sum(sum(r.tree_sizes) for r in ours) / calls)


def ideal_and_efficiency(method: Sequence[GenerationRecord], baseline: Sequence[GenerationRecord],
                         curve: CostCurve | None = None) -> tuple[float, float]:
    """(ideal speedup, measured decode-only speedup / ideal); NaN where the records cannot say."""
    return ideal_with_source(method, baseline, curve)[:2]


def ideal_with_source(method: Sequence[GenerationRecord], baseline: Sequence[GenerationRecord],
                      curve: CostCurve | None = None) -> tuple[float, float, str]:
    """(ideal, efficiency, where the target's forward times came from: 'curve' or 'run'). With a ``curve`` for
    the run's hardware and dtype it is used; a tree larger than the curve measured falls back to the run's
    own forwards, and the source says so."""
    model, source = (curve_model(method, baseline, curve), "curve") if curve is not None else (None, "")
    if model is None:
        model, source = cost_model(method, baseline), "run"
    if model is None or not math.isfinite(model.ideal) or model.ideal <= 0:
        return math.nan, math.nan, ""
    return model.ideal, metrics.speedup(method, baseline, decode_only=True) / model.ideal, source
