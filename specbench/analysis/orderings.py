"""Verdicts on the papers' claims: for each claim, holds / reversed / inconclusive from a paired
bootstrap over conversations (``specbench.analysis.paired``: a conversation's turns, both MT-Bench turns
included, are summed and resampled together), per benchmark and over all benches together.

Claims are data, YAML files that method packages ship (entry-point group ``specbench.claims``): two side
selectors, a metric, a direction and a threshold on the ratio A / B. A selector names sides by what the
results header says they are (``report.names.side_infos``), never by their labels: the registered method,
its family or the method it ablates, the options the side ran with, the options the run set itself
(``given``) and those left at the method's default (``defaults``). ``same_run`` pairs only sides one run
held side by side, ``same_budget`` only sides that set the same node budget (or none).
``compare`` says what A is held against: ``each`` B side, the ``best`` B side (highest point value on
the pairs), the ``next`` A side in the order of its node budget (monotone claims; A = the larger), or A's
own first ``quarters`` of the stream (its last quarter over its first, unpaired)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd
import yaml

from specbench import metrics
from specbench.analysis import paired
from specbench.analysis.report.names import MethodInfo, option_defaults
from specbench.errors import SpecbenchError
from specbench.data.plugin_files import declared_paths
from specbench.engine import VANILLA
from specbench.records import GenerationRecord

ALL = "all"


@dataclass(frozen=True)
class Sides:
    """Which sides a claim names, by what the results header says they are. Every field given must hold."""

    method: tuple[str, ...] = ()  # the registered method, one of these
    family: str = ""  # the method's family
    ablation_of: str = ""  # the registered method it ablates
    options: tuple[tuple[str, Any], ...] = ()  # the side ran with these values
    given: tuple[str, ...] = ()  # options the run set itself (a sweep's key, --opt), any value
    defaults: tuple[str, ...] = ()  # options it ran with at the method's default

    def matches(self, info: MethodInfo) -> bool:
        if (self.method and info.method not in self.method) or (self.family and info.family != self.family) \
                or (self.ablation_of and info.ablation_of != self.ablation_of):
            return False
        given = dict(info.given)
        if any(key not in given for key in self.given):
            return False
        if any(not _same_value(info.option(key), value) for key, value in self.options):
            return False
        defaults = option_defaults(info.method) if self.defaults else {}
        return all(key in defaults and _same_value(info.option(key) or defaults[key], defaults[key])
                   for key in self.defaults)


def _same_value(ran: str | None, wanted: Any) -> bool:
    """An option's value as the header holds it (text) against a claim's (YAML): numbers as numbers."""
    if ran is None:
        return False
    wanted = str(wanted).lower() if isinstance(wanted, bool) else str(wanted)
    try:
        return float(ran) == float(wanted)
    except ValueError:
        return ran == wanted


@dataclass(frozen=True)
class Claim:
    text: str  # the claim as the table prints it
    source: str  # the paper that makes it
    a: Sides  # the sides claimed better / larger
    b: Sides | None = None  # the sides they are held against
    metric: str = "speedup"  # speedup | tau | td (paired.METRICS)
    direction: str = ">"  # the claimed relation of A / B to threshold: > | >= | <
    threshold: float = 1.0
    compare: str = "each"  # each | best | next | quarters
    benches: tuple[str, ...] = ()  # only these benches (empty: every bench)
    up_to_peak: bool = False  # only A sides whose node budget is at most that of A's best speedup
    same_run: bool = False  # A and B only where one results file holds both
    same_budget: bool = False  # A and B only at the same given node budget (or both without one)


CLAIMS_GROUP = "specbench.claims"  # entry points naming YAML files of claims
COMPARES = ("each", "best", "next", "quarters")
DIRECTIONS = (">", ">=", "<")


def read_claims(path: Path) -> list[Claim]:
    """The claims of one YAML file: a list of mappings with Claim's fields (text, source and a required)."""
    try:
        raw = yaml.safe_load(Path(path).read_text(encoding="utf-8-sig"))  # utf-8-sig: a byte-order mark is dropped
    except (OSError, yaml.YAMLError) as e:
        raise SpecbenchError(f"claims file {path}: {e}".replace("\n", " ")) from None
    if not isinstance(raw, list) or not all(isinstance(c, dict) for c in raw):
        raise SpecbenchError(f"claims file {path} must be a YAML list of mappings")
    return [_claim(c, f"claims file {path}, claim {i + 1}") for i, c in enumerate(raw)]


