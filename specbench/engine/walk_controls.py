"""Three wrong acceptance walks, injected into ``verify`` for the length of a ``with`` block: the negative
controls of the end-to-end T = 1 check (``sampling_check.py``), which must catch each through every method
whose rule reaches it. Each patches a real function of ``verify.py``, so the engine's own ``walk`` commits
the wrong tokens; rule A (sample and match, every deterministic tree by default) reaches none of them.

* ``unnormalised_residual``: after a rejection the residual max(p - q, 0) is not divided by its mass beta;
  the mass it lost is filled back in proportion to the row's law before the rejection (what a bonus drawn
  by inverse CDF from the unnormalised residual, falling back to that law when its uniform runs past beta,
  commits). The bonus then follows r + (1 - beta) p instead of r / beta. Reached by rule C at every
  rejection (chains too) and rule B after each rejected sibling.
* ``biased_after_rejected_sibling``: what a walk reads only after rejecting an earlier sibling is sharpened
  (x^4, renormalised): the target rows of every node that is not its parent's first child (rules B and C),
  and under rule B the residual a later sibling is tested against. Reached only by trees with siblings under
  rule B or C: no registered method's trees by default (their sampled trees are chains, their trees with
  siblings get rule A), deterministic trees verified with ``tree_rule=B``, and sampled trees with siblings.
  The residual's part is what gives it power on a real target, where a later sibling is seldom accepted
  and the rows below it are reached seldom; rule B's wrong copy below carries it.
* ``reused_uniform``: the bonus draw reuses the uniform of the last accept test instead of a fresh one
  (inverse CDF of the same number). Reached by rule C at every step and by rule B.

``CONTROLS`` maps each name to its context manager and ``REACHED_BY`` names the rules that reach it."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch

from specbench.engine import verify
from specbench.engine.replay import cdf_of, inverse_cdf
from specbench.engine.tree import DraftTree


@contextmanager
def _patched(replacements: dict[str, Callable]) -> Iterator[None]:
    originals = {name: getattr(verify, name) for name in replacements}
    for name, fn in replacements.items():
        setattr(verify, name, fn)
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(verify, name, fn)


@contextmanager
def unnormalised_residual() -> Iterator[None]:
    def refilled(p: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
        # With fallback = p itself (rule C's q without replacement) this is still p / sum(p): only a residual
        # taken from another law is wrong.
        return p + (1 - p.sum()).clamp(min=0) * fallback / fallback.sum()

    with _patched({"_normalise": refilled}):
        yield


def later_siblings(tree: DraftTree) -> list[int]:
    """Nodes that have an earlier sibling (node order, the order rules B and C try siblings in)."""
    seen: set[int] = set()
    later = []
    for child, parent in enumerate(tree.parent_list):
        if parent in seen:
            later.append(child)
        seen.add(parent)
    return later


def _sharpened(probs: torch.Tensor) -> torch.Tensor:
    sharp = probs ** 4  # read at a quarter of the temperature
    return sharp / sharp.sum(-1, keepdim=True)


def _sharpening_later_siblings(rule):
    def biased(tree: DraftTree, probs: torch.Tensor, generator: torch.Generator | None = None):
        rows = torch.tensor(later_siblings(tree), dtype=torch.long) + 1
        if rows.numel():
            probs = probs.clone()
            probs[rows] = _sharpened(probs[rows])
        return rule(tree, probs, generator)
    return biased


def _rule_b_sharpening_later_tests(tree: DraftTree, probs: torch.Tensor, generator: torch.Generator | None = None):
    """A wrong copy of ``verify.recursive_rejection``: a sibling tried after a rejected one is tested against
    the residual sharpened, not the residual (the bonus still comes from the residual)."""
    node, accepted = -1, []
    while True:
        residual = probs[node + 1].clone()
        moved = False
        for tried, (token, child) in enumerate(tree.children.get(node, {}).items()):
            law = _sharpened(residual) if tried else residual
            if verify._uniform(generator) < float(law[token]):
                accepted.append(child)
                node, moved = child, True
                break
            residual[token] = 0.0
            residual = verify._normalise(residual, probs[node + 1])
        if not moved:
            return verify.WalkResult(accepted, verify.draw(residual, generator))


@contextmanager
def biased_after_rejected_sibling() -> Iterator[None]:
    with _patched({"recursive_rejection": _sharpening_later_siblings(_rule_b_sharpening_later_tests),
                   "multi_draft_rejection": _sharpening_later_siblings(verify.multi_draft_rejection)}):
        yield


@contextmanager
def reused_uniform() -> Iterator[None]:
    last: list[float] = []  # the uniform of the last accept test, until a draw consumes it
    real_uniform, real_draw = verify._uniform, verify.draw

    def uniform(generator: torch.Generator | None = None) -> float:
        u = real_uniform(generator)
        last[:] = [u]
        return u

    def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> int:
        if not last:  # no accept test before it (the prefill's token, rule A): a fresh draw
            return real_draw(probs, generator)
        u = torch.tensor([last.pop()], dtype=torch.float64)
        return int(inverse_cdf(cdf_of(probs.reshape(-1).cpu()), u)[0])

    with _patched({"_uniform": uniform, "draw": draw}):
        yield


CONTROLS = {
    "unnormalised-residual": unnormalised_residual,
    "sibling-bias": biased_after_rejected_sibling,
    "reused-uniform": reused_uniform,
}
REACHED_BY = {  # which walks commit through the broken step
    "unnormalised-residual": "rule C at any rejection (chains too); rule B after a rejected sibling",
    "sibling-bias": "rule B or C on a tree with siblings, after a rejected sibling",
    "reused-uniform": "rule C at every step (chains too); rule B",
}
