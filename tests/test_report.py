"""Report: synthetic result files -> tables, figures and formats."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pandas as pd
import pytest

from specbench import metrics
from specbench.errors import SpecbenchError
from specbench.records import GenerationRecord
from specbench.analysis.report import (build_report, declared_paper_numbers, load_results, missing_reasons, rich_main_table,
                              rich_tables, speedup_ci, tau_ci, write_report)
from specbench.analysis.report.figures import block_figures, sweep_frame

META = {"target": "smollm2-135m", "dtype": "bf16", "device": "cpu", "hardware": "AMD EPYC 9B14 (2 threads)",
        "git_sha": "abc1234", "temperature": 0.0, "max_new_tokens": 64, "seed": 0, "config_hash": "h",
        "method": "sps", "method_options": {}, "bench": "humaneval"}


def drafted(method: str, bench: str, pid: str, accept: list[int], draft: float, verify: float, commit: float = 0.1,
            prefill: float = 0.1, tokens: list[int] | None = None, tree_build: float = 0.0) -> GenerationRecord:
    depth = max(accept) + 1
    n_new = 1 + sum(accept) + len(accept)  # prefill's token + (accepted + bonus) per call
    return GenerationRecord(
        method=method, bench=bench, prompt_id=pid, new_tokens=tokens or list(range(n_new)), prompt_tokens=20,
        stop_reason="length", times={"prefill": prefill, "draft": draft, "verify": verify, "commit": commit,
                                     "tree_build": tree_build},
        n_verify=len(accept), accept_lengths=accept, tree_sizes=[depth] * len(accept),
        depth_attempts=[sum(a >= k - 1 for a in accept) for k in range(1, depth + 1)],
        depth_accepts=[sum(a >= k for a in accept) for k in range(1, depth + 1)],
        forwards={"drafter": depth * len(accept)}, seed=0)


def vanilla(bench: str, pid: str, n_new: int, verify: float, prefill: float = 0.1, commit: float = 0.1):
    return GenerationRecord(method="vanilla", bench=bench, prompt_id=pid, new_tokens=list(range(n_new)),
                            prompt_tokens=20, stop_reason="length",
                            times={"prefill": prefill, "draft": 0.0, "verify": verify, "commit": commit},
                            n_verify=n_new - 1, accept_lengths=[0] * (n_new - 1), tree_sizes=[0] * (n_new - 1),
                            depth_attempts=[], depth_accepts=[], seed=0)


def write_jsonl(path: Path, records: list[GenerationRecord], torn: bool = False, **meta) -> Path:
    lines = [json.dumps({"type": "header", "meta": {**META, **meta}})]
    lines += [json.dumps({"type": "record", **r.to_dict()}) for r in records]
    text = "\n".join(lines) + "\n"
    if torn:
        text += json.dumps({"type": "record", **records[0].to_dict()})[:57]  # interrupted mid-write
    path.write_text(text)
    return path


BENCHES = ("humaneval", "math500", "mt_bench")


def method_records(method: str, benches=BENCHES, quality: int = 2, draft: float = 0.2, prompts: int = 3):
    """Deterministic but prompt-varying records so intervals have width."""
    out = []
    for bench in benches:
        for i in range(prompts):
            accept = [quality, quality - 1 + i % 2, quality + 1, i % 3]
            out.append(drafted(method, bench, f"p{i}", accept, draft=draft + 0.01 * i, verify=0.5 + 0.05 * i,
                               tree_build=draft / 4))
    return out


def vanilla_records(benches=BENCHES, prompts: int = 3, n_new: int = 14):
    return [vanilla(b, f"p{i}", n_new + 1 + 2 * (i % 2), verify=1.2 + 0.1 * i) for b in benches for i in range(prompts)]


@pytest.fixture
def simple(tmp_path: Path) -> Path:
    """sps and specblock (not on math500) against vanilla, three benches, one file."""
    records = vanilla_records() + method_records("sps", quality=1, draft=0.3) + \
        method_records("specblock", benches=("humaneval", "mt_bench"), quality=3, draft=0.1)
    (tmp_path / "results").mkdir()
    write_jsonl(tmp_path / "results" / "a.jsonl", records)
    return tmp_path / "results"


@pytest.fixture
def full(simple: Path) -> Path:
    """Adds a specblock variant family and a ddtree budget sweep in a second file of the same block."""
    records = vanilla_records() + method_records("specblock-no-shift", benches=("humaneval", "mt_bench"), quality=2,
                                                 draft=0.1)
    for budget, quality in ((16, 2), (32, 3), (64, 4)):
        records += method_records(f"ddtree@budget={budget}", quality=quality, draft=0.1 * quality)
    write_jsonl(simple / "b.jsonl", records, method="ddtree", sweep="budget=16,32,64")  # the header declares the sweep
    return simple


def test_main_table_values_equal_hand_computed(tmp_path: Path):
    # method: 10 tokens in 0.1 + 0.2 + 0.6 + 0.2 = 1.1 s; vanilla: 10 tokens in 0.1 + 2.0 + 0.1 = 2.2 s -> 2.00x.
    # tau = (2 + 2 + 1 + 3 bonus) / 3 calls = 2.67; T_D = 0.2 / (0.2 + 0.6 + 0.2) = 20%.
    m = drafted("sps", "humaneval", "p0", [2, 2, 1], draft=0.2, verify=0.6, commit=0.2)
    assert m.num_new == 9
    m.new_tokens.append(9)  # 10 tokens
    v = vanilla("humaneval", "p0", 10, verify=2.0)
    src = write_jsonl(tmp_path / "one.jsonl", [v, m])
    out = tmp_path / "out"
    write_report(src, out, figures=False)
    md = (out / "main_table.md").read_text()
    # Every speedup shows its n; no forward times -> no cost model; the text equals vanilla's -> 100% (1 turn).
    # One conversation: its bootstrap interval is the point itself.
    assert ("| sps | 2.00× [2.00, 2.00] (n=1) | 2.67 [2.67, 2.67] | 2.00× [2.00, 2.00] (n=1) | 2.67 [2.67, 2.67] "
            "| — | — | 20% | 100% (1) |") in md
    row = pd.read_csv(out / "main_table.csv", comment="#").iloc[0]
    assert row.humaneval_spd == pytest.approx(2.0) and row.humaneval_tau == pytest.approx(8 / 3, abs=1e-4)
    assert row.td_percent == pytest.approx(20.0)
    assert row.humaneval_spd == pytest.approx(metrics.speedup([m], [v]), abs=1e-4)


def test_missing_cell_renders_dash_with_reason(simple: Path, tmp_path: Path):
    assert missing_reasons(build_report(simple, reps=0).cells) == {
        ("smollm2-135m", 0.0, "specblock", "math500"): "not run on math500"}
    write_report(simple, tmp_path / "out", figures=False)
    md = (tmp_path / "out" / "main_table.md").read_text()
    specblock_row = next(line for line in md.splitlines() if line.startswith("| specblock |"))
    assert specblock_row.split(" | ")[3:5] == ["—", "—"]  # math500 Spd, tau
    assert "specblock × math500 (smollm2-135m · T = 0): not run on math500" in md


def test_bold_only_where_the_interval_excludes_the_runner_up(simple: Path, tmp_path: Path):
    # Three prompts per bench pair too few turns for a bench column to count; pooled over its two benches
    # (six turns) specblock's Mean is clearly above sps'.
    rows = {row[0].text: row for row in build_report(simple).main.sections[0][1]}
    assert not any(c.bold for row in rows.values() for c in row[1:7])
    assert rows["specblock"][7].bold and not rows["sps"][7].bold
    # A clear winner over eight prompts (specblock: twice sps' acceptance, prompt-varying times) is bold,
    # in its bench column and in Mean; the runner-up is not.
    records = vanilla_records(benches=("humaneval",), prompts=8) + \
        method_records("sps", benches=("humaneval",), quality=1, draft=0.3, prompts=8) + \
        method_records("specblock", benches=("humaneval",), quality=3, draft=0.1, prompts=8)
    src = write_jsonl(tmp_path / "clear.jsonl", records)
    rows = {row[0].text: row for row in build_report(src).main.sections[0][1]}
    assert rows["specblock"][1].bold and rows["specblock"][3].bold
    assert not rows["sps"][1].bold and not rows["sps"][3].bold
    write_report(src, tmp_path / "out", figures=False)
    assert "**" in (tmp_path / "out" / "main_table.md").read_text()
    assert r"\textbf{" in (tmp_path / "out" / "main_table.tex").read_text()


def test_no_ablation_table_without_variants(simple: Path, tmp_path: Path):
    assert build_report(simple, reps=0).ablation is None
    assert not (tmp_path / "out" / "ablation_table.md").exists()
    assert not any("ablation" in p.name for p in write_report(simple, tmp_path / "out", figures=False))


def test_ablation_table_with_two_variants(full: Path):
    report = build_report(full, reps=0)
    assert [label for label, _ in report.ablation.sections] == ["smollm2-135m · T = 0 · specblock"]
    assert [row[0].text for row in report.ablation.sections[0][1]] == ["specblock", "specblock-no-shift"]
    data = report.ablation.data.set_index("method")
    assert data.at["specblock", "delta_spd"] == 0
    assert data.at["specblock-no-shift", "delta_tau"] == pytest.approx(
        data.at["specblock-no-shift", "mean_tau"] - data.at["specblock", "mean_tau"])


def test_budget_figure_only_with_sweep(simple: Path):
    report = build_report(simple, reps=0)
    assert set(block_figures(report, ("smollm2-135m", 0.0))) == {"acceptance_rates", "accept_length_hist",
                                                                 "stage_breakdown", "speedup_vs_td"}


def test_budget_figure_with_sweep(full: Path):
    report = build_report(full, reps=0)
    assert "budget_sweep" in block_figures(report, ("smollm2-135m", 0.0))
    sweep = sweep_frame(report.cells, ("smollm2-135m", 0.0), report.sides[("smollm2-135m", 0.0)])
    mean = sweep[sweep.bench == "mean"]
    assert list(mean.budget) == [16, 32, 64] and mean.tau.is_monotonic_increasing


def test_all_formats_written_and_deterministic(full: Path, tmp_path: Path):
    first = write_report(str(full / "*.jsonl"), tmp_path / "one")
    second = write_report([full / "a.jsonl", full / "b.jsonl"], tmp_path / "two")
    names = {p.relative_to(tmp_path / "one").as_posix() for p in first}
    for table in ("main_table", "companion_table", "ablation_table", "paper_comparison"):
        assert {f"{table}.md", f"{table}.tex", f"{table}.csv"} <= names
    for kind in ("acceptance_rates", "accept_length_hist", "stage_breakdown", "speedup_vs_td", "budget_sweep"):
        assert {f"figures/{kind}_smollm2-135m_T0.png", f"figures/{kind}_smollm2-135m_T0.pdf"} <= names
    assert "index.html" in names
    tex = (tmp_path / "one" / "main_table.tex").read_text()
    assert all(rule in tex for rule in (r"\toprule", r"\midrule", r"\bottomrule"))
    page = (tmp_path / "one" / "index.html").read_text()
    assert page.count('<img alt="') == 5 and "<style>" in page and "Ablations" in page  # the PNGs beside the page
    for a, b in zip(first, second):  # byte-identical, figures included
        assert a.name == b.name and a.read_bytes() == b.read_bytes(), a.name
    companion = pd.read_csv(tmp_path / "one" / "companion_table.csv", comment="#")
    assert {"speedup_lo", "speedup_hi", "tau_lo", "tau_hi"} <= set(companion.columns)


def test_provenance_on_every_table(full: Path, tmp_path: Path):
    write_report(full, tmp_path / "out", figures=False)
    for path in (tmp_path / "out").glob("*_table.*"):
        text = path.read_text()
        for needle in ("a.jsonl, b.jsonl", "humaneval 3, math500 3, mt_bench 3", "AMD EPYC 9B14 (2 threads)",
                       "seed 0", "git abc1234"):
            assert needle in text.replace(r"\_", "_"), (path.name, needle)


def test_provenance_names_the_node_budget(tmp_path: Path):
    from specbench.analysis.report.records import load_result_files
    from specbench.analysis.report.tables import provenance_lines

    path = write_jsonl(tmp_path / "b.jsonl", vanilla_records() + method_records("sps"), budget=16)
    assert "node budget 16; git abc1234" in provenance_lines(load_result_files(path))[0]
    plain = write_jsonl(tmp_path / "p.jsonl", vanilla_records() + method_records("sps"))
    assert "node budget" not in provenance_lines(load_result_files(plain))[0]  # only --budget runs name one


def test_torn_last_line_tolerated(tmp_path: Path):
    records = vanilla_records() + method_records("sps")
    path = write_jsonl(tmp_path / "torn.jsonl", records, torn=True)
    loaded, metas = load_results(path)
    assert len(loaded) == len(records) and metas == {str(path): META}
    assert build_report(path, reps=0).main.sections


def test_bootstrap_ci_contains_point_and_is_deterministic(simple: Path):
    cells = build_report(simple).cells
    again = build_report(simple).cells
    pd.testing.assert_frame_equal(cells, again)
    ran = cells[cells.n_prompts > 0]
    assert (ran.speedup_lo <= ran.speedup).all() and (ran.speedup <= ran.speedup_hi).all()
    assert (ran.tau_lo <= ran.tau).all() and (ran.tau <= ran.tau_hi).all()
    assert (ran.speedup_hi > ran.speedup_lo).all()


def test_bootstrap_sums_agree_with_metrics():
    # One prompt: every resample is the sample itself, so the interval collapses onto metrics' value.
    ours = method_records("sps", benches=("humaneval",), prompts=1)
    base = vanilla_records(benches=("humaneval",), prompts=1)
    lo, hi = speedup_ci(ours, base)
    assert lo == pytest.approx(metrics.speedup(ours, base)) and hi == pytest.approx(lo)
    lo, hi = tau_ci(ours)
    assert lo == pytest.approx(metrics.tau(ours)) and hi == pytest.approx(lo)


def test_speedup_uses_each_files_own_vanilla(tmp_path: Path):
    # Same prompt ids in two files; file b's vanilla is twice as slow, so its method must look 2x faster.
    m = method_records("sps", benches=("humaneval",))
    write_jsonl(tmp_path / "a.jsonl", vanilla_records(benches=("humaneval",)) + m)
    slow = [vanilla(r.bench, r.prompt_id, r.num_new, verify=2 * r.times["verify"], prefill=0.2, commit=0.2)
            for r in vanilla_records(benches=("humaneval",))]
    other = [GenerationRecord.from_dict({**r.to_dict(), "method": "sps-slowbase"}) for r in m]
    write_jsonl(tmp_path / "b.jsonl", slow + other)
    cells = build_report(tmp_path, reps=0).cells.set_index("method")
    base_a = vanilla_records(benches=("humaneval",))
    assert cells.at["sps", "speedup"] == pytest.approx(metrics.speedup(m, base_a))
    assert cells.at["sps-slowbase", "speedup"] == pytest.approx(2 * cells.at["sps", "speedup"])


def test_paper_numbers_csv_parses():
    shipped, = declared_paper_numbers()  # methods/paper_numbers.csv, declared by the methods package
    with shipped.open(newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["paper", "table", "model", "hardware", "temperature", "bench", "method", "speedup",
                             "tau", "td_percent", "notes", "specbench_method"]
    assert {r["paper"] for r in rows} == {"SpecBlock", "DDTree", "PACER", "DVI"}
    for r in rows:
        for col in ("speedup", "tau", "td_percent", "temperature"):
            assert r[col] == "" or math.isfinite(float(r[col])), r
    key = {(r["paper"], r["table"], r["model"], r["temperature"], r["bench"], r["method"]): r for r in rows}
    sb = key[("SpecBlock", "1", "Llama-3.1-8B", "0", "Mean", "SpecBlock")]
    assert (sb["speedup"], sb["tau"], sb["td_percent"]) == ("3.21", "4.41", "16")
    dd = key[("DDTree", "1", "Qwen3-8B", "0.0", "MATH-500", "DFlash+DDTree")]
    assert (dd["speedup"], dd["tau"]) == ("7.52", "10.73")
    pacer = key[("PACER", "5", "DeepSeek-Coder 1.3B/33B", "", "HumanEval", "PACER")]
    assert (pacer["speedup"], pacer["tau"]) == ("2.31", "9.67")
    dvi = key[("DVI", "2", "Vicuna-7B", "0", "Avg.", "DVI")]
    assert dvi["speedup"] == "2.16"


def test_paper_comparison_side_by_side(simple: Path, tmp_path: Path):
    write_report(simple, tmp_path / "out", figures=False)
    md = (tmp_path / "out" / "paper_comparison.md").read_text()
    assert "smollm2-135m · T = 0 on AMD EPYC 9B14 (2 threads)" in md
    assert "| specblock | humaneval |" in md and "Llama-3.1-8B" in md and "3.92×" in md  # SpecBlock Table 1
    assert "| sps | mt_bench |" in md and "Models and hardware differ" in md
    data = pd.read_csv(tmp_path / "out" / "paper_comparison.csv", comment="#")
    assert {"SpecBlock", "DVI"} <= set(data.paper)
    assert data.paper_temperature.isna().sum() == (data.paper == "PACER").sum()  # PACER states no temperature
    assert (data.paper_temperature.dropna() == 0).all()  # never the T = 1 rows


def test_mixed_stream_has_its_own_table_and_never_enters_a_benchmark_mean(full: Path, tmp_path: Path):
    # specblock ran the benches and, much slower, a mixed stream; dvi only the stream.
    stream = vanilla_records(benches=("mixed",), prompts=4) + \
        method_records("specblock", benches=("mixed",), quality=0, draft=0.9, prompts=4) + \
        method_records("dvi", benches=("mixed",), quality=1, draft=0.5, prompts=4)
    write_jsonl(full / "c.jsonl", stream, method="dvi", bench="mixed")
    records, _ = load_results(full)
    report = build_report(full, reps=0)

    main = report.main.data.set_index("method")
    assert "dvi" not in main.index and "mixed_spd" not in main.columns
    # Mean = the mean over the two benches specblock ran; its slow stream run does not pull it down.
    assert main.at["specblock", "mean_spd"] == pytest.approx(
        (main.at["specblock", "humaneval_spd"] + main.at["specblock", "mt_bench_spd"]) / 2)
    bench_specblock = [r for r in records if r.method == "specblock" and r.bench != "mixed"]
    assert main.at["specblock", "td_percent"] == pytest.approx(100 * metrics.draft_share(bench_specblock))

    streams = report.streams.data.set_index("method")
    assert sorted(streams.index) == ["dvi", "specblock"] and "humaneval_spd" not in streams.columns
    stream_specblock = [r for r in records if r.method == "specblock" and r.bench == "mixed"]
    assert streams.at["specblock", "mean_spd"] == pytest.approx(streams.at["specblock", "mixed_spd"])
    assert streams.at["specblock", "td_percent"] == pytest.approx(100 * metrics.draft_share(stream_specblock))
    assert streams.at["specblock", "mixed_spd"] < main.at["specblock", "mean_spd"]

    # The ablation table compares a base with its ablations on the benches the ablations ran only.
    ablation = report.ablation.data.set_index("method")
    assert "mixed_spd" not in ablation.columns
    assert ablation.at["specblock", "mean_spd"] == pytest.approx(main.at["specblock", "mean_spd"])

    assert [str(t.title) for t in rich_tables(report)] == [report.main.title, report.streams.title]
    only_stream = build_report(full / "c.jsonl", reps=0)
    assert not only_stream.main.sections and [str(t.title) for t in rich_tables(only_stream)] == [report.streams.title]
    written = {p.name for p in write_report(full, tmp_path / "out", figures=False)}
    assert {"main_table.md", "streams_table.md", "streams_table.csv", "streams_table.tex"} <= written


def test_no_streams_table_without_a_stream(simple: Path):
    report = build_report(simple, reps=0)
    assert report.streams is None and len(rich_tables(report)) == 1


def test_rich_main_table(simple: Path):
    table = rich_main_table(simple)
    assert table.row_count == 3 and len(table.columns) == 13  # Method, 3 × (Spd, τ), Mean Spd τ Ideal Eff., T_D%, Greedy


def test_no_result_files_is_a_user_error(tmp_path: Path):
    with pytest.raises(SpecbenchError, match=r"no result files matched .*; run `specbench run \.\.\.` first"):
        write_report(str(tmp_path / "results" / "*.jsonl"), tmp_path / "out")


def test_method_without_vanilla_keeps_tau_and_says_why(tmp_path: Path):
    path = write_jsonl(tmp_path / "no_base.jsonl", method_records("sps", benches=("humaneval",)))
    cell = build_report(path, reps=0).cells.iloc[0]
    assert math.isnan(cell.speedup) and cell.tau > 1
    assert cell.reason == "no vanilla baseline for humaneval in the same file"


def test_ablations_group_variants_at_the_same_budget_and_sweeps_stay_apart():
    # Files without the header's `methods` field: each side's class is found through the registry, each side's
    # budget through the run's recorded --also specs (every label here is the spec that made it).
    from specbench.analysis.report import ablation_groups, side_infos
    labels = ["vanilla", "specblock@budget=16", "specblock-no-shift@budget=16", "eagle3@budget=16", "eagle3@budget=60",
              "specblock", "specblock-uniform-tree", "specblock-adapt", "sps", "sps-confidence"]
    assert ablation_groups(side_infos({"also": labels}, labels)) == {
        "specblock": ["specblock", "specblock-uniform-tree"],
        "specblock@budget=16": ["specblock@budget=16", "specblock-no-shift@budget=16"]}


SHORT, LONG = {"epochs": 1, "max_steps": 400}, {"epochs": 2, "max_steps": None}  # two drafter recipes


def test_ablations_group_by_how_their_drafters_trained_never_by_their_labels():
    """Each label's suffix says the opposite of how its drafter trained: the header's drafter_recipes group the
    sides (a stem would pair 'specblock (short)' with 'specblock-no-shift (short)')."""
    from specbench.analysis.report import ablation_groups, side_infos
    sides = {"specblock (short)": ("specblock", SHORT), "specblock (long)": ("specblock", LONG),
             "specblock-no-shift (short)": ("specblock-no-shift", LONG),
             "specblock-no-broadcast (long)": ("specblock-no-broadcast", SHORT)}
    meta = {"side_specs": [{"method": m, "options": {}, "name": label, "shown": []} for label, (m, _) in sides.items()],
            "drafter_recipes": {label: {"path": recipe} for label, (_, recipe) in sides.items()},
            "method_options": {label: {"path": "", "budget": 16} for label in sides}}
    infos = side_infos(meta, list(sides))
    assert infos["specblock (short)"].trained == (("path", "400 steps"),)
    assert infos["specblock-no-shift (short)"].trained == (("path", "2 epochs"),)
    assert ablation_groups(infos) == {"specblock (long)": ["specblock (long)", "specblock-no-shift (short)"],
                                      "specblock (short)": ["specblock (short)", "specblock-no-broadcast (long)"]}
    # The node budget a side ran with splits a group too; a group without a base side is named by its key.
    meta["method_options"]["specblock-no-shift (short)"]["budget"] = 32
    assert ablation_groups(side_infos(meta, list(sides))) == {
        "specblock (short)": ["specblock (short)", "specblock-no-broadcast (long)"],
        "specblock@budget=32 (2 epochs)": ["specblock-no-shift (short)"]}


def test_ablations_of_an_older_header_read_the_recipe_of_their_drafter_folders(tmp_path: Path, monkeypatch):
    """A header written before drafter_recipes: the recipe of the folder its weights name (or, without weights,
    its method_options path names); with neither, sides group by method and options alone."""
    from specbench.analysis.report import ablation_groups, side_infos
    monkeypatch.setenv("SPECBENCH_DRAFTERS", str(tmp_path))
    for name, recipe in (("short", SHORT), ("long", LONG)):
        (tmp_path / "tiny" / name).mkdir(parents=True)
        (tmp_path / "tiny" / name / "config.json").write_text(
            json.dumps({"method": "specblock", "recipe": {**recipe, "extra": {"variant": name}}}))

    def source(name: str) -> dict:
        return {"path": {"spec": f"tiny/{name}", "path": f"tiny/{name}", "root": "drafters", "sha": None}}

    meta = {"method": "specblock", "label": "specblock (a)",
            "also": ["specblock-no-shift@label=specblock-no-shift (a)", "specblock@label=specblock (b)",
                     "specblock-no-broadcast@label=specblock-no-broadcast (b)"],
            "weights": {"drafters": {"specblock (a)": source("short"), "specblock-no-shift (a)": source("long"),
                                     "specblock (b)": source("long")}},
            "method_options": {"specblock-no-broadcast (b)": {"path": str(tmp_path / "tiny" / "short")}}}
    labels = ["specblock (a)", "specblock-no-shift (a)", "specblock (b)", "specblock-no-broadcast (b)"]
    assert ablation_groups(side_infos(meta, labels)) == {
        "specblock (a)": ["specblock (a)", "specblock-no-broadcast (b)"],
        "specblock (b)": ["specblock (b)", "specblock-no-shift (a)"]}
    for key in ("weights", "method_options"):
        del meta[key]
    infos = side_infos(meta, labels)
    assert {info.trained for info in infos.values()} == {()}
    assert ablation_groups(infos) == {"specblock (a)": ["specblock (a)", "specblock (b)", "specblock-no-broadcast (b)",
                                                        "specblock-no-shift (a)"]}


def test_rank_head_table_from_confusion_counts(tmp_path: Path):
    base = [vanilla("humaneval", f"p{i}", 9, verify=1.0) for i in range(2)]
    ours = []
    for i, conf in enumerate(([[6, 2, 0, 0], [1, 3, 0, 0], [0, 0, 0, 0], [0, 0, 1, 1]],
                              [[2, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]])):
        r = drafted("specblock", "humaneval", f"p{i}", [1, 2, 1], draft=0.2, verify=0.5)
        r.extra = {"rank_confusion": conf, "rank_predicted": [0, 0, 0, 0]}
        ours.append(r)
    write_jsonl(tmp_path / "r.jsonl", base + ours)
    table = build_report(tmp_path / "r.jsonl", reps=0).table("rank_head_table")  # methods/specblock/report.py
    data = table.data.set_index("bucket")
    assert data.loc[0, "positions"] == 10 and math.isclose(data.loc[0, "precision"], 8 / 9)
    assert math.isclose(data.loc[0, "recall"], 8 / 10) and math.isclose(data.loc[1, "recall"], 3 / 4)
    assert math.isclose(data.frequency.sum(), 1.0) and math.isnan(data.loc[2, "recall"])


def test_pacer_gamma_table_shares_over_the_lengths_chosen(tmp_path: Path):
    base = [vanilla("humaneval", f"p{i}", 9, verify=1.0) for i in range(2)]
    ours = []
    for i, hist in enumerate(({"4": 150, "8": 40}, {"4": 9, "12": 0, "48": 1})):
        r = drafted("pacer", "humaneval", f"p{i}", [1, 2, 1], draft=0.2, verify=0.5)
        r.extra = {"gamma_hist": hist, "mean_gamma": 0.0}
        ours.append(r)
    write_jsonl(tmp_path / "r.jsonl", base + ours)
    table = build_report(tmp_path / "r.jsonl", reps=0).table("pacer_gamma_table")  # methods/pacer/report.py
    data = table.data.set_index("gamma")
    assert list(data.index) == [4, 8, 48] and data.calls.tolist() == [159, 40, 1]
    assert math.isclose(data.share.sum(), 1.0)
    row = table.sections[0][1][0]
    assert [c.text for c in row[1:4]] == ["200", f"{(4 * 159 + 8 * 40 + 48) / 200:.2f}", "3 / 2"]
    assert row[4].text == "4: 79.5%, 8: 20.0%, 48: 0.5%"  # 0.5% is still listed
    assert build_report(write_jsonl(tmp_path / "none.jsonl", base), reps=0).table("pacer_gamma_table") is None


def _ddtree_files(tmp_path: Path, fa2_verify: float, fa2_label: str = "dflash-fa2") -> list[Path]:
    """ddtree-table1's two runs of one bench: SDPA (vanilla, dflash) and flash-attention-2 (vanilla, dflash-fa2),
    the flash-attention-2 DFlash taking ``fa2_verify`` s of verify per prompt against SDPA's 1.0 s."""
    sdpa = [r for p in range(4) for r in (vanilla("humaneval", f"p{p}", 21, 4.0),
                                           drafted("dflash", "humaneval", f"p{p}", [3] * 5, 0.5, 1.0))]
    fa2 = [r for p in range(4) for r in (vanilla("humaneval", f"p{p}", 21, 4.0),
                                          drafted(fa2_label, "humaneval", f"p{p}", [3] * 5, 0.5, fa2_verify))]
    meta = dict(preset="ddtree-table1", method="dflash")
    return [write_jsonl(tmp_path / "ddtree-table1_humaneval_t_T0.jsonl", sdpa, label="dflash", **meta),
            write_jsonl(tmp_path / "ddtree-table1_humaneval_t_T0_flash_attention_2.jsonl", fa2, label=fa2_label,
                        attn_implementation="flash_attention_2", **meta)]


