"""Reduced draft vocabularies (EAGLE-3, SpecBlock): the most frequent tokens of the target's
regenerated responses, with ``d2t`` offsets and ``t2d`` membership as the published formats use."""

from __future__ import annotations

import torch


def build_vocab_mapping(token_counts: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The ``size`` most frequent token ids (ties: lower id first), as EAGLE-3's reduced vocabulary.

    Returns ``d2t`` [size] offsets (target id = draft id + d2t[draft id], draft ids in target-id
    order), ``t2d`` [V] bool membership, and the share of counted tokens inside the vocabulary."""
    counts = torch.as_tensor(token_counts).reshape(-1)
    if not 1 <= size <= counts.numel():
        raise ValueError(f"draft vocabulary size must be in [1, {counts.numel()}], got {size}")
    chosen = torch.sort(-counts, stable=True).indices[:size].sort().values
    d2t = chosen - torch.arange(size)
    t2d = torch.zeros(counts.numel(), dtype=torch.bool)
    t2d[chosen] = True
    total = float(counts.sum())
    coverage = float(counts[chosen].sum()) / total if total > 0 else 0.0
    return d2t, t2d, coverage
