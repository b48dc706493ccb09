"""The method registry: which drafters are installed, and their classes by name.

A method is a ``Drafter`` subclass registered under the entry-point group ``specbench.methods`` (see
pyproject.toml), so adding a method touches no core file; ``register`` adds one in-process (tests,
notebooks). Other plugin kinds (report tables, parity checks, ...) find theirs with ``entry_points``.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points as installed_entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specbench import options as opts
from specbench.errors import unknown_name_error

if TYPE_CHECKING:
    from specbench.engine.drafter import Drafter

METHODS_GROUP = "specbench.methods"

_LOCAL: dict[str, type["Drafter"]] = {}


def entry_points(group: str = METHODS_GROUP) -> dict[str, str]:
    """name -> 'module:attr' for the installed entry points of ``group``; from a source checkout that was
    never pip-installed (e.g. a GPU machine's system python), the ones its pyproject.toml declares."""
    found = {ep.name: ep.value for ep in installed_entry_points(group=group)}
    if found:
        return found
    import tomllib

    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    if pyproject.is_file():
        declared = tomllib.loads(pyproject.read_text()).get("project", {}).get("entry-points", {})
        found = dict(declared.get(group, {}))
    return found


def register(name: str):
    """Register a drafter class in-process (tests, notebooks); packages use entry points."""

    def wrap(cls: type["Drafter"]) -> type["Drafter"]:
        cls.name = name
        _LOCAL[name] = cls
        return cls

    return wrap


def available_methods() -> dict[str, str]:
    """name -> 'module:Class' for every registered method."""
    found = entry_points()
    found.update({name: f"{cls.__module__}:{cls.__qualname__}" for name, cls in _LOCAL.items()})
    return dict(sorted(found.items()))


def method_class(name: str) -> type["Drafter"]:
    if name in _LOCAL:
        return _LOCAL[name]
    eps = entry_points()
    if name not in eps:
        raise unknown_name_error("method", name, sorted(available_methods()), "specbench list methods")
    module, _, attr = eps[name].partition(":")
    cls = getattr(importlib.import_module(module), attr)
    cls.name = name
    return cls


def parse_options(cls: type["Drafter"], raw: dict[str, Any]) -> Any:
    """A method's options from ``--opt``/config values, checked against its declaration."""
    return opts.parse(cls.Options, raw, cls.name)


def create_drafter(name: str, options: dict[str, Any] | None = None) -> "Drafter":
    cls = method_class(name)
    return cls(parse_options(cls, options or {}))
