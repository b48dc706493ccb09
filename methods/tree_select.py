"""Choosing a draft tree from scored candidates (pure): the best ``budget`` nodes closed under
ancestors, shared by the drafters that grow more candidates than they verify (EAGLE-3, SpecBlock)."""

from __future__ import annotations

import torch

from specbench.engine.tree import DraftTree, SiblingKind


def select_nodes(parents: torch.Tensor, scores: torch.Tensor, budget: int) -> torch.Tensor:
    """Indices (ascending, so still topological) of the best ``budget`` candidates by score, closed
    under ancestors. Sorting by (-score, index) puts a parent before its children (its score is
    >= theirs and its index smaller), so any prefix is already closed; the filter is a safeguard
    for scores that do not fall along paths."""
    order = torch.sort(-scores, stable=True).indices[:budget]
    parent_of = parents.tolist()
    kept: set[int] = set()
    for i in order.sort().values.tolist():
        if parent_of[i] < 0 or parent_of[i] in kept:
            kept.add(i)
    return torch.tensor(sorted(kept), dtype=torch.long)


def candidates_to_tree(tokens: torch.Tensor, parents: torch.Tensor, scores: torch.Tensor, budget: int) -> DraftTree:
    """Rerank recorded candidates (target-vocab ``tokens``, candidate-index ``parents``) into a tree."""
    keep = select_nodes(parents, scores, budget)
    parent_of = parents.tolist()
    new_index = {-1: -1} | {old: new for new, old in enumerate(keep.tolist())}
    new_parents = [new_index[parent_of[i]] for i in keep.tolist()]
    return DraftTree(tokens[keep], torch.tensor(new_parents, dtype=torch.long), scores=scores[keep],
                     kind=SiblingKind.DETERMINISTIC).dedup()
