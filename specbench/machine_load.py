"""How busy the machine was while a run timed its prompts.

A run writes the load average (1, 5, 15 min) and the CPU count into its results header
(``load_start``, ``cpus``) and a ``trailer`` line when it ends (``load_start`` / ``load_end`` of that
session: a resumed run adds one per session). Readers that only know header and record lines skip the
trailer. A file counts as recorded under load when the other work on the machine exceeded
``LOAD_SHARE`` of its CPUs: the run's own threads are subtracted from the end reading (it is itself
running then), not from the start one (taken before the model loads)."""

from __future__ import annotations

import os
from typing import Iterable

LOAD_SHARE = 0.75
MARK = "‡"  # printed beside numbers from a file recorded under load


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):  # not available on this platform
        return None


def start_fields(load: list[float] | None) -> dict:
    """Header fields: the load before the run and the CPUs it shares."""
    return {"load_start": load, "cpus": os.cpu_count()}


def trailer(load_start: list[float] | None, records: int) -> dict:
    """The last line of a session: its load at start and end and how many records it wrote."""
    return {"type": "trailer", "load_start": load_start, "load_end": load_average(), "cpus": os.cpu_count(),
            "records_written": records}


def _one_minute(load) -> float | None:
    try:
        return float(load[0])
    except (TypeError, ValueError, IndexError, KeyError):
        return None


def peak_other_load(meta: dict, trailers: Iterable[dict] = ()) -> float | None:
    """The highest 1-minute load of other work seen at any start or end of the file's sessions
    (None when the file records no load: files written before it was recorded)."""
    threads = meta.get("threads") or 1
    readings = [_one_minute(meta.get("load_start"))]
    for t in trailers:
        readings.append(_one_minute(t.get("load_start")))
        end = _one_minute(t.get("load_end"))
        readings.append(None if end is None else max(end - threads, 0.0))
    readings = [r for r in readings if r is not None]
    return max(readings) if readings else None


def under_load(meta: dict, trailers: Iterable[dict] = (), share: float = LOAD_SHARE) -> bool:
    """True when other work took more than ``share`` of the machine's CPUs during the run."""
    peak = peak_other_load(meta, list(trailers))
    cpus = meta.get("cpus") or next((t.get("cpus") for t in trailers if t.get("cpus")), None)
    return peak is not None and bool(cpus) and peak > share * cpus