def test_a_side_under_another_attention_is_found_by_its_header_not_its_label(tmp_path: Path):
    """The flash-attention-2 side is DFlash with the SDPA side's options, whatever its label says."""
    from specbench.analysis.report.papers import paper_metric_cells
    from specbench.analysis.report.records import load_result_files

    cells = paper_metric_cells(load_result_files(_ddtree_files(tmp_path, 0.4, fa2_label="dflash on flash")))
    assert list(cells.method) == ["dflash"] and cells.side.iloc[0] == "dflash on flash"
    assert cells.other_sides.iloc[0].startswith("dflash ")


@pytest.mark.parametrize("fa2_verify, faster", [(0.4, "dflash-fa2"), (1.6, "dflash")])
def test_ddtree_dflash_row_is_the_faster_attention(tmp_path: Path, fa2_verify: float, faster: str):
    """ddtree-table1 runs DFlash under SDPA and flash-attention-2; the paper reports the faster, so the paper
    metric and the paper comparison hold one DFlash row per bench: the faster side's, named in a note."""
    from specbench.analysis.report.papers import paper_metric_cells
    from specbench.analysis.report.records import load_result_files

    paths = _ddtree_files(tmp_path, fa2_verify)
    cells = paper_metric_cells(load_result_files(paths))
    assert list(cells.method) == ["dflash"] and cells.side.iloc[0] == faster
    slow = "dflash" if faster == "dflash-fa2" else "dflash-fa2"
    assert cells.other_sides.iloc[0].startswith(f"{slow} ")
    report = build_report(paths, reps=0)
    assert any(f"the {faster} side" in n for n in report.paper_metric.notes)
    assert report.paper_metric.sections[0][1][0][1].text == ("dflash" if faster == "dflash" else "dflash (dflash-fa2)")
    ours = report.papers.data.drop_duplicates(["method", "bench"])
    assert list(ours.method) == [faster]  # one DFlash row, the faster side's
    assert any(n.startswith(f"dflash × humaneval: the faster attention implementation is the {faster} side")
               for n in report.papers.notes)


