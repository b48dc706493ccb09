"""Repeated timing of one prompt turn: R generations with the same seed must commit the same tokens;
the record keeps every repeat's phase times and reports the median one.

The median is taken per prompt turn, on total time (prefill + decode), and is a real repeat (the
lower middle one when R is even), so every phase time, forward count and drafter statistic in the
record comes from one coherent generation and the metrics need no change."""

from __future__ import annotations

from typing import Sequence

from specbench.errors import SpecbenchError
from specbench.records import GenerationRecord


def median_index(values: Sequence[float]) -> int:
    """Index of the (lower) median of ``values``."""
    order = sorted(range(len(values)), key=lambda i: (values[i], i))
    return order[(len(values) - 1) // 2]


def merge_repeats(repeats: Sequence[GenerationRecord], where: str = "") -> GenerationRecord:
    """One record from R repeats of the same turn: the median repeat's, with ``times_repeats`` holding
    every repeat's phase times (in run order). Raises if the repeats committed different tokens."""
    if not repeats:
        raise ValueError("merge_repeats needs at least one record")
    first = repeats[0]
    for i, r in enumerate(repeats[1:], start=2):
        if r.new_tokens != first.new_tokens:
            raise SpecbenchError(f"--repeats: {where or first.prompt_id} gave different tokens in repeat {i} than in "
                                 "repeat 1 (a nondeterministic drafter or kernel); timings of different outputs "
                                 "cannot be pooled")
    chosen = repeats[median_index([r.total_time for r in repeats])]
    chosen.times_repeats = [dict(r.times) for r in repeats]
    return chosen


def repeat_times(record: GenerationRecord) -> list[float]:
    """Total seconds of each repeat (one value for a record timed once)."""
    if not record.times_repeats:
        return [record.total_time]
    return [GenerationRecord.total_of(t) for t in record.times_repeats]
