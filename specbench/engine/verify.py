"""Acceptance rules: which drafted nodes the target accepts, and the bonus token it adds.

All rules take the target logits of every verify row ([root, nodes...]) and return the accepted
node indices plus the bonus token. At temperature 0 the greedy walk reproduces vanilla greedy
decoding; at temperature > 0 every rule here leaves the committed tokens distributed exactly as
vanilla sampling with the same ``SamplingParams`` (docs/methods.md#verification):

* chains and sampled trees: rule C (SpecInfer multi-draft rejection; a chain is one child each),
* deterministic trees: rule A (sample from the target, follow a matching child) or rule B
  (recursive rejection over deterministic siblings, EAGLE-style). A and B give the same output
  distribution; A is the default because it is one batched ``multinomial``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Sequence

import torch

from specbench.engine.tree import DraftTree, SiblingKind


@dataclass(frozen=True)
class SamplingParams:
    """Decoding distribution shared by the baseline and every method's verifier."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class TreeRule(str, Enum):
    SAMPLE_AND_MATCH = "A"
    RECURSIVE_REJECTION = "B"
    MULTI_DRAFT = "C"


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Tempered, top-k/top-p filtered probabilities in float32 (rows = positions)."""
    if params.greedy:
        raise ValueError("logits_to_probs is for temperature > 0; use argmax at temperature 0")
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token when the mass strictly before it already reaches top_p (keeps >= 1 token).
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """The baseline's next-token rule for one row of logits: argmax at T=0, else a draw."""
    if params.greedy:
        return int(logits.argmax(-1))
    return draw(logits_to_probs(logits.reshape(1, -1), params), generator)


@dataclass
class WalkResult:
    accepted: list[int]  # node indices along the accepted path, in depth order
    bonus: int  # token sampled (or argmax) at the row where the walk stopped

    @property
    def stop_row(self) -> int:
        """Verify row whose target distribution produced the bonus (0 = root)."""
        return 0 if not self.accepted else self.accepted[-1] + 1


# Every random draw happens on the generator's device: PyTorch refuses a CUDA generator for a CPU
# draw (and vice versa), and the engine makes its generator on the target's device.
def _uniform(generator: torch.Generator | None) -> float:
    device = generator.device if generator is not None else None
    return float(torch.rand((), generator=generator, device=device))


