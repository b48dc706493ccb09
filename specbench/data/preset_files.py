"""Paper preset files: YAML files that method packages ship (entry-point group ``specbench.presets``), each a
published table's evaluation protocol, found, read and checked, with their named ``variants`` laid over them
(``<preset>-<variant>``). ``specbench.run.preset`` expands a preset into runs; the report reads a preset's
metric back from here."""

from __future__ import annotations

from pathlib import Path

import yaml

from specbench.data.plugin_files import declared_paths
from specbench.errors import SpecbenchError, unknown_name_error

PRESETS_GROUP = "specbench.presets"  # entry points naming folders of preset *.yaml files


def preset_files() -> dict[str, Path]:
    """Preset name (the file's stem) -> its YAML file, over every folder the packages declare."""
    found: dict[str, Path] = {}
    for folder in declared_paths(PRESETS_GROUP):
        for path in sorted(folder.glob("*.yaml")):
            if path.stem in found:
                raise SpecbenchError(f"preset {path.stem} is shipped twice: {found[path.stem]} and {path}")
            found[path.stem] = path
    return found


def _read_yaml(path: Path) -> dict:
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8-sig"))  # utf-8-sig: a byte-order mark is dropped
    except yaml.YAMLError as e:
        raise SpecbenchError(f"preset {path} is not valid YAML: {e}".replace("\n", " ")) from None
    missing = [k for k in ("name", "title", "metric", "temperatures", "max_new_tokens", "targets", "benches", "methods")
               if k not in (raw or {})]
    if missing:
        raise SpecbenchError(f"preset {path} lacks field(s) {', '.join(missing)}")
    from specbench.schemas import PresetFile, validate_file

    validate_file(PresetFile, raw, f"preset {path}", "fix the preset file")  # field types, one line
    return raw


def preset_names() -> list[str]:
    """Every preset file's name and, after it, ``<name>-<variant>`` for each variant it declares."""
    names = []
    for stem, path in sorted(preset_files().items()):
        names.append(stem)
        names += [f"{stem}-{v}" for v in (_read_yaml(path).get("variants") or {})]
    return sorted(names)


def load_preset(name: str) -> dict:
    files = preset_files()
    if name in files:
        raw = _read_yaml(files[name])
        raw["variant_names"] = [f"{name}-{v}" for v in raw.pop("variants", None) or {}]
        return raw
    for stem, path in files.items():
        variant = name[len(stem) + 1:] if name.startswith(f"{stem}-") else None
        variants = _read_yaml(path).get("variants") or {} if variant else {}
        if variant in variants:
            return apply_variant(_read_yaml(path), variant, variants[variant])
    raise unknown_name_error("preset", name, preset_names(), "specbench list presets")


def apply_variant(raw: dict, variant: str, spec: dict) -> dict:
    """The preset with a variant laid over it: ``methods`` {label: {options, source, note}} replace those
    methods' settings, ``benches`` {bench: {n, select, note, source, ...}} update those benches' keys."""
    raw = {**raw, "name": f"{raw['name']}-{variant}", "variant_of": raw["name"]}
    raw.pop("variants", None)
    raw["title"] = f"{raw['title']} [{variant}: {spec.get('title', variant)}]"
    for key in ("code", "dtype", "dtype_source"):
        if key in spec:
            raw[key] = spec[key]
    changes = spec.get("methods") or {}
    raw["methods"] = [{**m, **changes.get(m["label"], {})} for m in raw["methods"]]
    bench_changes = spec.get("benches") or {}
    raw["benches"] = [{**b, **bench_changes.get(b["bench"], {})} for b in raw["benches"]]
    unknown = sorted((set(changes) - {m["label"] for m in raw["methods"]})
                     | (set(bench_changes) - {b["bench"] for b in raw["benches"]}))
    if unknown:
        raise SpecbenchError(f"preset variant {raw['name']} changes {', '.join(unknown)}, which the preset does not "
                             "have")
    return raw


def list_presets() -> list[dict]:
    return [load_preset(name) for name in preset_names()]
