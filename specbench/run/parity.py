"""`specbench parity METHOD`: our implementation of a method beside its authors' own code, in one process.

A *reference* is the authors' implementation of a registered method, wrapped in a small adapter that
a method package registers under the entry-point group ``specbench.run.parity`` (the core names no
method; a third-party method brings its own). Both sides run on the same target, the same drafter
weights (the adapter gets our loaded drafter and reads its weights from it), the same prompts and
token budget, greedy, interleaved prompt by prompt with the order alternating (so slow drift favours
neither). Per prompt we keep both sides' tokens and text, per-step accept lengths, τ and decode time;
then ``reports/parity_table.md`` (and .csv) pools every parity file into one row per method.

Clock discipline, the same on both sides: decode time excludes the prompt's prefill; on CPU it is
perf_counter_ns wall time, on CUDA a synchronize brackets it (our engine reads CUDA events, which
measure the same interval on the GPU's timeline).
"""

from __future__ import annotations

import csv
import importlib
import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol, Sequence

import torch

from specbench.engine.drafter import Drafter
from specbench.engine.registry import available_methods, entry_points, method_class, parse_options
from specbench.data.safe_files import atomic_text
from specbench.errors import SpecbenchError, installed_version, unknown_name_error
from specbench.engine.timing import synchronize
from specbench.run.run_config import ParityConfig  # noqa: F401  (also imported from here)
from specbench.run.snapshots import Repository

ENTRY_POINT_GROUP = "specbench.parity"
TABLE_COLUMNS = ("method", "reference", "version", "prompts", "text identical", "τ ours", "τ ref", "speed ours/ref")
TABLE_NAME = "parity_table"
WARMUP_TOKENS = 16


# ---- the adapter protocol ----------------------------------------------------------------------
@dataclass
class ReferenceOutput:
    """What one reference generation returns: new tokens (the prefill's first token included, cut at
    EOS and the budget), accepted draft tokens per verify step (the bonus not counted, as in our
    records), and the decode seconds (prefill excluded) under the clock discipline above."""

    tokens: list[int]
    accept_lengths: list[int]
    decode_seconds: float


class Reference(Protocol):
    """An authors' implementation of one registered method.

    ``name``: the method it reproduces (its entry-point name). ``reference``: what it is, for the table
    (e.g. "transformers assisted generation"). ``notes``: where it differs from ours by design (one
    paragraph for the table's notes). ``load`` raises a one-line ``SpecbenchError`` when the package is
    missing or our drafter's layout cannot be expressed in theirs; nothing is written before it returns."""

    name: str
    reference: str
    notes: str
    # Optional: method options a parity run uses unless the user passes them (e.g. the one tree shape a
    # reference can run); both sides get them.
    options: dict
    # Optional, for authors' code published only as a repository (specbench/run/snapshots.py): the
    # repository it imports at run time; ``source`` is set from ``--reference-src`` before ``version``.
    repository: "Repository"
    source: str | None
    # Optional: set (to the reason, one paragraph) by a registered method whose authors' code cannot give a
    # row; the table lists it under "without a row", `parity ROW` refuses it, `--all` skips it.
    unavailable: str

    def version(self) -> str: ...

    def load(self, target, drafter: Drafter, options: Any) -> None: ...

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int) -> ReferenceOutput: ...


def available_references() -> dict[str, str]:
    """row name -> 'module:Class' of every registered reference adapter. A row is named after the method it
    reproduces, or ``METHOD-WHAT`` when a method has more than one reference (e.g. ``ddtree`` against its
    authors' loop, ``ddtree-drafter`` against another package's draft model in our loop); the adapter's
    ``name`` says which method it runs."""
    return dict(sorted(entry_points(ENTRY_POINT_GROUP).items()))


