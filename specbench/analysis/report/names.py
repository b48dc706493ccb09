"""Names and order: benches, blocks, and what each side of a run is (its method's registered name,
label, family and ablation_of; the side's label stem and, for a point of a node-budget sweep, its budget).

A side's method names come from the results header (``methods``, written by the runner from the
method class); files written before that field existed are read through the method registry
(``specbench.engine.registry.method_class``), never by typing method names here. What a side ran with
comes from the header too: the side as the run declared it (``side_specs``, ``specbench.sides``), the
options its drafter ran with (``method_options``) and how its drafter was trained (``drafter_recipes``, or in
older headers the recipe of the drafter folder its ``weights`` name); a label is only ever shown, never parsed."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Iterable, Mapping

from specbench.data import drafter_paths
from specbench.engine import VANILLA  # noqa: F401 (the baseline's one name, re-exported for the report)
from specbench.data.streams import stream_parts
from specbench.sides import header_sides

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
    ``family`` its method family, ``ablation_of`` the registered method it ablates (None if none),
    ``budget_option`` the method's node-budget option, ``weight_options`` its options that name weights (with
    their hub ``revision``); of the side itself, ``stem`` its label's stem (as declared), ``budget`` its node
    budget when the side is a point of a budget sweep (its label shows exactly its method's budget option),
    ``given`` the options the run set (as declared), ``ran`` every option its drafter ran with
    (``method_options``), values as text, and ``trained`` how long each drafter it loaded trained (weights
    option -> ``drafter_paths.training_budget`` of its recipe; empty where no recipe is known)."""

    method: str
    label: str
    family: str
    ablation_of: str | None = None
    budget_option: str | None = None
    weight_options: tuple[str, ...] = ()
    stem: str = ""
    budget: int | None = None
    given: tuple[tuple[str, str], ...] = ()
    ran: tuple[tuple[str, str], ...] = ()
    trained: tuple[tuple[str, str], ...] = ()

    @property
    def given_budget(self) -> int | None:
        """The node budget the run set for the side (its method's budget option, given); None if it set none."""
        return _whole(dict(self.given).get(self.budget_option)) if self.budget_option else None

    def option(self, key: str) -> str | None:
        """The value the side ran with for option ``key`` (as given when the header has no ``method_options``)."""
        return dict(self.ran).get(key, dict(self.given).get(key))


_REGISTERED: dict[str, MethodInfo] = {}


def registered_info(method: str) -> MethodInfo | None:
    """The class attributes of a registered method (``Drafter.report_names``); None if not registered
    (or its module cannot be imported here)."""
    from specbench.engine.registry import available_methods, method_class

    if method not in _REGISTERED:
        if method not in available_methods():
            return None
        try:
            cls = method_class(method)
        except ImportError:
            return None
        names = cls.report_names()
        weights = (*cls.weight_options, "revision") if cls.weight_options else ()  # methods/weights_options.py
        _REGISTERED[method] = MethodInfo(names["method"], names["label"], names["family"], names["ablation_of"],
                                         cls.budget_option, weights)
    return _REGISTERED[method]


def _unknown(method: str) -> MethodInfo:
    return MethodInfo(method, method, method, None)


def _method_info(meta: Mapping, label: str, method: str) -> MethodInfo:
    """The method half of a side's MethodInfo: the header's ``methods`` entry, else the registry."""
    entry = (meta.get("methods") or {}).get(label)
    registered = registered_info(method)
    if isinstance(entry, Mapping):
        method = str(entry.get("method") or method)
        registered = registered_info(method)
        option = entry.get("budget_option", registered.budget_option if registered else None)
        return MethodInfo(method, str(entry.get("label") or method), str(entry.get("family") or method),
                          entry.get("ablation_of") or None, option or None,
                          registered.weight_options if registered else ())
    return registered or _unknown(method)


def _whole(value) -> int | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return int(number) if number.is_integer() else None


def _texts(options: Mapping) -> tuple[tuple[str, str], ...]:
    return tuple((str(k), str(v).lower() if isinstance(v, bool) else str(v)) for k, v in options.items())


_DEFAULTS: dict[str, dict[str, str]] = {}


def option_defaults(method: str) -> dict[str, str]:
    """A registered method's option defaults as text (those with a plain default); empty if not registered."""
    from specbench.engine.registry import method_class

    if method not in _DEFAULTS:
        try:
            fields = dataclasses.fields(method_class(method).Options) if registered_info(method) else ()
        except (ImportError, TypeError, AttributeError):
            fields = ()
        _DEFAULTS[method] = dict(_texts({f.name: f.default for f in fields if f.default is not dataclasses.MISSING}))
    return _DEFAULTS[method]


def drafter_recipes(meta: Mapping, label: str, weight_options: Iterable[str] = ()) -> dict[str, Mapping]:
    """Weights option -> the recipe of the drafter side ``label`` loaded (``drafter_paths.recipe_summary``): the
    header's ``drafter_recipes``; in a header written before them, the recipe of the folder its ``weights`` name
    (resolved in this clone), else of a folder its ``method_options`` name (an empty one, the method's default
    folder, is recorded only in ``weights``). A drafter without a known recipe is left out."""
    if isinstance(meta.get("drafter_recipes"), Mapping):
        recorded = meta["drafter_recipes"].get(label)
        return {str(k): v for k, v in recorded.items() if isinstance(v, Mapping)} if isinstance(recorded, Mapping) \
            else {}
    sources = ((meta.get("weights") or {}).get("drafters") or {}).get(label)
    if not isinstance(sources, Mapping):
        ran = (meta.get("method_options") or {}).get(label)
        ran = ran if isinstance(ran, Mapping) else {}
        sources = {name: {"path": str(ran[name])} for name in weight_options if ran.get(name)}
    return drafter_paths.folder_recipes(sources)


def side_infos(meta: Mapping, labels: Iterable[str]) -> dict[str, MethodInfo]:
    """MethodInfo of every side label in ``labels``, read from the header: the side as the run declared it
    (``specbench.sides.header_sides``), its method's names (``methods``, else the registry), and the options
    its drafter ran with (``method_options``) and how long its drafters trained (``drafter_recipes``). A label
    the header does not declare is a side of the method of that name (its own label, family and no ablation
    when no method is)."""
    sides = header_sides(meta)
    ran = meta.get("method_options") or {}
    out = {}
    for label in labels:
        side = sides.get(label)
        entry = (meta.get("methods") or {}).get(label)
        method = side.method if side else str(entry.get("method") or label) if isinstance(entry, Mapping) else label
        info = _method_info(meta, label, method)
        options = ran.get(label) if isinstance(ran.get(label), Mapping) else {}
        budget = None
        if side and info.budget_option and side.shown == (info.budget_option,):
            budget = _whole(options.get(info.budget_option, side.options.get(info.budget_option)))
        trained = tuple(sorted((name, drafter_paths.training_budget(recipe))
                               for name, recipe in drafter_recipes(meta, label, info.weight_options).items()))
        out[label] = dataclasses.replace(info, stem=side.stem if side else label, budget=budget,
                                         given=_texts(side.options if side else {}), ran=_texts(options),
                                         trained=trained)
    return out


def sweep_points(sides: Mapping[str, MethodInfo]) -> dict[str, tuple[str, int]]:
    """Side label -> (its stem, its node budget) for the sides that are points of a budget sweep."""
    return {label: (info.stem, info.budget) for label, info in sides.items() if info.budget is not None}
