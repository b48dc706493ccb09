"""Writing files without hurting any: outputs that are refused before anything is written (one of
the run's own inputs, a device, a FIFO, a symlink, a folder), whole-file writes that land atomically
(a temporary file in the same folder, renamed over the target only once complete), and one writer
per results file (an advisory ``fcntl.flock`` that a second run finds and names): a run's store appends
under it, and every command that rewrites a whole results file (merge, recheck, re-timing) writes through
``rewrite_results`` under the same lock. A full disk is one line that says so (``write_error``)."""

from __future__ import annotations

import errno
import os
import shutil
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator, Optional

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


def write_error(path: str | Path, exc: OSError, kept: str, then: str = "rerun") -> SpecbenchError:
    """One line for a write to ``path`` that the system refused: ``kept`` says what is left ("the old file is
    unchanged"), ``then`` what to run once fixed. A full disk says so and where: that, not the path, is what
    the user must fix."""
    path = Path(path)
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return SpecbenchError(f"disk full: could not write {path} (no space left in {path.parent}); {kept}; "
                              f"free space there and {then}")
    return SpecbenchError(f"could not write {path} ({exc.strerror}); {kept}; {then} once that is fixed")


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
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        except OSError as exc:  # a full disk: no lock file is left behind
            self.fd = fd
            self.release()
            raise write_error(self.file, exc, "nothing was written") from None
        self.fd: int | None = fd

    def __enter__(self) -> "WriterLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            self.file.unlink()  # while still locked, so no one locks a file that is going away
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None


def writer_of(path: str | Path) -> Optional[str]:
    """The pid of a run appending to ``path`` now (its ``WriterLock``), or None. For files a command only
    reads but whose completeness matters (the parts a merge joins); it creates nothing."""
    import fcntl

    if not Path(path).name:
        return None  # '' or '/': no file of results, so no writer (the caller refuses it as a source)
    try:
        fd = os.open(lock_path(Path(path)), os.O_RDONLY)
    except OSError:
        return None  # no lock file: no writer
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return os.read(fd, 64).decode("ascii", "replace").strip() or "unknown"
        return None
    finally:
        os.close(fd)  # also drops our shared lock
    return None


def rewrite_results(path: str | Path, lines: Iterable[bytes], lock: WriterLock, what: str = "results file") -> Path:
    """The one way a whole results file is written: ``lines`` (each a whole line) replace ``path`` atomically,
    while its writer ``lock`` is held (the lock a run's store takes, so a run still appending is refused before
    anything is read), keeping an old file's mode. A failed write (a full disk) is one line; ``path`` stays as it
    was and no temporary is left."""
    path = Path(path)
    if lock.fd is None or lock.path != path:
        raise RuntimeError(f"rewrite_results({path}) needs that file's writer lock held")
    try:
        with atomic_path(path, what) as tmp:
            with open(tmp, "wb") as fh:
                fh.writelines(lines)
                fh.flush()
                os.fsync(fh.fileno())
            if path.is_file():
                shutil.copymode(path, tmp)
    except OSError as exc:
        raise write_error(path, exc, f"{path} is as it was" if path.exists() else "nothing was written") from None
    return path