def reference_for(row: str) -> Reference:
    """The reference adapter registered as ``row``; one line when it is unknown or the method has none."""
    refs = available_references()
    if row not in refs:
        known = available_methods()
        if row not in known:
            raise unknown_name_error("method", row, sorted({*known, *refs}), "specbench list methods")
        have = ", ".join(refs) or "none"
        raise SpecbenchError(f"method {row!r} has no reference implementation to compare with (methods with one: "
                             f"{have}); register one under the entry-point group {ENTRY_POINT_GROUP}")
    module, _, attr = refs[row].partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except ImportError as exc:  # the adapter module itself imports what it needs lazily; this is a broken plugin
        raise SpecbenchError(f"the reference adapter of {row!r} ({refs[row]}) fails to import ({exc}); "
                             "reinstall the package that provides it") from None
    return cls()


def unavailable_references() -> dict[str, tuple[str, str]]:
    """row -> (reference, reason) of every registered reference that cannot give a row."""
    found = {}
    for row in available_references():
        try:
            ref = reference_for(row)
        except SpecbenchError:
            continue
        if getattr(ref, "unavailable", None):
            found[row] = (ref.reference, ref.unavailable)
    return found


def package_version(dist: str, install_hint: str = "pip install 'specbench[parity]'") -> str:
    """The installed version of distribution ``dist``; one line naming the install command if absent."""
    return installed_version(dist, f"the reference package {dist!r} is not installed; {install_hint}")


# ---- one run ----------------------------------------------------------------------------------
def results_root(on_gpu: bool) -> Path:
    """CPU runs go to results/, GPU runs to results/gpu/ (tables beside them: reports/ or results/gpu/)."""
    return Path("results/gpu") if on_gpu else Path("results")


def table_dir(on_gpu: bool) -> Path:
    return Path("results/gpu") if on_gpu else Path("reports")


def default_out(cfg: ParityConfig) -> Path:
    target = Path(cfg.target).name.replace(".gguf", "")
    return results_root(cfg.on_gpu) / "parity" / f"{cfg.method}_{Path(cfg.bench).stem}_{target}.jsonl"


def decode_seconds_of(record) -> float:
    """Our side's decode time: the top-level decode phases (draft, compile, verify, commit), the same
    sum every table uses. Sub-phases a drafter times inside ``draft`` (``tree_build``, ``adapt``) are
    already in it; summing every phase but the prefill counted them twice."""
    return record.decode_time


def tau_of(tokens: list[int], steps: int) -> float:
    """Tokens produced by verify steps (all but the prefill's first) per step: the same count on both
    sides whatever each does past the budget in its last step."""
    return (len(tokens) - 1) / steps if steps else float("nan")


def _side(tokens: list[int], accept: list[int], seconds: float, tokenizer) -> dict:
    text = tokenizer.decode(tokens, skip_special_tokens=True) if tokenizer is not None else None
    return {"tokens": tokens, "text": text, "accept_lengths": accept, "steps": len(accept),
            "tau": tau_of(tokens, len(accept)), "decode_s": seconds}


def compare(ours: dict, ref: dict) -> dict:
    """Identical tokens; identical per-step accept lengths except the last step, which each side may
    cut differently at the token budget or EOS (tokens past it are not kept by either)."""
    a, b = ours["accept_lengths"], ref["accept_lengths"]
    same_steps = ours["steps"] == ref["steps"] and a[:-1] == b[:-1]
    differ = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))
    # where the accept lengths first differ (None: nowhere), and the tokens left in the budget there
    left = None if differ is None else len(ours["tokens"]) - 1 - sum(n + 1 for n in a[:differ])
    return {"text_identical": ours["tokens"] == ref["tokens"], "accept_identical": same_steps,
            "first_accept_difference": differ, "tokens_left_there": left}


