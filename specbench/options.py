"""Options, declared once: name, type, default, range and help of every setting a method or a trainer
takes.

A declaration is a dataclass whose fields are made with ``option()``. The same declaration

- validates input: ``--opt key=value`` strings and YAML/JSON values (``parse``), objects built in
  code (``validate``) and command-line flags (``check_values``), with pydantic checking the type
  (``Literal`` choices included) and the bounds; each error is one line naming the option;
- serialises to the results header (``dataclasses.asdict``);
- gives `specbench list methods NAME` and `specbench train CMD --help` their text (``describe``).

A field redeclared in a subclass only to change its default keeps the help and bounds declared above
it. A declaration may add ``check(self, owner)`` for rules that span fields (one ``SpecbenchError``).

``tokens=True`` marks a count of tokens that one verify call adds past the generated text (a chain
length, a tree budget): before the target is known it must be below ``LONGEST_CONTEXT``; once the
target's config is read it must fit the target's context beside ``--max-new-tokens``
(``check_context``), still before any drafter loads weights.

Commands are declared the same way (`specbench run`, `parity`, `reproduce`, `train ...`): a field may
also say how the command line spells it (``flag``, ``positional``, ``cli_default``, ``cli_type``,
``convert``), a rule on one value that no type can say (``check``: a dtype or a folder looked up), names
known only at run time (``choices``: registered methods), the options it cannot be set with
(``excludes``) and those it means nothing without (``requires``). ``specbench.commands`` builds the
Typer command from the declaration, and ``validate`` enforces all of it, one line per error. Every text
value is refused when it holds bytes that are not UTF-8 (a path or label from a shell with another
locale), before anything loads or is written.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib
import os
import types
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Callable, Iterable, Literal, Union

import pydantic

from specbench.errors import SpecbenchError

# No model holds a longer context today (the longest published one is 10M tokens); a token count
# above it is a typo, refused before anything loads.
LONGEST_CONTEXT = 2**24
# Counts and seeds end up in torch tensors and generators, which hold 64-bit integers.
INT64_MAX = 2**63 - 1

_MISSING = dataclasses.MISSING


class _Same:
    """The command line uses the declaration's own default / type."""

    def __repr__(self) -> str:
        return "SAME"


SAME: Any = _Same()


# Options several commands share, declared once (a command may change the default and add its own words):
# the checks are lazy "module:function" references, so this module stays free of torch.
DEVICE_HELP = "auto (cuda if available, else cpu), cpu, cuda or cuda:N."
DATA_DIR_HELP = "Folder of benchmark JSONL files (else $SPECBENCH_DATA)."


def device_option(default: str = "auto", help: str = DEVICE_HELP, **extra: Any) -> Any:
    """``--device``: checked (and ``auto`` resolved) by ``engine.devices.resolve_device``."""
    return option(default, help, check="specbench.engine.devices:resolve_device", **extra)


def data_dir_option(help: str = DATA_DIR_HELP) -> Any:
    """``--data-dir``: a folder of benchmark files, checked by ``data.benchmarks.check_data_dir_option``."""
    return option(None, help, check="specbench.data.benchmarks:check_data_dir_option")


