"""Drafter folders in results headers, portable between clones: a local drafter under the drafter root
(``$SPECBENCH_DRAFTERS`` when set, else the checkout's ``drafters/``) is written relative to it, with
``"root": "drafters"``; a reader resolves it against the drafter root of the clone it runs in, so a report
made in another checkout reads that checkout's drafter cards, never the writer's absolute paths."""

from __future__ import annotations

import os
from pathlib import Path

ROOT_ENV = "SPECBENCH_DRAFTERS"
ROOT_MARK = "drafters"  # a source's "root": its "path" is relative to the drafter root


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
