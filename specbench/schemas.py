"""Schemas of the files specbench reads (prompt files, --config, results headers, records and skip
lines, drafter folders' config.json, presets), checked with pydantic so that a wrong type, a null, a
lone surrogate or absurd nesting is one line naming the file, the line and the field, instead of a
traceback from deep inside a loader or a report."""

from __future__ import annotations

import codecs
import json
from pathlib import Path
from typing import Any, Iterator, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, TypeAdapter, ValidationError

from specbench.errors import SpecbenchError
from specbench.records import GenerationRecord

MAX_DEPTH = 32  # our files nest a handful of levels; deeper is a generated or hostile file
SHOWN = 40  # characters of an offending value shown in a message


class FileSchemaError(SpecbenchError):
    """A file that does not follow its schema; the message names the file, line and field."""


def where(path: str | Path, line: int | None) -> str:
    return f"{path} line {line}" if line else str(path)


def _field(loc: tuple) -> str:
    return ".".join(str(part) for part in loc) or "(the line itself)"


def _shown(value: Any) -> str:
    text = "null" if value is None else repr(value)
    return text if len(text) <= SHOWN else text[: SHOWN - 3] + "..."


def check_tree(obj: Any, path: str | Path, line: int | None, fix: str, depth: int = 0, loc: tuple = ()) -> None:
    """Refuse what JSON allows but nothing downstream can hold: nesting deeper than MAX_DEPTH and
    strings with lone surrogates ("\\ud800" escapes), which cannot be written back as UTF-8."""
    if depth > MAX_DEPTH:
        raise FileSchemaError(f"{where(path, line)}: field {_field(loc)} nests deeper than {MAX_DEPTH} levels; {fix}")
    if isinstance(obj, str):
        _check_text(obj, path, line, fix, loc)
    elif isinstance(obj, dict):
        for key, value in obj.items():
            _check_text(str(key), path, line, fix, loc + (key,))
            check_tree(value, path, line, fix, depth + 1, loc + (key,))
    elif isinstance(obj, list):
        for index, value in enumerate(obj):
            check_tree(value, path, line, fix, depth + 1, loc + (index,))


def _check_text(text: str, path, line, fix: str, loc: tuple) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = ascii(text[exc.start])
        raise FileSchemaError(f"{where(path, line)}: field {_field(loc)} holds a lone surrogate ({bad}), which is not "
                              f"text; {fix}") from None


def schema_error(exc: ValidationError, path: str | Path, line: int | None, fix: str) -> FileSchemaError:
    """The first pydantic error as one line: 'FILE line N: field turns.0 must be ... (got 5); FIX'."""
    first = exc.errors(include_url=False)[0]
    loc = tuple(part for part in first["loc"] if not _is_union_tag(part))
    got = f" (got {_shown(first['input'])})" if first["type"] != "missing" else ""
    if len(loc) < len(first["loc"]):  # one of several allowed types: pydantic's message names only the first
        message = "has the wrong type"
    else:
        message = first["msg"][0].lower() + first["msg"][1:]
    return FileSchemaError(f"{where(path, line)}: field {_field(loc)}: {message}{got}; {fix}")


def _is_union_tag(part) -> bool:
    """pydantic names the member of a union an error came from ('list[str]', 'int'): not a field."""
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool", "none", "dict", "list"))


