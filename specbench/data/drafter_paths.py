"""Drafter folders in results headers, portable between clones: a local drafter under the drafter root
(``$SPECBENCH_DRAFTERS`` when set, else the checkout's ``drafters/``) is written relative to it, with
``"root": "drafters"``; a reader resolves it against the drafter root of the clone it runs in, so a report
made in another checkout reads that checkout's drafter cards, never the writer's absolute paths.

A drafter folder's ``config.json`` also holds the recipe that trained it; ``recipe_summary`` keeps the part that
tells two drafters of one method apart (how long they trained, on what, which variant), which the results header
records per side (``drafter_recipes``) and the report groups ablations by."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

ROOT_ENV = "SPECBENCH_DRAFTERS"
ROOT_MARK = "drafters"  # a source's "root": its "path" is relative to the drafter root
RECIPE_KEYS = ("epochs", "max_steps", "batch_size", "lr", "seed", "dtype")  # of config.json's "recipe"
RECIPE_EXTRA_KEYS = ("variant", "train_examples")  # of its "recipe"."extra"


def drafter_roots() -> list[Path]:
    """Where a relative drafter path is looked up, in order: $SPECBENCH_DRAFTERS, the current directory's
    drafters/ (a clone, as `make report` runs), this checkout's drafters/."""
    roots = [Path(env).expanduser()] if (env := os.environ.get(ROOT_ENV)) else []
    roots += [Path.cwd() / "drafters", Path(__file__).resolve().parents[2] / "drafters"]
    out: list[Path] = []
    for root in roots:
        if root.resolve() not in [r.resolve() for r in out]:
            out.append(root)
    return out


def relative_to_root(path: str | Path) -> str | None:
    """``path`` relative to the first drafter root that holds it (POSIX form), or None."""
    try:
        target = Path(path).expanduser().resolve()
    except (OSError, RuntimeError):
        return None
    for root in drafter_roots():
        try:
            return target.relative_to(root.resolve()).as_posix()
        except ValueError:
            continue
    return None


def portable(source: dict) -> dict:
    """A header's weights source with a local drafter folder under the drafter root written relative to it
    (hub downloads and folders elsewhere stay as they are)."""
    if source.get("repo_id") or not source.get("path"):
        return source
    rel = relative_to_root(source["path"])
    return source if rel is None else {**source, "spec": rel, "path": rel, "root": ROOT_MARK}


def resolve(source: dict) -> Path | None:
    """The local folder (with a config.json) a header's source names in this clone, or None: a relative one
    under this clone's drafter root; an absolute one as is, or, when it is not here (records from another
    checkout), its ``drafters/<target>/<name>`` tail under this clone's drafter root."""
    path = Path(str(source.get("path") or source.get("spec") or ""))
    if source.get("root") == ROOT_MARK:
        tails = [path]
    else:
        if (path / "config.json").is_file():
            return path
        parts = path.parts
        tails = [Path(*parts[parts.index("drafters") + 1:])] if "drafters" in parts[:-1] else []
    for tail in tails:
        for root in drafter_roots():
            if (root / tail / "config.json").is_file():
                return root / tail
    return None


def recipe_summary(folder: str | Path | None) -> dict[str, Any] | None:
    """What trained the drafter in ``folder``: its config.json recipe's schedule and data fields (``RECIPE_KEYS``,
    ``RECIPE_EXTRA_KEYS``, those it has), or None for a folder without a readable recipe (a hub model, a GGUF file)."""
    if folder is None:
        return None
    try:
        config = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, RecursionError, json.JSONDecodeError):
        return None
    recipe = config.get("recipe") if isinstance(config, dict) else None
    if not isinstance(recipe, dict):
        return None
    extra = recipe.get("extra") if isinstance(recipe.get("extra"), dict) else {}
    return {**{k: recipe[k] for k in RECIPE_KEYS if k in recipe}, **{k: extra[k] for k in RECIPE_EXTRA_KEYS if k in extra}}


def folder_recipes(sources: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Weights option -> ``recipe_summary`` of the folder its header source names (``resolve``), for the options
    whose folder has a recipe."""
    found = {str(name): recipe_summary(resolve(source)) for name, source in sources.items() if isinstance(source, dict)}
    return {name: recipe for name, recipe in found.items() if recipe is not None}


def training_budget(recipe: Mapping[str, Any]) -> str:
    """How long a recipe trained: '400 steps' (a step cap) or '2 epochs' (its whole schedule)."""
    if recipe.get("max_steps"):
        return f"{recipe['max_steps']} steps"
    epochs = recipe.get("epochs", "?")
    return f"{epochs} epoch{'' if epochs == 1 else 's'}"
