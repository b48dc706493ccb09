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
TEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps on a warm mat by the door. " * 4


@pytest.fixture(scope="module")
def smol():
    from transformers import AutoTokenizer

    from specbench.engine.target import embedded_gguf

    gguf = embedded_gguf("smollm2-135m")
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def answer(tok, n: int, offset: int = 0) -> list[int]:
    """n tokens a trained model would write: a canonical tokenization of English text, ending in the EOS."""
    ids = tok(TEXT, add_special_tokens=False).input_ids
    return ids[offset: offset + n - 1] + [tok.eos_token_id]


def rec(method, pid, tokens, seconds, accept=(), turn=0):
    n_new = len(tokens)
    return GenerationRecord(method=method, new_tokens=list(tokens), prompt_tokens=7,
                            stop_reason="eos", times={"prefill": 0.1 * seconds, "draft": 0.3 * seconds,
                                                      "verify": 0.6 * seconds},
                            n_verify=len(accept) if method != "vanilla" else n_new - 1,
                            accept_lengths=list(accept) if method != "vanilla" else [0] * (n_new - 1),
                            tree_sizes=[], depth_attempts=[], depth_accepts=[], bench="spec_bench", prompt_id=pid,
                            turn=turn)


def records(tok):
    """Question 81 is MT-Bench 'writing' (two turns), 161 translation, 241 summarization."""
    method = [rec("eagle3", "81", answer(tok, 12), 0.5, [3, 2, 4]), rec("eagle3", "81", answer(tok, 9, 3), 0.4, [1, 5], 1),
              rec("eagle3", "161", answer(tok, 20, 5), 1.0, [6, 0, 2, 4, 3]), rec("eagle3", "241", answer(tok, 7), 0.7,
                                                                                    [1, 1, 2])]
    base = [rec("vanilla", "81", answer(tok, 12), 1.2), rec("vanilla", "81", answer(tok, 9, 3), 0.9, turn=1),
            rec("vanilla", "161", answer(tok, 20, 5), 2.0), rec("vanilla", "241", answer(tok, 7), 0.8)]
    return method, base


def write_results(path: Path, target: str, recs, categories: dict | None = None) -> None:
    meta = {"target": target, "temperature": 0.0, "bench": "spec_bench"}
    if categories is not None:
        meta["prompt_categories"] = categories
    lines = [{"type": "header", "meta": meta}] + [{"type": "record", **r.to_dict()} for r in recs]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


