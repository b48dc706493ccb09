"""Parts of a run sharded over several processes, and merging them into the usual single file.

Under ``torchrun`` rank r of N appends to ``OUT.part-rofN`` (same header as every other part: the
config hash, the whole query stream, the sides; plus ``rank`` and ``world_size``). Rank 0 merges
the parts (and, on ``--resume``, an earlier merged ``OUT``) into ``OUT`` in the original query
order and removes them. ``specbench merge`` does the same by hand. A merge refuses parts of
different runs, a record held twice, and a query with no record (unless the run skipped it as
too long for the context; parts record that in ``skip`` lines, which readers ignore). It writes under
``OUT``'s writer lock, the one a run appending to ``OUT`` holds, and refuses a part a run still writes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specbench.errors import SpecbenchError
from specbench.data.results import read_results
from specbench.data.safe_files import WriterLock, check_output, rewrite_results, writer_of


def line_key(obj: dict) -> tuple[str, str, str, int]:
    return obj["method"], obj["bench"], obj["prompt_id"], int(obj["turn"])


@dataclass
class RunFile:
    path: Path
    meta: dict
    lines: list[dict]  # records and skip lines, in file order

    @property
    def stream(self) -> list[str]:
        return list(self.meta.get("stream", []))


def read_run(path: str | Path) -> RunFile:
    path = Path(path)
    if not path.is_file():
        raise SpecbenchError(f"{path} does not exist" if not path.exists() else f"{path} is not a results file")
    content = read_results(path, fix="fix or remove that file and merge again")
    if content.meta is None:
        raise SpecbenchError(f"{path} has no header line; it is not a specbench results file")
    return RunFile(path, content.meta, [o for _, o in content.lines])


def _check_same_run(runs: list[RunFile]) -> RunFile:
    """All runs share the config hash and one query stream (an earlier one may be a prefix: a
    resume may extend ``--limit``); returns the run whose header the merged file takes."""
    first = runs[0]
    for run in runs[1:]:
        ours, theirs = first.meta.get("config_hash"), run.meta.get("config_hash")
        if ours != theirs:
            raise SpecbenchError(f"{run.path} was written by a different configuration than {first.path} "
                                 f"(config {theirs} vs {ours}); merge only the parts of one run")
    longest = max(runs, key=lambda r: len(r.stream))
    for run in runs:
        if run.stream != longest.stream[: len(run.stream)]:
            raise SpecbenchError(f"{run.path} and {longest.path} have different query streams; "
                                 "merge only the parts of one run")
    full = [r for r in runs if len(r.stream) == len(longest.stream)]
    return next((r for r in full if r.meta.get("rank") == 0), full[0])


def _check_complete(base: RunFile, records: dict, skips: dict) -> None:
    """Every (query, side, turn) of the stream has a record, or the side was skipped at or before
    that turn. Files without ``sides``/``stream_turns`` (older runs): every query has a line."""
    stream, sides, turns = base.stream, base.meta.get("sides"), base.meta.get("stream_turns")
    if not sides or not turns or len(turns) != len(stream):
        present = {key[2] for key in records} | {key[2] for key in skips}
        for index, pid in enumerate(stream):
            if pid not in present:
                raise SpecbenchError(f"query {index} ({pid}) has no record in any part; finish the run with "
                                     "--resume before merging")
        return
    bench = next((key[1] for key in [*records, *skips]), "")
    for index, (pid, n) in enumerate(zip(stream, turns)):
        for side in sides:
            for turn in range(n):
                if (side, bench, pid, turn) in records:
                    continue
                if any((side, bench, pid, t) in skips for t in range(turn + 1)):
                    break  # too long for the context: the conversation ended there
                raise SpecbenchError(f"query {index} ({pid}) has no {side} record for turn {turn} in any part; "
                                     "finish the run with --resume before merging")


def merge_runs(sources: list[str | Path]) -> tuple[dict, list[dict]]:
    """(header meta, lines in query order) of the union of ``sources``; one-line errors for parts of
    different runs, duplicates and missing queries."""
    if not sources:
        raise SpecbenchError("nothing to merge: name the part files (OUT.part-RofN)")
    runs = [read_run(p) for p in sources]
    base = _check_same_run(runs)
    records: dict[tuple, Path] = {}
    skips: dict[tuple, Path] = {}
    ordered = []
    for order, run in enumerate(runs):
        for pos, obj in enumerate(run.lines):
            key = line_key(obj)
            if obj["type"] == "skip":
                if key in skips:
                    continue  # a resumed rank re-skips what an earlier part skipped
                skips[key] = run.path
            else:
                if key in records:
                    what = f"the {key[0]} record of {key[2]} turn {key[3]}"
                    where = (f"{run.path} holds {what} twice" if records[key] == run.path
                             else f"{records[key]} and {run.path} both hold {what}")
                    raise SpecbenchError(f"{where}; give each part once")
                records[key] = run.path
            ordered.append((int(obj.get("query_index", -1)), order, pos, obj))
    _check_complete(base, records, skips)
    lines = [obj for *_, obj in sorted(ordered, key=lambda item: item[:3])
             if obj["type"] == "record" or line_key(obj) not in records]
    meta = {k: v for k, v in base.meta.items() if k != "rank"}
    meta["parts"] = [{"file": run.path.name, **{k: run.meta.get(k) for k in ("rank", "world_size", "device", "hardware")}}
                     for run in runs]
    return meta, lines


def merge_into(out: str | Path, sources: list[str | Path], inputs: tuple = ()) -> tuple[dict, list[dict]]:
    """Merge ``sources`` into ``out`` (``merge_runs``), written atomically under ``out``'s writer lock: taken before
    any source is read, so a run still appending to ``out`` is refused (naming its pid) rather than losing its
    records into a replaced file, and none can start meanwhile; a part a run is still writing is refused too.
    ``inputs``: (option, path) pairs ``out`` may be only if merged from. Returns what was written."""
    import json

    out = Path(out)
    check_output(out, inputs)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SpecbenchError(f"cannot create the folder of --out {out} ({exc.strerror}); pass another path") from None
    with WriterLock(out) as lock:
        for source in sources:
            if not same_file(source, out) and (pid := writer_of(source)) is not None:
                raise SpecbenchError(f"{source} is being written by another specbench run (pid {pid}); wait for it "
                                     "to finish, then merge")
        meta, lines = merge_runs(sources)
        objs = [{"type": "header", "meta": meta}, *lines]
        rewrite_results(out, ((json.dumps(o, ensure_ascii=False, default=str) + "\n").encode("utf-8") for o in objs),
                        lock, "--out")
    return meta, lines


def same_file(a: str | Path, b: str | Path) -> bool:
    """Both name one file on disk (False when either is missing)."""
    import os

    try:
        return os.path.samefile(a, b)
    except OSError:
        return False
