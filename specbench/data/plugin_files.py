"""Files that method packages ship for the core to read: paper presets, the papers' claims.

A package declares them under an entry-point group (``specbench.presets``, ``specbench.claims``) whose
value names a path in the package, ``package:ATTRIBUTE`` (or ``package`` alone: its folder). The core
thus finds them without importing any method package by name; from a source checkout that was never
pip-installed, the groups come from its pyproject.toml (as for ``specbench.methods``).
"""

from __future__ import annotations

import importlib
from pathlib import Path

from specbench.engine.registry import entry_points
from specbench.errors import SpecbenchError


def declared_paths(group: str) -> list[Path]:
    """The paths the entry points of ``group`` name, in entry-point name order."""
    paths = []
    for name, value in sorted(entry_points(group).items()):
        module, _, attr = value.partition(":")
        try:
            obj = importlib.import_module(module.strip())
            if not attr:
                paths.append(Path(obj.__file__).parent)
                continue
            for part in attr.strip().split("."):
                obj = getattr(obj, part)
            paths.append(Path(obj))
        except (ImportError, AttributeError, TypeError) as exc:
            raise SpecbenchError(f"entry point {name} = {value!r} of group {group} names no path: {exc}") from None
    return paths
