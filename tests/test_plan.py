"""Plan first, then run (specbench/run/plan.py): every parse and refusal before a model loads, typed options
from there on, and the same plan for a preset's runs (so its dry run refuses what the run would)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench_data import needs_data
from specbench.errors import SpecbenchError
from specbench.run.plan import plan_run
from specbench.run.run_config import RunConfig
from specbench.sides import Side
from test_cli import cli


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"id": f"q{i}", "turns": [f"question {i}"]}) + "\n" for i in range(3)))
    return path


def test_planning_imports_no_torch():
    code = "import sys, specbench.run.plan; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_plan_holds_typed_options_prompts_and_files(prompts, tmp_path):
    cfg = RunConfig(sides=[Side("eagle3"), Side("pld", {"gamma": "5"})], bench=str(prompts), budget=16,
                    device="cpu", dtype="float32", out=str(tmp_path / "r.jsonl"), passes=2)
    plan = plan_run(cfg)
    options = {side.label: side.options for side in plan.sides}
    assert options["eagle3"].total_tokens == 17 and options["pld"].gamma == 5  # --budget, then the side's own
    assert [q.prompt.id for q in plan.stream] == ["q0", "q1", "q2", "q0#pass2", "q1#pass2", "q2#pass2"]
    assert plan.outs == {1: tmp_path / "r.jsonl"} and not (tmp_path / "r.jsonl").exists()  # nothing written
    meta = plan.meta(1)
    assert meta["sides"] == ["eagle3", "pld", "vanilla"] and meta["method_options"]["eagle3"]["total_tokens"] == 17
    assert meta["config_hash"] and meta["budget"] == 16


def test_plan_refuses_before_anything_loads(prompts, tmp_path):
    out = tmp_path / "r.jsonl"
    bad = [(dict(sides=[Side("pld", {"gama": "5"})]), "has no option 'gama'"),
           (dict(sides=[Side("dvi")], repeats=2), "learn while serving"),
           (dict(sides=[Side("pld")], resume=True), "nothing to resume")]
    for fields, message in bad:
        with pytest.raises(SpecbenchError, match=message):
            plan_run(RunConfig(bench=str(prompts), device="cpu", dtype="float32", out=str(out), **fields))
    assert not out.exists()


@needs_data
def test_a_presets_dry_run_refuses_what_its_runs_would(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    code, _, err = cli(["reproduce", "ddtree-table1", "--target", "Qwen/Qwen3-8B", "--dry-run", "--limit", "2",
                        "--out-dir", str(a_file)], capsys)
    assert code == 2 and "Not a directory" in err and len(err.strip().splitlines()) == 1