def option(default: Any = _MISSING, help: str | None = None, *, ge: float | None = None,
           gt: float | None = None, le: float | None = None, lt: float | None = None, tokens: bool = False,
           note: str | None = None, min: float | None = None, positive: bool = False, fraction: bool = False,
           flag: str | tuple[str, ...] = (), positional: bool = False, cli_default: Any = SAME, cli_type: Any = SAME,
           convert: Callable[[Any], Any] | None = None, check: Callable[[Any], Any] | str | None = None,
           choices: Callable[[], Iterable[str]] | None = None, excludes: str | tuple[str, ...] = (),
           requires: str | tuple[str, ...] = ()) -> Any:
    """A dataclass field with its help text and range (``ge``/``gt``/``le``/``lt``; ``tokens``: see the
    module docstring; ``note`` is added to a range error, e.g. what a value means). ``min=N``,
    ``positive=True`` and ``fraction=True`` are the older spellings of ``ge=N``, ``gt=0`` and
    ``ge=0, lt=1`` that published trainer plugins use.

    For a command's fields: ``flag`` its spelling(s) (default ``--field-name``), ``positional`` an
    argument rather than a flag, ``cli_default``/``cli_type`` where the command line differs from the
    field (``auto`` for a fixed library value, a Path, key=value strings), ``convert`` the flag's value
    -> the field's; ``check(value)`` (a function or a lazy ``"module:function"``) raises a one-line
    ``SpecbenchError`` for a value no type rules out;
    ``choices()`` the names a value (each item of a list, each key of a mapping) must be one of;
    ``excludes`` the fields that cannot be set together with this one, ``requires`` the fields that must
    be set (away from their defaults) for this one to be set."""
    ge = min if ge is None else ge
    gt = 0 if positive and gt is None else gt
    if fraction:
        ge, lt = 0 if ge is None else ge, 1 if lt is None else lt
    metadata = {"help": help, "ge": ge, "gt": gt, "le": le, "lt": lt, "tokens": tokens or None, "note": note,
                "flags": (flag,) if isinstance(flag, str) else tuple(flag) or None, "positional": positional or None,
                "cli_default": None if cli_default is SAME else _Given(cli_default),
                "cli_type": None if cli_type is SAME else _Given(cli_type), "convert": convert, "check": check,
                "choices": choices, "excludes": (excludes,) if isinstance(excludes, str) else tuple(excludes) or None,
                "requires": (requires,) if isinstance(requires, str) else tuple(requires) or None}
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def internal(default: Any = _MISSING) -> Any:
    """A field that code sets, never a flag or a user's value (a run's sides, a preset's name): no command
    line spells it and ``validate`` leaves it to its own checks."""
    metadata = {"internal": True}
    if default is _MISSING:
        return dataclasses.field(metadata=metadata)
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def like(options_cls: type, name: str, **changes: Any) -> Any:
    """A field declared as ``options_cls``'s field ``name`` (default, help, range, spelling), with ``changes``
    (e.g. another help): for a command that shares another's option without restating it."""
    own = next(f for f in dataclasses.fields(options_cls) if f.name == name)
    meta = dict(own.metadata)
    default = own.default if own.default is not _MISSING else (
        own.default_factory() if own.default_factory is not _MISSING else _MISSING)
    if "default" in changes:
        default = changes.pop("default")
    meta.update(changes)
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclass(frozen=True)
class _Given:
    """A command-line default or type that was given (None is a valid default, so it needs a box)."""

    value: Any


@dataclass(frozen=True, eq=False)  # hashed by identity: declared() makes each once
class Declared:
    """One option as declared: what validation, help and listings read."""

    name: str
    type: Any  # the resolved annotation
    default: Any  # dataclasses.MISSING: required
    help: str = ""
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    tokens: bool = False
    note: str = ""
    flags: tuple[str, ...] = ()  # the command line's spelling; empty: --name-with-dashes
    positional: bool = False
    cli_default: Any = SAME
    cli_type: Any = SAME
    convert: Callable[[Any], Any] | None = None
    check: Callable[[Any], Any] | str | None = None  # a function or "module:function"
    choices: Callable[[], Iterable[str]] | None = None
    excludes: tuple[str, ...] = ()
    internal: bool = False
    requires: tuple[str, ...] = ()

    @property
    def flag(self) -> str:
        """How errors and help name the option on the command line: its first spelling."""
        return self.flags[0] if self.flags else "--" + self.name.replace("_", "-")

    @property
    def element(self) -> Any:
        """The type of one value: the list's item type for a list option, without ``None``."""
        tp = _without_none(self.type)
        if typing.get_origin(tp) in (list, tuple):
            return _without_none(typing.get_args(tp)[0]) if typing.get_args(tp) else str
        return tp

    @property
    def is_list(self) -> bool:
        return typing.get_origin(_without_none(self.type)) in (list, tuple)

    @property
    def optional(self) -> bool:
        return _without_none(self.type) is not self.type

    def upper(self) -> tuple[float | None, bool]:
        """The upper bound actually enforced (declared, else the ceiling of a token count or an int) and
        whether it is inclusive."""
        if self.le is not None or self.lt is not None:
            return (self.le, True) if self.lt is None else (self.lt, False)
        if self.element is int and self.tokens:
            return LONGEST_CONTEXT, True
        return (INT64_MAX, True) if self.element is int else (None, True)

    def range_text(self) -> str:
        """The declared range in one short phrase ("" when there is none): ">= 1", "in [0, 1)"."""
        low = (_num(self.ge), "[") if self.ge is not None else (_num(self.gt), "(") if self.gt is not None else None
        high = (_num(self.le), "]") if self.le is not None else (_num(self.lt), ")") if self.lt is not None else None
        if self.tokens and high is None:
            high = ("the target's context", "]")
        if low and high:
            return f"in {low[1]}{low[0]}, {high[0]}{high[1]}"
        if low:
            return (">= " if low[1] == "[" else "> ") + low[0]
        if high:
            return ("<= " if high[1] == "]" else "< ") + high[0]
        return ""

    def range_words(self) -> str:
        """The declared range as an inequality on the value ("" when there is none): "0 < value <= 1",
        "value >= 1"."""
        low = (_num(self.ge), "<=") if self.ge is not None else (_num(self.gt), "<") if self.gt is not None else None
        high = (_num(self.le), "<=") if self.le is not None else (_num(self.lt), "<") if self.lt is not None else None
        if self.tokens and high is None:
            high = ("the target's context", "<=")
        if low and high:
            return f"{low[0]} {low[1]} value {high[1]} {high[0]}"
        if low:
            return f"value {'>=' if low[1] == '<=' else '>'} {low[0]}"
        return f"value {high[1]} {high[0]}" if high else ""

    def kind_text(self) -> str:
        """The type as a user writes it: int, float, true/false, 'a' | 'b', list of int."""
        element = self.element
        if typing.get_origin(element) is Literal:
            text = " | ".join(repr(a) for a in typing.get_args(element))
        else:
            text = {bool: "true/false"}.get(element, getattr(element, "__name__", str(element)))
        return f"list of {text} (a,b,c)" if self.is_list else text

    def default_text(self) -> str:
        if self.default is _MISSING:
            return "(required)"
        if isinstance(self.default, bool):
            return str(self.default).lower()
        if isinstance(self.default, (list, tuple)):
            return ",".join(str(v) for v in self.default) or '""'
        return '""' if self.default == "" else str(self.default)