def _claim(raw: dict, where: str) -> Claim:
    fields = [f.name for f in dataclasses.fields(Claim)]
    unknown = sorted(set(raw) - set(fields))
    missing = [k for k in ("text", "source", "a") if not raw.get(k)]
    if unknown or missing:
        problems = [f"unknown field {k!r}" for k in unknown] + [f"no {k}" for k in missing]
        raise SpecbenchError(f"{where}: {'; '.join(problems)} (fields: {', '.join(fields)})")
    benches = raw.get("benches") or ()
    claim = Claim(**{**raw, "threshold": float(raw.get("threshold", 1.0)),
                     "a": _sides(raw["a"], f"{where}, a"), "b": _sides(raw["b"], f"{where}, b") if raw.get("b") else None,
                     "benches": (benches,) if isinstance(benches, str) else tuple(benches)})
    for name, value, allowed in (("metric", claim.metric, tuple(paired.METRICS)),
                                 ("direction", claim.direction, DIRECTIONS), ("compare", claim.compare, COMPARES)):
        if value not in allowed:
            raise SpecbenchError(f"{where}: {name} {value!r} is not one of {', '.join(allowed)}")
    if claim.b is None and claim.compare in ("each", "best"):
        raise SpecbenchError(f"{where}: compare {claim.compare!r} needs b, the sides A is held against")
    return claim


def _names(value, where: str, key: str) -> tuple[str, ...]:
    names = (value,) if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)) or not names or not all(isinstance(n, str) and n for n in names):
        raise SpecbenchError(f"{where}: {key} must be a name or a list of names (got {value!r})")
    return tuple(names)


def _sides(raw, where: str) -> Sides:
    """A selector from its YAML mapping; at least one of method, family or ablation_of."""
    fields = [f.name for f in dataclasses.fields(Sides)]
    if not isinstance(raw, Mapping):
        raise SpecbenchError(f"{where}: expected a mapping of {', '.join(fields)} (got {raw!r})")
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise SpecbenchError(f"{where}: unknown field {unknown[0]!r} (fields: {', '.join(fields)})")
    if not any(raw.get(k) for k in ("method", "family", "ablation_of")):
        raise SpecbenchError(f"{where}: name a method, family or ablation_of")
    options = raw.get("options") or {}
    if not isinstance(options, Mapping):
        raise SpecbenchError(f"{where}: options must be a mapping of option -> value (got {options!r})")
    return Sides(method=_names(raw["method"], where, "method") if raw.get("method") else (),
                 family=str(raw.get("family") or ""), ablation_of=str(raw.get("ablation_of") or ""),
                 options=tuple((str(k), v) for k, v in options.items()),
                 given=_names(raw["given"], where, "given") if raw.get("given") else (),
                 defaults=_names(raw["defaults"], where, "defaults") if raw.get("defaults") else ())


def load_claims() -> tuple[Claim, ...]:
    """Every claim the method packages declare (entry-point group ``specbench.claims``), in their order."""
    return tuple(c for path in declared_paths(CLAIMS_GROUP) for c in read_claims(path))


COLUMNS = ["target", "temperature", "claim", "source", "bench", "a", "b", "metric", "n", "ratio", "ratio_lo",
           "ratio_hi", "direction", "threshold", "verdict"]


# ---- units ---------------------------------------------------------------------------------------

