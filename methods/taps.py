"""Which target layers a feature-space drafter reads: EAGLE-3's three taps, shared by every drafter
trained on the same features (EAGLE-3, SpecBlock), and the check a saved drafter's taps must pass."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from specbench.engine.target import Target
from specbench.errors import SpecbenchError


def eagle3_taps(num_layers: int) -> tuple[int, int, int]:
    """HF ``hidden_states`` indices of the outputs of layers 1, L/2-1 and L-4 (docs/methods.md#target-features)."""
    if num_layers < 4:
        raise SpecbenchError(f"EAGLE-3 taps layers 1, L/2-1 and L-4; the target has only {num_layers} layers "
                             "(need >= 4)")
    return 2, num_layers // 2, num_layers - 3


def check_taps(taps: Sequence[int], target: Target, folder: str | Path) -> tuple[int, ...]:
    """A saved drafter's taps must be the three this target's drafters read (EAGLE-3, SpecBlock)."""
    wanted = eagle3_taps(target.num_layers)
    if tuple(taps) != wanted:
        raise SpecbenchError(f"drafter {folder} reads taps {list(taps)} but target {target.name!r} needs "
                             f"{list(wanted)}; train one for this target")
    return wanted
