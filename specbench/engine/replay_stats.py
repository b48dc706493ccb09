"""How far replayed walks are from the target's law: a chi-square test and a total-variation bound.

Each replayed row gives the counts of the tokens committed there and the row's exact law p (from the
captured logits). A row's vocabulary is split into cells fixed by p and the tree alone, never by the
data: every drafted child token, the ``TOP`` likeliest tokens, then the rest in ``TAIL_BINS`` bins of
equal mass (tokens with p = 0 apart: committing one is an error outright). Cells expected under
``MIN_EXPECTED`` times are merged. On these cells, summed over rows:

* ``chi2``: Pearson's statistic, and its p-value against exact sampling;
* ``tv_bound``: a 99% upper bound on the mean, over committed tokens, of the total variation between
  the law of the token committed at its row and that row's p. Pearson's statistic is noncentral
  chi-square with noncentrality lambda = sum_r n_r D_r, D_r the chi-square divergence of row r's
  law from p (n_r its visits); Cauchy-Schwarz gives TV_r <= sqrt(D_r) / 2, and by Jensen the mean
  TV per committed token is <= sqrt(lambda / N) / 2 (N = sum_r n_r). The bound puts lambda's 99%
  upper confidence limit there (the noncentral chi-square CDF, exactly, as a Poisson mixture).
  Pooling rows is what makes it tight: noise grows with the square root of the cells, signal with N.
* ``detectable_tv``: the same bound turned around, the mean TV per counted token that the test detects
  with 90% power (what a pass rules out, given only the number of tokens counted and the dof).

By the chain rule of couplings, a step's committed tokens differ from the target's law by at most the
sum over its depths of these per-row TVs, so the mean per committed token bounds the bias per token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

TOP = 32
TAIL_BINS = 8
MIN_EXPECTED = 5.0
CONFIDENCE = 0.99


@dataclass
class RowTally:
    """One row's committed tokens on its cells."""

    visits: int
    observed: np.ndarray  # [K] counts
    law: np.ndarray  # [K] exact cell probabilities (sum 1)
    impossible: int  # tokens committed that p gives no mass


def cells(p: torch.Tensor, drafted: list[int]) -> torch.Tensor:
    """[V] cell index of every token (-1: p = 0): drafted tokens and the ``TOP`` likeliest alone, the
    rest in ``TAIL_BINS`` bins of equal mass."""
    cell = torch.full(p.shape, -1, dtype=torch.long)
    order = torch.argsort(p.float(), descending=True)
    p = p.double()
    alone = list(dict.fromkeys([int(t) for t in drafted if p[t] > 0] + order[:TOP][p[order[:TOP]] > 0].tolist()))
    cell[torch.tensor(alone, dtype=torch.long)] = torch.arange(len(alone))
    rest = order[(cell[order] < 0) & (p[order] > 0)]
    if rest.numel():
        mass = p[rest]
        before = mass.cumsum(0) - mass
        cell[rest] = len(alone) + (before / mass.sum() * TAIL_BINS).long().clamp(max=TAIL_BINS - 1)
    return cell


def tally(counts: torch.Tensor, p: torch.Tensor, drafted: list[int], cell: torch.Tensor | None = None) -> RowTally:
    """``counts`` [V] on the cells of ``p`` (``cell``: those cells, when already computed)."""
    cell = cells(p, drafted) if cell is None else cell
    k = int(cell.max()) + 1
    live = cell >= 0
    observed = torch.zeros(k, dtype=torch.long).index_add_(0, cell[live], counts[live].long())
    law = torch.zeros(k, dtype=torch.float64).index_add_(0, cell[live], p.double()[live])
    return RowTally(int(counts.sum()), observed.numpy(), (law / law.sum()).numpy(), int(counts[~live].sum()))


@dataclass(frozen=True)
class Verdict:
    rows: int
    visits: int  # committed tokens counted at rows that test something (N)
    untested: int  # committed tokens at rows visited too rarely to test
    chi2: float
    dof: int
    p_value: float
    tv: float  # sqrt(max(chi2 - dof, 0) / N) / 2: the bound's point estimate
    tv_bound: float  # 99% upper bound on the mean TV per committed token
    impossible: int  # committed tokens the target gives no mass

    @property
    def detected(self) -> bool:
        return self.impossible > 0 or self.p_value < 1e-3