def parse_json_line(raw: bytes | str, path: str | Path, line: int, fix: str) -> Any:
    """One JSON value from one line; undecodable bytes, bad JSON and absurd nesting are one line each."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
    except UnicodeDecodeError:
        raise FileSchemaError(f"{where(path, line)} is not UTF-8 text; {fix}") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise FileSchemaError(f"{where(path, line)} is not valid JSON ({exc.msg}); {fix}") from None
    except RecursionError:
        raise FileSchemaError(f"{where(path, line)} nests deeper than Python can read; {fix}") from None
    check_tree(obj, path, line, fix)
    return obj


def validate(model, obj: Any, path: str | Path, line: int | None, fix: str):
    """``model`` (a pydantic model class or TypeAdapter) applied to ``obj``, errors as one line."""
    try:
        if isinstance(model, TypeAdapter):
            return model.validate_python(obj)
        return model.model_validate(obj)
    except ValidationError as exc:
        raise schema_error(exc, path, line, fix) from None


# ---------------------------------------------------------------------------------- prompt files

PROMPT_FIX = "fix or remove the record (each line: {\"id\": ..., \"turns\": [\"...\"]})"


class PromptLine(BaseModel):
    """One line of a prompt file (SOURCES.md); other keys are kept as they are."""

    model_config = ConfigDict(extra="allow")

    id: Union[StrictStr, StrictInt]
    turns: list[StrictStr] = Field(min_length=1)
    reference: Union[list[Union[StrictStr, StrictInt, StrictFloat]], StrictStr, None] = None
    meta: Optional[dict[str, Any]] = None

    @property
    def references(self) -> list[str]:
        if self.reference is None:
            return []
        return [self.reference] if isinstance(self.reference, str) else [str(r) for r in self.reference]


def read_jsonl(path: Path, what: str, fix: str) -> Iterator[tuple[int, Any]]:
    """(line number, JSON value) of every non-blank line of a JSONL file."""
    try:
        with open(path, "rb") as fh:  # a byte-order mark (Windows tools write one) is no part of line 1
            raw_lines = fh.read().removeprefix(codecs.BOM_UTF8).split(b"\n")
    except IsADirectoryError:
        raise SpecbenchError(f"{what} {path} is a folder; pass a JSONL file") from None
    except OSError as exc:
        raise SpecbenchError(f"cannot read {what} {path} ({exc.strerror}); check its permissions") from None
    for number, raw in enumerate(raw_lines, 1):
        if raw.strip():
            yield number, parse_json_line(raw, path, number, fix)


# ------------------------------------------------------------------------------------ --config

_SCALAR = Union[StrictBool, StrictInt, StrictFloat, StrictStr]
_CONFIG = TypeAdapter(dict[StrictStr, Union[_SCALAR, None, list[_SCALAR]]])


def validate_config(loaded: Any, path: Path) -> dict:
    """--config: a mapping of option names to scalars or flat lists of scalars."""
    fix = "method options are flat, e.g. gamma: 5"
    check_tree(loaded, path, None, fix)
    if not isinstance(loaded, dict):
        raise FileSchemaError(f"config file {path} must hold a mapping of option names to values "
                              f"(got {type(loaded).__name__}), e.g. gamma: 5")
    return validate(_CONFIG, loaded, f"config file {path}", None, fix)


# ------------------------------------------------------------------------------------ results files

RESULTS_FIX = "move the file aside and rerun, or pass --overwrite to start it again"


class HeaderMeta(BaseModel):
    """The fields of a results header that readers rely on; the rest is provenance, kept as is."""

    model_config = ConfigDict(extra="allow")

    config_hash: Optional[StrictStr] = None
    method: Optional[StrictStr] = None
    bench: Optional[StrictStr] = None
    target: Optional[StrictStr] = None
    temperature: Optional[Union[StrictFloat, StrictInt]] = None
    stream: Optional[list[StrictStr]] = None
    stream_turns: Optional[list[StrictInt]] = None
    sides: Optional[list[StrictStr]] = None
    methods: Optional[dict[StrictStr, Any]] = None
    weights: Optional[dict[StrictStr, Any]] = None
    drafter_recipes: Optional[dict[StrictStr, dict[StrictStr, dict[StrictStr, Any]]]] = None
    hardware: Optional[StrictStr] = None
    rank: Optional[StrictInt] = None
    world_size: Optional[StrictInt] = None


class HeaderLine(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: StrictStr
    meta: HeaderMeta


class SkipLine(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: StrictStr
    method: StrictStr
    bench: StrictStr
    prompt_id: StrictStr
    turn: StrictInt
    query_index: StrictInt = -1


_RECORD = TypeAdapter(GenerationRecord)
RECORD_KEY = ("method", "bench", "prompt_id", "turn")  # what names a record (record_key); every reader pairs by it
# Fields a record line may lack (older writers); everything else GenerationRecord requires.
RECORD_DEFAULTS = {"new_tokens": [], "prompt_tokens": 0, "stop_reason": "", "times": {}, "n_verify": 0,
                   "accept_lengths": [], "tree_sizes": [], "depth_attempts": [], "depth_accepts": []}


_FIGURE = Optional[Union[StrictFloat, StrictInt]]


class ForcedSide(BaseModel):
    """One side of a record's ``forced`` figures (specbench/agreement.py): None where no position was checked."""

    model_config = ConfigDict(extra="allow")

    positions: StrictInt = Field(ge=0)
    tokens_differ: StrictInt = Field(ge=0)
    max: _FIGURE
    p50: _FIGURE
    p90: _FIGURE
    p99: _FIGURE
    top1: _FIGURE
    margin_max: _FIGURE
    margin_order: _FIGURE
    rows: dict[StrictStr, StrictInt]
    deltas: list[Union[StrictFloat, StrictInt]]
    within_bound: Optional[StrictBool] = None


