"""One clock for every method: named phase timers and model-forward counters.

On CUDA every reading is preceded by ``torch.cuda.synchronize`` so that asynchronous kernels are
charged to the phase that launched them; on CPU ``perf_counter_ns`` is exact enough.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch


def synchronize(device: torch.device | str | None) -> None:
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


class PhaseTimer:
    """Accumulates wall time (ns) per phase name and counts model forwards per owner."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = device
        self.ns: dict[str, int] = defaultdict(int)
        self.forward_calls: dict[str, int] = defaultdict(int)
        self.forward_ns: dict[str, int] = defaultdict(int)

    @contextmanager
    def _timed(self, totals: dict[str, int], name: str):
        synchronize(self.device)
        start = time.perf_counter_ns()
        try:
            yield
        finally:
            synchronize(self.device)
            totals[name] += time.perf_counter_ns() - start

    def phase(self, name: str):
        return self._timed(self.ns, name)

    def forward(self, owner: str):
        """Time one model forward (``owner`` is "target" or "drafter")."""
        self.forward_calls[owner] += 1
        return self._timed(self.forward_ns, owner)

    def seconds(self) -> dict[str, float]:
        return {k: v / 1e9 for k, v in self.ns.items()}


class NullTimer(PhaseTimer):
    """A timer that records nothing (used outside the engine, e.g. in training)."""

    @contextmanager
    def phase(self, name: str):
        yield

    @contextmanager
    def forward(self, owner: str):
        yield