def _num(value: float) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _without_none(tp: Any) -> Any:
    if typing.get_origin(tp) in (Union, types.UnionType):  # Optional[X] and X | None
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(args) < len(typing.get_args(tp)):
            return args[0]
    return tp


@functools.lru_cache(maxsize=None)
def declared(options_cls: type) -> tuple[Declared, ...]:
    """The options of a declaration in field order, with help and bounds inherited where a subclass
    only redeclares the default."""
    hints = typing.get_type_hints(options_cls)
    result = []
    for f in dataclasses.fields(options_cls):
        meta: dict = {}
        for cls in reversed(options_cls.__mro__):  # the base class's help and bounds, then overrides
            own = vars(cls).get("__dataclass_fields__", {}).get(f.name)
            if own is not None:
                meta.update({k: v for k, v in own.metadata.items() if v is not None})
        default = f.default if f.default is not _MISSING else (
            f.default_factory() if f.default_factory is not _MISSING else _MISSING)
        given = {k: meta[k].value for k in ("cli_default", "cli_type") if k in meta}
        result.append(Declared(f.name, hints[f.name], default, meta.get("help") or "", meta.get("ge"), meta.get("gt"),
                               meta.get("le"), meta.get("lt"), bool(meta.get("tokens")), meta.get("note") or "",
                               meta.get("flags") or (), bool(meta.get("positional")), given.get("cli_default", SAME),
                               given.get("cli_type", SAME), meta.get("convert"), meta.get("check"),
                               meta.get("choices"), meta.get("excludes") or (), bool(meta.get("internal")),
                               meta.get("requires") or ()))
    return tuple(result)


def declared_by_name(options_cls: type) -> dict[str, Declared]:
    return {d.name: d for d in declared(options_cls)}


@functools.lru_cache(maxsize=None)
def _adapter(option: Declared) -> pydantic.TypeAdapter:
    """pydantic's validator for one option: its type, and its bounds on each value."""
    high, inclusive = option.upper()
    bounds = pydantic.Field(ge=option.ge, gt=option.gt, le=high if inclusive else None,
                            lt=None if inclusive else high)
    element = option.element
    if element is float:
        element = Annotated[float, pydantic.Field(allow_inf_nan=False)]
    if element in (int, float) or typing.get_origin(element) is Annotated:
        element = Annotated[element, bounds]
    tp = list[element] if option.is_list else element
    return pydantic.TypeAdapter(tp | None if option.optional else tp)


