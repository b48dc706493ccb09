"""`specbench run --batch-size B` end to end on tiny real models that share the default target's
tokenizer: every side and vanilla decode in batches, records carry the batch, greedy texts equal
vanilla's, batch 1 records stay as they were, and a learner is refused in one line (exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench_data import needs_data
from specbench.run.run_config import RunConfig
from specbench.run.plan import default_out
from specbench.sides import Side
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


def test_a_learner_is_refused_a_batch_in_one_line(models, tmp_path, capsys):
    """SpS learns only with its heuristic schedule: the instance, not the class, is refused (the declared
    batch flags are refused with the other run flags, tests/test_commands.py)."""
    out = tmp_path / "bad.jsonl"
    code, _, stderr = cli(base_args(models, out, "--batch-size", "2", "--opt", "schedule=heuristic"), capsys)
    assert code == 2 and "sps learns while serving" in stderr and "Traceback" not in stderr
    assert not out.exists()


def test_dvi_refuses_a_batch_before_loading_anything(tmp_path, capsys):
    out = tmp_path / "dvi.jsonl"
    code, _, stderr = cli(["run", "--method", "dvi", "--bench", "humaneval", "--batch-size", "4", "--out", str(out)],
                          capsys)  # the default target: refused before it loads
    assert code == 2 and "dvi learns while serving" in stderr and "--batch-size 1" in stderr
    assert not out.exists()


def test_batched_runs_get_their_own_default_file():
    def config(**batch) -> RunConfig:
        return RunConfig(sides=[Side("sps")], bench="humaneval", **batch)

    one, four, cont = (default_out(config(**b)) for b in ({}, {"batch_size": 4}, {"batch_size": 4, "continuous": True}))
    assert len({one, four, cont}) == 3 and "_B4_" in four.name and "_B4c_" in cont.name
    assert "batch_size" not in config().identity()  # batch-1 runs keep their config hash
    assert config().identity() == {k: v for k, v in config(batch_size=4).identity().items()
                                   if k not in ("batch_size", "continuous")}


@pytest.mark.deep  # 94 s on 2 cores; the tiny models' batched checks stay in `make test`
@needs_data
def test_real_target_batched_texts_equal_batch1_vanilla(tmp_path, capsys):
    """SmolLM2-135M in fp32, four HumanEval prompts in continuous batches of 4 (static batches and every
    method's batch are checked on tiny targets), with SpS, EAGLE-3, prompt lookup and SpecBlock."""
    common = ["--bench", "humaneval", "--limit", "4", "--dtype", "float32", "--max-new-tokens", "32", "--no-warmup"]
    alone = tmp_path / "alone.jsonl"
    assert cli(["run", "--method", "vanilla", "--baseline", "none", "--out", str(alone), *common], capsys)[0] == 0
    expected = {r["prompt_id"]: r["new_tokens"] for r in read(alone)[1:]}
    for extra in (["--batch-size", "4", "--continuous"],):
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


@pytest.mark.slow
def test_real_target_batch_one_computes_what_the_one_request_loop_computes_in_bf16():
    """At B = 1 a chain takes batch 1's own forward (the causal kernel, no mask), so the batched loop reproduces
    the one-request loop bit for bit even in bf16 (SmolLM2-135M, one prompt). Through the additive mask instead,
    3 HumanEval prompts x 48 tokens on an AVX2 EPYC kept only 4-7 of 48 rows' logits identical, and 2 of the 3
    texts differed."""
    from collections import deque

    from specbench.engine.batch_loop import BatchConfig, BatchRequest, generate_batch
    from specbench.engine.loop import GenerationConfig, generate
    from specbench.engine.target import Target
    from specbench.engine.vanilla import VanillaDrafter

    target = Target.load("smollm2-135m", dtype="bfloat16")
    drafter = VanillaDrafter()
    drafter.setup(target)
    ids = target.tokenizer("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n")["input_ids"]
    config = GenerationConfig(max_new_tokens=24)
    alone = generate(target, drafter, ids, config)
    (_, batched), = generate_batch(target, drafter, deque([BatchRequest(0, ids, config)]), BatchConfig(1))
    assert batched.new_tokens == alone.new_tokens
    assert batched.top_logits.values == alone.top_logits.values


def test_a_bf16_batched_run_rescores_its_flips_as_recheck_does(models, tmp_path, capsys, monkeypatch):
    """Batched records keep their prompt for the exact rule. A planted bug shifts the logits of every batched
    verify with draft rows (vanilla's one-row steps untouched), so the method's texts flip: the run re-scores
    each flip with correct one-request forwards, whose replay of the stored prompt reproduces vanilla's tokens,
    and finds it unexplained; the file stripped of the rule's fields re-checks to the same verdicts."""
    from specbench.engine.batch_target import BatchTarget
    from specbench.engine.target import TargetOutput
    from specbench.engine.timing import NULL_TIMER
    from test_recheck import METHOD, assert_rechecks_to

    real = BatchTarget.verify
    shifts: dict = {}

    def shifted(self, packed, taps=(), timer=NULL_TIMER):
        outs = real(self, packed, taps, timer)
        vocab = outs[0].logits.shape[-1]
        shift = shifts.setdefault(vocab, 2.0 * torch.randn(vocab, generator=torch.Generator().manual_seed(0)))
        return [out if out.logits.shape[0] == 1 else TargetOutput(out.logits + shift.to(out.logits), out.taps)
                for out in outs]

    monkeypatch.setattr(BatchTarget, "verify", shifted)
    ran = tmp_path / "ran.jsonl"
    args = ["run", "--method", METHOD, "--bench", "mt_bench", "--target", models["target"], "--dtype", "bfloat16",
            "--max-new-tokens", "16", "--limit", "4", "--batch-size", "2", "--out", str(ran), "--no-warmup"]
    code, _, err = cli(args, capsys)
    assert code == 0, err
    monkeypatch.setattr(BatchTarget, "verify", real)
    lines = ran.read_bytes().splitlines(keepends=True)
    records = [json.loads(line) for line in lines[1:]]
    assert records and all(r["batch"]["size"] == 2 for r in records)
    flips = [r["divergence"] for r in records if r.get("divergence") and "method_token" in r["divergence"]]
    assert flips, "the planted bug flips the method's texts"
    for d in flips:  # judged at run time by the exact rule, on the prompt the batch decoded
        assert d["rule"] == "exact" and d["status"] == "unexplained" and d["replay_mismatches"] == 0, d
    assert_rechecks_to(lines, len(flips), tmp_path, capsys)
