"""DDTree: a draft tree from ONE DFlash forward (the DDTree paper, Algorithm 1; docs/methods.md#ddtree).

The drafter's per-position marginals q_1..q_{L-1} define the factorised surrogate Q(y) = Π q_i(y_i);
the B prefixes with the largest Π q are the tree that maximises the surrogate's expected
acceptance length (Props. 1-3). They are found best-first over rank tuples with a max-heap:

    build   (``best_first_prefixes``): pure, on top-K log-probs per depth, K = min(B, V)
    compile (``compile_tree``): the DraftTree over the popped prefixes; the engine's ``compile``
            phase turns it into depth positions and the ancestor-only mask, as for every method
    follow  the engine's walk: greedy at T = 0, rule A (sample from the target, match a child) at T > 0

In a batch the DFlash forward drafts every request at once (methods/dflash/drafter.py) and each request's
tree is built from its own marginals.

Budget B counts drafted nodes (the root, the bonus token, is not one). The paper sweeps
B in {16, ..., 1024} and peaks at 256-512 on an H200; on this CPU a verify of 16 nodes costs
~1.2x one token and 64 nodes ~2.3x (reports/cost_table.md), so our default is 32.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

from methods.dflash.drafter import DFlashDrafter
from methods.weights_options import drafter_weights
from specbench.engine.drafter import DecodeState
from specbench.options import option
from specbench.engine.tree import DraftTree, SiblingKind

METHOD = "ddtree"
Ranks = tuple[int, ...]  # 1-based rank per depth: (1, 3) = best token at depth 1, third best at depth 2


def best_first_prefixes(log_q: list[list[float]], budget: int) -> list[tuple[Ranks, float]]:
    """Algorithm 1: the ``budget`` rank tuples with the largest σ(ρ) = Σ_d log q_d^(ρ_d), in pop
    order (non-increasing σ, every parent before its children).

    ``log_q[d][k]`` is the log-prob of the (k+1)-th most likely token at depth d+1, sorted
    descending per depth; its width is K. Popping ρ pushes its next sibling (last rank + 1, if
    <= K) and its first child (rank 1 appended, if depth < L)."""
    depth_max = len(log_q)
    if budget <= 0 or depth_max == 0 or not log_q[0]:
        return []
    width = len(log_q[0])
    heap: list[tuple[float, int, Ranks]] = [(-log_q[0][0], 0, (1,))]  # (-σ, push order, ρ): a max-heap on σ
    pushes = 1
    popped: list[tuple[Ranks, float]] = []
    while heap and len(popped) < budget:
        neg, _, rho = heapq.heappop(heap)
        score = -neg
        popped.append((rho, score))
        d, last = len(rho), rho[-1]
        if last + 1 <= width:  # next sibling: swap the last token for the next-ranked one
            sibling = score - log_q[d - 1][last - 1] + log_q[d - 1][last]
            heapq.heappush(heap, (-sibling, pushes, rho[:-1] + (last + 1,)))
            pushes += 1
        if d < depth_max:  # first child: extend with the best token of the next depth
            heapq.heappush(heap, (-(score + log_q[d][0]), pushes, rho + (1,)))
            pushes += 1
    return popped


def compile_tree(prefixes: list[tuple[Ranks, float]], top_ids: list[list[int]]) -> DraftTree:
    """DraftTree over the popped prefixes (pop order is topological): token of ρ = top_ids[d-1][ρ_d - 1],
    parent = the node of ρ without its last rank. Positions and the mask are the engine's compile phase."""
    index: dict[Ranks, int] = {}
    tokens, parents, scores = [], [], []
    for i, (rho, score) in enumerate(prefixes):
        index[rho] = i
        tokens.append(top_ids[len(rho) - 1][rho[-1] - 1])
        parents.append(index[rho[:-1]] if len(rho) > 1 else -1)
        scores.append(score)
    return DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long),
                     scores=torch.tensor(scores), kind=SiblingKind.DETERMINISTIC)


def ddtree_from_log_probs(log_q: torch.Tensor, budget: int, to_target_ids=None) -> DraftTree:
    """The DDTree for marginals log_q [depth, V]: top-K per depth (K = min(B, V)), heap, compile.
    ``to_target_ids`` maps draft-vocabulary indices to target ids (reduced vocabularies)."""
    k = min(budget, log_q.shape[-1])
    top = torch.topk(log_q.float(), k, dim=-1)
    ids = top.indices if to_target_ids is None else to_target_ids(top.indices)
    return compile_tree(best_first_prefixes(top.values.tolist(), budget), ids.tolist())


@dataclass
class DDTreeOptions(drafter_weights("DFlash drafter folder", "ours or the published layout", "dflash")):
    # Paper: {16..1024}, best 256-512 on an H200; a CPU's verify cost grows past ~32 rows, so 32 here.
    budget: int = option(32, "Node budget B: drafted nodes per verify call, root excluded.", ge=1, tokens=True)


class DDTreeDrafter(DFlashDrafter):
    name = METHOD
    label = "DDTree"
    Options = DDTreeOptions
    budget_option = "budget"

    def __init__(self, options: DDTreeOptions | None = None, model=None) -> None:
        super().__init__(options, model)

    def tree_from(self, log_q: torch.Tensor) -> DraftTree:
        # untempered marginals: the tree ignores T (rule A keeps it lossless)
        return ddtree_from_log_probs(log_q, self.options.budget, self.model.to_target_ids)

    def end(self, state: DecodeState) -> dict:
        return {"block_size": self.model.block_size, "budget": self.options.budget}