def _why(error: dict, option: Declared) -> str:
    """pydantic's first error as the end of one line, in this project's words."""
    kind = error["type"]
    note = f"; {option.note}" if option.note else ""
    if kind in ("less_than_equal", "less_than") and option.le is None and option.lt is None:  # an implied ceiling
        if option.tokens:
            return f"must be <= {_num(LONGEST_CONTEXT)} (no model holds a longer context){note}"
        return f"must be <= {_num(INT64_MAX)} (a 64-bit integer){note}"
    if kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
        span = option.range_text()
        if option.tokens and option.le is None and option.lt is None:  # only the lower bound is in play
            span = span.split(",")[0].replace("in [", ">= ").replace("in (", "> ")
        return f"must be {span}{note}"
    if kind == "finite_number":
        return "must be a finite number"
    if kind.startswith("int_"):
        return "expects a whole number"
    if kind.startswith("float_"):
        return "expects a number"
    if kind.startswith("bool_"):
        return "expects true or false"
    if kind == "literal_error":
        return "must be one of " + ", ".join(repr(a) for a in typing.get_args(option.element))
    return error["msg"][:1].lower() + error["msg"][1:]


def check_one(option: Declared, value: Any, label: str) -> Any:
    """``value`` (already split into items for a list option) validated and converted; ``label`` names
    the option in the error, e.g. "sps: option gamma" or "--epochs"."""
    check_text(value, label)
    try:
        checked = _adapter(option).validate_python(value)
    except pydantic.ValidationError as exc:
        error = exc.errors()[0]
        shown = error.get("input", value) if option.is_list else value
        raise SpecbenchError(f"{label} {_why(error, option)} (got {shown!r})") from None
    if checked is not None and option.choices is not None:
        _check_names(option, checked, label)
    if checked is not None and option.check is not None:
        _checked_by(option.check, checked, label)
    return checked


def check_text(value: Any, label: str) -> None:
    """Text (or the items of a list or mapping) that holds bytes a UTF-8 locale could not decode: a shell
    passes them as lone surrogates, which no results file, header or message can write."""
    items = value.items() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
    for item in items:
        for text in item if isinstance(item, tuple) else (item,):
            text = os.fspath(text) if isinstance(text, os.PathLike) else text
            if isinstance(text, str) and not text.isascii():
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError:
                    shown = text.encode("utf-8", "backslashreplace").decode("ascii", "backslashreplace")
                    raise SpecbenchError(f"{label} holds bytes that are not UTF-8 (got '{shown}'); pass UTF-8 text "
                                         "or rename the file") from None


