"""Vanilla decoding: no drafter. Every verify call carries only the bonus token, through the
same engine, cache code and clock as every method, so speedups compare like with like."""

from __future__ import annotations

from specbench.engine import VANILLA
from specbench.engine.drafter import DecodeState, Drafter
from specbench.engine.tree import DraftTree

_EMPTY = DraftTree.empty()


class VanillaDrafter(Drafter):
    """The engine's own baseline (registered as a method too, so a run may name it)."""

    name = VANILLA
    label = "Vanilla"

    def propose(self, state: DecodeState) -> DraftTree:
        return _EMPTY