def run_parity(cfg: ParityConfig, progress=None) -> Path:
    """Run ``cfg.method`` and its reference interleaved; write the JSONL and refresh the table.
    Every check that can refuse (method, package, drafter layout, prompts) runs before anything is written."""
    from specbench.data.benchmarks import check_data_dir_option
    from specbench.engine.devices import choose_dtype, resolve_device
    from specbench.engine.registry import create_drafter
    from specbench.engine.loop import GenerationConfig, generate
    from specbench.engine.prompts import render_chat
    from specbench.data.results import environment_metadata
    from specbench.data.streams import load_stream_prompts
    from specbench.engine.target import Target
    from specbench.engine.verify import SamplingParams

    from specbench import commands
    from specbench.options import validate

    validate(cfg, "parity", commands.label(ParityConfig))  # its declaration: ranges, checks, conflicts
    out = parity_outputs(cfg)  # every file it will write, before any work
    reference = reference_for(cfg.method)
    if getattr(reference, "unavailable", None):
        raise SpecbenchError(f"{cfg.method} has no parity row: {reference.unavailable}")
    if cfg.reference_src is not None:
        if getattr(reference, "repository", None) is None:
            raise SpecbenchError(f"{cfg.method}'s reference ({reference.reference}) is an installed package, not a "
                                 "repository snapshot; drop --reference-src")
        reference.source = cfg.reference_src
    ref_version = reference.version()  # a missing package is refused here, before any model loads
    method = reference.name  # the method the row runs (the row's own name for a method's first reference)
    cls = method_class(method)
    cfg = replace(cfg, options={**dict(getattr(reference, "options", None) or {}), **cfg.options})
    options = parse_options(cls, cfg.options)
    cls.check_references(options)
    device = resolve_device(cfg.device)
    dtype, dtype_reason = choose_dtype(cfg.dtype, device)
    cfg = replace(cfg, device=device, dtype=dtype)
    check_data_dir_option(cfg.data_dir)
    prompts = load_stream_prompts(cfg.bench, cfg.data_dir, limit=cfg.limit)
    if not prompts:
        raise SpecbenchError(f"bench {cfg.bench!r} has no prompts")

    target = Target.load(cfg.target, dtype, device)
    drafter = create_drafter(method, cfg.options)
    drafter.setup(target)
    reference.load(target, drafter, options)

    greedy = GenerationConfig(cfg.max_new_tokens, SamplingParams(0.0), seed=0)
    rendered = [render_chat(target.tokenizer, [{"role": "user", "content": p.turns[0]}], None, target.chat)
                for p in prompts]
    fits = [(p, ids) for p, ids in zip(prompts, rendered)
            if len(ids) + cfg.max_new_tokens + 128 <= target.max_context]
    if not fits:
        raise SpecbenchError(f"no prompt of {cfg.bench!r} fits the target's context with --max-new-tokens "
                             f"{cfg.max_new_tokens}; lower it")

    header = {"type": "header", "kind": "parity", "method": method, "row": cfg.method, "reference": reference.reference,
              "reference_version": ref_version, "notes": reference.notes, "bench": prompts[0].bench,
              "target": target.name, "dtype": dtype, "dtype_reason": dtype_reason,
              "max_new_tokens": cfg.max_new_tokens, "limit": cfg.limit, "method_options": asdict(options),
              **environment_metadata(target.device)}

    # One short generation per side first: first calls pay for allocation and kernel selection.
    warm = fits[0][1]
    generate(target, drafter, warm, GenerationConfig(WARMUP_TOKENS, SamplingParams(0.0), seed=0))
    reference.generate(warm, WARMUP_TOKENS)

    with atomic_text(out) as fh:  # whole or not at all: a failure or a stop leaves the old file, no part
        fh.write(json.dumps(header) + "\n")
        for index, (prompt, ids) in enumerate(fits):
            sides = {}
            for side in (("ours", "ref") if index % 2 == 0 else ("ref", "ours")):
                if side == "ours":
                    rec = generate(target, drafter, ids, greedy, method=method)
                    sides[side] = _side(rec.new_tokens, rec.accept_lengths, decode_seconds_of(rec), target.tokenizer)
                else:
                    got = reference.generate(ids, cfg.max_new_tokens)
                    sides[side] = _side(list(got.tokens), list(got.accept_lengths), got.decode_seconds,
                                        target.tokenizer)
            line = {"type": "record", "prompt_id": prompt.id, "prompt_tokens": len(ids), "first": "ours"
                    if index % 2 == 0 else "ref", "ours": sides["ours"], "ref": sides["ref"],
                    **compare(sides["ours"], sides["ref"])}
            fh.write(json.dumps(line) + "\n")
            fh.flush()
            if progress is not None:
                progress(index + 1, len(fits), line)
    write_table(out.parent, table_folder(cfg, out))
    return out