def speed_py(method_rows: list[dict], base_rows: list[dict], task: str, tokenizer_path) -> tuple[float, float, list]:
    """Spec-Bench evaluation/speed.py's arithmetic, written out here: the method's tokens from new_tokens, the
    baseline's by re-tokenizing each turn's text with the tokenizer at ``tokenizer_path`` minus one."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_path)

    def keep(row):
        return task == "overall" or (row["category"] in MT_BENCH if task == "mt_bench" else row["category"] == task)

    speeds, accept = [], []
    for row in filter(keep, method_rows):
        c = row["choices"][0]
        speeds.append(sum(c["new_tokens"]) / sum(c["wall_time"]))
        accept.extend(c["accept_lengths"])
    base, counts = [], []
    for row in filter(keep, base_rows):
        tokens = sum(len(tok(t).input_ids) - 1 for t in row["choices"][0]["turns"])
        counts.append(tokens)
        base.append(tokens / sum(row["choices"][0]["wall_time"]))
    return float(np.mean(speeds) / np.mean(base)), float(np.mean(accept)), counts


def test_answer_rows_follow_spec_bench_schema(smol):
    method, base = records(smol)
    cats = {("spec_bench", "81"): "writing", ("spec_bench", "161"): "translation", ("spec_bench", "241"): "summarization"}
    rows = answer_rows(method, cats, "tiny-eagle3", lambda ids: f"{len(ids)} tokens", 1.0)
    assert [r["question_id"] for r in rows] == [81, 161, 241]  # Spec-Bench's ids are ints, sorted
    for row in rows:
        assert set(row) == ROW_KEYS and len(row["choices"]) == 1 and set(row["choices"][0]) == CHOICE_KEYS
    first = rows[0]["choices"][0]
    assert first["turns"] == ["12 tokens", "9 tokens"] and first["new_tokens"] == [12, 9]
    assert first["wall_time"] == pytest.approx([0.5, 0.4]) and first["decoding_steps"] == [3, 2]
    assert first["accept_lengths"] == [4, 3, 5, 2, 6]  # committed per step: accepted + bonus
    assert answer_rows(base, cats, "tiny-vanilla", str, 1.0)[0]["choices"][0]["accept_lengths"] == [1] * 21
    with pytest.raises(KeyError):  # a question without a category is never labelled with the bench's name
        answer_rows(base, {}, "tiny-vanilla", str, 1.0)


@needs_data
def test_export_cli_and_speed_py_agree_with_our_metrics(models, smol, tmp_path, capsys):
    method, base = records(smol)
    results = tmp_path / "run.jsonl"
    write_results(results, models["target"], method + base)  # an older header: categories from the bench's data
    code, out, err = cli(["export", "--format", "spec-bench", str(results), "--out", str(tmp_path / "sb")], capsys)
    assert code == 0, err
    files = sorted((tmp_path / "sb").glob("*.jsonl"))
    assert [f.name for f in files] == ["target-eagle3-temperature-0.jsonl", "target-vanilla-temperature-0.jsonl"]
    method_rows, base_rows = ([json.loads(x) for x in f.read_text().splitlines()] for f in files)
    assert {r["category"] for r in method_rows} == {"writing", "translation", "summarization"}
    assert all(set(r) == ROW_KEYS and set(r["choices"][0]) == CHOICE_KEYS for r in method_rows + base_rows)
    assert all(isinstance(t, str) for r in method_rows for t in r["choices"][0]["turns"])
    counting = tmp_path / "sb" / "tokenizer"
    spd, mat, counts = speed_py(method_rows, base_rows, "overall", counting)
    # speed.py's recount of the baseline through the exported tokenizer is the true count, question by question
    assert counts == [21, 20, 7]
    assert spd == pytest.approx(metrics.spec_bench_speedup(method, base))
    assert mat == pytest.approx(metrics.tau(method))
    spd_mt, mat_mt, _ = speed_py(method_rows, base_rows, "mt_bench", counting)
    mt = [r for r in method if r.prompt_id == "81"]
    assert spd_mt == pytest.approx(metrics.spec_bench_speedup(mt, base)) and mat_mt == pytest.approx(metrics.tau(mt))
    assert spd != pytest.approx(metrics.speedup(method, base))  # Spec-Bench's mean of ratios is not our pooled one
    # Negative control: SmolLM2's own tokenizer adds no BOS, so speed.py would undercount every turn by one.
    smol.save_pretrained(tmp_path / "raw")
    assert speed_py(method_rows, base_rows, "overall", tmp_path / "raw")[2] == [19, 19, 6]


def test_categories_come_from_the_header_or_export_refuses(models, smol, tmp_path, capsys):
    method, base = records(smol)
    results = tmp_path / "run.jsonl"
    header = {"spec_bench": {"field": "category", "values": {"81": "roleplay", "161": "qa", "241": "rag"}}}
    write_results(results, models["target"], method + base, header)
    code, _, err = cli(["export", str(results), "--out", str(tmp_path / "sb")], capsys)
    assert code == 0, err
    rows = [json.loads(x) for x in (tmp_path / "sb" / "target-vanilla-temperature-0.jsonl").read_text().splitlines()]
    assert [r["category"] for r in rows] == ["roleplay", "qa", "rag"]  # the header's, not the data's
    code, _, err = cli(["export", str(results), "--out", str(tmp_path / "sb")], capsys)
    assert code == 2 and "already exists; pass --overwrite" in err
    del header["spec_bench"]["values"]["161"]
    write_results(results, models["target"], method + base, header)
    code, _, err = cli(["export", str(results), "--out", str(tmp_path / "sb2")], capsys)
    assert code == 2 and err.strip().count("\n") == 0 and "1 spec_bench question(s)" in err and "161" in err
    assert not (tmp_path / "sb2").exists()
    write_results(results, models["target"], method + base, {"spec_bench": {"field": None, "values": {}}})
    code, _, err = cli(["export", str(results), "--out", str(tmp_path / "sb3")], capsys)
    assert code == 2 and "has no categories" in err and not (tmp_path / "sb3").exists()


def test_export_bad_input_is_one_line(models, smol, tmp_path, capsys):
    code, _, err = cli(["export", str(tmp_path / "missing.jsonl")], capsys)
    assert code == 2 and "does not exist" in err and err.strip().count("\n") == 0
    results = tmp_path / "run.jsonl"
    # The header names the categories, so the tokenizer is reached without the bench's files.
    categories = {"spec_bench": {"field": "category", "values": {"81": "roleplay", "161": "qa", "241": "rag"}}}
    write_results(results, str(tmp_path / "no-such-model"), sum(records(smol), []), categories)
    code, _, err = cli(["export", "--format", "csv", str(results)], capsys)
    assert code == 2 and "--format names 'csv', which is unknown" in err and "known: spec-bench" in err
    code, _, err = cli(["export", str(results)], capsys)
    assert code == 2 and "cannot load the tokenizer" in err and not (tmp_path / "run_spec-bench").exists()


@needs_data
def test_tiny_run_exports_with_its_categories_and_true_counts(models, tmp_path, capsys):
    """A real run on two Spec-Bench translation questions, then export: the header names the categories, the
    answers carry them, and the exported counts are the records' (speed.py's recount differs only where a
    random model's tokens do not re-tokenize to themselves, which the export reports)."""
    from specbench.analysis.report import read_result_file

    out = tmp_path / "run.jsonl"
    code, _, err = cli(["run", "--method", "sps", "--bench", "spec_bench", "--category", "translation", "--target",
                        models["target"], "--dtype", "float32", "--opt", f"draft={models['draft']}", "--opt",
                        "gamma=3", "--max-new-tokens", "8", "--limit", "2", "--out", str(out), "--no-warmup"], capsys)
    assert code == 0, err
    result = read_result_file(out)
    recorded = result.meta["prompt_categories"]["spec_bench"]
    assert recorded["field"] == "category" and set(recorded["values"].values()) == {"translation"}
    with pytest.warns(UserWarning, match="vanilla turns do not re-tokenize") if _non_canonical(result) else _nothing():
        code, _, err = cli(["export", str(out), "--out", str(tmp_path / "sb")], capsys)
    assert code == 0, err
    for label in ("sps", "vanilla"):
        rows = [json.loads(x) for x in (tmp_path / "sb" / f"target-{label}-temperature-0.jsonl").read_text().splitlines()]
        assert {r["category"] for r in rows} == {"translation"}
        true = {r.prompt_id: r.num_new for r in result.records if r.method == label}
        assert {str(r["question_id"]): r["choices"][0]["new_tokens"][0] for r in rows} == true


def _non_canonical(result) -> bool:
    from transformers import AutoTokenizer

    from specbench.analysis.export import counting_tokenizer, exact_text, speed_py_count

    tok = counting_tokenizer(AutoTokenizer.from_pretrained(result.meta["target"]))
    decode = exact_text(tok)
    return any(speed_py_count(tok, decode(r.new_tokens)) != r.num_new for r in result.records if r.method == "vanilla")


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@needs_data
def test_spec_bench_bench_and_its_categories():
    from specbench.data.benchmarks import load_benchmark

    assert len(load_benchmark("spec_bench")) == 480
    for category in ("translation", "summarization", "qa", "math_reasoning", "rag"):
        assert len(load_benchmark("spec_bench", category=category)) == 80
    mt = load_benchmark("spec_bench", category="mt_bench")  # speed.py's group of the 8 MT-Bench sub-categories
    assert len(mt) == 80 and all(len(p.turns) == 2 for p in mt)
    assert len(load_benchmark("spec_bench", category="writing")) == 10
