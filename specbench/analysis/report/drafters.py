"""The drafters behind the records: every local drafter folder a result file's header names, with its
held-out figures (eval.json), its data and recipe (config.json) and where its learning curve ended, so a
speedup in the tables can be read against how well its drafter was trained."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Sequence

import pandas as pd

from specbench.data import drafter_paths
from specbench.analysis.report.records import ResultFile
from specbench.analysis.report.table import DASH, Cell, Table, fmt_tau
from specbench.training.learning_curve import curve_metric, plateau, read_curve

ACC_COLUMNS = 4  # acc_1..acc_4: every chain drafter has them; deeper ones are in eval.json


def _local_folder(source: dict) -> Path | None:
    """The folder a header's drafter source names in this clone (``drafter_paths.resolve``: a path relative
    to the drafter root, or an older absolute one)."""
    return drafter_paths.resolve(source)


def drafter_folders(files: Sequence[ResultFile]) -> dict[str, dict[Path, list[str]]]:
    """target -> local drafter folder -> the side labels that used it, over every file's header."""
    found: dict[str, dict[Path, list[str]]] = {}
    for f in files:
        target = str(f.meta.get("target", "unknown"))
        for label, sources in ((f.meta.get("weights") or {}).get("drafters") or {}).items():
            for source in sources.values():
                folder = _local_folder(source)
                if folder is not None:
                    labels = found.setdefault(target, {}).setdefault(folder.resolve(), [])
                    if label not in labels:
                        labels.append(label)
    return found


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def drafter_row(folder: Path) -> dict:
    """One drafter's figures: what it is, what trained it and how it scores on its held-out split."""
    config, evaluation = _read_json(folder / "config.json"), _read_json(folder / "eval.json")
    recipe = config.get("recipe") or {}
    extra = recipe.get("extra") or {}
    weights = folder / "model.safetensors"
    points = read_curve(folder)
    metric = curve_metric(points)
    row = {"drafter": folder.name, "method": config.get("method", "?"),
           "size_mib": weights.stat().st_size / 2**20 if weights.is_file() else math.nan,
           "train_examples": extra.get("train_examples"), "eval_examples": extra.get("eval_examples"),
           "train_tokens": extra.get("train_response_tokens"), "epochs": recipe.get("epochs"),
           "steps": evaluation.get("steps"), "wall_time_s": evaluation.get("wall_time_s"),
           "hardware": extra.get("hardware"), "tau_proxy": evaluation.get("tau_proxy", math.nan),
           "auc": evaluation.get("auc", math.nan),
           "curve": plateau(points, metric) if metric else "no learning curve"}
    row.update({f"acc_{k}": evaluation.get(f"acc_{k}", math.nan) for k in range(1, ACC_COLUMNS + 1)})
    return row


def _count(x) -> str:
    return DASH if x is None else f"{int(x):,}"


def drafters_table(files: Sequence[ResultFile], provenance: Sequence[str] = ()) -> Table | None:
    """A section per target, a row per drafter folder the records used (None when they name none)."""
    found = drafter_folders(files)
    if not found:
        return None
    columns = ["Drafter", "Used by", "Method", "MiB", "Train answers", "Epochs", "Steps", "τ proxy",
               *[f"acc_{k}" for k in range(1, ACC_COLUMNS + 1)], "AUROC", "Learning curve"]
    sections, frames = [], []
    for target in sorted(found):
        rows = []
        for folder, labels in sorted(found[target].items()):
            r = drafter_row(folder)
            frames.append({"target": target, "used_by": " ".join(labels), **r})
            rows.append([Cell(r["drafter"]), Cell(", ".join(labels)), Cell(r["method"]), Cell(fmt_tau(r["size_mib"])),
                         Cell(_count(r["train_examples"])), Cell(DASH if r["epochs"] is None else str(r["epochs"])),
                         Cell(_count(r["steps"])), Cell(fmt_tau(r["tau_proxy"])),
                         *[Cell(fmt_tau(r[f"acc_{k}"])) for k in range(1, ACC_COLUMNS + 1)],
                         Cell(fmt_tau(r["auc"])), Cell(r["curve"])])
        sections.append((target, rows))
    notes = ["Held-out figures from each folder's eval.json, measured at the end of training on the answers held out "
             "from its training data: acc_k = top-1 agreement with the target at draft depth k (teacher-forced), "
             "τ proxy = 1 + Σ_k Π_{j≤k} acc_j (a chain's expected tokens per verify), AUROC = a pre-verifier's "
             "ranking of accepted vs rejected drafts",
             "Learning curve: whether the held-out curve metric still rose by more than 1% over the last third of "
             "training (learning_curve.csv next to the drafter)",
             "Folders as they are on disk now: retraining a drafter after its records were made changes this table, "
             "not the records"]
    return Table("drafters_table", "Drafters: held-out figures of the drafters these records used", columns, [],
                 sections, pd.DataFrame(frames), notes, list(provenance), align="lllrrrrrrrrrrl")
