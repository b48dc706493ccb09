"""SpS's note under the forward-cost table (registered under ``specbench.cost_notes`` in pyproject.toml):
its verify cost in one-row steps per γ, from the run's own timings, beside what the hardware's cost curve
prices a γ+1-row forward at, and which of the two explains a cost that is not monotone in γ."""

from __future__ import annotations

from typing import Sequence

from specbench.analysis.cost_model import CHAIN, CostCurve, cost_model
from specbench.analysis.report.names import VANILLA
from specbench.analysis.report.records import ResultFile


def _gamma(f: ResultFile, label: str) -> int | None:
    options = (f.meta.get("method_options") or {}).get(label) or {}
    try:
        return int(options["gamma"])
    except (KeyError, TypeError, ValueError):
        return None


def verify_cost_note(files: Sequence[ResultFile], curve: CostCurve) -> str | None:
    """SpS's verify cost in one-row steps per γ, from the run (verify seconds per call / vanilla's step) beside
    the curve's t(γ+1)/t(1), and what the curve says about a cost that is not monotone in γ."""
    run: dict[int, float] = {}
    for f in files:
        base = [r for r in f.records if r.method == VANILLA]
        for label, info in f.sides().items():
            gamma = _gamma(f, label)
            if info.method != "sps" or gamma is None or gamma in run:
                continue
            model = cost_model([r for r in f.records if r.method == label], base)
            if model is not None and model.step > 0:
                run[gamma] = model.verify / model.step
    if len(run) < 2:
        return None
    gammas = sorted(run)
    curve_steps = {g: curve.steps(g + 1, CHAIN) for g in gammas}
    shown = ", ".join(f"γ={g}: run {run[g]:.2f}, curve {curve_steps[g]:.2f}" for g in gammas)
    run_dips = [(a, b) for a, b in zip(gammas, gammas[1:]) if run[b] < run[a] * 0.95]
    curve_dips = [(r, s) for r, s in curve.dips(CHAIN) if gammas[0] + 1 <= r <= gammas[-1] + 1]
    text = f"SpS verify cost in one-row steps (verify forward over γ+1 rows / one-row step): {shown}. "
    if curve_dips:
        where = ", ".join(f"{r} rows cost more than {s}" for r, s in curve_dips)
        text += (f"The curve itself is not monotone here ({where}): the machine's matrix kernels cost a forward by "
                 "its row count in blocks (rows padded to the kernel's tile, another code path above a size), so "
                 "on this hardware a longer chain can verify for fewer steps; the run's non-monotone steps follow the "
                 "machine, not the method.")
    elif run_dips:
        text += ("The curve rises monotonically over these rows, so the run's dips "
                 f"({', '.join(f'γ={b} below γ={a}' for a, b in run_dips)}) are not the machine's cost: they are timing "
                 "noise of the run (load, drift between its turns); re-time it on an idle machine.")
    else:
        text += "Both rise monotonically with γ."
    return text
