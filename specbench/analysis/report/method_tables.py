"""Report tables a method brings along: functions registered under the entry-point group
``specbench.report_tables`` (pyproject.toml, ``name = "package.module:function"``) or in-process with
``register_table``. The report calls each, in name order, as ``function(blocks, provenance)`` with the
records per (target, temperature) block and the provenance lines; a function returns a ``Table``
(``specbench.analysis.report.table``) or None when the records hold nothing for it. Other plugin functions
of the report (the cost table's notes) load the same way (``plugin_functions``)."""

from __future__ import annotations

import importlib
from typing import Callable, Mapping, Sequence

from specbench.engine.registry import entry_points
from specbench.errors import SpecbenchError
from specbench.records import GenerationRecord
from specbench.analysis.report.names import Block
from specbench.analysis.report.table import Table

GROUP = "specbench.report_tables"
TableFunction = Callable[[Mapping[Block, list[GenerationRecord]], Sequence[str]], "Table | None"]
_LOCAL: dict[str, TableFunction] = {}


def register_table(name: str):
    """Register a table function in-process (tests, notebooks); packages use the entry-point group."""

    def wrap(fn: TableFunction) -> TableFunction:
        _LOCAL[name] = fn
        return fn

    return wrap


def plugin_functions(group: str, kind: str) -> dict[str, Callable]:
    """name -> function, for every entry point of ``group`` (``kind`` names one in the error), in name order."""
    found: dict[str, Callable] = {}
    for name, target in entry_points(group).items():
        module, _, attr = target.partition(":")
        try:
            found[name] = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise SpecbenchError(f"{kind} {name!r} ({target}) cannot be loaded: {exc}") from None
    return dict(sorted(found.items()))


def table_functions() -> dict[str, TableFunction]:
    """name -> table function, for every registered one."""
    found = plugin_functions(GROUP, "report table") | _LOCAL
    return dict(sorted(found.items()))


def registered_tables(blocks: Mapping[Block, list[GenerationRecord]], provenance: Sequence[str] = ()) -> list[Table]:
    """Every registered table that has rows in these records."""
    tables = [fn(blocks, list(provenance)) for fn in table_functions().values()]
    return [t for t in tables if t is not None]
