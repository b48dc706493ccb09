"""The report's batch tables from the records of a real tiny sweep (`--batch-size 1,2,4`): metrics checked
against values computed here from the raw JSON lines, the crossover rule on constructed intervals, the
figure written, and the batched files kept out of the batch-1 tables."""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
import torch

from specbench.analysis.cost_model import CHAIN, TREE, CostCurve, batch_kind
from specbench.analysis.report import build_report, write_report
from specbench.analysis.report.batch import crossover, fmt_crossover
from specbench.cli import main
from specbench.run.plan import sweep_out
from test_cli import base_args, read

SIZES = (1, 2)
PROMPTS = 3
PHASES = ("prefill", "draft", "compile", "verify", "commit")


@pytest.fixture(scope="module")
def sweep(models, tmp_path_factory):
    """One sweep for the module (three prompts: B = 2's last batch is not full)."""
    out = tmp_path_factory.mktemp("runs") / "sweep.jsonl"
    args = base_args(models, out, "--batch-size", ",".join(map(str, SIZES)), "--also", "pld")
    args[args.index("--limit") + 1] = str(PROMPTS)
    argv = sys.argv
    sys.argv = ["specbench", *args]
    try:
        main()
    except SystemExit as exc:
        assert not exc.code
    finally:
        sys.argv = argv
    return {b: read(sweep_out(out, b))[1:] for b in SIZES}, out.parent


def _throughput(records: list[dict]) -> float:
    spans: dict = {}
    for r in records:
        spans.setdefault(r["batch"]["group"], []).append((r["batch"]["start"], r["batch"]["end"]))
    makespan = sum(max(e for _, e in s) - min(b for b, _ in s) for s in spans.values())
    return sum(len(r["new_tokens"]) for r in records) / makespan


def _rate(records: list[dict]) -> float:
    return sum(len(r["new_tokens"]) for r in records) / sum(r["times"].get(p, 0.0) for r in records for p in PHASES)


def test_the_batch_tables_hold_what_the_records_say(sweep):
    by_size, folder = sweep
    report = build_report(folder, reps=200)
    frame = report.batch_frame
    assert sorted(frame.batch_size.unique()) == list(SIZES)
    assert set(frame.method) == {"sps", "pld", "vanilla"}
    for size, records in by_size.items():
        base = [r for r in records if r["method"] == "vanilla"]
        for method in ("sps", "pld", "vanilla"):
            mine = [r for r in records if r["method"] == method]
            row = frame[(frame.method == method) & (frame.batch_size == size)].iloc[0]
            latency = [r["batch"]["end"] - r["batch"]["start"] for r in mine]
            assert row.throughput == pytest.approx(_throughput(mine))
            assert row.latency_mean == pytest.approx(np.mean(latency))
            assert row.latency_p50 == pytest.approx(np.percentile(latency, 50))
            assert row.latency_p90 == pytest.approx(np.percentile(latency, 90))
            assert row.n_prompts == PROMPTS
            if method == "vanilla":
                assert math.isnan(row.speedup)
                continue
            tau = sum(sum(r["accept_lengths"]) + len(r["accept_lengths"]) for r in mine) / \
                sum(r["n_verify"] for r in mine)
            assert row.tau == pytest.approx(tau)
            assert row.speedup == pytest.approx(_rate(mine) / _rate(base))
            assert row.speedup_lo <= row.speedup <= row.speedup_hi
            assert row.throughput_ratio == pytest.approx(_throughput(mine) / _throughput(base))
            assert math.isfinite(row.ideal) and row.ideal_source == "run"  # no curve measured here
            assert row.batched_drafting == (method == "sps")
            assert row.divergence == f"{len(mine)}/0/0"  # fp32 greedy: every text is vanilla's
    table = report.batch
    assert table.columns == ["Method", *(f"B={b}" for b in SIZES), "Crossover B"]
    (label, rows), = table.sections
    assert "HumanEval" in label and [r[0].text for r in rows] == ["pld", "sps"]
    for cells in rows:
        mine = frame[frame.method == cells[0].text].set_index("batch_size")
        expected = crossover({b: (mine.speedup_lo[b], mine.speedup_hi[b]) for b in SIZES})
        assert cells[-1].text == fmt_crossover(expected, max(SIZES))
    assert report.batch_detail is not None and not report.main.sections  # batched files stay out of the main table


