"""Loading: result files (header + records) -> ResultFile -> records per (target, temperature) block."""

from __future__ import annotations

import dataclasses
import glob
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence, Union

from specbench.errors import SpecbenchError
from specbench.options import check_text
from specbench.records import GenerationRecord
from specbench.analysis.report.names import Block, MethodInfo, side_infos

PathSpec = Union[str, Path, Sequence[Union[str, Path]]]



@dataclass(frozen=True)
class ResultFile:
    path: Path
    meta: dict
    records: tuple[GenerationRecord, ...]

    @property
    def block(self) -> Block:
        temperature = self.meta.get("temperature")
        if temperature is None:
            temperature = self.records[0].temperature if self.records else 0.0
        # apart_dtypes may name the dtype beside the target (a machine that ran the target in several dtypes)
        return str(self.meta.get(BLOCK_TARGET) or self.meta.get("target", "unknown")), float(temperature)

    def sides(self) -> dict[str, MethodInfo]:
        """Every side label of its records -> what method it is (names.side_infos)."""
        return side_infos(self.meta, sorted({r.method for r in self.records}))


BLOCK_TARGET = "report_block"  # set by apart_dtypes only, never written to a results file


def apart_dtypes(files: Sequence[ResultFile]) -> list[ResultFile]:
    """One machine's files, those of a target and temperature that ran in several dtypes with the dtype in their
    block ("smollm2-135m · bfloat16"): a dtype is a setting of its own (other costs, and bf16 text may differ from
    vanilla's by near-ties), so its rows never pool with another dtype's. One dtype per target: unchanged. Files
    of the compiled engine likewise, always ("smollm2-135m · compiled engine")."""
    from specbench.engine.target import DTYPES

    def dtype(f: ResultFile) -> str:  # one name per dtype ("bf16" and "bfloat16" alike)
        name = str(f.meta.get("dtype") or "?")
        return str(DTYPES[name]).removeprefix("torch.") if name in DTYPES else name

    dtypes: dict[Block, set[str]] = {}
    for f in files:
        dtypes.setdefault(f.block, set()).add(dtype(f))

    def label(f: ResultFile) -> str | None:
        parts = [dtype(f)] if len(dtypes[f.block]) > 1 else []
        if f.meta.get("engine", "eager") != "eager":  # the compiled engine is a setting of its own (other costs)
            parts.append(f"{f.meta['engine']} engine")
        return " · ".join([f.block[0], *parts]) if parts else None

    return [dataclasses.replace(f, meta={**f.meta, BLOCK_TARGET: label(f)}) if label(f) else f for f in files]


def resolve_paths(spec: PathSpec) -> list[Path]:
    """A glob, a file, a folder (its *.jsonl) or a list of those -> sorted files. One file reached twice (the
    same path in two arguments, a folder and a file in it, a link beside its file) is refused: its turns would
    pool twice."""
    import os

    items = [spec] if isinstance(spec, (str, Path)) else list(spec)
    found: dict[tuple[int, int], tuple[Path, int]] = {}  # (device, inode) -> the path and the argument that named it
    for index, item in enumerate(items):
        path = Path(item)
        if path.is_dir():
            matched = sorted(path.glob("*.jsonl"))
        elif path.is_file():
            matched = [path]
        else:
            matched = sorted(Path(p) for p in glob.glob(str(item)) if Path(p).is_file())
        for match in matched:
            st = os.stat(match)
            key = (st.st_dev, st.st_ino)
            if key in found:
                first, by = found[key]
                same = f"{match}" if first == match else f"{first} and {match} (one file)"
                how = f"by {items[by]}" if by == index else f"by {items[by]} and {item}"
                raise SpecbenchError(f"{same} is given twice ({how}); name each results file once")
            found[key] = (match, index)
    if not found:
        shown = ", ".join(str(i) for i in items) or "(nothing given)"
        raise SpecbenchError(f"no result files matched {shown}; run `specbench run ...` first")
    paths = [path for path, _ in found.values()]
    for path in paths:  # tables and pages name their files: a name no UTF-8 text can hold is refused first
        check_text(str(path), "results file name")
    return sorted(paths, key=str)


