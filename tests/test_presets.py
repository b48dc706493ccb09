"""Paper presets: the dry-run plans print the papers' settings, plans expand into the right RunConfigs,
bad input fails in one line, and the papers' metrics are computed as the papers compute them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specbench import metrics
from specbench.data.preset_files import apply_variant, load_preset, preset_names
from specbench.run.preset import build_plan, frame, select_prompts
from specbench.data.benchmarks import Prompt
from specbench.records import GenerationRecord
from specbench.analysis.report import ResultFile, paper_metric_cells, paper_metric_table, render_markdown
from specbench.run.plan import run_sides
from bench_data import needs_data
from test_cli import cli


# ------------------------------------------------------------------------------------------ dry runs

@needs_data
def test_specblock_table1_dry_run_prints_the_papers_settings(capsys, tmp_path):
    code, out, _ = cli(["reproduce", "specblock-table1", "--target", "meta-llama/Llama-3.1-8B-Instruct", "--dry-run",
                        "--out-dir", str(tmp_path / "r")], capsys)
    assert code == 0
    assert "max new tokens: 1024" in out  # App. A.4 / harness README
    assert "temperatures: 0, 1" in out  # §4.1
    # App. A.4's counts: the whole NQ dev split and all of WMT-23 de-en; Alpaca's 4,000 are not available offline.
    for line in ("humaneval: 164 prompts, 164 turns", "math500: 500 prompts, 500 turns",
                 "natural_questions: 3610 prompts, 3610 turns (all 3610; paper n=3610)", "mt_bench: 80 prompts, 160 turns",
                 "wmt23: 549 prompts, 549 turns (all 549; paper n=549)", "alpaca: 80 prompts, 80 turns (all 80; paper n=4000)"):
        assert line in out
    # §4.1: every tree method gets the same verifier tree of up to 60 nodes.
    assert "specblock: specblock path=weijiezz/SpecBlock-Llama-3.1-8B-Instruct blocks=2 beam_width=10 budget=60" in out
    assert "eagle3: eagle3 path=weijiezz/EAGLE3-Llama-3.1-8B-Instruct depth=7 top_k=10 total_tokens=60" in out
    assert "sps: sps draft=meta-llama/Llama-3.2-1B" in out
    assert "NOT RUN medusa" in out and "specbench train medusa" in out
    assert "dtype: bfloat16  [not stated by the paper; the authors' harness loads the target in bfloat16" in out
    assert "variants: specblock-table1-harness" in out
    assert "paper metric: end_to_end_speedup" in out
    assert "runs (12 results files)" in out  # 6 benches x 2 temperatures
    assert "~38,081 at the paper's tau 4.41" in out  # HumanEval: 164 turns x 1024 / Table 1 mean tau
    assert not (tmp_path / "r").exists()  # a dry run writes nothing


@needs_data
def test_specblock_table1_harness_variant_keeps_the_released_values(capsys, tmp_path):
    code, out, _ = cli(["reproduce", "specblock-table1-harness", "--target", "meta-llama/Llama-3.1-8B-Instruct",
                        "--dry-run", "--out-dir", str(tmp_path / "r")], capsys)
    assert code == 0, out
    assert "variant of specblock-table1" in out
    assert "blocks=2 beam_width=10 budget=90  [run_eval.py default config '1,2,10,90'" in out
    assert "depth=7 top_k=4 total_tokens=20  [run_eval.py default config '1,7,4,20'" in out
    assert "natural_questions: 200 prompts, 200 turns (first 200; paper n=3610)" in out  # the paper's n stays shown
    assert "wmt23: 200 prompts, 200 turns (first 200; paper n=549)" in out and "(all 80; paper n=4000)" in out


@needs_data
def test_specblock_table1_runs_no_sps_or_medusa_where_table1_has_none(capsys, tmp_path):
    code, out, _ = cli(["reproduce", "specblock-table1", "--target", "Qwen/Qwen3-8B", "--dry-run",
                        "--out-dir", str(tmp_path / "r")], capsys)
    assert code == 0
    assert "NOT RUN sps: Table 1 has an SpS row for Llama-3.1-8B only" in out
    assert "NOT RUN medusa: Table 1 has a Medusa row for Llama-3.1-8B only" in out
    assert "sps: sps" not in out and "drafter sps" not in out


@needs_data
def test_dvi_table2_sps_is_assisted_generation_with_its_schedule(capsys, tmp_path):
    code, out, _ = cli(["reproduce", "dvi-table2", "--target", "lmsys/vicuna-7b-v1.3", "--dry-run",
                        "--out-dir", str(tmp_path / "r")], capsys)
    assert code == 0
    assert "sps: sps draft=double7/vicuna-68m gamma=5 schedule=heuristic  [Spec-Bench's SpS row is transformers'" in out


@needs_data
def test_ddtree_table1_dry_run_prints_the_papers_settings(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # tatsu-lab/alpaca is not in this machine's HF cache
    code, out, _ = cli(["run", "--preset", "ddtree-table1", "--target", "Qwen/Qwen3-8B", "--dry-run",
                        "--out", str(tmp_path / "r")], capsys)
    assert code == 0
    assert "max new tokens: 2048" in out  # App. B
    assert "temperatures: 0, 1" in out
    assert "math500: 128 prompts, 128 turns (shuffle(seed=0).select(128)" in out  # Table 2 + benchmark.py
    assert "gsm8k: 128 prompts, 128 turns (shuffle(seed=0).select(128)" in out
    assert "humaneval: 164 prompts" in out and "mt_bench: 80 prompts, 160 turns" in out
    assert "ddtree path=z-lab/Qwen3-8B-DFlash-b16 budget=16|32|64|128|256|512|1024" in out
    assert "dflash: dflash path=z-lab/Qwen3-8B-DFlash-b16" in out
    assert "dflash-fa2: dflash path=z-lab/Qwen3-8B-DFlash-b16" in out  # App. B: DFlash at SDPA and FA2 too
    assert "{'enable_thinking': False}" in out
    assert "vanilla baselines: sdpa, flash_attention_2" in out
    assert "paper metric: faster_baseline_tpot_speedup" in out
    assert "aime24: paper n=30; NOT RUN" in out
    assert ("alpaca: paper n=128; NOT RUN: needs the train split of tatsu-lab/alpaca from the Hugging Face Hub, which "
            "could not be read (HF_HUB_OFFLINE=1 and not in the HF cache)") in out
    assert "runs (16 results files)" in out  # 4 benches x 2 temperatures x (SDPA run + flash-attention run)
    assert not (tmp_path / "r").exists()


def test_unknown_preset_is_one_line_exit_2_and_writes_nothing(capsys, tmp_path):
    code, out, err = cli(["reproduce", "specblok-table1", "--target", "x", "--out-dir", str(tmp_path / "r")], capsys)
    assert code == 2
    assert err.strip().count("\n") == 0 and "unknown preset 'specblok-table1'" in err and "specblock-table1" in err
    assert not (tmp_path / "r").exists()


def test_list_presets(capsys):
    code, out, _ = cli(["list", "presets"], capsys)
    assert code == 0
    for name in ("specblock-table1", "ddtree-table1", "pacer-table1", "dvi-table2"):
        assert name in out
    assert set(preset_names()) >= {"specblock-table1", "ddtree-table1", "pacer-table1", "dvi-table2"}


def test_every_preset_cites_its_settings():
    for name in preset_names():
        p = load_preset(name)
        for key in ("temperatures_source", "max_new_tokens_source", "dtype_source"):
            assert p.get(key), (name, key)
        assert p["metric"].get("source")
        assert all(b.get("source") for b in p["benches"]), name
        assert all(m.get("source") for m in p["methods"]), name
        for t in p["targets"]:
            for d in t["drafters"].values():
                assert d.get("source") and (d.get("train") or {k for k in d if k not in ("source", "revision")})


# ------------------------------------------------------------------------------------------ plan -> RunConfigs

@needs_data
def test_plan_expands_into_run_configs(tmp_path):
    plan = build_plan("specblock-table1", "Qwen/Qwen3-8B", limit=3, out_dir=tmp_path)
    assert len(plan.runs) == 12
    run = next(r for r in plan.runs if r.bench == "humaneval" and r.temperature == 1.0)
    cfg = run.cfg
    (main,) = cfg.sides
    assert (main.method, main.label, cfg.temperature, cfg.max_new_tokens, cfg.preset) == \
           ("specblock", "specblock", 1.0, 1024, "specblock-table1")
    assert {k: str(v) for k, v in main.options.items()} == \
        {"path": "weijiezz/SpecBlock-Qwen3-8B", "blocks": "2", "beam_width": "10", "budget": "60"}
    # The selected, framed prompts travel in the config; nothing is written to be read back.
    assert cfg.bench == "humaneval" and cfg.prompts == next(b for b in plan.benches if b.bench == "humaneval").prompts
    assert cfg.out == str(tmp_path / "specblock-table1_humaneval_Qwen3-8B_T1.jsonl")
    assert not any(tmp_path.iterdir())
    # EAGLE-3 has no published Qwen3-8B drafter in the release: not run, with the training command; Table 1 has
    # no SpS or Medusa row for Qwen3.
    assert [label for label, _ in plan.skipped][:3] == ["eagle3", "sps", "medusa"]
    assert [s.label for s in run_sides(cfg)] == ["specblock"]
    assert len(next(b for b in plan.benches if b.bench == "mt_bench").prompts) == 3  # --limit after selection


@needs_data
def test_plan_sweeps_and_flash_attention_baselines(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the Hub-read Alpaca bench stays out: no network in tests
    plan = build_plan("ddtree-table1", "/models/Qwen3-8B", out_dir=tmp_path, drafters={"dflash": "/drafters/dflash"})
    mains = [r for r in plan.runs if r.cfg.sides[0].method == "ddtree"]
    fa2 = [r for r in plan.runs if r.cfg.attn_implementation == "flash_attention_2"]
    assert len(mains) == len(fa2) == len({r.bench for r in mains}) * 2
    # App. B: vanilla and vanilla DFlash also under flash-attention-2 (DDTree's trees need SDPA), kept apart by label.
    assert all([(s.method, s.label) for s in r.cfg.sides] == [("dflash", "dflash-fa2")] and r.cfg.baseline == "vanilla"
               and r.cfg.out.endswith("_flash_attention_2.jsonl") for r in fa2)
    sides = run_sides(mains[0].cfg)
    assert [s.label for s in sides] == [f"ddtree@budget={b}" for b in (16, 32, 64, 128, 256, 512, 1024)] + ["dflash"]
    assert all(s.options["path"] == "/drafters/dflash" for s in sides)  # --drafter wins; target matched by name
    assert mains[0].cfg.sides[-1].options == {"path": "/drafters/dflash"}
    # a sweep's sides are data: their stem and the option their label shows
    assert {(s.stem, s.shown) for s in mains[0].cfg.sides[:-1]} == {("ddtree", ("budget",))}


@needs_data
def test_pacer_overrides_per_target_and_bench(tmp_path):
    plan = build_plan("pacer-table1", "meta-llama/Llama-2-70b-chat-hf", out_dir=tmp_path, max_new_tokens=64,
                      drafters={"pacer": "/runs/pacer"})
    by_bench = {r.bench: {s.label: {k: str(v) for k, v in s.options.items()} for s in run_sides(r.cfg)}
                for r in plan.runs}
    assert by_bench["gsm8k"]["pacer"] == {"draft": "meta-llama/Llama-2-7b-chat-hf", "pacer": "/runs/pacer",
                                          "block": "3", "threshold": "0.65", "rho": "1.05"}  # Table 10
    assert by_bench["cnn_dailymail"]["pacer"]["block"] == "3"
    assert [f"sps@gamma={g}" for g in range(1, 11)] == [k for k in by_bench["gsm8k"] if k.startswith("sps")]


def test_shuffle_selection_matches_hf_datasets():
    datasets = pytest.importorskip("datasets")
    prompts = [Prompt("b", str(i), [f"q{i}"]) for i in range(500)]
    chosen, how = select_prompts(prompts, {"bench": "b", "n": 128, "select": "shuffle", "seed": 0})
    hf = datasets.Dataset.from_dict({"i": list(range(500))}).shuffle(seed=0).select(range(128))
    assert [int(p.id) for p in chosen] == hf["i"]
    assert how == "shuffle(seed=0).select(128)"
    assert select_prompts(prompts[:80], {"bench": "b", "n": 128, "select": "shuffle"})[0] == prompts[:80]


@needs_data
def test_framing_follows_the_papers(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the Hub-read Alpaca bench stays out: no network in tests
    ddtree = build_plan("ddtree-table1", "Qwen/Qwen3-8B", out_dir=tmp_path, limit=2)
    math = next(b for b in ddtree.benches if b.bench == "math500").prompts[0].turns[0]
    assert math.endswith("\nPlease reason step by step, and put your final answer within \\boxed{}.")
    he = next(b for b in ddtree.benches if b.bench == "humaneval").prompts[0].turns[0]
    assert he.startswith("Write a solution to the following problem and make sure that it passes the tests:\n```python\n")
    specblock = build_plan("specblock-table1", "meta-llama/Llama-3.1-8B-Instruct", out_dir=tmp_path, limit=1)
    bench = {b.bench: b.prompts[0] for b in specblock.benches}
    assert bench["humaneval"].turns[0] == bench["humaneval"].meta["prompt"]  # raw prompt, no EAGLE instruction
    assert bench["natural_questions"].turns[0] == "when was the last time anyone was on the moon"
    assert bench["wmt23"].turns[0].startswith("Translate the following German text to English:\n\n")
    assert frame(Prompt("b", "1", ["a", "b"]), "{turn}!").turns == ["a!", "b!"]


@needs_data
def test_ddtree_alpaca_follows_ddtrees_loader(tmp_path, monkeypatch):
    """DDTree's load_and_process_dataset('alpaca'): tatsu-lab/alpaca train rows, 'instruction\\n\\nInput:\\ninput'
    when there is an input, else the instruction; then shuffle(seed=0).select(128). The rows here stand in for
    the Hub's (the loader reads them from the HF cache); the selection is HF datasets' own permutation."""
    from specbench.run import preset as preset_module

    rows = [{"instruction": f"do {i}", "input": f"x{i}" if i % 3 else "", "output": "-"} for i in range(300)]
    asked = []

    def fake(bench, spec):
        asked.append(spec)
        return [Prompt(bench, str(i), [""], meta=row) for i, row in enumerate(rows)]

    monkeypatch.setattr(preset_module, "hub_dataset_prompts", fake)
    plan = build_plan("ddtree-table1", "Qwen/Qwen3-8B", out_dir=tmp_path)
    alpaca = next(b for b in plan.benches if b.bench == "alpaca")
    assert asked == [{"path": "tatsu-lab/alpaca", "split": "train"}]
    assert len(alpaca.prompts) == 128 and alpaca.selection == "shuffle(seed=0).select(128)"
    order = [int(p.id) for p in alpaca.prompts]
    datasets = pytest.importorskip("datasets")
    assert order == datasets.Dataset.from_dict({"i": list(range(300))}).shuffle(seed=0).select(range(128))["i"]
    for p in alpaca.prompts:
        row = rows[int(p.id)]
        assert p.turns == [f"{row['instruction']}\n\nInput:\n{row['input']}" if row["input"] else row["instruction"]]


def test_preset_variant_errors_are_one_line(tmp_path, monkeypatch):
    base = load_preset("specblock-table1")
    with pytest.raises(Exception, match="changes nosuch, which the preset does not have") as err:
        apply_variant(base, "x", {"methods": {"nosuch": {"options": {}}}})
    assert "\n" not in str(err.value)
    assert "specblock-table1-harness" in preset_names() and load_preset("specblock-table1-harness")["variant_of"] == \
        "specblock-table1"


# ------------------------------------------------------------------------------------------ a real tiny run

@needs_data
def test_reproduce_runs_the_plan_on_a_tiny_target(models, tmp_path, capsys):
    out = tmp_path / "r"
    code, stdout, err = cli(["reproduce", "dvi-table2", "--target", models["deep"], "--limit", "1", "--max-new-tokens",
                             "4", "--dtype", "float32", "--out-dir", str(out)], capsys)
    assert code == 0, err
    files = sorted(out.glob("*.jsonl"))
    assert [f.name for f in files] == ["dvi-table2_spec_bench_deep_T0.jsonl"]
    lines = [json.loads(x) for x in files[0].read_text().splitlines()]
    assert lines[0]["meta"]["preset"] == "dvi-table2"
    records = [x for x in lines if x.get("type") == "record"]
    assert {r["method"] for r in records} == {"dvi", "vanilla"}
    assert {(r["prompt_id"], r["turn"]) for r in records} == {("81", 0), ("81", 1)}  # MT-Bench's two turns
    assert all(len(r["new_tokens"]) <= 4 for r in records)
    # The report names the paper's metric; the export gives Spec-Bench files for both sides.
    from specbench.analysis.report import build_report

    table = build_report(files, paper_numbers=None, reps=0).paper_metric
    assert table is not None and "spec_bench_speedup" in render_markdown(table)
    code, stdout, err = cli(["export", "--format", "spec-bench", str(files[0]), "--out", str(tmp_path / "sb")], capsys)
    assert code == 0, err
    assert sorted(p.name for p in (tmp_path / "sb").iterdir()) == ["deep-dvi-temperature-0.jsonl",
                                                                  "deep-vanilla-temperature-0.jsonl", "tokenizer"]
    rows = [json.loads(x) for x in (tmp_path / "sb" / "deep-vanilla-temperature-0.jsonl").read_text().splitlines()]
    assert [r["category"] for r in rows] == ["writing"]  # question 81, from the run's header


# ------------------------------------------------------------------------------------------ the papers' metrics

def rec(method, pid, n_new, decode, prefill=0.1, accept=(), turn=0, bench="b"):
    """A record with n_new tokens, `decode` seconds of decode spread over draft/verify, and accept lengths."""
    return GenerationRecord(method=method, new_tokens=list(range(n_new)), prompt_tokens=5, stop_reason="length",
                            times={"prefill": prefill, "draft": decode / 4, "verify": decode * 3 / 4},
                            n_verify=len(accept), accept_lengths=list(accept), tree_sizes=[], depth_attempts=[],
                            depth_accepts=[], bench=bench, prompt_id=pid, turn=turn)


def test_decode_speedup_uses_the_faster_baseline_and_mean_time_per_token():
    method = [rec("ddtree", "a", 11, 1.0, accept=[4, 4]), rec("ddtree", "b", 21, 1.0, accept=[9, 0, 9])]
    sdpa = [rec("vanilla", "a", 11, 4.0), rec("vanilla", "b", 21, 8.0)]
    fa2 = [rec("vanilla", "a", 11, 3.0), rec("vanilla", "b", 21, 6.0)]
    # Decode-only time per token: method (0.1 + 0.05) / 2, fa2 (0.3 + 0.3) / 2, sdpa (0.4 + 0.4) / 2.
    assert metrics.mean_time_per_token(method) == pytest.approx(0.075)
    spd, used = metrics.faster_baseline_tpot_speedup(method, {"sdpa": sdpa, "flash_attention_2": fa2})
    assert used == "flash_attention_2" and spd == pytest.approx(0.3 / 0.075)
    assert metrics.faster_baseline_tpot_speedup(method, {"sdpa": sdpa}) == (pytest.approx(0.4 / 0.075), "sdpa")
    # tau per response (macro) vs pooled: (10/2 + 21/3) / 2 vs 31 / 5.
    assert metrics.tau_macro(method) == pytest.approx(6.0)
    assert metrics.tau(method) == pytest.approx(31 / 5)


def test_spec_bench_speedup_is_a_ratio_of_per_question_means():
    method = [rec("m", "1", 10, 0.9), rec("m", "1", 10, 0.9, turn=1), rec("m", "2", 30, 0.9)]
    base = [rec("vanilla", "1", 10, 1.9), rec("vanilla", "1", 10, 1.9, turn=1), rec("vanilla", "2", 30, 4.9)]
    # Per question: method 20/2 and 30/1; vanilla 20/4 and 30/5.
    assert metrics.spec_bench_speedup(method, base) == pytest.approx(((10 + 30) / 2) / ((5 + 6) / 2))
    assert metrics.speedup(method, base) == pytest.approx((50 / 3) / (50 / 9))  # ours: pooled


def test_report_paper_metric_table_names_the_metric_used():
    def result(name, preset, attn, records):
        meta = {"target": "Qwen3-8B", "temperature": 0.0, "preset": preset, "attn_implementation": attn}
        return ResultFile(Path(name), meta, tuple(records))

    method = [rec("ddtree@budget=16", "a", 11, 1.0, accept=[4, 4], bench="math500")]
    files = [result("main.jsonl", "ddtree-table1", "sdpa", method + [rec("vanilla", "a", 11, 4.0, bench="math500")]),
             result("fa2.jsonl", "ddtree-table1", "flash_attention_2", [rec("vanilla", "a", 11, 3.0, bench="math500")]),
             result("other.jsonl", None, "sdpa", [rec("vanilla", "x", 3, 1.0)])]
    cells = paper_metric_cells(files)
    assert len(cells) == 1
    row = cells.iloc[0]
    assert row.metric == "faster_baseline_tpot_speedup" and row.baseline == "flash_attention_2"
    assert row.paper_speedup == pytest.approx(3.0) and row.paper_tau == pytest.approx(5.0)
    text = render_markdown(paper_metric_table(files))
    assert "faster_baseline_tpot_speedup" in text and "3.00×" in text and "flash_attention_2" in text