def units(files: Sequence, label: str, bench: str | None, with_file: bool) -> dict:
    """Unit rows of one side keyed by (bench, prompt_id, turn), or (file, bench, prompt_id, turn)."""
    out: dict = {}
    for f in files:
        base = {metrics.key(r): r for r in f.records if r.method == VANILLA}
        for r in f.records:
            if r.method == label and (bench is None or r.bench == bench):
                key = (f.path.name, *metrics.key(r)) if with_file else metrics.key(r)
                out.setdefault(key, paired.unit_columns(r, base.get(metrics.key(r))))
    return out


def paired_units(files: Sequence, a: str, b: str, bench: str | None) -> tuple[np.ndarray, np.ndarray]:
    """Rows of A and B, one per conversation, over the turns both ran (paired.pair_rows sums a conversation's
    turns): within the files that hold both sides when there are any (each with its own vanilla), else across
    files of the same block by prompt id and turn."""
    shared = [f for f in files if {a, b} <= {r.method for r in f.records}]
    group = shared or files
    ra, rb, _ = paired.pair_rows(units(group, a, bench, bool(shared)), units(group, b, bench, bool(shared)))
    return ra, rb


def quarter_units(files: Sequence, label: str, bench: str | None) -> tuple[np.ndarray, np.ndarray]:
    """A side's first and last quarter of its stream (by query index), per file, pooled."""
    first, last = [], []
    for f in files:
        recs = sorted((r for r in f.records if r.method == label and (bench is None or r.bench == bench)),
                      key=lambda r: (r.query_index, r.turn))
        q = len(recs) // 4
        if q:
            first += [paired.unit_columns(r, None) for r in recs[:q]]
            last += [paired.unit_columns(r, None) for r in recs[-q:]]
    return np.array(first, dtype=float).reshape(-1, 8), np.array(last, dtype=float).reshape(-1, 8)


# ---- one claim -------------------------------------------------------------------------------------

def sides_of(files: Sequence, bench: str | None) -> dict[str, list[tuple[Any, MethodInfo]]]:
    """Side label -> (file, what the side is) for every file that holds its records (on ``bench``)."""
    out: dict[str, list] = {}
    for f in files:
        labels = {r.method for r in f.records if bench is None or r.bench == bench}
        for label, info in f.sides().items():
            if label in labels:
                out.setdefault(label, []).append((f, info))
    return out


def select(sides: Sides, infos: Mapping[str, list]) -> dict[str, MethodInfo]:
    """The labels ``sides`` names (what each is, from the first file where it matches), in label order."""
    out = {}
    for label in sorted(infos):
        info = next((i for _, i in infos[label] if sides.matches(i)), None)
        if info is not None:
            out[label] = info
    return out


def _point(files, label: str, bench: str | None, metric: str) -> float:
    rows = np.array(list(units(files, label, bench, True).values()), dtype=float).reshape(-1, 8)
    rows = rows[paired.usable(metric, rows)]
    with np.errstate(divide="ignore", invalid="ignore"):
        return float(paired.METRICS[metric](rows.sum(0))) if len(rows) else math.nan