def on_generator_device(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """``probs`` moved to the generator's device (a no-op when already there or unseeded)."""
    return probs if generator is None or probs.device == generator.device else probs.to(generator.device)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token ~ ``probs`` ([V] or [1, V]) with ``generator`` (drafters sample through this too)."""
    return int(torch.multinomial(on_generator_device(probs, generator), 1, generator=generator).reshape(-1)[0])



def _normalise(p: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    total = p.sum()
    # A residual with no mass can only arise from float round-off when p == q; the rejection
    # that led here then had probability ~0, so falling back to p changes nothing measurable.
    return fallback if total <= 1e-12 else p / total


def follow(tree: DraftTree, choices: list[int]) -> WalkResult:
    """Walk down while the child whose token equals the target's choice at the current row exists."""
    node, accepted = -1, []
    while True:
        y = choices[node + 1]
        child = tree.children.get(node, {}).get(y)
        if child is None:
            return WalkResult(accepted, y)
        accepted.append(child)
        node = child


def greedy_walk(tree: DraftTree, logits: torch.Tensor) -> WalkResult:
    return follow(tree, logits.argmax(-1).tolist())


def forced_walk(tree: DraftTree, logits: torch.Tensor, upcoming: Sequence[int]) -> WalkResult:
    """Teacher forcing (T = 0): the greedy walk with the given next tokens in place of the target's
    choices. A row at depth d chooses ``upcoming[d]``, so a node is accepted when it equals the token
    forced at its depth and the bonus is the forced one; rows deeper than ``upcoming`` keep their argmax."""
    choices = logits.argmax(-1).tolist()
    for row, depth in enumerate([0, *tree.depths.tolist()]):
        if depth < len(upcoming):
            choices[row] = int(upcoming[depth])
    return follow(tree, choices)


def sample_and_match(tree: DraftTree, probs: torch.Tensor, generator: torch.Generator | None) -> WalkResult:
    """Rule A: draw y ~ p at every row (one batched multinomial), then follow matching children."""
    probs = on_generator_device(probs, generator)
    return follow(tree, torch.multinomial(probs, 1, generator=generator).squeeze(-1).tolist())


def recursive_rejection(tree: DraftTree, probs: torch.Tensor, generator: torch.Generator | None) -> WalkResult:
    """Rule B: deterministic siblings x_1..x_m; accept x_j with prob p(x_j) (p renormalised after
    zeroing each rejected sibling); none accepted -> bonus ~ p."""
    node, accepted = -1, []
    while True:
        p = probs[node + 1].clone()
        moved = False
        for token, child in tree.children.get(node, {}).items():
            if _uniform(generator) < float(p[token]):
                accepted.append(child)
                node, moved = child, True
                break
            p[token] = 0.0
            p = _normalise(p, probs[node + 1])
        if not moved:
            return WalkResult(accepted, draw(p, generator))


def multi_draft_rejection(tree: DraftTree, probs: torch.Tensor, generator: torch.Generator | None) -> WalkResult:
    """Rule C: siblings sampled from q (i.i.d. or without replacement). Accept x_j with
    prob min(1, p/q); on rejection p <- norm(max(0, p - q)); none accepted -> bonus ~ p.
    A chain of sampled drafts is the one-child case (Leviathan et al. / Chen et al.)."""
    if tree.q is None:
        raise ValueError("rule C needs the draft distribution q of every node")
    without_replacement = tree.kind == SiblingKind.SAMPLED_WITHOUT_REPLACEMENT
    node, accepted = -1, []
    kids_of: dict[int, list[int]] = {}  # keeps i.i.d. duplicates, unlike tree.children
    for c, parent in enumerate(tree.parent_list):
        kids_of.setdefault(parent, []).append(c)
    while True:
        p = probs[node + 1].clone()
        kids = kids_of.get(node, [])
        q = tree.q[kids[0]].to(p.device, torch.float32, copy=True) if kids else None
        if any(not torch.equal(tree.q[k], tree.q[kids[0]]) for k in kids[1:]):
            # The residual rule needs every sibling drawn from one q; reading the first child's for
            # siblings drawn from others would be biased.
            raise ValueError(f"rule C: the children of node {node} declare different q rows; siblings must share "
                             "their parent's proposal")
        moved = False
        for child in kids:
            x = tree.token_list[child]
            qx = float(q[x])
            if qx > 0 and _uniform(generator) < min(1.0, float(p[x]) / qx):
                accepted.append(child)
                node, moved = child, True
                break
            p = _normalise(torch.clamp(p - q, min=0.0), p)
            if without_replacement:
                q[x] = 0.0
                q = _normalise(q, q)
        if not moved:
            return WalkResult(accepted, draw(p, generator))


def choose_rule(tree: DraftTree, rule: TreeRule | None = None) -> TreeRule:
    """The rule ``walk`` verifies ``tree`` with at T > 0: ``rule`` when given (refused where it is not
    lossless for the tree's kind), else A for deterministic siblings and C for sampled ones."""
    if rule is None:
        return TreeRule.SAMPLE_AND_MATCH if tree.kind == SiblingKind.DETERMINISTIC else TreeRule.MULTI_DRAFT
    if rule != TreeRule.MULTI_DRAFT and tree.kind != SiblingKind.DETERMINISTIC:
        raise ValueError(f"rule {rule.value} is only lossless for deterministic siblings; this tree is {tree.kind.value}")
    return rule


def walk(
    tree: DraftTree,
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    rule: TreeRule | None = None,
) -> WalkResult:
    """Accept a path through ``tree`` given target logits for rows [root, nodes...]."""
    if params.greedy:
        return greedy_walk(tree, logits)
    probs = logits_to_probs(logits, params)
    rule = choose_rule(tree, rule)
    if rule == TreeRule.MULTI_DRAFT:
        return multi_draft_rejection(tree, probs, generator)
    if rule == TreeRule.RECURSIVE_REJECTION:
        return recursive_rejection(tree, probs, generator)
    return sample_and_match(tree, probs, generator)
