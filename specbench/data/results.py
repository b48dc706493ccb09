"""Result files as read: the header line with the run's metadata, then one line per prompt turn (or a
skipped turn), each checked against its schema; and the metadata that says where and with what a run was made
(git commit, versions, hardware). ``specbench.run.store.RunStore`` writes these files."""

from __future__ import annotations

import hashlib
import json
import platform
import subprocess
import sys
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

from specbench.engine.devices import BF16_CPU_FLAGS, cpu_fields
from specbench.errors import SpecbenchError
from specbench.records import GenerationRecord
from specbench.schemas import RESULTS_FIX, check_tree, parse_header, parse_record, parse_skip, record_key

RecordKey = tuple[str, str, str, int]  # method, bench, prompt_id, turn


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