def comparisons(claim: Claim, files: Sequence, bench: str | None,
                infos: Mapping[str, list] | None = None) -> list[tuple[str, str, np.ndarray, np.ndarray]]:
    """(A label, B label, A rows, B rows) for every comparison the claim makes on ``bench``; ``infos``: the
    files' sides there (``sides_of``) when already read."""
    infos = sides_of(files, bench) if infos is None else infos
    sides_a = select(claim.a, infos)
    budget = {label: info.given_budget or 0 for label, info in sides_a.items()}
    if claim.up_to_peak and sides_a:
        points = {label: _point(files, label, bench, "speedup") for label in sides_a}
        finite = {k: v for k, v in points.items() if math.isfinite(v)}
        if finite:
            peak = budget[max(finite, key=finite.get)]
            sides_a = {k: info for k, info in sides_a.items() if budget[k] <= peak}
    out = []
    if claim.compare == "quarters":
        for label in sides_a:
            first, last = quarter_units(files, label, bench)
            out.append((f"{label} (last quarter)", f"{label} (first quarter)", last, first))
        return out
    if claim.compare == "next":
        ordered = sorted(sides_a, key=lambda k: budget[k])
        for small, large in zip(ordered, ordered[1:]):
            out.append((large, small, *paired_units(files, large, small, bench)))
        return out
    sides_b = select(claim.b, infos)
    held = [{r.method for r in f.records} for f in files] if claim.same_run else []
    for label_a, info_a in sides_a.items():
        rivals = [label_b for label_b, info_b in sides_b.items() if label_b != label_a
                  and (not claim.same_budget or info_a.given_budget == info_b.given_budget)
                  and (not claim.same_run or any({label_a, label_b} <= labels for labels in held))]
        if claim.compare == "best" and rivals:
            rivals = [max(rivals, key=lambda b: _nan_low(_point(files, b, bench, claim.metric)))]
        for label_b in rivals:
            out.append((label_a, label_b, *paired_units(files, label_a, label_b, bench)))
    return out


def _nan_low(x: float) -> float:
    return x if math.isfinite(x) else -math.inf


def judge(claim: Claim, a: np.ndarray, b: np.ndarray, reps: int = paired.REPS, seed: int = paired.SEED) -> dict:
    """Point ratio A / B, its 95% interval, n (paired conversations; for ``quarters``: queries per quarter) and
    the verdict."""
    if claim.compare == "quarters":
        n = min(len(a), len(b))
        point, lo, hi = paired.unpaired_ratio(a, b, claim.metric, reps, seed) if n else (math.nan,) * 3
    else:
        keep = paired.usable(claim.metric, a) & paired.usable(claim.metric, b)
        a, b = a[keep], b[keep]
        n = len(a)
        point, lo, hi = paired.paired_ratio(a, b, claim.metric, reps, seed) if n else (math.nan,) * 3
    return dict(n=n, ratio=point, ratio_lo=lo, ratio_hi=hi,
                verdict=paired.verdict(lo, hi, claim.direction, claim.threshold, n))


def ordering_frame(files: Sequence, claims: Sequence[Claim] | None = None, reps: int = paired.REPS,
                   seed: int = paired.SEED) -> pd.DataFrame:
    """One row per (block, claim, bench or 'all', comparison); a claim with nothing to compare in a
    block gets one 'no data' row. ``claims``: the declared ones (``load_claims``) unless given."""
    claims = load_claims() if claims is None else claims
    blocks: dict = {}
    for f in files:
        if f.records:
            blocks.setdefault(f.block, []).append(f)
    rows = []
    for (target, temp), group in sorted(blocks.items()):
        benches = sorted({r.bench for f in group for r in f.records})
        infos = {bench: sides_of(group, None if bench == ALL else bench) for bench in [*benches, ALL]}
        for claim in claims:
            scope = [b for b in benches if not claim.benches or b in claim.benches]
            found = 0
            for bench in scope + ([ALL] if len(scope) > 1 else []):
                for label_a, label_b, a, b in comparisons(claim, group, None if bench == ALL else bench, infos[bench]):
                    found += 1
                    rows.append(dict(target=target, temperature=temp, claim=claim.text, source=claim.source,
                                     bench=bench, a=label_a, b=label_b, metric=claim.metric,
                                     direction=claim.direction, threshold=claim.threshold,
                                     **judge(claim, a, b, reps, seed)))
            if not found:
                rows.append(dict(target=target, temperature=temp, claim=claim.text, source=claim.source, bench="",
                                 a="", b="", metric=claim.metric, n=0, ratio=math.nan, ratio_lo=math.nan,
                                 ratio_hi=math.nan, direction=claim.direction, threshold=claim.threshold,
                                 verdict="no data"))
    return pd.DataFrame(rows, columns=COLUMNS)


