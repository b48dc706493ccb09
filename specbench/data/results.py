"""Append-only JSONL run store: a header line with the run's metadata, then one line per prompt
turn. Every record is flushed and fsynced, so a killed run loses at most the turn in flight; a
torn last line is ignored on read and cut off before appending."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import platform
import subprocess
import sys
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

from specbench.engine import interrupt
from specbench.engine.devices import BF16_CPU_FLAGS, cpu_fields
from specbench.errors import SpecbenchError
from specbench.records import GenerationRecord
from specbench.data.safe_files import WriterLock, check_output, publish, temp_path
from specbench.schemas import RESULTS_FIX, check_tree, parse_header, parse_record, parse_skip, record_key

RecordKey = tuple[str, str, str, int]  # method, bench, prompt_id, turn


def config_hash(config: dict) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:12]


def _same_older_run(meta: dict, expected_hash: str | None) -> bool:
    """A file written before runs recorded their sides as data, by the configuration whose hash is
    ``expected_hash`` today (``run_config.identity_of_header``)."""
    from specbench.run.run_config import identity_of_header

    ident = identity_of_header(meta)
    return ident is not None and config_hash(ident) == expected_hash


# What a run writes (records, tables, training runs) is not code: a tree whose only changes are there still ran the
# committed code, so neither the dirty mark nor the diff hash looks at them.
OUTPUTS = ("results", "reports", "runs")
NOT_OUTPUTS = [".", *(f":(exclude,top){folder}" for folder in OUTPUTS)]


def _git_sha() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=Path(__file__).parent,
                             capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", *top_level(NOT_OUTPUTS)],
                               cwd=Path(__file__).parent, capture_output=True, text=True, timeout=5).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def top_level(pathspecs: list[str]) -> list[str]:
    """Pathspecs relative to the checkout's top ('.' -> ':(top)'), whichever folder git runs in."""
    return [":(top)" if spec == "." else spec for spec in pathspecs]


