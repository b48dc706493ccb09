"""Authors' code that is published only as a GitHub repository, imported at run time from a snapshot
(a checkout) the user points at: nothing of it is copied into this project.

A reference adapter names its repository, licence, the environment variable that points at a snapshot
and a file that identifies one; ``specbench parity METHOD --reference-src PATH`` sets the path for one
run. Without a snapshot the adapter refuses in one line that says what to fetch and where to point.

Their top-level module names are generic (``model``, ``dflash``, ``eagle``) and can collide with installed
packages (z-lab's ``dflash``), so ``import_snapshot`` imports them with the snapshot first on ``sys.path``
and any already-loaded module of the same top-level names set aside, then puts the previous modules
back: their functions keep their own module globals, ours keep ours.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Iterator, Sequence

from specbench.errors import SpecbenchError


@dataclass(frozen=True)
class Repository:
    """What an adapter needs of an authors' repository: where it lives, its licence, the variable that
    points at a snapshot of it, and a file every snapshot of it has (to catch a wrong folder)."""

    url: str
    licence: str
    env: str
    marker: str


@dataclass(frozen=True)
class Snapshot:
    repository: Repository
    path: Path
    commit: str

    def describe(self) -> str:
        """For the table: repository, commit and licence."""
        return f"{self.repository.url} @ {self.commit[:12]} ({self.repository.licence})"


def snapshot_commit(path: Path) -> str:
    """The checked-out commit of a git checkout; 'unknown commit' for a plain copy (an archive)."""
    try:
        out = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown commit"
    sha = out.stdout.strip()
    return sha if out.returncode == 0 and len(sha) == 40 else "unknown commit"


def locate_snapshot(repository: Repository, source: str | os.PathLike | None = None) -> Snapshot:
    """The snapshot at ``source`` (``--reference-src``), else at ``$env``; one line naming what to fetch
    and where to point when there is none or the folder is not a snapshot of that repository."""
    given = source if source is not None else os.environ.get(repository.env)
    how = (f"git clone {repository.url} and point --reference-src (or ${repository.env}) at the checkout; "
           "it is imported at run time, never copied")
    if not given:
        raise SpecbenchError(f"this reference runs the authors' code from a snapshot of {repository.url} "
                             f"({repository.licence}); {how}")
    path = Path(given).expanduser()
    if not (path / repository.marker).is_file():
        raise SpecbenchError(f"{path} is not a snapshot of {repository.url} (it has no {repository.marker}); {how}")
    return Snapshot(repository, path.resolve(), snapshot_commit(path))


@contextmanager
def _isolated(root: Path, tops: Sequence[str]) -> Iterator[None]:
    clashing = {k: sys.modules.pop(k) for k in list(sys.modules) if k.split(".")[0] in tops}
    sys.path.insert(0, str(root))
    try:
        yield
    finally:
        for key in [k for k in sys.modules if k.split(".")[0] in tops]:
            sys.modules.pop(key)
        sys.modules.update(clashing)
        sys.path.remove(str(root))


def import_snapshot(snapshot: Snapshot, modules: Sequence[str], tops: Sequence[str] = (),
                    stubs: dict[str, ModuleType] | None = None) -> dict[str, ModuleType]:
    """Import ``modules`` (dotted names) from the snapshot; ``tops`` lists every top-level name of theirs
    that their imports reach (``model`` for ``from model import ...``), so that all of them are theirs
    while importing and ours again afterwards. ``stubs`` stand in for modules of theirs that cannot import
    here and that the reference never runs (each adapter says why). A snapshot whose code does not import here (a missing
    dependency, a transformers change no shim bridges) is refused in one line."""
    names = sorted({m.split(".")[0] for m in modules} | set(tops))
    with _isolated(snapshot.path, names):
        sys.modules.update(stubs or {})
        try:
            return {m: importlib.import_module(m) for m in modules}
        except Exception as exc:  # their import-time code: any error is theirs, said in one line
            raise SpecbenchError(f"the snapshot of {snapshot.repository.url} at {snapshot.path} does not import "
                                 f"here ({type(exc).__name__}: {exc}); check its commit and this "
                                 "environment's packages") from None