def test_one_target_in_two_dtypes_on_one_machine_gets_two_sections_never_pooled(tmp_path):
    """bf16 and fp32 runs of the same target on the same machine are two settings: each dtype its own section."""
    write_jsonl(tmp_path / "fp32.jsonl", method_records("sps") + vanilla_records(), dtype="float32")
    write_jsonl(tmp_path / "bf16.jsonl", method_records("sps", quality=3) + vanilla_records(), dtype="bf16")
    report = build_report(tmp_path, reps=0)
    assert [label for label, _ in report.main.sections] == ["smollm2-135m · bfloat16 · T = 0",
                                                            "smollm2-135m · float32 · T = 0"]
    sps = report.cells[report.cells.method == "sps"].groupby("target")["tau"].mean()
    assert sps["smollm2-135m · bfloat16"] > sps["smollm2-135m · float32"]  # each section holds its own records
    # One dtype per target: the plain label, as before
    (tmp_path / "bf16.jsonl").unlink()
    assert [label for label, _ in build_report(tmp_path, reps=0).main.sections] == ["smollm2-135m · T = 0"]


def test_the_engine_table_pairs_each_methods_speedup_in_both_engines(tmp_path):
    """Compiled-engine files are a setting of their own (never pooled with eager ones), and the engine table
    sets each method's speedup in the two engines side by side with a verdict per engine."""
    write_jsonl(tmp_path / "eager.jsonl", method_records("sps", draft=0.05) + vanilla_records(), dtype="float32")
    # the compiled engine's vanilla is faster: the same drafter no longer pays
    fast = [r for r in vanilla_records()]
    for r in fast:
        r.times = {k: v / 4 for k, v in r.times.items()}
    write_jsonl(tmp_path / "compiled.jsonl", method_records("sps", draft=0.05) + fast, dtype="float32",
                engine="compiled")
    report = build_report(tmp_path, reps=200)
    assert [label for label, _ in report.main.sections] == ["smollm2-135m · T = 0",
                                                            "smollm2-135m · compiled engine · T = 0"]
    table = report.engines
    assert table is not None and [label for label, _ in table.sections] == ["smollm2-135m · T = 0"]
    data = table.data.set_index("bench")
    assert (data.speedup_eager > data.speedup_compiled).all()
    rows = table.sections[0][1]
    assert {row[7].text for row in rows} == {"faster"} and {row[8].text for row in rows} == {"slower"}
    assert "verdicts that change with the engine: sps × " in " ".join(table.notes)
    # without a compiled file there is no engine table
    (tmp_path / "compiled.jsonl").unlink()
    assert build_report(tmp_path, reps=0).engines is None


