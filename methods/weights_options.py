"""The weights options of a trained method, declared once: where its weights are (a folder or a hub id
``org/name[@rev]``) and the hub revision to take them at (``Drafter.resolve_weights`` reads both, and applies
``revision`` to the first of ``weight_options``). A method's ``Options`` inherits one of the two forms below, so
it says only what its weights hold; its own fields follow these two."""

from __future__ import annotations

import dataclasses

from specbench.options import option


def _weights(field: str, help: str) -> type:
    cls = dataclasses.make_dataclass(f"{field.capitalize()}Weights", [
        (field, str, option("", help)),
        ("revision", str, option("", f"Hub revision of {field}; empty = main."))])
    cls.__module__ = __name__
    return cls


def drafter_weights(folder: str, layouts: str, default: str) -> type:
    """``path`` (a drafter's own weights: a ``folder`` of ours, or a hub id; ``layouts`` the checkpoint layouts
    that load; empty = ``drafters/<target>/<default>``) and ``revision``."""
    return _weights("path", f"{folder} or hub id org/name[@rev] ({layouts}); empty = drafters/<target>/{default}.")


def draft_model_weights(help: str) -> type:
    """``draft`` (a separate draft model, as ``help`` says) and ``revision``."""
    return _weights("draft", help)
