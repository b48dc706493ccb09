"""Names and order: benches, blocks, budget labels, and what each side of a run is (its method's
registered name, label, family and ablation_of).

A side's method names come from the results header (``methods``, written by the runner from the
method class); files written before that field existed are read through the method registry
(``specbench.engine.registry.method_class``), never by typing method names here."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Mapping

from specbench.engine import VANILLA  # noqa: F401 (the baseline's one name, re-exported for the report)
from specbench.run.streams import stream_parts

Block = tuple[str, float]  # (target, temperature): one group of rows in every table (records.apart_dtypes)

MEAN = "mean"

# Paper column order first (SpecBlock Table 1), then the other benches we ship, then anything else.
BENCH_ORDER = ("humaneval", "math500", "alpaca", "natural_questions", "mt_bench", "wmt23", "gsm8k",
               "cnn_dailymail", "spec_bench", "alpaca_eval")
BENCH_LABELS = {"humaneval": "HumanEval", "math500": "MATH-500", "alpaca": "Alpaca", "natural_questions": "NQ",
                "mt_bench": "MT-Bench", "wmt23": "WMT-23", "gsm8k": "GSM8K", "cnn_dailymail": "CNN/DM",
                "spec_bench": "Spec-Bench", "alpaca_eval": "AlpacaEval"}

# Printed benchmark names in the papers -> our bench names (lower-cased keys).
PAPER_BENCH_ALIASES = {
    "humaneval": "humaneval", "math-500": "math500", "math500": "math500", "alpaca": "alpaca",
    "nq": "natural_questions", "natural questions": "natural_questions", "mt-bench": "mt_bench",
    "mt bench": "mt_bench", "wmt": "wmt23", "wmt-23": "wmt23", "gsm8k": "gsm8k", "cnn/dm": "cnn_dailymail",
    # Spec-Bench categories; these three draw on the same sources as our benches.
    "summarization": "cnn_dailymail", "qa": "natural_questions", "math": "gsm8k",
    "mean": MEAN, "avg.": MEAN, "average": MEAN,
}
# The six mission benches (SpecBlock's Table 1): a Mean pools only these, so a method that also ran an extra
# bench (CNN/DM, for the copy claims) keeps a Mean comparable with the methods that did not.
MEAN_BENCHES = BENCH_ORDER[:6]
_BUDGET = re.compile(r"^(?P<base>[^@]+)@budget=(?P<budget>\d+)$")


def bench_key(bench: str) -> tuple[int, str]:
    return (BENCH_ORDER.index(bench) if bench in BENCH_ORDER else len(BENCH_ORDER), bench)


def mean_benches(benches: Iterable[str]) -> list[str]:
    """The benches a Mean pools, in table order: the mission benches among ``benches``, or all of them when
    none is one (a table of streams, or of other benches only)."""
    ordered = sorted(set(benches), key=bench_key)
    return [b for b in ordered if b in MEAN_BENCHES] or ordered


def is_stream(bench: str) -> bool:
    """A mixed query stream (``mixed``, ``a+b``): reported in a table of its own, never pooled into a
    benchmark mean."""
    return stream_parts(bench) is not None


def bench_label(bench: str) -> str:
    return BENCH_LABELS.get(bench, bench)


def block_label(block: Block) -> str:
    return f"{block[0]} · T = {block[1]:g}"


def budget_of(label: str) -> tuple[str, int] | None:
    m = _BUDGET.match(label)
    return (m["base"], int(m["budget"])) if m else None


def normalise_bench(name: str) -> str:
    key = name.strip().lower()
    return PAPER_BENCH_ALIASES.get(key, re.sub(r"[^a-z0-9]+", "_", key).strip("_"))


def normalise_method(name: str) -> str:
    """A printed method name as a registered name would spell it: lower case, no spaces, '+' -> '-'."""
    return re.sub(r"\s+", "", name.strip().lower()).replace("+", "-")


# ------------------------------------------------------------------------------------------ sides

@dataclass(frozen=True)
class MethodInfo:
    """What one side of a run is: ``method`` its registered name, ``label`` the method's display name,
    ``family`` its method family, ``ablation_of`` the registered method it ablates (None if none)."""

    method: str
    label: str
    family: str
    ablation_of: str | None = None


_REGISTERED: dict[str, MethodInfo] = {}


def registered_info(method: str) -> MethodInfo | None:
    """The class attributes of a registered method (``Drafter.report_names``); None if not registered
    (or its module cannot be imported here)."""
    from specbench.engine.registry import available_methods, method_class

    if method not in _REGISTERED:
        if method not in available_methods():
            return None
        try:
            _REGISTERED[method] = MethodInfo(**method_class(method).report_names())
        except ImportError:
            return None
    return _REGISTERED[method]


def _unknown(method: str) -> MethodInfo:
    return MethodInfo(method, method, method, None)


def header_sides(meta: Mapping) -> dict[str, str]:
    """Side label -> registered method from a header without ``methods`` (older files): the main side
    (``label``, or one side per ``--sweep`` value) is ``method``; an ``--also`` spec ``name@k=v...``
    is ``name``, labelled by the whole spec or by what follows ``@label=``."""
    out: dict[str, str] = {}
    method = meta.get("method")
    if method:
        label = meta.get("label") or method
        sweep = meta.get("sweep")
        if sweep and "=" in sweep:
            key, _, values = sweep.partition("=")
            for v in values.split(","):
                out[f"{label}@{key.strip().replace('-', '_')}={v.strip()}"] = method
        out[label] = method
    for spec in meta.get("also") or ():
        body, _, label = str(spec).partition("@label=")
        out[label or body] = body.split("@", 1)[0].strip()
    return out


def side_infos(meta: Mapping, labels: Iterable[str]) -> dict[str, MethodInfo]:
    """MethodInfo of every side label in ``labels``: from the header's ``methods`` when it has the side,
    else the registered method the header names for it (or the label up to its first '@') looked up in
    the registry; a method the registry does not know is its own label, family and no ablation."""
    declared = meta.get("methods") or {}
    named = header_sides(meta)
    out = {}
    for label in labels:
        if isinstance(declared.get(label), Mapping):
            entry = declared[label]
            method = str(entry.get("method") or label)
            out[label] = MethodInfo(method, str(entry.get("label") or method), str(entry.get("family") or method),
                                    entry.get("ablation_of") or None)
            continue
        method = named.get(label) or label.split("@", 1)[0]
        out[label] = registered_info(method) or _unknown(method)
    return out