# ---- the table ---------------------------------------------------------------------------------------

def _fmt_ratio(point: float, lo: float, hi: float) -> str:
    if not math.isfinite(point):
        return "—"
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return f"{point:.3f}"
    return f"{point:.3f} [{lo:.3f}, {hi:.3f}]"


def orderings_table(frame: pd.DataFrame, provenance: Sequence[str] = (), claims: Sequence[Claim] | None = None):
    """The 'orderings' table: a section per block, a row per claim × bench × comparison (claims in the
    order of ``claims``, by default the declared ones). Only claims the block's records can test get rows;
    a note counts the others per block (the CSV keeps every row, 'no data' ones included)."""
    from specbench.analysis.report.table import Cell, Table, bench_label, block_label

    claims = load_claims() if claims is None else claims

    columns = ["Claim", "Bench", "A", "B", "Metric", "n (conv.)", "A / B [95% CI]", "Claimed", "Verdict"]
    sections, untested = [], []
    for (target, temp), block in frame.groupby(["target", "temperature"], sort=True):
        rows = []
        order = {c.text: i for i, c in enumerate(claims)}
        tested = block[block.verdict != "no data"]
        if without := block.claim.nunique() - tested.claim.nunique():
            untested.append(f"{block_label((target, temp))}: {without} of {block.claim.nunique()}")
        block = tested.assign(_c=tested.claim.map(lambda c: order.get(c, len(order))),
                              _b=tested.bench.map(lambda b: (b == ALL, b)))
        if block.empty:
            continue
        for r in block.sort_values(["_c", "_b", "a", "b"], kind="stable").itertuples():
            claimed = f"{r.direction} {r.threshold:g}"
            rows.append([Cell(r.claim), Cell(bench_label(r.bench) if r.bench not in ("", ALL) else r.bench or "—"),
                         Cell(r.a or "—"), Cell(r.b or "—"), Cell(paired.METRIC_LABELS.get(r.metric, r.metric)),
                         Cell(str(r.n)),
                         Cell(_fmt_ratio(r.ratio, r.ratio_lo, r.ratio_hi), False, _fmt_ratio(r.ratio, math.nan, math.nan)),
                         Cell(claimed),
                         Cell(r.verdict, r.verdict in ("holds", "reversed"))])
        sections.append((block_label((target, temp)), rows))
    notes = [f"Verdict from a paired bootstrap over conversations ({paired.REPS} resamples, seed {paired.SEED}, "
             f"{paired.LEVEL:.0%} percentile interval of A / B): holds = the whole interval on the claimed side of "
             "the threshold, reversed = the whole interval on the other side, inconclusive = it straddles it or "
             f"fewer than {paired.MIN_UNITS} conversations pair",
             "Pairs: the same conversation of A and B (the turns both ran, summed per conversation, so MT-Bench's "
             "two turns are resampled together), inside the files that hold both sides (each speedup against "
             "its own file's vanilla), else across files of the same block by prompt id and turn; n = paired "
             "conversations; 'all' pools the benches",
             "Monotone claims hold A = the next larger budget against B = the smaller; stream claims hold a "
             "side's last quarter of the stream (by query index) against its first quarter, resampled apart "
             "(there n = queries per quarter)"]
    if untested:  # listed claims only: the rest are counted, not printed as rows of dashes
        notes.append("Only the claims these records can test are listed; claims without data (the records hold no "
                     "side they name, or no pair of them): " + "; ".join(untested) + " (orderings_table.csv has them "
                     "as 'no data')")
    listed = set(frame.claim[frame.verdict != "no data"])
    notes += [f"{c.text}: {c.source}" for c in claims if c.text in listed]
    data = frame.assign(temperature=frame.temperature.map(lambda t: f"{t:g}"))
    return Table("orderings_table", "Orderings: do the papers' claims hold in these records?", columns, [],
                 sections, data, notes, list(provenance), align="lllllrrll")
