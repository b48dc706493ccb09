"""The Drafter protocol and the method registry.

A method is a ``Drafter`` subclass registered under the entry-point group ``specbench.methods``
(see pyproject.toml); adding a method touches no core file. Where it trains, the class names its
trainer (``Drafter.trainer``), and `specbench train` gets a command for it. Options are a dataclass so that
``--opt key=value`` strings are validated and typed in one place.
"""

from __future__ import annotations

import importlib

import dataclasses
import math
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from specbench.errors import SpecbenchError, unknown_name_error
from specbench.engine.timing import NullTimer, PhaseTimer
from specbench.engine.tree import DraftTree
from specbench.engine.verify import SamplingParams

if TYPE_CHECKING:
    from specbench.engine.target import Target, TargetOutput

ENTRY_POINT_GROUP = "specbench.methods"


@dataclass
class DecodeState:
    """What a drafter may read during one generation. ``tokens`` are all committed ids
    (prompt + generated); the last one is the bonus token, which the target has not cached."""

    tokens: list[int]
    prompt_len: int
    params: SamplingParams
    generator: torch.Generator | None = None
    timer: PhaseTimer = field(default_factory=NullTimer)

    @property
    def bonus(self) -> int:
        return self.tokens[-1]


@dataclass
class VerifyResult:
    """What the verifier tells the drafter after each call."""

    tree: DraftTree
    accepted: list[int]  # node indices of the accepted path, in depth order
    committed: list[int]  # tokens appended this call: accepted tokens then the bonus
    bonus: int
    logits: torch.Tensor  # target logits of every verify row [root, nodes...]
    taps: dict[int, torch.Tensor]  # requested taps of the kept rows [root, accepted...]
    stop_row: int  # verify row whose distribution produced the bonus (the rejection point)


@dataclass
class NoOptions:
    """For methods without options."""


class Drafter:
    """Base class: override what your method needs.

    setup(target)                once per run, after options are parsed
    begin(state, prefill)        once per prompt turn, after the target's prefill
    propose(state) -> DraftTree  each decode iteration (timed as drafting)
    observe(state, result)       after each verify (timed as drafting)
    end(state)                   after the turn
    """

    name: ClassVar[str] = ""
    Options: ClassVar[type] = NoOptions
    taps: tuple[int, ...] = ()  # hidden_states indices of the target this drafter reads
    learns: ClassVar[bool] = False  # True if the drafter updates itself while serving (no warm-up, stream order matters)
    # Options that name weights: a local folder/file or a hub id ``org/name[@rev]``; a ``revision``
    # option, where the method has one, applies to the first.
    weight_options: ClassVar[tuple[str, ...]] = ()
    # How `specbench train` trains this method's weights: a ``training.plugin.MethodTrainer`` subclass
    # or a "module:Class" reference to one (imported only when the train commands are built); None =
    # nothing to train. Subclasses (variants) inherit it and share its command.
    trainer: ClassVar[Any] = None

    # How reports name and group the method (a subclass inherits these, so each registered class sets
    # its own): ``label`` its display name, ``family`` its method family ("" = the registered name for
    # both), ``ablation_of`` the registered name of the method it ablates (None: a method in its own right).
    label: ClassVar[str] = ""
    family: ClassVar[str] = ""
    ablation_of: ClassVar[str | None] = None

    # The option that caps the drafted nodes one verify call checks (`specbench run --budget B` sets it
    # on every side that has one, so methods are compared at one node budget); ``budget_counts_root``:
    # the option counts verify rows, the root included (B + 1). None: the method has no such knob.
    budget_option: ClassVar[str | None] = None
    budget_counts_root: ClassVar[bool] = False

    @classmethod
    def budget_options(cls, budget: int) -> dict[str, str]:
        """The options that give this method a budget of ``budget`` drafted nodes per verify ({}: none)."""
        if cls.budget_option is None:
            return {}
        return {cls.budget_option: str(budget + 1 if cls.budget_counts_root else budget)}

    @classmethod
    def report_names(cls) -> dict:
        """The header's ``methods`` entry for a side of this method: registered name, label, family, ablation_of."""
        return {"method": cls.name, "label": cls.label or cls.name, "family": cls.family or cls.name,
                "ablation_of": cls.ablation_of}

    def __init__(self, options: Any = None) -> None:
        self.options = options if options is not None else self.Options()
        self.sources: dict[str, Any] = {}  # weight option -> hub.Resolved (files and commit), for the header

    @classmethod
    def check_references(cls, options: Any) -> None:
        """Validate the weight references in ``options`` without loading or downloading anything."""
        from specbench.engine import hub

        revision = getattr(options, "revision", "") or None
        first = cls.weight_options[0] if cls.weight_options else None
        if revision and not (first and getattr(options, first, "")):
            raise SpecbenchError(f"{cls.name}: revision={revision} needs {first or 'a weights option'}=ORG/NAME")
        for name in cls.weight_options:
            spec = getattr(options, name, "")
            if spec and not cls.builtin_reference(spec):
                hub.check_reference(spec, revision if name == first else None, f"{cls.name} {name}")

    @classmethod
    def builtin_reference(cls, spec: str) -> bool:
        """A weights value that is neither a path nor a hub id (e.g. SpS's ``truncated:N``)."""
        return False

    def resolve_weights(self, name: str, default: str | Path | None = None, missing: str = "") -> Path:
        """Option ``name`` as a local path: a hub id is downloaded (or found in the HF cache); when
        the option is empty, the ``default`` folder. ``missing`` (with ``{path}``) is the error for a
        folder that does not exist. Where the weights came from is kept in ``sources`` for the header."""
        from specbench.engine import hub

        spec = str(getattr(self.options, name, "") or "")
        local = not spec or not hub.looks_like_hub_id(hub.split_reference(spec)[0])
        path = Path(spec or default or "").expanduser()
        if local and not (spec or default) or local and not path.exists() and not hub.is_local(spec):
            raise SpecbenchError((missing or f"{self.name}: {{path}} does not exist; pass --opt {name}=FOLDER_OR_HUB_ID")
                                 .format(path=spec or default))
        if not spec:
            self.sources[name] = hub.Resolved(str(path), path)
            return path
        first = self.weight_options[0] if self.weight_options else name
        revision = (getattr(self.options, "revision", "") or None) if name == first else None
        resolved = hub.resolve(spec, revision, f"{self.name} {name}")
        self.sources[name] = resolved
        return resolved.path

    def setup(self, target: "Target") -> None:
        self.target = target

    def begin(self, state: DecodeState, prefill: "TargetOutput") -> None:
        pass

    def propose(self, state: DecodeState) -> DraftTree:
        raise NotImplementedError

    def observe(self, state: DecodeState, result: VerifyResult) -> None:
        pass

    def end(self, state: DecodeState) -> dict:
        """Return drafter-specific statistics to store in the record's ``extra``."""
        return {}


