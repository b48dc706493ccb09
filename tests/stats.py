"""Goodness-of-fit helper for the losslessness tests."""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Callable, Sequence

import numpy as np
from scipy.stats import chi2, chisquare, norm


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


def sequential_chi2(samples: Sequence[Sequence[int]], conditional: Callable[[tuple], np.ndarray],
                    prefix_prob: Callable[[tuple], float], min_expected: float = 5.0,
                    min_prefix_count: float = 25.0) -> tuple[float, int, float]:
    """One chi^2 over every position of sampled sequences, against the exact conditionals.

    ``conditional(prefix)`` is the target's next-token distribution after ``prefix`` (a tuple of
    sampled tokens) and ``prefix_prob(prefix)`` the target's probability of the prefix itself.
    Position t of each sample goes to a bucket: its exact prefix when that prefix is expected at
    least ``min_prefix_count`` times (decided from exact probabilities, not from the data), else a
    pool keyed by (t, last token). Per bucket, O - E over next tokens (E = sum of each sample's own
    conditional) has covariance sum_i diag(p_i) - p_i p_i^T under the target; tokens expected
    fewer than ``min_expected`` times are merged. These per-bucket terms are martingale increments,
    so their quadratic forms add up to one chi^2 whose dof is the sum of the ranks (an exact prefix
    bucket gives Pearson's statistic). Returns (statistic, dof, p-value)."""
    n = len(samples)
    obs: dict = defaultdict(float)
    exp: dict = defaultdict(float)
    cov: dict = defaultdict(float)
    for seq in samples:
        for t, token in enumerate(seq):
            prefix = tuple(seq[:t])
            p = np.asarray(conditional(prefix), dtype=np.float64)
            if n * prefix_prob(prefix) >= min_prefix_count:
                key = (t, prefix)
            else:
                key = (t, "pool", prefix[-1] if prefix else None)
            onehot = np.zeros_like(p)
            onehot[token] = 1.0
            obs[key] = obs[key] + onehot
            exp[key] = exp[key] + p
            cov[key] = cov[key] + np.diag(p) - np.outer(p, p)
    stat, dof = 0.0, 0
    for key in obs:
        groups = _merge_small(exp[key], min_expected)
        if len(groups) < 2:
            continue
        merge = np.zeros((len(groups), len(exp[key])))
        for row, cells in enumerate(groups):
            merge[row, cells] = 1.0
        z = merge @ (obs[key] - exp[key])
        c = merge @ cov[key] @ merge.T
        stat += float(z @ np.linalg.pinv(c, rcond=1e-10, hermitian=True) @ z)
        dof += len(groups) - 1
    return stat, dof, float(chi2.sf(stat, dof)) if dof else 1.0


def _merge_small(expected: np.ndarray, min_expected: float) -> list[list[int]]:
    """Cells with expected counts >= min_expected, plus one merged cell of the rest (itself folded
    into the smallest kept cell when still too small)."""
    order = np.argsort(expected)
    small = [int(i) for i in order if expected[i] < min_expected]
    groups = [[int(i)] for i in order if expected[i] >= min_expected]
    if small:
        if expected[small].sum() >= min_expected or not groups:
            groups.append(small)
        else:
            groups[0] = groups[0] + small
    return groups if sum(expected) >= min_expected else []


def loglik_z(samples: Sequence[Sequence[int]], conditional: Callable[[tuple], np.ndarray]) -> tuple[float, float]:
    """z-score of the sampled tokens' total log-probability under the exact conditionals:
    sum_i log p_i(x_i) - E[log p_i] over the variance sum_i Var[log p_i] (martingale increments
    again). A sampler that draws from q != p loses E_q[log p] - E_p[log p] = H(p) - H(q) - KL(q||p)
    per token, which keeps one sign across prefixes when q is a corrupted copy of p, where the
    per-bucket chi^2 sees deviations pointing every way. Returns (z, two-sided p-value)."""
    total = mean = var = 0.0
    for seq in samples:
        for t, token in enumerate(seq):
            p = np.asarray(conditional(tuple(seq[:t])), dtype=np.float64)
            if p[token] <= 0:
                return float("-inf"), 0.0  # a token the target never samples
            live = p > 0
            logp = np.log(p[live])
            m = float((p[live] * logp).sum())
            total += float(np.log(p[token]))
            mean += m
            var += float((p[live] * logp ** 2).sum()) - m * m
    z = (total - mean) / np.sqrt(var) if var > 0 else 0.0
    return float(z), float(2 * norm.sf(abs(z)))
