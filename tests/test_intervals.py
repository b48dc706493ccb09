"""Numbers that hold up: conversations resampled whole, the A/A control, bold only within one file, one
machine per table, per-turn load flags and their re-timing, the measured cost curve, portable drafter paths."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from specbench.data import drafter_paths, machine_load

from methods.sps.report import verify_cost_note
from specbench.analysis import paired
from specbench.analysis.cost_model import CHAIN, TREE, CostCurve, curve_path, ideal_with_source, load_curve, slug
from specbench.errors import SpecbenchError
from specbench.records import GenerationRecord
from specbench.analysis.report import build_report, read_result_file, write_report
from specbench.analysis.report.checks import aa_frame
from specbench.analysis.report.cost import cost_table

HW = "Test CPU [family 1 model 1, avx2 only] (2 threads)"
META = {"target": "tiny", "dtype": "float32", "device": "cpu", "hardware": HW, "temperature": 0.0, "threads": 2,
        "max_new_tokens": 16, "seed": 0, "git_sha": "abc"}


def rec(method: str, pid: str, seconds: float, turn: int = 0, bench: str = "mt_bench", n: int = 10,
        load: float | None = None, sizes: int = 0, target_s: float = 0.0, chains: int = -1) -> GenerationRecord:
    calls = n if sizes == 0 else n // 2
    return GenerationRecord(method=method, new_tokens=list(range(n)), prompt_tokens=5, stop_reason="length",
                            times={"prefill": 0.0, "draft": 0.0, "verify": seconds, "commit": 0.0}, n_verify=calls,
                            accept_lengths=[n // calls - 1] * calls, tree_sizes=[sizes] * calls, depth_attempts=[],
                            depth_accepts=[], forwards={"target": calls}, forward_times={"target": target_s},
                            bench=bench, prompt_id=pid, turn=turn, load_avg=None if load is None else [load, 0, 0],
                            chain_calls=chains)


def write(path: Path, records: list[GenerationRecord], **meta) -> Path:
    lines = [{"type": "header", "meta": {**META, **meta}}] + [{"type": "record", **r.to_dict()} for r in records]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return path


def test_paired_rows_resample_conversations_whole():
    a = {("mt", "p0", 0): [1.0] * 8, ("mt", "p0", 1): [2.0] * 8, ("mt", "p1", 0): [3.0] * 8}
    b = {k: [x * 2 for x in v] for k, v in a.items()}
    ra, rb, keys = paired.pair_rows(a, b)
    assert keys == [("mt", "p0"), ("mt", "p1")]  # two conversations, not three turns
    assert ra[:, 0].tolist() == [3.0, 3.0] and rb[:, 0].tolist() == [6.0, 6.0]
    # a turn without its twin on the other side is left out of its conversation's pair
    ra, _, _ = paired.pair_rows({**a, ("mt", "p2", 0): [1.0] * 8}, b)
    assert len(ra) == 2


def test_conversation_bootstrap_is_wider_when_turns_move_together():
    """Two turns of a conversation that are slow together: resampling turns apart would understate the
    spread; resampling conversations keeps it."""
    rng = np.random.default_rng(0)
    base = {}
    ours = {}
    for c in range(20):
        slow = rng.uniform(0.5, 1.5)
        for t in range(2):
            ours[("mt", f"p{c}", t)] = [10, slow, 10, 1.0, 2, 1, 0, slow]
            base[("mt", f"p{c}", t)] = [10, 1.0, 10, 1.0, 1, 1, 0, 1.0]
    a, b, _ = paired.pair_rows(ours, base)
    _, lo, hi = paired.paired_ratio(a, b, "speedup")
    turns = sorted(ours)
    ta = np.array([ours[k] for k in turns], dtype=float)
    tb = np.array([base[k] for k in turns], dtype=float)
    _, tlo, thi = paired.paired_ratio(ta, tb, "speedup")
    assert hi - lo > (thi - tlo) * 1.2


def _aa_file(tmp_path: Path, name: str, jitter: float, skew: float = 1.0) -> Path:
    rng = np.random.default_rng(1)
    records = []
    for p in range(12):
        t = rng.uniform(1.0, 2.0)
        records += [rec("vanilla", f"p{p}", t), rec("vanilla (A/A)", f"p{p}", t * skew * rng.uniform(1 - jitter, 1 + jitter))]
    methods = {"vanilla": {"method": "vanilla"}, "vanilla (A/A)": {"method": "vanilla"}}
    return write(tmp_path / name, records, methods=methods, sides=["vanilla (A/A)", "vanilla"], bench="mt_bench")


def test_aa_interval_must_contain_one_and_is_flagged_otherwise(tmp_path: Path):
    fine = aa_frame([read_result_file(_aa_file(tmp_path, "fine.jsonl", 0.03))])
    assert fine.contains_1.tolist() == [True] and fine.n.tolist() == [12]
    off = aa_frame([read_result_file(_aa_file(tmp_path, "off.jsonl", 0.01, skew=1.2))])
    assert off.contains_1.tolist() == [False]
    report = build_report(tmp_path / "off.jsonl", paper_numbers=None, reps=200)
    assert report.aa is not None and any("narrower than its timing noise" in n for n in report.aa.notes)
    assert "vanilla (A/A)" not in set(report.cells.method)  # a control, not a method row


def test_bold_needs_the_runner_up_in_the_same_file(tmp_path: Path):
    fast = [r for p in range(8) for r in (rec("vanilla", f"p{p}", 2.0), rec("fast", f"p{p}", 1.0))]
    slow = [r for p in range(8) for r in (rec("vanilla", f"p{p}", 2.0), rec("slow", f"p{p}", 1.6))]
    write(tmp_path / "a.jsonl", fast)
    write(tmp_path / "b.jsonl", slow)
    apart = build_report([tmp_path / "a.jsonl", tmp_path / "b.jsonl"], paper_numbers=None, reps=200)
    assert not any(c.bold for _, rows in apart.main.sections for row in rows for c in row)
    write(tmp_path / "c.jsonl", fast + [rec("slow", f"p{p}", 1.6) for p in range(8)])
    together = build_report(tmp_path / "c.jsonl", paper_numbers=None, reps=200)
    assert any(c.bold for _, rows in together.main.sections for row in rows for c in row)
    assert any(n.startswith("Resolution: a per-bench speedup interval spans ±") for n in together.main.notes)
    # no A/A side in these files: the resolution note says so instead of pointing to an aa_table that is not there
    assert any("hold no A/A side" in n for n in together.main.notes) and together.aa is None
    assert not any("aa_table" in n for n in together.main.notes)
    cell = together.main.sections[0][1][0][1].text  # fast on mt_bench: point, interval, n
    assert cell.startswith("2.00× [") and cell.endswith("(n=8)")


def test_the_mean_pools_the_mission_benches_only(tmp_path: Path):
    """A method that also ran CNN/DM (the copy claims' extra bench) keeps a Mean over the mission benches, so
    it compares with methods that did not; a method of the extra bench alone has no Mean, and the table says
    which benches stand outside it."""
    main = [r for p in range(8) for r in (rec("vanilla", f"p{p}", 2.0, bench="humaneval"),
                                          rec("a", f"p{p}", 1.0, bench="humaneval"),
                                          rec("b", f"p{p}", 1.25, bench="humaneval"))]
    copy = [r for p in range(8) for r in (rec("vanilla", f"c{p}", 2.0, bench="cnn_dailymail"),
                                          rec("a", f"c{p}", 0.25, bench="cnn_dailymail"),
                                          rec("c", f"c{p}", 0.5, bench="cnn_dailymail"))]
    write(tmp_path / "main.jsonl", main)
    write(tmp_path / "copy.jsonl", copy)
    report = build_report(tmp_path, paper_numbers=None, reps=200)
    data = report.main.data.set_index("method")
    assert data.at["a", "cnn_dailymail_spd"] == pytest.approx(8.0)  # the extra bench keeps its column
    assert data.at["a", "mean_spd"] == pytest.approx(2.0) and data.at["b", "mean_spd"] == pytest.approx(1.6)
    assert data.at["a", "mean_spd_lo"] <= 2.0 <= data.at["a", "mean_spd_hi"] < 8.0  # its interval: HumanEval only
    assert math.isnan(data.at["c", "mean_spd"]) and math.isnan(data.at["c", "mean_spd_lo"])
    mean_cell = {row[0].text: row[-6].text for _, rows in report.main.sections for row in rows}
    assert mean_cell["a"].endswith("(n=8)") and mean_cell["c"] == "—"
    assert ("Mean = over HumanEval only; CNN/DM stands outside it, so a method's Mean does not depend on whether it "
            "ran CNN/DM") in report.main.notes


def test_records_of_two_machines_are_split_one_machine_per_table(tmp_path: Path):
    """Files of two machines: every table holds one machine's files; the machine with the most files keeps the
    plain names, a kind both machines have takes the other's hardware as a suffix; nothing ranks across."""
    other = "Other CPU (2 threads)"
    fast = [r for p in range(8) for r in (rec("vanilla", f"p{p}", 2.0), rec("m", f"p{p}", 1.0))]
    write(tmp_path / "a.jsonl", fast)
    write(tmp_path / "a2.jsonl", [rec("vanilla", f"p{p}", 2.0, bench="humaneval") for p in range(8)]
          + [rec("m", f"p{p}", 1.0, bench="humaneval") for p in range(8)])
    write(tmp_path / "b.jsonl", [r for p in range(8) for r in (rec("vanilla", f"p{p}", 2.0),
                                                                rec("m2", f"p{p}", 0.5))], hardware=other)
    report = build_report(tmp_path, paper_numbers=None, reps=0)
    assert report.hardware == HW and [o.hardware for o in report.others] == [other]
    main, mains = report.main, [t for t in report.tables if t.name.startswith("main_table")]
    assert [t.name for t in mains] == ["main_table", "main_table_other-cpu-2-threads"]
    rows = {t.name: {row[0].text for _, rows in t.sections for row in rows} for t in mains}
    assert rows == {"main_table": {"m"}, "main_table_other-cpu-2-threads": {"m2"}}
    assert main.title.endswith(f"— {HW}") and mains[1].title.endswith(f"— {other}")
    assert all(HW in line and other not in line for line in main.provenance)
    assert all(other in line and HW not in line for line in mains[1].provenance)
    # m2 (0.5 s) is faster than m (1.0 s) but on another machine: never in one table, never bold against m
    assert not any(c.bold for _, rows in main.sections for row in rows for c in row)
    written = {p.name for p in write_report(tmp_path, tmp_path / "out", paper_numbers=None)}
    assert {"main_table.md", "main_table_other-cpu-2-threads.md"} <= written
    figures = {n for n in written if n.endswith(".png")}  # each machine's figures apart, by name
    assert figures and {n for n in figures if n.endswith("_other-cpu-2-threads.png")} == \
        {n.replace(".png", "_other-cpu-2-threads.png") for n in figures if "other-cpu" not in n}
    # one machine: plain names and titles, as before
    alone = build_report([tmp_path / "a.jsonl"], paper_numbers=None, reps=0)
    assert not alone.others and not alone.main.title.endswith(HW)


def test_a_merged_file_of_two_machines_is_refused_in_one_line(tmp_path: Path):
    """The one split that is impossible: a merged file whose parts ran on two machines (its records do not
    say which machine timed them)."""
    parts = [{"file": "r0.jsonl", "rank": 0, "hardware": HW}, {"file": "r1.jsonl", "rank": 1, "hardware": "Other"}]
    write(tmp_path / "merged.jsonl", [rec("vanilla", "p0", 1.0), rec("m", "p0", 0.5)], parts=parts)
    with pytest.raises(SpecbenchError) as err:
        build_report(tmp_path, paper_numbers=None, reps=0)
    msg = str(err.value)
    assert "\n" not in msg and "merged.jsonl" in msg and "2 machines" in msg and "cannot be split" in msg
    write(tmp_path / "merged.jsonl", [rec("vanilla", "p0", 1.0), rec("m", "p0", 0.5)], parts=parts[:1])
    assert build_report(tmp_path, paper_numbers=None, reps=0).hardware == HW  # parts of one machine: fine


def test_turns_under_load_are_flagged_and_dropped_for_retiming(tmp_path: Path):
    meta = {"threads": 2}
    assert not machine_load.flagged_turn(meta, [2.4, 0, 0])  # 0.4 CPU beyond the run's own two threads
    assert machine_load.flagged_turn(meta, [2.6, 0, 0])
    assert not machine_load.flagged_turn(meta, None)
    records = [rec("vanilla", "p0", 1.0, load=2.0), rec("m", "p0", 0.5, load=2.9),  # p0 turn 0: flagged (m)
               rec("vanilla", "p0", 1.0, turn=1, load=2.0), rec("m", "p0", 0.5, turn=1, load=2.1),
               rec("vanilla", "p1", 1.0, load=1.0), rec("m", "p1", 0.5, load=1.0)]
    path = write(tmp_path / "r.jsonl", records)
    report = build_report(path, paper_numbers=None, reps=0)
    assert any("‡" in c.text for _, rows in report.main.sections for row in rows for c in row)
    assert machine_load.drop_flagged(path) == [("mt_bench", "p0", 0)]
    left = read_result_file(path)
    assert [(r.method, r.prompt_id, r.turn) for r in left.records] == [
        ("vanilla", "p0", 1), ("m", "p0", 1), ("vanilla", "p1", 0), ("m", "p1", 0)]  # both sides of the turn went
    assert left.meta["hardware"] == HW and machine_load.drop_flagged(path) == []


def _curve_file(root: Path, chain: dict, tree: dict | None = None) -> None:
    root.mkdir(parents=True, exist_ok=True)
    data = {"hardware": HW, "target": "tiny", "prefix": 64,
            "curves": {"float32": {CHAIN: {str(k): v for k, v in chain.items()},
                                   TREE: {str(k): v for k, v in (tree or chain).items()}}}}
    curve_path(root, HW, "tiny").write_text(json.dumps(data))


def test_cost_curve_prices_the_verify_and_the_report_uses_it(tmp_path: Path):
    assert slug(HW) == "test-cpu-family-1-model-1-avx2-only-2-threads"
    _curve_file(tmp_path / "cost", {1: 0.010, 2: 0.012, 4: 0.016, 8: 0.030})
    curve = load_curve(tmp_path / "cost", HW, "float32", "tiny")
    assert curve.time(3) == pytest.approx(0.014) and curve.steps(8) == pytest.approx(3.0)
    assert math.isnan(curve.time(9)) and load_curve(tmp_path / "cost", "Other", "float32", "tiny") is None
    assert load_curve(tmp_path / "cost", HW, "float32", "other-target") is None  # a curve prices its own target only
    # method: 3 calls of a 3-node chain (4 rows), 2 tokens each; run's own target forwards say 0.05 s per call
    m = rec("m", "p0", 0.3, n=6, sizes=3, target_s=0.15, chains=3)
    v = rec("vanilla", "p0", 0.6, n=6, target_s=0.12)
    ideal, _, source = ideal_with_source([m], [v], curve)
    assert source == "curve" and ideal == pytest.approx(2 * 0.010 / 0.016)
    ideal_run, _, source_run = ideal_with_source([m], [v])
    assert source_run == "run" and ideal_run == pytest.approx(2 * 0.02 / 0.05)
    write(tmp_path / "r.jsonl", [v, m])
    report = build_report(tmp_path / "r.jsonl", paper_numbers=None, reps=0)
    assert report.cells.ideal_source.tolist() == ["curve"] and report.cost is not None


def test_sps_gamma_note_reads_the_curve(tmp_path: Path):
    def sps_file(name: str, chain: dict) -> Path:
        records = [rec("vanilla", "p0", 1.0, n=12, target_s=0.12)]
        for gamma, per_call in ((2, 0.0204), (4, 0.0147), (6, 0.0192)):  # the run's non-monotone verify steps
            calls = 12 // (gamma + 1) or 1
            records.append(rec(f"sps@gamma={gamma}", "p0", 1.0, n=12, sizes=gamma, target_s=per_call * 6,
                               chains=calls))
        return write(tmp_path / name, records, method_options={f"sps@gamma={g}": {"gamma": g} for g in (2, 4, 6)},
                     methods={f"sps@gamma={g}": {"method": "sps"} for g in (2, 4, 6)} | {"vanilla": {"method": "vanilla"}})

    monotone = CostCurve(HW, "float32", {CHAIN: {1: 0.01, 3: 0.012, 5: 0.014, 7: 0.016}})
    note = verify_cost_note([read_result_file(sps_file("m.jsonl", {}))], monotone)
    assert "γ=2: run 2.04" in note and "timing noise" in note
    bumpy = CostCurve(HW, "float32", {CHAIN: {1: 0.01, 3: 0.02, 5: 0.015, 7: 0.019}})
    note = verify_cost_note([read_result_file(sps_file("b.jsonl", {}))], bumpy)
    assert "not monotone here (3 rows cost more than 5)" in note
    # the cost table finds the note through its entry point (specbench.cost_notes), under the block's curve
    _curve_file(tmp_path / "cost", {1: 0.01, 3: 0.02, 5: 0.015, 7: 0.019})
    table = cost_table([read_result_file(tmp_path / "b.jsonl")])
    assert any("not monotone here (3 rows cost more than 5)" in n for n in table.notes)


def test_drafter_paths_are_written_relative_to_the_drafter_root(tmp_path: Path, monkeypatch):
    root = tmp_path / "elsewhere"
    folder = root / "tiny" / "sps"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    monkeypatch.setenv("SPECBENCH_DRAFTERS", str(root))
    source = drafter_paths.portable({"spec": str(folder), "repo_id": None, "sha": None, "path": str(folder)})
    assert source["path"] == "tiny/sps" and source["root"] == "drafters"
    assert drafter_paths.resolve(source) == root / "tiny" / "sps"
    # another clone: the same relative path under its own root
    clone = tmp_path / "clone"
    (clone / "tiny" / "sps").mkdir(parents=True)
    (clone / "tiny" / "sps" / "config.json").write_text("{}")
    monkeypatch.setenv("SPECBENCH_DRAFTERS", str(clone))
    assert drafter_paths.resolve(source) == clone / "tiny" / "sps"
    # hub downloads and folders outside the root stay as they are
    hubbed = {"spec": "org/x", "repo_id": "org/x", "path": str(folder)}
    assert drafter_paths.portable(hubbed) == hubbed
    outside = {"spec": str(tmp_path), "repo_id": None, "path": str(tmp_path)}
    assert drafter_paths.portable(outside) == outside


def test_a_run_with_an_aa_side_writes_portable_paths_and_divergences(models, tmp_path, capsys):
    from test_cli import base_args, cli

    out = tmp_path / "aa.jsonl"
    code, _, err = cli(base_args(models, out, "--also", "vanilla@label=vanilla (A/A)"), capsys)
    assert code == 0, err
    f = read_result_file(out)
    assert {r.method for r in f.records} == {"sps", "vanilla", "vanilla (A/A)"}
    assert all(r.divergence["status"] == "identical" for r in f.records if r.method != "vanilla")
    assert aa_frame([f]).side.tolist() == ["vanilla (A/A)"]
