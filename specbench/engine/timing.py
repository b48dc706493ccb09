"""One clock for every method: named phase timers and model-forward counters.

On CPU ``perf_counter_ns`` around each phase and forward is exact enough. On CUDA the timer never
synchronizes while the engine runs: it records a CUDA event at each phase/forward boundary (a few
microseconds, no CPU/GPU stall) and reads the elapsed times once, after the step or the generation
(``resolve``), with a single synchronize. Event times are on the GPU's timeline, so CPU work that
overlaps earlier kernels is not charged twice, and back-to-back phases still sum to the wall time.

``paused()`` takes a span out of every phase and forward open around it (the compiled engine builds a
graph there the first time a row count appears); the spans are summed under ``paused_ns``, never in a phase.
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
    """Accumulates wall time (ns) per phase name and counts model forwards per owner.

    The engine creates one per generation and passes it explicitly (``Target.verify(timer=...)``,
    ``DecodeState.timer``); nothing else owns a clock. Phases nest (a drafter's ``adapt`` inside the
    engine's ``draft``): ``outer`` keeps the names that were opened at the top level, so
    ``elapsed()`` sums wall time without counting a nested phase twice.

    ``ns`` / ``forward_ns`` are complete after ``resolve()`` (``seconds()`` resolves); forward
    counts are exact at any time."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = torch.device(device) if device is not None else None
        self.cuda = self.device is not None and self.device.type == "cuda"
        self.ns: dict[str, int] = defaultdict(int)
        self.forward_calls: dict[str, int] = defaultdict(int)
        self.forward_ns: dict[str, int] = defaultdict(int)
        self._pending: list[tuple[dict[str, int], str, object, object, int]] = []  # (totals, name, start, end, paused)
        self._spare: list = []  # recycled CUDA events
        self.outer: dict[str, None] = {}  # phases opened at the top level, in first-use order
        self._depth = 0  # phases open right now
        self.paused_ns: dict[str, int] = defaultdict(int)  # spans taken out of the clock, per reason
        self._paused_total = 0  # all of them, in ns: an open span subtracts what accrued inside it

    def _event(self):
        if self._spare:
            event = self._spare.pop()
        else:
            event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @contextmanager
    def _timed(self, totals: dict[str, int], name: str):
        paused_before = self._paused_total
        if self.cuda:
            with torch.cuda.device(self.device):
                start = self._event()
                try:
                    yield
                finally:
                    self._pending.append((totals, name, start, self._event(), self._paused_total - paused_before))
            return
        start = time.perf_counter_ns()
        try:
            yield
        finally:
            totals[name] += time.perf_counter_ns() - start - (self._paused_total - paused_before)

    @contextmanager
    def paused(self, reason: str):
        """Take the enclosed span out of every open phase and forward; its wall time goes to
        ``paused_ns[reason]``. On CUDA the span starts and ends with a synchronize, so the GPU is idle
        across it and the events around it see exactly this gap."""
        synchronize(self.device)
        start = time.perf_counter_ns()
        try:
            yield
        finally:
            synchronize(self.device)
            span = time.perf_counter_ns() - start
            self.paused_ns[reason] += span
            self._paused_total += span

    @contextmanager
    def phase(self, name: str):
        if self._depth == 0:
            self.outer.setdefault(name)
        self._depth += 1
        try:
            with self._timed(self.ns, name):
                yield
        finally:
            self._depth -= 1

    def forward(self, owner: str):
        """Time one model forward (``owner`` is "target" or "drafter")."""
        self.forward_calls[owner] += 1
        return self._timed(self.forward_ns, owner)

    def resolve(self) -> None:
        """Fold recorded CUDA events into the totals (one synchronize); a no-op on CPU."""
        if not self._pending:
            return
        self._pending[-1][3].synchronize()  # the last event recorded: everything before it is done
        for totals, name, start, end, paused in self._pending:
            totals[name] += max(0, round(start.elapsed_time(end) * 1e6) - paused)  # ms -> ns
            self._spare += (start, end)
        self._pending.clear()

    def seconds(self) -> dict[str, float]:
        self.resolve()
        return {k: v / 1e9 for k, v in self.ns.items()}

    def elapsed(self, exclude: tuple[str, ...] = ()) -> float:
        """Seconds in top-level phases so far, less those named in ``exclude`` (resolves: on CUDA
        one synchronize). E.g. a drafter's decode time of the turn: ``elapsed(exclude=("prefill",))``."""
        seconds = self.seconds()
        return sum(seconds.get(name, 0.0) for name in self.outer if name not in exclude)


class NullTimer(PhaseTimer):
    """A timer that records nothing (the default wherever no clock is passed, e.g. in training)."""

    @contextmanager
    def phase(self, name: str):
        yield

    @contextmanager
    def forward(self, owner: str):
        yield

    @contextmanager
    def paused(self, reason: str):
        yield


NULL_TIMER = NullTimer()  # shared: it never records, so it holds no state