def test_divergence_table_sets_each_flips_gap_beside_the_noise(tmp_path: Path):
    """Per method side: counts by status, the largest logit disagreement where the texts agree, the largest
    gap m + v at a flip and the smallest tolerance given there (a later turn's inherited status has none)."""
    from specbench.analysis.report.checks import divergence_frame, divergence_table
    from specbench.analysis.report.records import load_result_files
    from specbench.analysis.report.render import render_markdown

    flips = [dict(status="near-tie", method_margin=0.0625, vanilla_margin=0.0625, tolerance=2.5, noise=0.25,
                  noise_roundings=12.0),
             dict(status="near-tie", method_margin=0.125, vanilla_margin=0.25, tolerance=0.9, noise=0.125,
                  noise_roundings=40.0),
             dict(status="identical", noise=0.375, noise_roundings=3.0),
             dict(status="near-tie", after_turn=0)]
    records = vanilla_records(benches=("humaneval",), prompts=4)
    for r, d in zip(method_records("sps", benches=("humaneval",), prompts=4), flips):
        r.divergence = d
        records.append(r)
    write_jsonl(tmp_path / "d.jsonl", records, dtype="bfloat16", temperature=0.0)
    files = load_result_files(tmp_path)
    row = divergence_frame(files).iloc[0]
    assert (row.turns, row.identical, row.near_tie, row.unexplained) == (4, 1, 3, 0)
    assert row.noise == 0.375 and row.noise_roundings == 40.0
    assert row.gap_max == 0.375 and row.tolerance_min == 0.9
    assert "| 0.375 | 0.375 | 0.9 |" in render_markdown(divergence_table(files))


