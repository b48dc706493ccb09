"""Writing files without hurting any: outputs that are refused before anything is written (one of
the run's own inputs, a device, a FIFO, a symlink, a folder), whole-file writes that land atomically
(a temporary file in the same folder, renamed over the target only once complete), and one writer
per results file (an advisory ``fcntl.flock`` that a second run finds and names)."""

from __future__ import annotations

import errno
import os
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

from specbench.engine import interrupt
from specbench.errors import SpecbenchError


def _kind(mode: int) -> str | None:
    """What a non-regular file is, in words (None for a regular file)."""
    for test, name in ((stat.S_ISLNK, "a symlink"), (stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a device"),
                       (stat.S_ISBLK, "a device"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return None


def check_output(path: str | Path, inputs: Iterable[tuple[str, str | Path | None]] = (), what: str = "--out",
                 folder_ok: bool = False) -> None:
    """Refuse an output we must not write: a symlink, device, FIFO, socket (or a folder unless
    ``folder_ok``), or the very file (same inode) of one of ``inputs`` ((option, path) pairs)."""
    path = Path(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return  # a new file cannot be any input
    except OSError as exc:
        raise SpecbenchError(f"cannot use {what} {path} ({exc.strerror}); pass another path") from None
    kind = _kind(st.st_mode)
    if kind and not (folder_ok and kind == "a folder"):
        raise SpecbenchError(f"{what} {path} is {kind}; specbench writes only regular files, pass another path")
    for option, source in inputs:
        if source is None:
            continue
        try:
            theirs = os.stat(Path(source).expanduser())
        except OSError:
            continue  # not a file on disk (a bench name, a hub id)
        if (theirs.st_dev, theirs.st_ino) == (st.st_dev, st.st_ino):
            raise SpecbenchError(f"{what} {path} is the file {option} {source} reads; writing it would destroy the "
                                 "input, pass another path")


def fsync_folder(folder: Path) -> None:
    """Make a rename in ``folder`` durable (best effort: some filesystems refuse folder fsync)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def temp_path(path: Path) -> Path:
    """The hidden temporary a write to ``path`` goes to (same folder, so the rename is atomic)."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def replaceable(path: Path) -> bool:
    """Whether a rename may replace ``path``: in a folder with the sticky bit (/tmp) only the file's owner, the
    folder's owner or root may (elsewhere write permission on the folder is enough)."""
    folder, own = os.stat(path.parent), os.lstat(path)
    uid = os.geteuid()
    return not folder.st_mode & stat.S_ISVTX or uid in (0, folder.st_uid, own.st_uid)


def publish(tmp: Path, path: Path) -> None:
    """Rename a complete temporary over ``path`` (a signal waits until the rename is done)."""
    with interrupt.critical():
        os.replace(tmp, path)
        fsync_folder(path.parent)


@contextmanager
def atomic_path(path: str | Path, what: str = "--out") -> Iterator[Path]:
    """A temporary path to write; renamed over ``path`` when the block ends without an error, removed
    otherwise, so ``path`` holds either its old content or the complete new one, never a part."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SpecbenchError(f"cannot create the folder of {what} {path} ({exc.strerror}); pass another path") from None
    tmp = temp_path(path)
    try:
        yield tmp
        publish(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


@contextmanager
def atomic_text(path: str | Path, what: str = "--out") -> Iterator:
    """A text file handle whose content replaces ``path`` atomically on success (see ``atomic_path``)."""
    with atomic_path(path, what) as tmp:
        with open(tmp, "w", encoding="utf-8") as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())


def lock_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.lock")


class WriterLock:
    """An advisory ``flock`` held for as long as a run writes ``path``: a second run on the same file
    refuses in one line naming the first one's pid. The lock lives on a hidden file beside ``path``
    (the results file itself appears only with its first record) and goes when released; one left by
    a killed run holds no lock and is taken over."""

    def __init__(self, path: str | Path, what: str = "--out") -> None:
        import fcntl

        self.path = Path(path)
        self.file = lock_path(self.path)
        for _ in range(10):  # the holder may remove the file between our open and our lock: retry
            try:
                fd = os.open(self.file, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                raise SpecbenchError(f"cannot write results to {self.path} ({exc.strerror}); pass a writable {what}") \
                    from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                holder = os.read(fd, 64).decode("ascii", "replace").strip() or "unknown"
                os.close(fd)
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise SpecbenchError(f"cannot lock {self.path} ({exc.strerror}); pass another {what}") from None
                raise SpecbenchError(f"{self.path} is being written by another specbench run (pid {holder}); "
                                     f"wait for it to finish or pass another {what}") from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.file).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        else:
            raise SpecbenchError(f"cannot lock {self.path}: other runs keep taking it; pass another {what}")
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd: int | None = fd

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            self.file.unlink()  # while still locked, so no one locks a file that is going away
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None