def read_result_file(path: str | Path) -> ResultFile:
    """Header line -> meta; record lines -> GenerationRecords, every line checked against its schema
    (specbench.schemas): a null or wrong-typed field, a second header or a record held twice is one
    line naming the file and line. A torn last line (an interrupted run) is left out."""
    from specbench.data.results import read_results

    path = Path(path)
    content = read_results(path, fix="fix or remove that line, or leave the file out", lenient=True)
    return ResultFile(path, dict(content.meta or {}), tuple(r for _, r in content.records))


def refuse_copies(files: Sequence[ResultFile]) -> None:
    """Two files of one header where every record of one is in the other, every field and timing alike (a copy
    of a file, or of part of it) would pool those turns twice: n doubles and every interval narrows. Two runs
    never time a turn alike, so no real pair of runs is refused. One line naming both files."""
    import hashlib
    import json

    def key(obj) -> str:
        return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()

    seen: dict[str, list[tuple[ResultFile, set[str]]]] = {}  # header -> its files and their records
    for f in files:
        if not f.records:
            continue
        mine = {key(r.to_dict()) for r in f.records}
        for other, theirs in seen.get(key(f.meta), []):
            if mine <= theirs or theirs <= mine:
                small, big = (f, other) if mine <= theirs else (other, f)
                raise SpecbenchError(f"{other.path} and {f.path} hold the same run: one header, and all "
                                     f"{len(small.records)} records of {small.path.name} are in {big.path.name}, "
                                     "timings and all (a copy); give each run once")
        seen.setdefault(key(f.meta), []).append((f, mine))


def load_result_files(spec: PathSpec) -> list[ResultFile]:
    files = [read_result_file(p) for p in resolve_paths(spec)]
    refuse_copies(files)
    if not any(f.records for f in files):
        names = ", ".join(f.path.name for f in files)
        raise SpecbenchError(f"no records in {names}; run `specbench run ...` first")
    return files


def load_results(paths: PathSpec) -> tuple[list[GenerationRecord], dict[str, dict]]:
    """All records of the matched files, and each file's header meta keyed by its path."""
    files = load_result_files(paths)
    return [r for f in files for r in f.records], {str(f.path): f.meta for f in files}


def files_by_block(files: Sequence[ResultFile]) -> dict[Block, list[ResultFile]]:
    """The files with records, grouped by (target, temperature), in file order."""
    out: dict[Block, list[ResultFile]] = {}
    for f in files:
        if f.records:
            out.setdefault(f.block, []).append(f)
    return out


def block_records(files: Sequence[ResultFile]) -> dict[Block, list[GenerationRecord]]:
    """Records per (target, temperature). Speedups must pair a method with the vanilla run of the
    same file, and metrics match by (bench, prompt_id, turn): so when a block spans several files,
    prompt ids are prefixed with the file name to keep each file's pairs apart."""
    out: dict[Block, list[GenerationRecord]] = {}
    for block, group in sorted(files_by_block(files).items()):
        if len(group) == 1:
            out[block] = list(group[0].records)
        else:
            out[block] = [dataclasses.replace(r, prompt_id=f"{f.path.name}:{r.prompt_id}")
                          for f in group for r in f.records]
    return out


def block_sides(files: Sequence[ResultFile]) -> dict[Block, dict[str, MethodInfo]]:
    """Side label -> MethodInfo per block (a label in several files of a block: the first file's)."""
    out: dict[Block, dict[str, MethodInfo]] = {}
    for block, group in sorted(files_by_block(files).items()):
        sides: dict[str, MethodInfo] = {}
        for f in group:
            for label, info in f.sides().items():
                sides.setdefault(label, info)
        out[block] = dict(sorted(sides.items()))
    return out
