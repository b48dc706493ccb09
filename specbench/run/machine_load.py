"""How busy the machine was while a run timed its prompts.

A run writes the load average (1, 5, 15 min) before it loads anything and the CPU count into its
results header (``load_start``, ``cpus``), and the load average when each turn finished into that
record (``load_avg``), so a killed or resumed run keeps its readings and no reader meets a new kind of
line. A file counts as recorded under load when other work exceeded ``LOAD_SHARE`` of its CPUs at any
reading: the run's own threads are subtracted from the per-record readings (it is running then), not
from the start one."""

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
