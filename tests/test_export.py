"""Spec-Bench export: our results files become Spec-Bench answer files in its exact schema, and Spec-Bench's
speed.py arithmetic over the exported files gives the same speedup and mean accepted tokens as our metrics."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from specbench import metrics
from specbench.analysis.export import answer_rows
from specbench.records import GenerationRecord
from bench_data import needs_data
from test_cli import cli

# hemingkx/Spec-Bench evaluation/eval.py: the answer row and its choice.
ROW_KEYS = {"question_id", "category", "answer_id", "model_id", "choices", "tstamp"}
CHOICE_KEYS = {"index", "turns", "decoding_steps", "new_tokens", "wall_time", "accept_lengths"}
MT_BENCH = ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"]


def rec(method, pid, n_new, seconds, accept=(), turn=0):
    return GenerationRecord(method=method, new_tokens=[100 + i for i in range(n_new)], prompt_tokens=7,
                            stop_reason="length", times={"prefill": 0.1 * seconds, "draft": 0.3 * seconds,
                                                         "verify": 0.6 * seconds},
                            n_verify=len(accept) if method != "vanilla" else n_new - 1,
                            accept_lengths=list(accept) if method != "vanilla" else [0] * (n_new - 1),
                            tree_sizes=[], depth_attempts=[], depth_accepts=[], bench="spec_bench", prompt_id=pid,
                            turn=turn)


# Question 81 is MT-Bench 'writing' (two turns), 161 translation, 241 summarization.
METHOD = [rec("eagle3", "81", 12, 0.5, [3, 2, 4]), rec("eagle3", "81", 9, 0.4, [1, 5], turn=1),
          rec("eagle3", "161", 20, 1.0, [6, 0, 2, 4, 3]), rec("eagle3", "241", 7, 0.7, [1, 1, 2])]
BASE = [rec("vanilla", "81", 12, 1.2), rec("vanilla", "81", 9, 0.9, turn=1), rec("vanilla", "161", 20, 2.0),
        rec("vanilla", "241", 7, 0.8)]


def write_results(path: Path, target: str) -> None:
    header = {"type": "header", "meta": {"target": target, "temperature": 0.0, "bench": "spec_bench"}}
    lines = [header] + [{"type": "record", **r.to_dict()} for r in METHOD + BASE]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


def speed_py(method_rows: list[dict], base_rows: list[dict], task: str) -> tuple[float, float]:
    """Spec-Bench evaluation/speed.py's arithmetic (baseline tokens from new_tokens instead of re-tokenising
    the text, which equals it when the text round-trips)."""
    def keep(row):
        return task == "overall" or (row["category"] in MT_BENCH if task == "mt_bench" else row["category"] == task)

    speeds, accept = [], []
    for row in filter(keep, method_rows):
        c = row["choices"][0]
        speeds.append(sum(c["new_tokens"]) / sum(c["wall_time"]))
        accept.extend(c["accept_lengths"])
    base = [sum(r["choices"][0]["new_tokens"]) / sum(r["choices"][0]["wall_time"]) for r in filter(keep, base_rows)]
    return float(np.mean(speeds) / np.mean(base)), float(np.mean(accept))


def test_answer_rows_follow_spec_bench_schema():
    rows = answer_rows(METHOD, {"81": "writing", "161": "translation", "241": "summarization"}, "tiny-eagle3",
                       lambda ids: f"{len(ids)} tokens", 1.0)
    assert [r["question_id"] for r in rows] == [81, 161, 241]  # Spec-Bench's ids are ints, sorted
    for row in rows:
        assert set(row) == ROW_KEYS and len(row["choices"]) == 1 and set(row["choices"][0]) == CHOICE_KEYS
    first = rows[0]["choices"][0]
    assert first["turns"] == ["12 tokens", "9 tokens"] and first["new_tokens"] == [12, 9]
    assert first["wall_time"] == pytest.approx([0.5, 0.4]) and first["decoding_steps"] == [3, 2]
    assert first["accept_lengths"] == [4, 3, 5, 2, 6]  # committed per step: accepted + bonus
    base = answer_rows(BASE, {}, "tiny-vanilla", str, 1.0)
    assert base[0]["choices"][0]["accept_lengths"] == [1] * 21  # as Spec-Bench's baseline_forward writes
    assert base[0]["category"] == "spec_bench"  # no category known: the bench name


@needs_data
def test_export_cli_and_speed_py_agree_with_our_metrics(models, tmp_path, capsys):
    results = tmp_path / "run.jsonl"
    write_results(results, models["target"])
    code, out, err = cli(["export", "--format", "spec-bench", str(results), "--out", str(tmp_path / "sb")], capsys)
    assert code == 0, err
    files = sorted((tmp_path / "sb").glob("*.jsonl"))
    assert [f.name for f in files] == ["target-eagle3-temperature-0.jsonl", "target-vanilla-temperature-0.jsonl"]
    method_rows, base_rows = ([json.loads(x) for x in f.read_text().splitlines()] for f in files)
    assert {r["category"] for r in method_rows} == {"writing", "translation", "summarization"}
    assert all(set(r) == ROW_KEYS and set(r["choices"][0]) == CHOICE_KEYS for r in method_rows + base_rows)
    assert all(isinstance(t, str) for r in method_rows for t in r["choices"][0]["turns"])
    spd, mat = speed_py(method_rows, base_rows, "overall")
    assert spd == pytest.approx(metrics.spec_bench_speedup(METHOD, BASE))
    assert mat == pytest.approx(metrics.tau(METHOD))
    spd_mt, mat_mt = speed_py(method_rows, base_rows, "mt_bench")
    mt = [r for r in METHOD if r.prompt_id == "81"]
    assert spd_mt == pytest.approx(metrics.spec_bench_speedup(mt, BASE)) and mat_mt == pytest.approx(metrics.tau(mt))
    assert spd != pytest.approx(metrics.speedup(METHOD, BASE))  # Spec-Bench's mean of ratios is not our pooled one


def test_export_bad_input_is_one_line(tmp_path, capsys):
    code, _, err = cli(["export", str(tmp_path / "missing.jsonl")], capsys)
    assert code == 2 and "does not exist" in err and err.strip().count("\n") == 0
    results = tmp_path / "run.jsonl"
    write_results(results, str(tmp_path / "no-such-model"))
    code, _, err = cli(["export", "--format", "csv", str(results)], capsys)
    assert code == 2 and "unknown export format 'csv'" in err
    code, _, err = cli(["export", str(results)], capsys)
    assert code == 2 and "cannot load the tokenizer" in err and not (tmp_path / "run_spec-bench").exists()


@needs_data
def test_spec_bench_bench_and_its_categories():
    from specbench.run.benchmarks import load_benchmark

    assert len(load_benchmark("spec_bench")) == 480
    for category in ("translation", "summarization", "qa", "math_reasoning", "rag"):
        assert len(load_benchmark("spec_bench", category=category)) == 80
    mt = load_benchmark("spec_bench", category="mt_bench")  # speed.py's group of the 8 MT-Bench sub-categories
    assert len(mt) == 80 and all(len(p.turns) == 2 for p in mt)
    assert len(load_benchmark("spec_bench", category="writing")) == 10
