"""The files a report owns in its folder: ``.report-files.json`` lists each one it wrote with its sha256, so the
next report into the same folder removes the previous report's tables and figures that it does not write
again (a stale table would otherwise sit beside the new ones, e.g. a method no longer in the inputs). A file
the manifest does not list, or whose bytes changed since the report wrote it, is never removed."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Iterable

MANIFEST = ".report-files.json"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def owned_files(folder: Path) -> dict[str, str]:
    """Relative path -> sha256 of what the last report wrote into ``folder`` (empty when it left no manifest,
    or one that cannot be read: then nothing is removed)."""
    try:
        listed = json.loads((folder / MANIFEST).read_text(encoding="utf-8")).get("files")
    except (OSError, ValueError, AttributeError):
        return {}
    if not isinstance(listed, dict):
        return {}
    return {str(k): str(v) for k, v in listed.items()}


def _inside(folder: Path, name: str) -> Path | None:
    """``folder / name`` when ``name`` is a plain relative path that stays in ``folder`` (a hand-edited manifest
    cannot point elsewhere), else None."""
    rel = Path(name)
    if rel.is_absolute() or ".." in rel.parts or not rel.parts:
        return None
    path = folder / rel
    return None if path.is_symlink() else path


def remove_stale(folder: Path, previous: dict[str, str], written: Iterable[Path]) -> list[Path]:
    """Remove what the previous report owned (``previous``, from ``owned_files`` read before writing) and this
    one did not write again, when its bytes are still the ones that report wrote. Returns the removed paths."""
    now = {path.relative_to(folder).as_posix() for path in written}
    removed = []
    for name, sha in sorted(previous.items()):
        path = _inside(folder, name)
        if name in now or path is None or not path.is_file() or _sha256(path) != sha:
            continue
        path.unlink()
        removed.append(path)
    return removed


def write_manifest(folder: Path, written: Iterable[Path]) -> Path:
    """List ``written`` (files inside ``folder``) with their sha256 as this report's own."""
    from specbench.data.safe_files import atomic_text

    files = {path.relative_to(folder).as_posix(): _sha256(path) for path in sorted(written)}
    with atomic_text(folder / MANIFEST, "the report's file list") as fh:
        fh.write(json.dumps({"files": files}, indent=1, sort_keys=True) + "\n")
    return folder / MANIFEST
