"""T = 1 through the batched engine: every counted request's first DEPTH tokens follow the target's exact
law position by position (the sequential chi^2 and log-likelihood tests of test_deep_sampling.py),
while it shares continuous batches with neighbours of other prompt lengths and budgets (so rows join,
leave and sit at different lengths in every step). Each case has a negative control: the same run with
one deliberately broken batched step must fail the same test."""

from __future__ import annotations

import dataclasses
from collections import deque

import numpy as np
import pytest

from specbench.engine import batch_loop
from specbench.engine.batch_loop import BatchConfig, BatchRequest, generate_batch
from specbench.engine.batch_target import BatchTarget
from specbench.engine.loop import GenerationConfig
from stats import loglik_z, sequential_chi2
from test_deep_sampling import (ALPHA, BROKEN_SAMPLES, CASES, DEPTH, PROMPT, SAMPLES, accepting_one_more, exact_law,
                                params_of)

NEIGHBOURS = [[2], [0, 1, 2, 3, 3, 2, 1, 0, 1, 2, 0], [3, 3, 3]]
BATCH = BatchConfig(4, continuous=True)
# Every method that batches: those that draft the batch in one drafter forward (SpS, EAGLE-3, SpecBlock, DFlash,
# DDTree, Medusa, PACER) and one that loops over requests (PLD's chains); each with its own break (test_deep_sampling).
BREAKS = {name: CASES[name][1] for name in
          ("vanilla", "sps", "eagle3", "specblock", "dflash", "ddtree", "medusa", "pacer", "pld")}


def break_batched_step(monkeypatch, kind: str) -> None:
    real = BatchTarget.commit
    if kind == "forget_last_row":  # every request forgets its last kept row (for vanilla, the bonus)
        def commit(self, packed, kept):
            real(self, packed, kept)
            for b, length in enumerate(self.lengths):
                self.cache.truncate(b, length - 1)
        monkeypatch.setattr(BatchTarget, "commit", commit)
    elif kind == "rows_off_by_one":  # node i keeps the keys/values of the row before it
        def commit(self, packed, kept):
            real(self, packed, [[0] + [r - 1 for r in rows[1:]] for rows in kept])
        monkeypatch.setattr(BatchTarget, "commit", commit)
    elif kind == "accept_one_more":
        monkeypatch.setattr(batch_loop, "walk", accepting_one_more(batch_loop.walk))
    else:
        raise ValueError(kind)


def run_batched(name: str, samples: int):
    """``samples`` counted requests of PROMPT (one seed each), a neighbour after every second one."""
    target, drafter = CASES[name][0]()
    drafter.setup(target)
    config = GenerationConfig(max_new_tokens=DEPTH, sampling=params_of(name))
    queue = deque()
    for seed in range(samples):
        queue.append(BatchRequest(("counted", seed), PROMPT, dataclasses.replace(config, seed=seed)))
        if seed % 2:
            prompt = NEIGHBOURS[seed % len(NEIGHBOURS)]
            budget = DEPTH + 1 + seed % 5  # neighbours finish at other steps than the counted requests
            queue.append(BatchRequest(("neighbour", seed), prompt,
                                      dataclasses.replace(config, max_new_tokens=budget, seed=10_000 + seed)))
    sequences, accepted = [], []
    for request, record in generate_batch(target, drafter, queue, BATCH):
        if request.key[0] == "counted":
            assert len(record.new_tokens) == DEPTH
            sequences.append(tuple(record.new_tokens))
            accepted.extend(record.accept_lengths)
    return target, sequences, np.array(accepted)


def pvalue(name: str, samples: int) -> tuple[float, np.ndarray]:
    target, sequences, accepted = run_batched(name, samples)
    conditional, prefix_prob = exact_law(target, sequences, params_of(name))
    stat, dof, p_chi2 = sequential_chi2(sequences, conditional, prefix_prob)
    z, p_ll = loglik_z(sequences, conditional)
    print(f"{name} batched: chi2={stat:.1f} dof={dof} p={p_chi2:.2e} loglik z={z:.2f} p={p_ll:.2e} "
          f"mean accepted={accepted.mean():.2f} calls>=3={np.sum(accepted >= 3)}")
    return min(1.0, 2 * min(p_chi2, p_ll)), accepted


@pytest.mark.parametrize("name", list(BREAKS))
def test_batched_sampling_matches_target(name):
    p, accepted = pvalue(name, SAMPLES)
    if name != "vanilla":  # deep acceptances happened, so ragged compaction after them ran
        assert np.sum(accepted >= 3) >= 10, np.sum(accepted >= 3)
    assert p > ALPHA


@pytest.mark.parametrize("name", list(BREAKS))
def test_broken_batched_step_is_caught(name, monkeypatch):
    break_batched_step(monkeypatch, BREAKS[name])
    p, _ = pvalue(name, BROKEN_SAMPLES)
    assert p < ALPHA