def test_the_report_writes_the_batch_tables_and_figure(sweep, tmp_path):
    _, folder = sweep
    written = {p.name for p in write_report(folder, tmp_path / "report")}
    assert {"batch_table.md", "batch_detail.md", "batch_table.csv"} <= written
    assert any(name.startswith("batch_speedup_") and name.endswith(".png") for name in written)
    assert "Speedup under load" in (tmp_path / "report" / "index.html").read_text()


@pytest.mark.parametrize("intervals, expected", [
    ({1: (1.2, 1.5), 2: (0.9, 1.1), 4: (0.7, 0.95), 8: (0.5, 0.6)}, 4),  # touching 1 is not below it
    ({1: (0.8, 0.99), 4: (0.5, 0.7)}, 1),
    ({16: (0.5, 0.9), 2: (0.6, 0.8), 8: (1.1, 1.2)}, 2),  # the smallest B, whatever the order
    ({1: (0.9, 1.0), 2: (1.0, 1.3), 4: (0.2, float("nan"))}, None),  # an interval of 1.00 or one missing: no
])
def test_crossover_is_the_smallest_b_wholly_below_one(intervals, expected):
    assert crossover(intervals) == expected
    assert fmt_crossover(crossover(intervals), 16) == ("none ≤ 16" if expected is None else str(expected))


def test_a_cost_curve_per_batch_size():
    seconds = {CHAIN: {1: 1.0, 4: 2.0}, TREE: {1: 1.0, 4: 3.0}, batch_kind(CHAIN, 4): {1: 2.0, 4: 6.0}}
    curve = CostCurve("hw", "float32", seconds)
    assert curve.at_batch(1) is curve and curve.at_batch(8) is None
    at4 = curve.at_batch(4)
    assert at4.time(4, CHAIN) == 6.0 and at4.steps(4) == 3.0 and at4.time(2.5, TREE) == 4.0  # tree: chain's


@pytest.mark.parametrize("damage, field", [({"size": "2"}, "batch.size"), ({"end": None}, "batch.end"),
                                           ({"group": 1.5}, "batch.group")])
def test_a_damaged_batch_field_is_one_line(sweep, tmp_path, capsys, damage, field):
    import json

    from test_cli import cli

    by_size, folder = sweep
    source = sweep_out(folder / "sweep.jsonl", 2)
    lines = source.read_text().splitlines()
    record = json.loads(lines[1])
    record["batch"].update(damage)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join([lines[0], json.dumps(record), *lines[2:]]) + "\n")
    code, _, stderr = cli(["report", str(bad), "--out-dir", str(tmp_path / "r")], capsys)
    assert code == 2 and "Traceback" not in stderr
    assert f"{bad} line 2: field {field}" in stderr and len(stderr.strip().splitlines()) == 1


def test_report_show_prints_the_batch_table(sweep, tmp_path, capsys):
    from test_cli import cli

    _, folder = sweep
    code, stdout, stderr = cli(["report", str(folder), "--out-dir", str(tmp_path / "r"), "--show"], capsys)
    assert code == 0, stderr
    assert "Speedup under load" in stdout and "Crossover B" in stdout


def test_a_curve_measured_per_batch_size_prices_the_ideal_at_each_b(sweep, models, tmp_path):
    """bench/forward_cost.py --batch measures the tiny target's verify at B = 1 and 2 through the batched path;
    beside the sweep's files, the batch tables' ideal for SpS (γ = 3: 4 rows per verify) comes from it."""
    import json
    import os
    import shutil
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    _, folder = sweep
    for path in folder.glob("*.jsonl"):
        shutil.copy(path, tmp_path / path.name)
    cost = tmp_path / "cost"
    # the curve is looked up by hardware, thread count included: the subprocess gets this process's
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": str(torch.get_num_threads())}
    done = subprocess.run([sys.executable, "bench/forward_cost.py", "--target", models["target"], "--dtype", "float32",
                           "--rows", "1-5", "--prefix", "8", "--repeats", "1", "--warmup", "0", "--batch", "1,2",
                           "--out", str(cost)], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    curves = json.loads(next(cost.glob("*.json")).read_text())["curves"]["float32"]
    assert {"chain", "tree", "chain@B2", "tree@B2"} == set(curves) and all(
        t > 0 for kind in curves.values() for t in kind.values())
    frame = build_report(tmp_path, reps=0).batch_frame
    sps = frame[frame.method == "sps"].set_index("batch_size")
    assert list(sps.ideal_source) == ["curve"] * len(SIZES) and sps.ideal.notna().all()
