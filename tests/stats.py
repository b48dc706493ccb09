"""Goodness-of-fit helper for the losslessness tests."""

from __future__ import annotations

from collections import Counter

from scipy.stats import chisquare


def chi2_pvalue(samples: list[tuple], exact: dict[tuple, float], min_expected: float = 5.0) -> tuple[float, float]:
    """Pearson chi^2 of sampled tuples against exact probabilities; cells with small expected
    counts are pooled into one so the chi^2 approximation holds. Returns (statistic, p-value)."""
    n = len(samples)
    counts = Counter(samples)
    assert set(counts) <= set(exact), "sampled a sequence the target gives zero probability"
    obs, exp = [], []
    pooled_obs = pooled_exp = 0.0
    for cell, p in exact.items():
        if n * p >= min_expected:
            obs.append(counts.get(cell, 0))
            exp.append(n * p)
        else:
            pooled_obs += counts.get(cell, 0)
            pooled_exp += n * p
    if pooled_exp > 0:
        obs.append(pooled_obs)
        exp.append(pooled_exp)
    scale = sum(obs) / sum(exp)
    result = chisquare(obs, [e * scale for e in exp])
    return float(result.statistic), float(result.pvalue)