def parity_outputs(cfg: ParityConfig) -> Path:
    """The parity file ``cfg`` writes, once every file the command will write is known to be writable as such:
    the parity file (not a device, a link, a folder, the prompt file, or a file of another kind that it would
    replace) and the table beside it, whose rows pool every ``*.jsonl`` in the parity file's folder, so each of
    those must be a parity file too. Checked before any work; a refusal names the file and what to do."""
    from specbench.data.safe_files import check_output

    out = Path(cfg.out) if cfg.out else default_out(cfg)
    check_output(out, [("--bench", cfg.bench)])
    if out.is_file() and not is_parity_file(out):
        raise SpecbenchError(f"--out {out} exists and is not a parity file; writing it would replace it, pass "
                             "another path")
    for other in sorted(out.parent.glob("*.jsonl")) if out.parent.is_dir() else []:
        if other.is_file() and other != out and not is_parity_file(other):
            raise SpecbenchError(f"{other} is not a parity file, and the parity table pools every .jsonl file in "
                                 f"{out.parent}; move it out, or pass an --out in a folder of parity files only")
    folder = table_folder(cfg, out)
    for table in (folder / f"{TABLE_NAME}.md", folder / f"{TABLE_NAME}.csv"):
        check_output(table, what="the parity table")
    return out


def is_parity_file(path: Path) -> bool:
    """Its first line is a parity header (an unreadable or damaged file is not one)."""
    try:
        with open(path, encoding="utf-8") as fh:
            return json.loads(fh.readline()).get("kind") == "parity"
    except (OSError, ValueError, AttributeError):
        return False


def table_folder(cfg: ParityConfig, out: Path) -> Path:
    """Where the table of ``out``'s folder goes: the default folder's table is the reported one
    (reports/ or results/gpu/); a file written elsewhere (--out) gets its own table beside it."""
    same = out.parent.resolve() == default_out(cfg).parent.resolve()
    return table_dir(cfg.on_gpu) if same else out.parent


def timed_call(device: torch.device, fn, *args, **kwargs) -> tuple[Any, float]:
    """``fn(*args)`` and its seconds under the clock discipline (perf_counter_ns; synchronized on CUDA):
    for adapters that time a reference loop from outside."""
    synchronize(device)
    start = time.perf_counter_ns()
    result = fn(*args, **kwargs)
    synchronize(device)
    return result, (time.perf_counter_ns() - start) / 1e9


# ---- the table ---------------------------------------------------------------------------------
def read_parity(path: Path) -> tuple[dict, list[dict]]:
    try:
        lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except ValueError as exc:  # a damaged line (UnicodeDecodeError is one too)
        raise SpecbenchError(f"{path} is damaged ({exc}); fix or remove it") from None
    if not lines or not isinstance(lines[0], dict) or lines[0].get("kind") != "parity":
        raise SpecbenchError(f"{path} is not a parity file (no parity header); move it out of the parity folder")
    return lines[0], [o for o in lines[1:] if o.get("type") == "record"]


def row_of(header: dict) -> str:
    """A parity file's row: its ``row`` (files before rows had names: the method)."""
    return header.get("row", header["method"])