def test_divergence_table_counts_both_rules_and_where_they_disagree(tmp_path: Path):
    """bf16 flips judged by the exact rule count under both rules (the bound's verdict kept as old_status); a
    flip written before the rule existed counts under the bound and as not re-scored; fp32 has no exact column."""
    from specbench.analysis.report.checks import divergence_frame, divergence_table
    from specbench.analysis.report.records import load_result_files
    from specbench.analysis.report.render import render_markdown

    flips = [dict(status="near-tie", rule="exact", old_status="near-tie", position_noise=0.125),
             dict(status="unexplained", rule="exact", old_status="near-tie", position_noise=0.25),
             dict(status="unexplained", after_turn=1, rule="exact", old_status="near-tie"),
             dict(status="near-tie", method_margin=0.0625, vanilla_margin=0.0625, tolerance=2.5),
             dict(status="identical", noise=0.375)]
    for dtype in ("bfloat16", "float32"):
        records = vanilla_records(benches=("humaneval",), prompts=5)
        for r, d in zip(method_records("sps", benches=("humaneval",), prompts=5), flips):
            r.divergence = d
            records.append(r)
        (tmp_path / dtype).mkdir()
        write_jsonl(tmp_path / dtype / "d.jsonl", records, dtype=dtype, temperature=0.0)
    bf16 = load_result_files(tmp_path / "bfloat16")
    row = divergence_frame(bf16).iloc[0]
    assert (row.near_tie, row.unexplained) == (2, 2)  # each status as the rule that set it says
    assert (row.old_near_tie, row.old_unexplained, row.exact_near_tie, row.exact_unexplained) == (4, 0, 1, 2)
    assert (row.disagree, row.not_rescored, row.position_noise_max) == (2, 1, 0.25)
    assert "| 4/0 | **1/2 +1** | 0.25 | **2** |" in render_markdown(divergence_table(bf16))
    fp32 = render_markdown(divergence_table(load_result_files(tmp_path / "float32")))
    assert "| 4/0 | — | — | — |" in fp32


def test_divergence_table_says_which_files_were_rescored_on_another_machine(tmp_path: Path):
    """recheck stamps each verdict with the machine whose noise it measured; a file re-scored elsewhere than it ran
    is named in a note (its N is another machine's kernels), one re-scored where it ran is not."""
    from specbench.analysis.report.checks import divergence_table
    from specbench.analysis.report.records import load_result_files

    for name, where in (("here.jsonl", "Xeon (2 threads)"), ("elsewhere.jsonl", "EPYC (2 threads)")):
        records = vanilla_records(benches=("humaneval",), prompts=1)
        (r,) = method_records("sps", benches=("humaneval",), prompts=1)
        r.divergence = dict(status="near-tie", rule="exact", old_status="near-tie", position_noise=0.25,
                            rescored_on=where)
        write_jsonl(tmp_path / name, [*records, r], dtype="bfloat16", temperature=0.0, hardware="Xeon (2 threads)")
    notes = divergence_table(load_result_files(tmp_path)).notes
    (note,) = [n for n in notes if "re-scored on" in n]
    assert note.startswith("elsewhere.jsonl: its exact verdicts were re-scored on EPYC (2 threads)")
    assert "(Xeon (2 threads))" in note