# ---- registry --------------------------------------------------------------------------------
_LOCAL: dict[str, type[Drafter]] = {}


def register(name: str):
    """Register a drafter class in-process (tests, notebooks); packages use entry points."""

    def wrap(cls: type[Drafter]) -> type[Drafter]:
        cls.name = name
        _LOCAL[name] = cls
        return cls

    return wrap


def _entry_points(group: str = ENTRY_POINT_GROUP) -> dict[str, str]:
    """Installed entry points of ``group``; from a source checkout that was never pip-installed (e.g. a
    GPU machine's system python), the ones declared in its pyproject.toml."""
    found = {ep.name: ep.value for ep in entry_points(group=group)}
    if found:
        return found
    import tomllib
    from pathlib import Path

    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    if pyproject.is_file():
        declared = tomllib.loads(pyproject.read_text()).get("project", {}).get("entry-points", {})
        found = dict(declared.get(group, {}))
    return found


def available_methods() -> dict[str, str]:
    """name -> 'module:Class' for every registered method."""
    found = _entry_points()
    found.update({name: f"{cls.__module__}:{cls.__qualname__}" for name, cls in _LOCAL.items()})
    return dict(sorted(found.items()))


def method_class(name: str) -> type[Drafter]:
    if name in _LOCAL:
        return _LOCAL[name]
    eps = _entry_points()
    if name not in eps:
        raise unknown_name_error("method", name, sorted(available_methods()), "specbench list methods")
    module, _, attr = eps[name].partition(":")
    cls = getattr(importlib.import_module(module), attr)
    cls.name = name
    return cls


def _cast(text: str, annotation: Any) -> Any:
    """Convert an option string to the field's annotated type (annotations may be strings)."""
    kind = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    kind = kind.replace("Optional[", "").replace("]", "").replace(" ", "")
    optional = "None" in kind
    kind = kind.replace("|None", "").replace("None|", "")
    if optional and text.lower() == "none":
        return None
    if kind == "bool":
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"expected true or false, got {text!r}")
    if kind.startswith(("list[int", "tuple[int")):
        return [int(x) for x in text.split(",") if x.strip()]
    if kind.startswith(("list[float", "tuple[float")):
        return [float(x) for x in text.split(",") if x.strip()]
    if kind.startswith(("list", "tuple")):
        return [x.strip() for x in text.split(",") if x.strip()]
    return {"int": int, "float": float}.get(kind, str)(text)


def parse_options(cls: type[Drafter], raw: dict[str, Any]) -> Any:
    """Build ``cls.Options`` from strings, naming the valid keys on a typo."""
    valid = {f.name: f for f in dataclasses.fields(cls.Options)}
    values = {}
    for key, value in raw.items():
        if key not in valid:
            known = ", ".join(valid) or "none"
            raise SpecbenchError(f"method {cls.name!r} has no option {key!r}; its options are: {known}")
        if isinstance(value, dict):
            raise SpecbenchError(f"option {key} for {cls.name!r} must be a single value or a list, not a mapping")
        if isinstance(value, (list, tuple)):  # a YAML/JSON list: the same as key=a,b,c
            value = ",".join(str(v) for v in value)
        try:
            values[key] = _cast(value if isinstance(value, str) else str(value), valid[key].type)
        except ValueError as exc:
            raise SpecbenchError(f"option {key}={value!r} for {cls.name!r}: {exc}") from None
    for key, value in values.items():
        _check_value(cls.name, key, value)
    return cls.Options(**values)


MAX_OPTION_INT = 2**31 - 1


def _check_value(method: str, key: str, value: Any) -> None:
    """Numbers must be finite, non-negative and fit an int32 (every count, size, rate and weight is)."""
    for item in value if isinstance(value, (list, tuple)) else [value]:
        if isinstance(item, bool) or not isinstance(item, (int, float)):
            continue
        if not math.isfinite(item) or item < 0 or item > MAX_OPTION_INT:
            raise SpecbenchError(f"option {key}={value!r} for {method!r}: expected a finite number between 0 and "
                                 f"{MAX_OPTION_INT}")


def create_drafter(name: str, options: dict[str, Any] | None = None) -> Drafter:
    cls = method_class(name)
    return cls(parse_options(cls, options or {}))
