"""`specbench run --batch-size B` end to end on tiny real models that share the default target's
tokenizer: every side and vanilla decode in batches, records carry the batch, greedy texts equal
vanilla's, batch 1 records stay as they were, and bad batch flags are one-line errors (exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench_data import needs_data
from specbench.run.run_config import RunConfig
from specbench.run.runner import default_out
from test_cli import base_args, cli, read


def by_prompt(records: list[dict]) -> dict:
    pairs: dict = {}
    for r in records:
        pairs.setdefault((r["prompt_id"], r["turn"]), {})[r["method"]] = r
    return pairs


@pytest.mark.parametrize("extra", [["--batch-size", "2"], ["--batch-size", "2", "--continuous"]],
                         ids=["static", "continuous"])
def test_batched_run_records_batches_and_stays_lossless(models, tmp_path, capsys, extra):
    out = tmp_path / "b.jsonl"
    args = base_args(models, out, *extra, "--also", "pld")
    args[args.index("--limit") + 1] = "3"  # the last batch is not full
    code, stdout, stderr = cli(args, capsys)
    assert code == 0, stderr
    lines = read(out)
    assert lines[0]["meta"]["batch_size"] == 2 and lines[0]["meta"]["continuous"] == ("--continuous" in extra)
    records = lines[1:]
    assert sorted(r["method"] for r in records) == ["pld"] * 3 + ["sps"] * 3 + ["vanilla"] * 3
    for r in records:
        assert r["batch"]["size"] == 2 and r["batch"]["end"] > r["batch"]["start"] >= 0
        assert r["batch"]["batched_drafting"] == (r["method"] == "sps")
    for pair in by_prompt(records).values():  # fp32 greedy: lossless, and divergence says so
        assert pair["sps"]["new_tokens"] == pair["vanilla"]["new_tokens"] == pair["pld"]["new_tokens"]
        assert pair["sps"]["divergence"]["status"] == "identical"


def test_batched_run_resumes_without_redoing_finished_turns(models, tmp_path, capsys):
    out = tmp_path / "resume.jsonl"
    args = base_args(models, out, "--batch-size", "2")
    assert cli(args, capsys)[0] == 0  # two prompts
    first = {(r["method"], r["prompt_id"]): r for r in read(out)[1:]}
    args[args.index("--limit") + 1] = "3"
    assert cli(args + ["--resume"], capsys)[0] == 0
    records = read(out)[1:]
    assert len(records) == 6 and len({(r["method"], r["prompt_id"]) for r in records}) == 6
    for r in records:  # the first two prompts' records are the stored ones, untouched
        if (r["method"], r["prompt_id"]) in first:
            assert r == first[(r["method"], r["prompt_id"])]
    assert len({r["prompt_id"] for r in records}) == 3


def test_batch_one_records_have_no_batch_field(models, tmp_path, capsys):
    out = tmp_path / "one.jsonl"
    assert cli(base_args(models, out, "--limit", "1"), capsys)[0] == 0
    lines = read(out)
    assert "batch_size" not in lines[0]["meta"] and all("batch" not in r for r in lines[1:])


@needs_data
def test_batched_conversations_answer_their_second_turn(models, tmp_path, capsys):
    out = tmp_path / "mt.jsonl"
    args = base_args(models, out, "--batch-size", "2")
    args[args.index("humaneval")] = "mt_bench"
    assert cli(args, capsys)[0] == 0
    records = read(out)[1:]
    turns = sorted((r["method"], r["turn"]) for r in records)
    assert turns == [(m, t) for m in ("sps", "vanilla") for t in (0, 0, 1, 1)]
    for pair in by_prompt(records).values():
        assert pair["sps"]["new_tokens"] == pair["vanilla"]["new_tokens"]


@pytest.mark.parametrize("extra,message", [
    (["--batch-size", "0"], "--batch-size must be between 1 and 256"),
    (["--batch-size", "1000"], "--batch-size must be between 1 and 256"),
    (["--continuous"], "--continuous refills the slots of a batch; pass --batch-size B with B > 1"),
    (["--batch-size", "2", "--repeats", "2"], "--repeats times each turn alone"),
    (["--batch-size", "2", "--opt", "schedule=heuristic"], "sps learns while serving"),
], ids=["zero", "huge", "continuous-alone", "repeats", "learner"])
def test_bad_batch_flags_are_one_line_errors(models, tmp_path, capsys, extra, message):
    out = tmp_path / "bad.jsonl"
    code, _, stderr = cli(base_args(models, out, *extra), capsys)
    assert code == 2 and message in stderr and "Traceback" not in stderr
    assert not out.exists()


def test_dvi_refuses_a_batch_before_loading_anything(tmp_path, capsys):
    out = tmp_path / "dvi.jsonl"
    code, _, stderr = cli(["run", "--method", "dvi", "--bench", "humaneval", "--batch-size", "4", "--out", str(out)],
                          capsys)  # the default target: refused before it loads
    assert code == 2 and "dvi learns while serving" in stderr and "--batch-size 1" in stderr
    assert not out.exists()


def test_batched_runs_get_their_own_default_file():
    one = default_out(RunConfig(method="sps", bench="humaneval"))
    four = default_out(RunConfig(method="sps", bench="humaneval", batch_size=4))
    cont = default_out(RunConfig(method="sps", bench="humaneval", batch_size=4, continuous=True))
    assert len({one, four, cont}) == 3 and "_B4_" in four.name and "_B4c_" in cont.name
    assert RunConfig(method="sps", bench="humaneval").identity() == {
        k: v for k, v in RunConfig(method="sps", bench="humaneval", batch_size=4).identity().items()
        if k not in ("batch_size", "continuous")}


@pytest.mark.slow
@needs_data
def test_real_target_batched_texts_equal_batch1_vanilla(tmp_path, capsys):
    """SmolLM2-135M in fp32, four HumanEval prompts: static batches of 2 and continuous batches of 4, with
    batched drafting (SpS, EAGLE-3) and per-request drafting (prompt lookup, SpecBlock)."""
    common = ["--bench", "humaneval", "--limit", "4", "--dtype", "float32", "--max-new-tokens", "32", "--no-warmup"]
    alone = tmp_path / "alone.jsonl"
    assert cli(["run", "--method", "vanilla", "--baseline", "none", "--out", str(alone), *common], capsys)[0] == 0
    expected = {r["prompt_id"]: r["new_tokens"] for r in read(alone)[1:]}
    for extra in (["--batch-size", "2"], ["--batch-size", "4", "--continuous"]):
        out = tmp_path / f"b{extra[1]}.jsonl"
        args = ["run", "--method", "sps", "--also", "eagle3", "--also", "pld", "--also", "specblock", "--out", str(out)]
        code, _, stderr = cli(args + common + extra, capsys)
        assert code == 0, stderr
        records = read(out)[1:]
        assert len(records) == 5 * 4
        for r in records:
            assert r["new_tokens"] == expected[r["prompt_id"]], (extra, r["method"], r["prompt_id"])
            assert r["batch"]["size"] == int(extra[1])
        assert sum(sum(r["accept_lengths"]) for r in records if r["method"] == "eagle3") > 0