class ForcedFigures(ForcedSide):
    """A record's ``forced`` field: the method's side, the A/A side beside it, and the fp32 bound."""

    aa: ForcedSide
    bound: Optional[Union[StrictFloat, StrictInt]] = None


class _ForcedField(BaseModel):
    forced: Optional[ForcedFigures] = None


class BatchFigures(BaseModel):
    """A batched record's ``batch`` field (engine/batch_loop.py), what the report's batch tables read: its B,
    its batch group, its start and end on the batch clock (seconds)."""

    model_config = ConfigDict(extra="allow")

    size: StrictInt = Field(ge=1)
    continuous: StrictBool = False
    group: StrictInt
    start: Union[StrictFloat, StrictInt] = Field(ge=0)
    end: Union[StrictFloat, StrictInt] = Field(ge=0)
    active_mean: Optional[Union[StrictFloat, StrictInt]] = None
    batched_drafting: StrictBool = False


class _BatchField(BaseModel):
    batch: Optional[BatchFigures] = None


def parse_record(obj: dict, path: str | Path, line: int | None, fix: str = RESULTS_FIX,
                 lenient: bool = False) -> GenerationRecord:
    """A record line -> GenerationRecord, every field type-checked (a null token list, a string time,
    a list where a dict belongs are one line). ``lenient``: fields older writers left out get defaults;
    never the fields that name the record (``RECORD_KEY``), which every reader pairs records by."""
    missing = next((key for key in RECORD_KEY if key not in obj), None)
    if missing is not None:
        raise FileSchemaError(f"{where(path, line)}: field {missing}: the record has none, and records are paired by "
                              f"{', '.join(RECORD_KEY)}; {fix}")
    record = validate(_RECORD, {**RECORD_DEFAULTS, **obj} if lenient else obj, path, line, fix)
    if record.forced is not None:
        validate(_ForcedField, {"forced": record.forced}, path, line, fix)
    if record.batch is not None:
        validate(_BatchField, {"batch": record.batch}, path, line, fix)
    return record


def parse_header(obj: dict, path: str | Path, line: int | None, fix: str = RESULTS_FIX) -> dict:
    validate(HeaderLine, obj, path, line, fix)
    return obj["meta"]


def parse_skip(obj: dict, path: str | Path, line: int | None, fix: str = RESULTS_FIX) -> SkipLine:
    return validate(SkipLine, obj, path, line, fix)


def record_key(obj) -> tuple[str, str, str, int]:
    """(method, bench, prompt_id, turn) of a record or skip line (object or dict)."""
    if isinstance(obj, dict):
        return obj["method"], obj["bench"], obj["prompt_id"], int(obj["turn"])
    return obj.method, obj.bench, obj.prompt_id, int(obj.turn)


# ------------------------------------------------------------------------------- drafter folders, presets

class DrafterConfig(BaseModel):
    """The generic part of a drafter folder's config.json (ours); method-specific keys are the method's."""

    model_config = ConfigDict(extra="allow")

    method: StrictStr
    architecture: dict[StrictStr, Any]
    target: Optional[dict[StrictStr, Any]] = None


class PresetFile(BaseModel):
    """A paper preset's top level; each method's entries are checked when the plan is built."""

    model_config = ConfigDict(extra="allow")

    name: StrictStr
    title: StrictStr
    metric: Union[dict[StrictStr, Any], StrictStr]
    temperatures: list[Union[StrictFloat, StrictInt]] = Field(min_length=1)
    max_new_tokens: Union[StrictInt, dict[StrictStr, Any], None]
    targets: list[dict[StrictStr, Any]]
    benches: Union[list[Any], dict[StrictStr, Any]]
    methods: Union[list[Any], dict[StrictStr, Any]]


def validate_file(model, obj: Any, path: str | Path, fix: str):
    """A whole-file document (YAML/JSON) against ``model``, after the tree check."""
    check_tree(obj, path, None, fix)
    return validate(model, obj, path, None, fix)
