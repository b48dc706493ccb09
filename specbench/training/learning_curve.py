"""A drafter's learning curve: its held-out figures against the training tokens seen so far, read
from the trainer's log, written next to the drafter (CSV + PNG) and summarised in its model card."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

# The held-out figure a curve follows, in order of preference (chain drafters log a tau proxy; a
# pre-verifier logs its ranking quality).
CURVE_METRICS = ("tau_proxy", "auc", "acc_1")


def read_log(path: str | Path) -> list[dict]:
    """Every entry of a train_log.jsonl (a torn last line from a killed run is skipped)."""
    entries = []
    for line in Path(path).read_text().splitlines():
        try:
            entries.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return entries


def curve_points(entries: list[dict], tokens_per_step: float | None = None) -> list[dict]:
    """One point per held-out evaluation: step, training tokens seen (logged with it, else step x the
    mean tokens per step), and the logged eval figures. A resumed run's repeated steps keep the last entry."""
    points: dict[int, dict] = {}
    for e in entries:
        if "eval" not in e:
            continue
        step = e["step"]
        tokens = e.get("tokens")  # logged with the evaluation by trainers that count tokens
        estimated = tokens is None
        if estimated and tokens_per_step:
            tokens = round(step * tokens_per_step)
        points[step] = {"step": step, "tokens": tokens, "tokens_estimated": estimated, **e["eval"]}
    return [points[s] for s in sorted(points)]


def curve_metric(points: list[dict]) -> str | None:
    return next((m for m in CURVE_METRICS if points and all(m in p for p in points)), None)


def write_learning_curve(folder: str | Path, points: list[dict]) -> tuple[Path, Path | None] | None:
    """learning_curve.csv (every logged figure) and learning_curve.png (the curve metric vs tokens)."""
    if not points:
        return None
    folder = Path(folder)
    columns = ["step", "tokens", "tokens_estimated"] + sorted({k for p in points for k in p} -
                                                              {"step", "tokens", "tokens_estimated"})
    csv_path = folder / "learning_curve.csv"
    with open(csv_path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, columns)
        writer.writeheader()
        writer.writerows(points)
    metric = curve_metric(points)
    xs = [p["tokens"] for p in points]
    if metric is None or any(x is None for x in xs):
        return csv_path, None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2), dpi=100)
    ax.plot([x / 1e6 for x in xs], [p[metric] for p in points], marker="o", markersize=3)
    ax.set_xlabel("training tokens (millions)" + (", estimated" if any(p["tokens_estimated"] for p in points) else ""))
    ax.set_ylabel(f"held-out {metric}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    png_path = folder / "learning_curve.png"
    fig.savefig(png_path)
    plt.close(fig)
    return csv_path, png_path


def plateau(points: list[dict], metric: str, tolerance: float = 0.01) -> str:
    """Whether the last third of training still improved the metric by more than ``tolerance`` (relative):
    from its value at two thirds of the final step (interpolated between evaluations) to the best after."""
    if len(points) < 3:
        return "too few evaluations to tell"
    cut = points[-1]["step"] * 2 / 3
    before = [p for p in points if p["step"] <= cut]
    after = [p for p in points if p["step"] > cut]
    if before:
        a, b = before[-1], after[0]
        first = a[metric] + (b[metric] - a[metric]) * (cut - a["step"]) / (b["step"] - a["step"])
    else:  # the curve starts inside the last third (a log that begins late)
        first = after[0][metric]
    best = max(p[metric] for p in after)
    gain = (best - first) / abs(first) if first and math.isfinite(first) else float("inf")
    if gain > tolerance:
        return f"still improving ({100 * gain:.1f}% over the last third of training)"
    return f"plateaued (within {100 * tolerance:.0f}% over the last third of training)"


def read_curve(folder: str | Path) -> list[dict]:
    """The points of a drafter folder's learning_curve.csv (none if it has no curve)."""
    path = Path(folder) / "learning_curve.csv"
    if not path.is_file():
        return []
    points = []
    with open(path, newline="") as fh:
        for row in csv.DictReader(fh):
            point = {k: float(v) for k, v in row.items() if v not in ("", None) and k != "tokens_estimated"}
            point["step"] = int(point["step"])
            point["tokens"] = int(point["tokens"]) if "tokens" in point else None
            point["tokens_estimated"] = row.get("tokens_estimated") == "True"
            points.append(point)
    return points


def curve_section(folder: str | Path) -> list[str]:
    """The model card's learning-curve section (Markdown), from the folder's learning_curve.csv."""
    points = read_curve(folder)
    metric = curve_metric(points)
    if metric is None:
        return []
    est = any(p["tokens_estimated"] for p in points)
    shown = points if len(points) <= 12 else [points[round(i * (len(points) - 1) / 11)] for i in range(12)]
    lines = ["## Learning curve", "",
             f"Held-out {metric} against training tokens ({plateau(points, metric)}); every evaluation is in "
             "`learning_curve.csv`" + (", tokens estimated from the step and the mean tokens per step" if est else "")
             + ".", "", "![learning curve](learning_curve.png)", "",
             f"| step | training tokens | {metric} |", "|---:|---:|---:|"]
    for p in shown:
        tokens = "—" if p["tokens"] is None else f"{p['tokens']:,}"
        lines.append(f"| {p['step']} | {tokens} | {p[metric]:.3f} |")
    return lines + [""]