def table_rows(folder: Path) -> tuple[list[dict], list[dict]]:
    """One row per method over every parity file in ``folder`` (pooled), plus the headers read."""
    by_method: dict[str, list[tuple[dict, list[dict]]]] = {}
    for path in sorted(folder.glob("*.jsonl")):
        header, records = read_parity(path)
        by_method.setdefault(row_of(header), []).append((header, records))
    rows, headers = [], []
    for method, files in sorted(by_method.items()):
        records = [r for _, rs in files for r in rs]
        headers += [h for h, _ in files]
        versions = sorted({h["reference_version"] for h, _ in files})

        def pooled(side: str) -> tuple[float, float]:
            tokens = sum(len(r[side]["tokens"]) - 1 for r in records)
            steps = sum(r[side]["steps"] for r in records)
            seconds = sum(r[side]["decode_s"] for r in records)
            return (tokens / steps if steps else float("nan"), tokens / seconds if seconds else float("nan"))

        tau_ours, speed_ours = pooled("ours")
        tau_ref, speed_ref = pooled("ref")
        rows.append({"method": method, "reference": files[0][0]["reference"], "version": ", ".join(versions),
                     "prompts": len(records),
                     "text identical": f"{sum(r['text_identical'] for r in records)}/{len(records)}",
                     "τ ours": f"{tau_ours:.3f}", "τ ref": f"{tau_ref:.3f}",
                     "speed ours/ref": f"{speed_ours / speed_ref:.3f}" if speed_ref else "—",
                     "accept identical": f"{sum(r['accept_identical'] for r in records)}/{len(records)}"})
    return rows, headers


def write_table(folder: Path, out_dir: Path) -> list[Path]:
    """``parity_table.md`` and ``.csv`` from every parity file in ``folder``."""
    rows, headers = table_rows(folder)
    out_dir.mkdir(parents=True, exist_ok=True)
    md = ["| " + " | ".join(TABLE_COLUMNS) + " |", "|" + "---|" * len(TABLE_COLUMNS)]
    md += ["| " + " | ".join(str(row[c]) for c in TABLE_COLUMNS) + " |" for row in rows]
    md += ["", "Notes:", "",
           "- Both sides run in one process on the same target and drafter weights, greedy, interleaved prompt by "
           "prompt (the side that goes first alternates). `text identical` compares the token ids.",
           "- τ = tokens produced by verify steps (all but the prefill's first token) per verify step, the same count "
           "on both sides; `speed ours/ref` = our decode tokens/s over the reference's, decode time without the "
           "prompt's prefill (CPU: perf_counter_ns; CUDA: synchronized).",
           "- Per-step accept lengths agree (all steps but the last, which each side may cut at the budget or EOS) on "
           + ", ".join(f"{r['method']} {r['accept identical']}" for r in rows) + " prompts."]
    seen = set()
    for h in headers:
        key = (row_of(h), h["notes"])
        if key not in seen and h["notes"]:
            seen.add(key)
            md.append(f"- {row_of(h)} ({h['reference']}): {h['notes']}")
    machines = sorted({f"{h['hardware']}, {h['dtype']}, torch {h['versions'].get('torch')}, transformers "
                       f"{h['versions'].get('transformers')}, {h['bench']} ×{h['limit']} prompts, "
                       f"{h['max_new_tokens']} new tokens" for h in headers})
    md += [f"- Measured on: {m}." for m in machines]
    missing = unavailable_references()
    if missing:
        md += ["", "Without a row:", ""]
        md += [f"- {row} ({reference}): {reason}" for row, (reference, reason) in missing.items()]
    md_path, csv_path = out_dir / f"{TABLE_NAME}.md", out_dir / f"{TABLE_NAME}.csv"
    md_path.write_text("\n".join(md) + "\n", encoding="utf-8")
    with open(csv_path, "w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(TABLE_COLUMNS), extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    return [md_path, csv_path]
