"""The speedup a method would reach if a decode iteration cost only its model forwards, from the
forward times the engine measured (decode phase only).

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

import math
from dataclasses import dataclass
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


def ideal_and_efficiency(method: Sequence[GenerationRecord], baseline: Sequence[GenerationRecord]) -> tuple[float, float]:
    """(ideal speedup, measured decode-only speedup / ideal); NaN where the records cannot say."""
    model = cost_model(method, baseline)
    if model is None or not math.isfinite(model.ideal) or model.ideal <= 0:
        return math.nan, math.nan
    return model.ideal, metrics.speedup(method, baseline, decode_only=True) / model.ideal
