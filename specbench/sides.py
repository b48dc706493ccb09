"""The sides of a run: each a method, its options and the label it is shown under, as data from the
command line's edge to the report.

The command line writes sides as text (``--method``/``--opt``/``--config``/``--label``, ``--sweep
key=v1,v2``, ``--also name@key=value``); ``cli_sides`` turns that text into ``Side`` objects once, and
from there on nothing parses a label: the runner takes each side's method and options, the results
header records every side (``side_specs``: method, the options as given, its name and shown options)
beside the options each drafter ran with (``method_options``), and the report reads both.
``header_sides`` reads the sides back from a header, including headers written before ``side_specs``
existed (their sides were recorded only as the command line's text, which is parsed here as the
command line would parse it).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

from specbench.errors import SpecbenchError


@dataclass(frozen=True)
class Side:
    """One method configuration in a run. ``options`` as given (text from the command line, values from a
    preset); ``name`` the label's stem ("" = the method's name); ``shown`` the options whose values follow
    the stem in the label (``ddtree@budget=16``: a sweep's key, or an ``--also`` spec's keys)."""

    method: str
    options: Mapping[str, Any] = field(default_factory=dict)
    name: str = ""
    shown: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        """How records and tables name the side (display only: nothing reads options back from it)."""
        return (self.name or self.method) + "".join(f"@{key}={_text(self.options[key])}" for key in self.shown)

    @property
    def stem(self) -> str:
        return self.name or self.method

    def header(self) -> dict:
        """What the results header records of the side."""
        return {"label": self.label, "method": self.method, "options": dict(self.options), "name": self.stem,
                "shown": list(self.shown)}


def _text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _key(text: str) -> str:
    return text.strip().replace("-", "_")


# An '@' separates two options only where `key=` follows it, so a value may hold one: a hub id's
# org/name@REVISION stays whole.
_NEXT_OPTION = re.compile(r"@(?=\s*[A-Za-z_][\w-]*\s*=)")
_LABEL = "@label="


def parse_spec(spec: str, flag: str = "--also") -> Side:
    """``name[@key=value...][@label=LABEL]`` -> a Side; ``@label=`` takes the rest of the spec, '@'
    included, as the side's label (else the label is the spec itself)."""
    usage = f"{flag} expects name or name@key=value[@key=value...][@label=LABEL] (got {spec!r})"
    body, has_label, label = spec.partition(_LABEL)
    if has_label and not label:
        raise SpecbenchError(f"{flag} {body}{_LABEL} needs a label after 'label='")
    method, at, rest = body.partition("@")
    pieces = _NEXT_OPTION.split("@" + rest) if at else [""]
    if not method.strip() or pieces[0]:
        raise SpecbenchError(usage)
    options: dict[str, str] = {}
    for piece in pieces[1:]:
        key, _, value = piece.partition("=")
        options[_key(key)] = value.strip()
    if has_label:
        return Side(method.strip(), options, name=label)
    return Side(method.strip(), options, shown=tuple(options))


def parse_sweep(sweep: str) -> tuple[str, list[str]]:
    key, sep, values = sweep.partition("=")
    items = [v.strip() for v in values.split(",") if v.strip()]
    if not sep or not key.strip() or not items:
        raise SpecbenchError(f"--sweep expects key=v1,v2,... (got {sweep!r}), e.g. --sweep budget=16,32,64")
    return _key(key), items


def cli_sides(method: str, options: Mapping[str, Any], label: Optional[str] = None, sweep: Optional[str] = None,
              also: tuple[str, ...] | list[str] = ()) -> list[Side]:
    """The sides the command line names, in order: the main method (one side per ``--sweep`` value,
    labelled ``LABEL@key=value``), then every ``--also`` spec."""
    if sweep:
        key, values = parse_sweep(sweep)
        sides = [Side(method, {**options, key: value}, label or "", (key,)) for value in values]
    else:
        sides = [Side(method, dict(options), label or "")]
    return sides + [parse_spec(spec) for spec in also]


def header_sides(meta: Mapping) -> dict[str, Side]:
    """Side label -> Side from a results header: its ``side_specs``, or in a header written before them the
    sides its recorded command line names (``recorded_sides``)."""
    specs = meta.get("side_specs")
    if isinstance(specs, list):
        sides = [Side(str(s.get("method")), dict(s.get("options") or {}), str(s.get("name") or ""),
                      tuple(s.get("shown") or ())) for s in specs if isinstance(s, Mapping)]
        return {side.label: side for side in sides}
    return {side.label: side for side in recorded_sides(meta)}


def recorded_sides(meta: Mapping) -> list[Side]:
    """The sides of a header written before ``side_specs``, which recorded only the command line's text
    (``method``, ``options``, ``label``, ``sweep``, ``also``): read as the command line reads it. A spec that
    does not parse is left out (its side then reads as its label alone)."""
    method, label = meta.get("method"), meta.get("label")
    sides: list[Side] = []
    if isinstance(method, str) and method:
        name = label if isinstance(label, str) and label != method else ""
        try:
            sides = cli_sides(method, dict(meta.get("options") or {}), name, meta.get("sweep"))
        except SpecbenchError:
            sides = [Side(method, dict(meta.get("options") or {}), name)]
    for spec in meta.get("also") or ():
        try:
            sides.append(parse_spec(str(spec)))
        except SpecbenchError:
            continue
    return sides


# ------------------------------------------------------------------------------ --opt and --config

def read_config(config: Path) -> dict:
    """A YAML/JSON mapping of method options; a missing, unreadable or malformed file is one line."""
    import yaml

    if not config.is_file():
        raise SpecbenchError(f"config file {config} does not exist; pass a YAML or JSON file of method options")
    try:
        text = config.read_text(encoding="utf-8-sig")  # a byte-order mark (Windows tools write one) is dropped
        loaded = yaml.safe_load(text) if config.suffix in (".yaml", ".yml") else json.loads(text)
    except OSError as exc:
        raise SpecbenchError(f"cannot read config file {config} ({exc.strerror}); check its permissions") from None
    except UnicodeDecodeError:
        raise SpecbenchError(f"config file {config} is not UTF-8 text; pass a YAML or JSON file") from None
    except json.JSONDecodeError as exc:
        raise SpecbenchError(f"config file {config} is not valid JSON ({exc.msg} at line {exc.lineno}); "
                             "fix it or pass a .yaml file") from None
    except RecursionError:
        raise SpecbenchError(f"config file {config} nests deeper than Python can read; method options are flat, "
                             "e.g. gamma: 5") from None
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" at line {where.line + 1}" if where is not None else ""
        raise SpecbenchError(f"config file {config} is not valid YAML ({getattr(exc, 'problem', None) or 'syntax error'}"
                             f"{at}); fix it") from None
    if loaded is None:
        return {}
    from specbench.schemas import validate_config

    return validate_config(loaded, config)


def parse_opts(opts: list[str], config: Optional[Path] = None) -> dict:
    """``--config`` then every ``--opt key=value`` (a later one wins) -> one side's options as given."""
    options: dict = {}
    if config is not None:
        options.update(read_config(config))
    for opt in opts:
        if "=" not in opt:
            raise SpecbenchError(f"--opt expects key=value, got {opt!r}")
        key, value = opt.split("=", 1)
        if not key.strip():
            raise SpecbenchError(f"--opt expects key=value, got {opt!r} (empty key)")
        options[_key(key)] = value.strip()
    return options