def chi2_sf(stat: float, dof: int) -> float:
    """P(chi2_dof >= stat)."""
    if dof <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def noncentral_chi2_cdf(x: float, dof: int, lam: float) -> float:
    """P(chi2_dof(lam) <= x): the Poisson(lam / 2) mixture of central chi-square CDFs."""
    mu = lam / 2
    spread = 40 * math.sqrt(mu) + 40
    j = torch.arange(max(0, int(mu - spread)), int(mu + spread) + 1, dtype=torch.float64)
    log_weight = -mu + j * math.log(mu) - torch.lgamma(j + 1) if mu > 0 else torch.where(j == 0, 0.0, -math.inf)
    central = torch.special.gammainc(dof / 2 + j, torch.tensor(x / 2, dtype=torch.float64))
    return float((log_weight.exp() * central).sum())


def noncentrality_bound(stat: float, dof: int, confidence: float = CONFIDENCE) -> float:
    """The largest lambda under which a statistic as small as ``stat`` has probability >= 1 - confidence."""
    tail = 1 - confidence
    if dof <= 0 or noncentral_chi2_cdf(stat, dof, 0.0) <= tail:
        return 0.0
    hi = max(2 * (stat - dof), 10.0) + 10 * math.sqrt(stat + dof)
    while noncentral_chi2_cdf(stat, dof, hi) > tail:
        hi *= 2
    lo = 0.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if noncentral_chi2_cdf(stat, dof, mid) > tail else (lo, mid)
    return hi


def chi2_critical(dof: int, alpha: float) -> float:
    """The statistic a central chi-square with ``dof`` degrees exceeds with probability ``alpha``."""
    lo, hi = 0.0, dof + 10 * math.sqrt(2 * dof) + 50
    while chi2_sf(hi, dof) > alpha:
        hi *= 2
    for _ in range(80):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chi2_sf(mid, dof) > alpha else (lo, mid)
    return hi


def detectable_tv(dof: int, visits: int, alpha: float = 1e-3, power: float = 0.9) -> float:
    """The mean TV per counted token (on the test's cells) that a chi-square with ``dof`` degrees over
    ``visits`` counted tokens detects at level ``alpha`` with probability ``power`` at least: the
    noncentrality lambda* at which that power is reached, and TV <= sqrt(lambda / N) / 2 (as for
    ``tv_bound``) turned around: a mean TV above sqrt(lambda* / N) / 2 forces lambda above lambda*."""
    if dof <= 0 or visits <= 0:
        return math.inf
    critical = chi2_critical(dof, alpha)
    lo, hi = 0.0, 10.0 + critical
    while noncentral_chi2_cdf(critical, dof, hi) > 1 - power:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if noncentral_chi2_cdf(critical, dof, mid) > 1 - power else (lo, mid)
    return 0.5 * math.sqrt(hi / visits)


def _pearson(observed: np.ndarray, expected: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic with cells expected under ``MIN_EXPECTED`` times merged into one (itself
    folded into the smallest kept cell when still too small)."""
    small = expected < MIN_EXPECTED
    obs, exp = list(observed[~small]), list(expected[~small])
    if small.any():
        o, e = observed[small].sum(), expected[small].sum()
        if e >= MIN_EXPECTED or not exp:
            obs.append(o)
            exp.append(e)
        else:
            i = int(np.argmin(exp))
            obs[i] += o
            exp[i] += e
    if len(exp) < 2:
        return 0.0, 0
    obs_a, exp_a = np.asarray(obs, dtype=np.float64), np.asarray(exp, dtype=np.float64)
    return float(((obs_a - exp_a) ** 2 / exp_a).sum()), len(exp) - 1


def judge(tallies: list[RowTally]) -> Verdict:
    """The verdict over all rows. Rows visited too rarely to hold two cells expected ``MIN_EXPECTED``
    times test nothing; their visits are ``untested`` and left out of N."""
    stat, dof, visits, untested, impossible = 0.0, 0, 0, 0, 0
    for t in tallies:
        impossible += t.impossible
        s, d = _pearson(t.observed, t.visits * t.law) if t.visits else (0.0, 0)
        stat, dof = stat + s, dof + d
        visits, untested = (visits + t.visits, untested) if d else (visits, untested + t.visits)
    n = max(visits, 1)
    return Verdict(len(tallies), visits, untested, stat, dof, chi2_sf(stat, dof),
                   0.5 * math.sqrt(max(stat - dof, 0.0) / n), 0.5 * math.sqrt(noncentrality_bound(stat, dof) / n),
                   impossible)


def tallies_of(replay, probs: torch.Tensor, tree, cache: dict | None = None) -> list[RowTally]:
    """One ``RowTally`` per row the replay reached; the cells of row r single out r's drafted children.
    ``cache``: row -> cells, shared between replays of the same tree."""
    cache = {} if cache is None else cache
    out = []
    for row, counts in sorted(replay.counts.items()):
        drafted = list(tree.children.get(row - 1, {}))
        if row not in cache:
            cache[row] = cells(probs[row], drafted)
        out.append(tally(counts, probs[row], drafted, cache[row]))
    return out
