"""Append-only JSONL run store: a header line with the run's metadata, then one line per prompt
turn. Every record is flushed and fsynced, so a killed run loses at most the turn in flight; a
torn last line is ignored on read and cut off before appending (``specbench.data.results`` reads it)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
from pathlib import Path

from specbench.data.part_files import find_parts
from specbench.data.results import RecordKey, ResultsContent, read_results, weight_shas
from specbench.data.safe_files import WriterLock, check_output, publish, replaceable, temp_path, write_error
from specbench.engine import interrupt
from specbench.errors import SpecbenchError
from specbench.records import GenerationRecord
from specbench.schemas import record_key


def config_hash(config: dict) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:12]


def has_records(path: Path) -> bool:
    """Whether ``path`` holds a results file to continue (``--resume``); an empty one is started afresh."""
    return path.is_file() and path.stat().st_size > 0


def check_resumable(paths: list[Path], parts: bool = False) -> None:
    """``--resume`` continues a file on disk: when none of the run's files (a sweep's one per B; ``parts``: or
    the part files of a sharded run) is there, there is nothing to continue and the run is refused."""
    if any(has_records(p) or (parts and find_parts(p)) for p in paths):
        return
    what = "is empty" if paths[0].exists() else "does not exist"
    others = " (nor does any other file of the sweep)" if len(paths) > 1 else ""
    raise SpecbenchError(f"nothing to resume: {paths[0]} {what}{others}; drop --resume")


def _same_older_run(meta: dict, expected_hash: str | None) -> bool:
    """A file written before runs recorded their sides as data, by the configuration whose hash is
    ``expected_hash`` today (``run_config.identity_of_header``)."""
    from specbench.run.run_config import identity_of_header

    ident = identity_of_header(meta)
    return ident is not None and config_hash(ident) == expected_hash


def already_exists(path: Path) -> SpecbenchError:
    """The refusal of an output that holds records when neither --resume nor --overwrite was given."""
    return SpecbenchError(f"{path} already exists; pass --resume to continue it, --overwrite to replace it, or a new "
                          "--out")


class RunStore:
    """One results file: ``open`` checks resume compatibility and returns the finished keys.

    A new file is written to a hidden temporary beside ``path`` and renamed into place with its
    first record (or, with none, on a clean finish): a run that fails or is stopped before that
    leaves no file, and under --overwrite the old file stays whole until then. One writer at a time
    (``WriterLock``)."""

    def __init__(self, path: str | Path, meta: dict, resume: bool = False, overwrite: bool = False,
                 inputs: tuple = (), identity: dict | None = None) -> None:
        self.path = Path(path)
        self.meta = meta
        self.identity = identity  # the run's configuration as hashed: a resume mismatch names what differs
        self.done: dict[RecordKey, GenerationRecord] = {}
        self.skipped: set[RecordKey] = set()  # turns recorded as skipped (part files of a sharded run)
        self.fh = None
        self.replacing = False  # --overwrite of an existing file: the old one stays until our first record
        check_output(self.path, inputs)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            existing = has_records(self.path)
        except OSError as exc:  # a folder on the way that this user may not enter
            raise self._unwritable(exc) from None
        self._check_writable(replace=not (existing and resume) and (overwrite or not existing),
                             append=existing and resume)
        self.lock = WriterLock(self.path)
        try:
            if existing:
                if resume:
                    self._load_existing()
                elif not overwrite:
                    raise already_exists(self.path)
                else:
                    self.replacing = True
            self._open(append=existing and resume)
        except BaseException:
            self.lock.release()
            raise
        interrupt.note_kept(self.kept)

    def _check_writable(self, replace: bool, append: bool) -> None:
        """Refuse, before any model loads, an output this run could not write: in a read-only folder, a file it
        may not append to (``append``: --resume) or not replace (``replace``: a sticky folder's other user's file,
        which the rename of the first record would fail on)."""
        try:
            if self.path.is_dir():
                raise IsADirectoryError(errno.EISDIR, "a folder")
            if not os.access(self.path.parent, os.W_OK):
                raise PermissionError(errno.EACCES, "the folder is read-only")
            if append and not os.access(self.path, os.W_OK):
                raise PermissionError(errno.EACCES, "the file is read-only")
            if replace and self.path.exists() and not replaceable(self.path):
                raise PermissionError(errno.EPERM, "it is another user's file in a folder with the sticky bit, where "
                                                   "only its owner may replace it")
        except OSError as exc:
            raise self._unwritable(exc) from None

    @staticmethod
    def _read_checked(path: Path, expected_hash: str | None, identity: dict | None = None) -> ResultsContent:
        """``path``'s content, refused unless its header's configuration is ``expected_hash``'s; ``identity`` (the
        run's, ``RunConfig.identity``) lets the refusal name the options that differ."""
        content = read_results(path)
        if content.meta is None:
            raise SpecbenchError(f"{path} has no header line; it is not a specbench results file "
                                 "(pass a new --out, or --overwrite to replace it)")
        theirs = content.meta.get("config_hash")
        if theirs != expected_hash and not _same_older_run(content.meta, expected_hash):
            from specbench.run.run_config import identity_differences

            differ = identity_differences(content.meta, identity) if identity else []
            what = "; ".join(differ) if differ else f"config {theirs}, now {expected_hash}"
            raise SpecbenchError(f"{path} was written by a different configuration ({what}); rerun with the same "
                                 "options or write to a new --out")
        return content

    @classmethod
    def read_done(cls, path: str | Path, expected_hash: str | None,
                  identity: dict | None = None) -> dict[RecordKey, GenerationRecord]:
        """The finished records of another file of the same run (read only)."""
        content = cls._read_checked(Path(path), expected_hash, identity)
        return {record_key(r): r for _, r in content.records}

    def _load_existing(self) -> None:
        content = self._read_checked(self.path, self.meta.get("config_hash"), self.identity)
        self.existing = content.meta
        self.done = {record_key(r): r for _, r in content.records}
        self.skipped = {record_key(o) for _, o in content.skips}
        self._good_on_disk = content.good

    def _open(self, append: bool) -> None:
        # Opened now so an unwritable path fails before any model loads; the header is written
        # by ``start`` once the environment (hardware, versions) is known.
        try:
            if append:
                with open(self.path, "r+b") as fh:  # drop a torn tail so appends start on a fresh line
                    fh.truncate(self._good_on_disk)
                self.fh = open(self.path, "a", encoding="utf-8")
                self.writing = self.path
                self.fresh, self.published = False, True
            else:
                self.writing = temp_path(self.path)
                self.fh = open(self.writing, "w", encoding="utf-8")
                self.fresh, self.published = True, False
            self.good = self.fh.tell()  # bytes of whole lines so far
        except OSError as exc:
            raise self._unwritable(exc) from None

    def _unwritable(self, exc: OSError) -> SpecbenchError:
        """An output refused before anything was written: a full disk says so (``write_error``), anything else
        asks for another --out."""
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return write_error(self.path, exc, "nothing was written")
        return SpecbenchError(f"cannot write results to {self.path} ({exc.strerror}); pass a writable --out")

    def start(self, environment: dict) -> None:
        before, now = weight_shas(getattr(self, "existing", {})), weight_shas(environment)
        if not self.fresh and before and now and before != now:
            changed = sorted(k for k in set(before) | set(now) if before.get(k) != now.get(k))
            raise SpecbenchError(f"{self.path} was written with other weights ({', '.join(changed)}: "
                                 f"{before.get(changed[0])} then, {now.get(changed[0])} now); pin the same revisions "
                                 "or write to a new --out")
        then, here = getattr(self, "existing", {}).get("hardware"), environment.get("hardware")
        if not self.fresh and then and here and then != here:
            # One file's timings are compared side by side; two machines in it would be compared as one.
            raise SpecbenchError(f"{self.path} was started on {then}, and this machine is {here}; finish it there, "
                                 "or write to a new --out (--overwrite starts it again here)")
        self.meta.update(environment)
        if self.fresh:
            self._write({"type": "header", "meta": self.meta})
            self.fresh = False

    def _write(self, obj: dict) -> None:
        line = json.dumps(obj, ensure_ascii=False, default=str) + "\n"
        with interrupt.critical():  # a signal waits for the line to be whole on disk
            try:
                self.fh.write(line)
                self.fh.flush()
                os.fsync(self.fh.fileno())
            except OSError as exc:
                self._cut_back()
                raise self._write_error(exc) from None
            self.good += len(line.encode("utf-8"))
            if obj.get("type") != "header" and not self.published:
                self._publish()

    def _write_error(self, exc: OSError) -> SpecbenchError:
        if self.published:
            return write_error(self.path, exc, f"the file is valid up to its last whole record ({len(self.done)} "
                                               "records)", "rerun with --resume")
        return write_error(self.path, exc, "nothing was kept")

    def _publish(self) -> None:
        """The first record is on disk: the file takes its place (replacing an old one under --overwrite)."""
        try:
            publish(self.writing, self.path)
        except OSError as exc:  # what _check_writable could not foresee; named by the results file, not the temporary
            raise write_error(self.path, exc, "nothing was kept", "pass a writable --out or rerun") from None
        self.writing, self.published, self.replacing = self.path, True, False

    def _cut_back(self) -> None:
        """After a failed write: drop the partial line so the file ends with a whole record."""
        try:
            self.fh.close()
        except OSError:
            pass  # the buffered tail could not be flushed either; it is cut below
        self.fh = open(os.devnull, "w")  # later closes are harmless
        try:
            os.truncate(self.writing, self.good)
        except OSError:
            pass

    def append(self, record: GenerationRecord) -> None:
        self._write({"type": "record", **record.to_dict()})
        self.done[record_key(record)] = record

    def skip(self, method: str, bench: str, prompt_id: str, turn: int, query_index: int) -> None:
        """Note a turn the run skipped (too long for the context), once."""
        key = (method, bench, prompt_id, turn)
        if key not in self.skipped:
            self._write({"type": "skip", "method": method, "bench": bench, "prompt_id": prompt_id, "turn": turn,
                         "query_index": query_index})
            self.skipped.add(key)

    def kept(self) -> str:
        """What a stop now keeps, for the interrupted line."""
        if self.published:
            return f"finished records kept in {self.path} ({len(self.done)} records)"
        if self.replacing:
            return f"no new records yet; {self.path} is unchanged"
        return f"no records yet; {self.path} was not written"

    def finish(self) -> None:
        """A clean end: a run with no record to write (all skipped or already done) still leaves its file."""
        if not self.published and not self.fresh:
            try:
                self.fh.flush()
                os.fsync(self.fh.fileno())
            except OSError as exc:
                raise self._write_error(exc) from None
            self._publish()
        self.close()

    def close(self) -> None:
        """Close; a temporary that never got a record is removed (the run failed or stopped before one), and
        the writer lock always goes, even when the close itself fails (a full disk)."""
        try:
            if self.fh is not None:
                try:
                    self.fh.close()
                except OSError:
                    pass  # every record was flushed and fsynced when written; nothing whole is lost
            if not self.published and self.writing.exists():
                self.writing.unlink()
        finally:
            self.lock.release()

    abandon = close  # the run failed before its header