def git_dirty(where: Path = Path(__file__).parent) -> dict | None:
    """What a dirty working tree changes against HEAD (tracked files, outputs aside): the sha256 of
    ``git diff HEAD`` and the changed files' names, so a record made from uncommitted code says which code it
    was; None when clean or outside a git checkout."""
    here = where
    try:
        paths = ["--", *top_level(NOT_OUTPUTS)]
        names = subprocess.run(["git", "diff", "HEAD", "--name-only", *paths], cwd=here, capture_output=True,
                               text=True, timeout=10)
        if names.returncode != 0 or not names.stdout.strip():
            return None
        diff = subprocess.run(["git", "diff", "HEAD", "--binary", *paths], cwd=here, capture_output=True,
                              timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return {"diff_sha256": hashlib.sha256(diff).hexdigest(), "files": names.stdout.split()}


def _cpu_model() -> str:
    return cpu_fields().get("model name") or platform.processor() or platform.machine()


def _cpu_generation(fields: dict[str, str]) -> str:
    """'family 25 model 1, avx2 only' from /proc/cpuinfo's fields: the model name alone ("AMD EPYC") hides the
    generation, and with it whether bf16 is native, which decides CPU timings; '' where unknown."""
    if "cpu family" not in fields or "model" not in fields:
        return ""
    flags = set(fields.get("flags", "").split())
    isa = "/".join(f for f in BF16_CPU_FLAGS if f in flags) or ("avx2 only" if "avx2" in flags else "no avx2")
    return f"family {fields['cpu family']} model {fields['model']}, {isa}"


def _versions() -> dict[str, str]:
    found = {"python": sys.version.split()[0]}
    for pkg in ("specbench", "torch", "transformers", "gguf", "datasets"):
        try:
            found[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return found


def hardware(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    threads = torch.get_num_threads()
    generation = _cpu_generation(cpu_fields())
    return f"{_cpu_model()}{f' [{generation}]' if generation else ''} ({threads} thread{'s' if threads != 1 else ''})"


def environment_metadata(device: torch.device | str) -> dict:
    """Where and with what a run was made (not part of the config hash)."""
    dirty = git_dirty()
    return {"git_sha": _git_sha(), **({"git_dirty": dirty} if dirty else {}), "versions": _versions(), "hardware": hardware(device), "device": str(device),
            "cpu": _cpu_model(), "threads": torch.get_num_threads(), "platform": platform.platform()}


def weight_shas(meta: dict) -> dict[str, str | None]:
    """'target' / 'LABEL.option' -> commit sha, from a header's ``weights`` (empty if it has none)."""
    weights = meta.get("weights") or {}
    shas = {"target": (weights.get("target") or {}).get("sha")} if weights else {}
    for label, sources in (weights.get("drafters") or {}).items():
        shas.update({f"{label}.{name}": src.get("sha") for name, src in sources.items()})
    return shas


@dataclass
class ResultsContent:
    """A results file as read: its header meta, its record and skip lines (with their line numbers),
    and the byte length of the intact part (a torn last line excluded)."""

    path: Path
    meta: dict | None
    records: list[tuple[int, GenerationRecord]]
    skips: list[tuple[int, dict]]
    lines: list[tuple[int, dict]]  # record and skip lines as parsed, in file order
    good: int


def _read_lines(path: Path, fix: str = RESULTS_FIX) -> tuple[list[tuple[int, dict]], int]:
    """(line number, parsed object) and the byte length of the intact part. Only the last line may be
    damaged (the process died mid-write: it is dropped); a damaged line before it is refused."""
    objects, good = [], 0
    try:
        with open(path, "rb") as fh:
            lines = fh.readlines()
    except IsADirectoryError:
        raise SpecbenchError(f"{path} is a folder, not a results file; pass a .jsonl file") from None
    except OSError as exc:
        raise SpecbenchError(f"cannot read results file {path} ({exc.strerror}); check its permissions, or leave it "
                             "out / pass a new --out") from None
    for number, raw in enumerate(lines, 1):
        last = number == len(lines)
        try:
            obj = json.loads(raw) if raw.endswith(b"\n") else None
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            obj = None
        if not isinstance(obj, dict):
            if last:
                break  # torn last line: cut off before appending
            raise SpecbenchError(f"{path} is damaged at line {number} of {len(lines)} (not a JSON record); {fix}")
        check_tree(obj, path, number, fix)
        objects.append((number, obj))
        good += len(raw)
    if lines and not objects and len(lines) == 1 and lines[0].endswith(b"\n"):
        raise SpecbenchError(f"{path} is not a specbench results file (its one line is not a JSON record); {fix}")
    return objects, good


def read_results(path: str | Path, fix: str = RESULTS_FIX, lenient: bool = False) -> ResultsContent:
    """Every line checked against its schema; a second header (two runs wrote the file at once) and a
    record held twice are refused, not counted twice. ``lenient``: records of older writers may lack
    fields (they get defaults)."""
    path = Path(path)
    objects, good = _read_lines(path, fix)
    meta, header_line = None, 0
    records, skips, lines = [], [], []
    seen: dict[RecordKey, int] = {}
    for number, obj in objects:
        kind = obj.get("type")
        if kind == "header":
            if header_line:
                raise SpecbenchError(f"{path} has two headers (lines {header_line} and {number}): two runs wrote to "
                                     "it at once; keep one run's lines, or rerun with --overwrite")
            if number != objects[0][0]:
                raise SpecbenchError(f"{path} line {number}: the header is not the first line; {fix}")
            meta, header_line = parse_header(obj, path, number, fix), number
        elif kind == "record":
            record = parse_record(obj, path, number, fix, lenient=lenient)
            key = record_key(record)
            if key in seen:
                raise SpecbenchError(f"{path} holds the {key[0]} record of prompt {key[2]} turn {key[3]} twice (lines "
                                     f"{seen[key]} and {number}): two runs wrote to it at once; keep one copy, or "
                                     "rerun with --overwrite")
            seen[key] = number
            records.append((number, record))
            lines.append((number, obj))
        elif kind == "skip":
            parse_skip(obj, path, number, fix)
            skips.append((number, obj))
            lines.append((number, obj))
        elif not header_line:
            raise SpecbenchError(f"{path} has no header line; it is not a specbench results file (pass a new --out, "
                                 "or --overwrite to replace it)")
        else:
            raise SpecbenchError(f"{path} line {number} is not a header, record or skip line (type "
                                 f"{str(kind)[:40]!r}); it is not a specbench results file, {fix}")
    return ResultsContent(path, meta, records, skips, lines, good)


class RunStore:
    """One results file: ``open`` checks resume compatibility and returns the finished keys.

    A new file is written to a hidden temporary beside ``path`` and renamed into place with its
    first record (or, with none, on a clean finish): a run that fails or is stopped before that
    leaves no file, and under --overwrite the old file stays whole until then. One writer at a time
    (``WriterLock``)."""

    def __init__(self, path: str | Path, meta: dict, resume: bool = False, overwrite: bool = False,
                 inputs: tuple = ()) -> None:
        self.path = Path(path)
        self.meta = meta
        self.done: dict[RecordKey, GenerationRecord] = {}
        self.skipped: set[RecordKey] = set()  # turns recorded as skipped (part files of a sharded run)
        self.fh = None
        self.replacing = False  # --overwrite of an existing file: the old one stays until our first record
        check_output(self.path, inputs)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            existing = self.path.is_file() and self.path.stat().st_size > 0
        except OSError as exc:  # a folder on the way that this user may not enter
            raise SpecbenchError(f"cannot write results to {self.path} ({exc.strerror}); pass a writable --out") from None
        self._check_writable()
        self.lock = WriterLock(self.path)
        try:
            if existing:
                if resume:
                    self._load_existing()
                elif not overwrite:
                    raise SpecbenchError(f"{self.path} already exists; pass --resume to continue it, "
                                         "--overwrite to replace it, or a new --out")
                else:
                    self.replacing = True
            self._open(append=existing and resume)
        except BaseException:
            self.lock.release()
            raise
        interrupt.note_kept(self.kept)

    def _check_writable(self) -> None:
        try:
            if self.path.is_dir():
                raise IsADirectoryError(errno.EISDIR, "a folder")
            if not os.access(self.path.parent, os.W_OK):
                raise PermissionError(errno.EACCES, "the folder is read-only")
        except OSError as exc:
            raise SpecbenchError(f"cannot write results to {self.path} ({exc.strerror}); pass a writable --out") from None

    @staticmethod
    def _read_checked(path: Path, expected_hash: str | None) -> ResultsContent:
        content = read_results(path)
        if content.meta is None:
            raise SpecbenchError(f"{path} has no header line; it is not a specbench results file "
                                 "(pass a new --out, or --overwrite to replace it)")
        theirs = content.meta.get("config_hash")
        if theirs != expected_hash and not _same_older_run(content.meta, expected_hash):
            raise SpecbenchError(f"{path} was written by a different configuration (config {theirs}, now "
                                 f"{expected_hash}); rerun with the same options or write to a new --out")
        return content

    @classmethod
    def read_done(cls, path: str | Path, expected_hash: str | None) -> dict[RecordKey, GenerationRecord]:
        """The finished records of another file of the same run (read only)."""
        content = cls._read_checked(Path(path), expected_hash)
        return {record_key(r): r for _, r in content.records}

    def _load_existing(self) -> None:
        content = self._read_checked(self.path, self.meta.get("config_hash"))
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
            raise SpecbenchError(f"cannot write results to {self.path} ({exc.strerror}); pass a writable --out") from None

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
                full = " (disk full)" if exc.errno == errno.ENOSPC else ""
                kept = (f"the file is valid up to its last whole record ({len(self.done)} records); free space and "
                        "rerun with --resume") if self.published else "nothing was kept; free space and rerun"
                raise SpecbenchError(f"could not append to {self.path}{full}: {exc.strerror}; {kept}") from None
            self.good += len(line.encode("utf-8"))
            if obj.get("type") != "header" and not self.published:
                self._publish()

    def _publish(self) -> None:
        """The first record is on disk: the file takes its place (replacing an old one under --overwrite)."""
        publish(self.writing, self.path)
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
            self.fh.flush()
            os.fsync(self.fh.fileno())
            self._publish()
        self.close()

    def close(self) -> None:
        """Close; a temporary that never got a record is removed (the run failed or stopped before one)."""
        if self.fh is not None:
            self.fh.close()
        if not self.published and self.writing.exists():
            self.writing.unlink()
        self.lock.release()

    abandon = close  # the run failed before its header
