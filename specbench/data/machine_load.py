"""How busy the machine was while a run timed its prompts.

A run writes the load average (1, 5, 15 min) before it loads anything and the CPU count into its
results header (``load_start``, ``cpus``), and the load average when each turn finished into that
record (``load_avg``), so a killed or resumed run keeps its readings and no reader meets a new kind of
line. A file counts as recorded under load when other work exceeded ``LOAD_SHARE`` of its CPUs at any
reading: the run's own threads are subtracted from the per-record readings (it is running then), not
from the start one. A turn is flagged (``flagged_turn``) when the load beyond the run's own threads at its
reading exceeds ``TURN_LOAD`` (half a CPU: on two cores that already slows verify calls by several
percent); ``flagged_keys`` lists them per file and ``drop_flagged`` cuts every side's record of those
turns out of a results file, so ``specbench run ... --resume`` times them again.

The 1-minute load average is a smoothed count of runnable threads, so a reading taken when a turn ends
also carries some of the minute before it; a flagged turn may have run beside the work, or just after it.
Re-timing it is cheap, so the rule errs that way."""

from __future__ import annotations

import os
from typing import Iterable

LOAD_SHARE = 0.75
TURN_LOAD = 0.5  # a turn is flagged when other work kept more than half a CPU busy while it ran
MARK = "‡"  # printed beside numbers from turns (or files) recorded under load


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):  # not available on this platform
        return None


def start_fields(load: list[float] | None) -> dict:
    """Header fields: the load before the run and the CPUs it shares."""
    return {"load_start": load, "cpus": os.cpu_count()}


def _one_minute(load) -> float | None:
    try:
        return float(load[0])
    except (TypeError, ValueError, IndexError, KeyError):
        return None


def peak_other_load(meta: dict, record_loads: Iterable = ()) -> float | None:
    """The highest 1-minute load of other work at the start or after any turn (None when the file
    records no load: files written before it was recorded)."""
    threads = meta.get("threads") or 1
    readings = [_one_minute(meta.get("load_start"))]
    readings += [None if (x := _one_minute(load)) is None else max(x - threads, 0.0) for load in record_loads]
    readings = [r for r in readings if r is not None]
    return max(readings) if readings else None


def under_load(meta: dict, record_loads: Iterable = (), share: float = LOAD_SHARE) -> bool:
    """True when other work took more than ``share`` of the machine's CPUs during the run."""
    peak = peak_other_load(meta, record_loads)
    cpus = meta.get("cpus")
    return peak is not None and bool(cpus) and peak > share * cpus


def other_load(meta: dict, load) -> float | None:
    """The 1-minute load of other work at one record's reading: its load minus the run's own threads."""
    x = _one_minute(load)
    return None if x is None else max(x - (meta.get("threads") or 1), 0.0)


def flagged_turn(meta: dict, load, limit: float = TURN_LOAD) -> bool:
    """True when other work exceeded ``limit`` CPUs at this turn's reading."""
    x = other_load(meta, load)
    return x is not None and x > limit


def flagged_keys(meta: dict, records: Iterable, limit: float = TURN_LOAD) -> set[tuple]:
    """(bench, prompt_id, turn) of every turn that any side recorded under load: all sides of such a turn are
    re-timed together, so a speedup always pairs turns timed side by side."""
    return {(r.bench, r.prompt_id, r.turn) for r in records if flagged_turn(meta, r.load_avg, limit)}


def drop_flagged(path, limit: float = TURN_LOAD) -> list[tuple]:
    """Rewrite the results file at ``path`` without every side's record of its flagged turns (header, other
    lines and record order kept; under its writer lock, so a run still appending to it is refused, and written
    beside it and renamed into place). Returns the dropped turns."""
    import json
    from pathlib import Path

    from specbench.data.safe_files import WriterLock, rewrite_results
    from specbench.records import GenerationRecord

    path = Path(path)
    with WriterLock(path, "results file") as lock:
        lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        objs = [json.loads(line) for line in lines]
        meta = next((o.get("meta") or {} for o in objs if o.get("type") == "header"), {})
        records = [GenerationRecord.from_dict(o) for o in objs if o.get("type") == "record"]
        drop = flagged_keys(meta, records, limit)
        if not drop:
            return []
        kept = [line for line, o in zip(lines, objs)
                if not (o.get("type") == "record" and (o.get("bench"), o.get("prompt_id"), o.get("turn")) in drop)]
        rewrite_results(path, [(line + "\n").encode("utf-8") for line in kept], lock)
    return sorted(drop, key=str)