def _check_names(option: Declared, value: Any, label: str) -> None:
    """Each name (the value, each item of a list, each key of a mapping) among ``option.choices()``."""
    names = value.keys() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
    known = sorted(option.choices())
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(str(name), known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            what = f" ({option.note})" if option.note else ""
            raise SpecbenchError(f"{label} names {name!r}, which is unknown{what}{hint} (known: {', '.join(known)})")


def _checked_by(check: Callable[[Any], Any] | str, value: Any, label: str) -> None:
    """A declared ``check`` (a function, or a ``"module:function"`` reference imported only now, so that a
    declaration stays free of what the check needs, e.g. torch); its one-line error names the option unless
    it already does."""
    if isinstance(check, str):
        module, _, name = check.partition(":")
        check = getattr(importlib.import_module(module), name)
    try:
        check(value)
    except SpecbenchError as exc:
        text = str(exc)
        raise SpecbenchError(text if label.lstrip("-").split(":")[0] in text else f"{label}: {text}") from None


def _from_text(option: Declared, value: Any) -> Any:
    """A command-line or config value as pydantic's input: lists split on commas ("a,b" and a YAML
    list mean the same), "none" for an optional option, everything else as text."""
    if isinstance(value, dict):
        raise SpecbenchError("must be a single value or a list, not a mapping")
    if isinstance(value, (list, tuple)):
        value = ",".join(str(v) for v in value)
    text = value if isinstance(value, str) else str(value)
    if option.optional and text.lower() == "none":
        return None
    if option.is_list:
        return [x.strip() for x in text.split(",") if x.strip()]
    return text


def _method_label(owner: str, name: str) -> str:
    return f"{owner}: option {name}"


def parse(options_cls: type, raw: dict[str, Any], owner: str) -> Any:
    """``options_cls`` built from ``--opt``/config values (strings or YAML values), naming the valid keys on a typo."""
    known = declared_by_name(options_cls)
    values = {}
    for key, value in raw.items():
        if key not in known:
            names = ", ".join(known) or "none"
            raise SpecbenchError(f"method {owner!r} has no option {key!r}; its options are: {names} "
                                 f"(see `specbench list methods {owner}`)")
        try:
            text = _from_text(known[key], value)
        except SpecbenchError as exc:
            raise SpecbenchError(f"{_method_label(owner, key)} {exc}") from None
        values[key] = check_one(known[key], text, _method_label(owner, key))
    return validate(options_cls(**values), owner)


def validate(options: Any, owner: str, label: Callable[[str], str] | None = None) -> Any:
    """Check every field of an options object against its declaration (converting where pydantic does,
    e.g. a float field given an int), then the declaration's own ``check``; returns the object."""
    label = label or functools.partial(_method_label, owner)
    for option in declared(type(options)):
        if option.internal:
            continue
        value = current = getattr(options, option.name)
        if option.element is str and isinstance(value, os.PathLike):  # a Path given in code
            value = os.fspath(value)
        checked = check_one(option, list(value) if option.is_list and value is not None else value, label(option.name))
        if option.is_list and isinstance(value, tuple):
            checked = tuple(checked)
        if type(checked) is not type(current) or checked != current:
            object.__setattr__(options, option.name, checked)
    check_conflicts(options, label)
    check = getattr(options, "check", None)
    if callable(check):
        check(owner)
    return options


def _empty(value: Any) -> bool:
    return value is None or value is False or (isinstance(value, (str, list, dict, tuple)) and not value)


def is_set(option: Declared, value: Any) -> bool:
    """Whether a value says something: not the declared default, not None, off or empty."""
    return not _empty(value) and (option.default is _MISSING or value != option.default)


def check_conflicts(options: Any, label: Callable[[str], str]) -> None:
    """Options set together that a declaration's ``excludes`` keeps apart, or set without one its ``requires``:
    one line naming both."""
    known = declared_by_name(type(options))
    for option in known.values():
        for other in option.requires:
            if is_set(option, getattr(options, option.name)) and not is_set(known[other], getattr(options, other)):
                base = known[other].default  # a default that says something (e.g. 1) is named
                away = "" if base is _MISSING or _empty(base) else \
                    f" away from its default {known[other].default_text()}"
                raise SpecbenchError(f"{label(option.name)} needs {label(other)} set{away} ({label(option.name)}: "
                                     f"{option.help.rstrip('.')}); pass {label(other)} too or drop "
                                     f"{label(option.name)}")
        for other in option.excludes:
            if is_set(option, getattr(options, option.name)) and is_set(known[other], getattr(options, other)):
                raise SpecbenchError(f"{label(option.name)} and {label(other)} cannot be used together "
                                     f"({label(option.name)}: {option.help.rstrip('.')}; {label(other)}: "
                                     f"{known[other].help.rstrip('.')}); pass one of them")


def check_values(values: dict[str, Any], declarations: dict[str, Declared], label: Callable[[str], str]) -> None:
    """Values already typed (e.g. by the command line) checked against the declarations they have."""
    for name, value in values.items():
        if name in declarations and value is not None:
            check_one(declarations[name], value, label(name))


def check_context(options: Any, owner: str, context: int, max_new_tokens: int) -> None:
    """Token counts (``tokens=True``) against the target's context: a verify call past the generated
    text must still fit beside ``max_new_tokens`` new tokens and a one-token prompt."""
    room = context - max_new_tokens - 1
    for option in declared(type(options)):
        value = getattr(options, option.name)
        if option.tokens and isinstance(value, int) and value > room:
            raise SpecbenchError(f"{owner}: option {option.name}={value} does not fit the target's context of "
                                 f"{context} tokens beside --max-new-tokens {max_new_tokens} (at most {max(room, 0)}); "
                                 f"lower {option.name} or --max-new-tokens")


def describe(options_cls: type) -> list[dict[str, str]]:
    """One row per option for listings and help: name, type, default, range, help."""
    return [{"option": d.name, "type": d.kind_text(), "default": d.default_text(), "range": d.range_text(),
             "help": d.help} for d in declared(options_cls)]


def help_text(option: Declared) -> str | None:
    """A flag's help: the declared text and, where there is one, its range as an inequality (an interval such as
    (0, 1] would leave its brackets unpaired), escaped for the command line's Rich markup, which would read a `[`
    before a word (``[@key=value]``) as a style tag and drop it."""
    from rich.markup import escape

    span = option.range_words()
    text = f"{option.help} ({span})".strip() if span else option.help
    return escape(text) if text else None


@dataclass
class NoOptions:
    """For methods without options."""
