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
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

from specbench.engine.devices import BF16_CPU_FLAGS, cpu_fields
from specbench.errors import SpecbenchError
from specbench.records import GenerationRecord

RecordKey = tuple[str, str, str, int]  # method, bench, prompt_id, turn


def config_hash(config: dict) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:12]


def _git_sha() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=Path(__file__).parent,
                             capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=Path(__file__).parent,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


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
    return {"git_sha": _git_sha(), "versions": _versions(), "hardware": hardware(device), "device": str(device),
            "cpu": _cpu_model(), "threads": torch.get_num_threads(), "platform": platform.platform()}


def weight_shas(meta: dict) -> dict[str, str | None]:
    """'target' / 'LABEL.option' -> commit sha, from a header's ``weights`` (empty if it has none)."""
    weights = meta.get("weights") or {}
    shas = {"target": (weights.get("target") or {}).get("sha")} if weights else {}
    for label, sources in (weights.get("drafters") or {}).items():
        shas.update({f"{label}.{name}": src.get("sha") for name, src in sources.items()})
    return shas


def _read_lines(path: Path) -> tuple[list[dict], int]:
    """Parsed JSON objects and the byte length of the intact part. Only the last line may be
    damaged (the process died mid-write: it is dropped); a damaged line before it is refused."""
    objects, good = [], 0
    try:
        with open(path, "rb") as fh:
            lines = fh.readlines()
    except OSError as exc:
        raise SpecbenchError(f"cannot read {path} ({exc.strerror}); check its permissions or pass a new --out") from None
    for number, raw in enumerate(lines, 1):
        last = number == len(lines)
        try:
            obj = json.loads(raw) if raw.endswith(b"\n") else None
        except (json.JSONDecodeError, UnicodeDecodeError):
            obj = None
        if not isinstance(obj, dict):
            if last:
                break  # torn last line: cut off before appending
            raise SpecbenchError(f"{path} is damaged at line {number} of {len(lines)} (not a JSON record); "
                                 "move it aside and rerun, or pass --overwrite to start it again")
        objects.append(obj)
        good += len(raw)
    return objects, good


class RunStore:
    """One results file: ``open`` checks resume compatibility and returns the finished keys."""

    def __init__(self, path: str | Path, meta: dict, resume: bool = False, overwrite: bool = False) -> None:
        self.path = Path(path)
        self.meta = meta
        self.done: dict[RecordKey, GenerationRecord] = {}
        self.skipped: set[RecordKey] = set()  # turns recorded as skipped (part files of a sharded run)
        try:
            existing = self.path.is_file() and self.path.stat().st_size > 0
        except OSError as exc:  # a folder on the way that this user may not enter
            raise SpecbenchError(f"cannot write results to {self.path} ({exc.strerror}); pass a writable --out") from None
        if existing:
            if resume:
                self._load_existing()
            elif not overwrite:
                raise SpecbenchError(f"{self.path} already exists; pass --resume to continue it, "
                                     "--overwrite to replace it, or a new --out")
            else:
                self.path.unlink()
        elif resume:
            pass  # nothing to resume: start fresh
        self._open()

    @staticmethod
    def _read_checked(path: Path, expected_hash: str | None) -> tuple[list[dict], int]:
        objects, good = _read_lines(path)
        header = objects[0] if objects and objects[0].get("type") == "header" else None
        if header is None or not isinstance(header.get("meta"), dict):
            raise SpecbenchError(f"{path} has no header line; it is not a specbench results file "
                                 "(pass a new --out, or --overwrite to replace it)")
        theirs = header["meta"].get("config_hash")
        if theirs != expected_hash:
            raise SpecbenchError(f"{path} was written by a different configuration (config {theirs}, now "
                                 f"{expected_hash}); rerun with the same options or write to a new --out")
        return objects, good

    @classmethod
    def read_done(cls, path: str | Path, expected_hash: str | None) -> dict[RecordKey, GenerationRecord]:
        """The finished records of another file of the same run (read only)."""
        objects, _ = cls._read_checked(Path(path), expected_hash)
        records = [GenerationRecord.from_dict(o) for o in objects if o.get("type") == "record"]
        return {(r.method, r.bench, r.prompt_id, r.turn): r for r in records}

    def _load_existing(self) -> None:
        objects, good = self._read_checked(self.path, self.meta.get("config_hash"))
        self.existing = objects[0]["meta"]
        for number, o in enumerate(objects, 1):
            if o.get("type") == "record":
                try:
                    r = GenerationRecord.from_dict(o)
                except (TypeError, KeyError, ValueError):
                    raise SpecbenchError(f"{self.path} is damaged at line {number} (not a record of this specbench); "
                                         "move it aside and rerun, or pass --overwrite") from None
                self.done[(r.method, r.bench, r.prompt_id, r.turn)] = r
            elif o.get("type") == "skip":
                self.skipped.add((o["method"], o["bench"], o["prompt_id"], o["turn"]))
        with open(self.path, "r+b") as fh:  # drop a torn tail so appends start on a fresh line
            fh.truncate(good)

    def _open(self) -> None:
        # Opened now so an unwritable path fails before any model loads; the header is written
        # by ``start`` once the environment (hardware, versions) is known.
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if self.path.is_dir():
                raise IsADirectoryError(errno.EISDIR, "a folder")
            if not os.access(self.path.parent, os.W_OK):
                raise PermissionError(errno.EACCES, "the folder is read-only")
            self.fresh = not self.path.exists() or self.path.stat().st_size == 0
            self.fh = open(self.path, "a", encoding="utf-8")
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
        try:
            self.fh.write(line)
            self.fh.flush()
            os.fsync(self.fh.fileno())
        except OSError as exc:
            self._cut_back()
            full = " (disk full)" if exc.errno == errno.ENOSPC else ""
            raise SpecbenchError(f"could not append to {self.path}{full}: {exc.strerror}; the file is valid up to its "
                                 f"last whole record ({len(self.done)} records); free space and rerun with --resume") from None
        self.good += len(line.encode("utf-8"))

    def _cut_back(self) -> None:
        """After a failed write: drop the partial line so the file ends with a whole record."""
        try:
            self.fh.close()
        except OSError:
            pass  # the buffered tail could not be flushed either; it is cut below
        self.fh = open(os.devnull, "w")  # later closes are harmless
        try:
            os.truncate(self.path, self.good)
        except OSError:
            pass

    def abandon(self) -> None:
        """The run failed before its header: remove the empty file this store created."""
        self.close()
        if self.fresh and self.path.exists() and self.path.stat().st_size == 0:
            self.path.unlink()

    def append(self, record: GenerationRecord) -> None:
        self._write({"type": "record", **record.to_dict()})
        self.done[(record.method, record.bench, record.prompt_id, record.turn)] = record

    def skip(self, method: str, bench: str, prompt_id: str, turn: int, query_index: int) -> None:
        """Note a turn the run skipped (too long for the context), once."""
        key = (method, bench, prompt_id, turn)
        if key not in self.skipped:
            self._write({"type": "skip", "method": method, "bench": bench, "prompt_id": prompt_id, "turn": turn,
                         "query_index": query_index})
            self.skipped.add(key)

    def close(self) -> None:
        self.fh.close()

    def abandon(self) -> None:
        """Close; a file this run created and wrote nothing to is removed (failed before the header)."""
        self.fh.close()
        if self.fresh and self.path.exists() and self.path.stat().st_size == 0:
            self.path.unlink()
