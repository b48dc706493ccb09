"""`specbench run --batch-size 1,2,4` on tiny real models: one process runs every side at every B, one
results file per B whose header names the loop and the sweep, records carry their B, and B = 1 of a sweep
(or --batched-loop) runs through the batched loop while a plain batch-1 run keeps the one-request loop."""

from __future__ import annotations

import pytest

from specbench.errors import SpecbenchError
from specbench.run.run_config import RunConfig, parse_batch_sizes
from specbench.run.plan import default_out, sweep_out
from specbench.sides import Side
from test_cli import base_args, cli, read


def test_a_sweep_writes_one_file_per_batch_size(models, tmp_path, capsys):
    out = tmp_path / "sweep.jsonl"
    args = base_args(models, out, "--batch-size", "4,1,2", "--also", "pld")
    args[args.index("--limit") + 1] = "4"
    code, stdout, stderr = cli(args, capsys)
    assert code == 0, stderr
    assert not out.exists()
    texts = {}
    for size in (1, 2, 4):
        path = sweep_out(out, size)
        lines = read(path)
        meta = lines[0]["meta"]
        assert meta["batch_size"] == size and meta["batch_sweep"] == [1, 2, 4] and meta["loop"] == "batched"
        assert meta.get("batched_loop", False) == (size == 1)
        records = lines[1:]
        assert sorted(r["method"] for r in records) == ["pld"] * 4 + ["sps"] * 4 + ["vanilla"] * 4
        for r in records:
            assert r["batch"]["size"] == size and r["batch"]["active_mean"] <= size
            texts.setdefault((r["method"], r["prompt_id"]), []).append(r["new_tokens"])
    # fp32 greedy: every B gives every side vanilla's text
    vanilla = {p: t[0] for (m, p), t in texts.items() if m == "vanilla"}
    assert all(t == [vanilla[p]] * 3 for (m, p), t in texts.items())
    assert "B" in stdout and str(sweep_out(out, 4)) in stdout.replace("\n", "")


def test_batch_one_through_the_batched_loop_is_named_in_the_header(models, tmp_path, capsys):
    forced, plain = tmp_path / "forced.jsonl", tmp_path / "plain.jsonl"
    assert cli(base_args(models, forced, "--batched-loop", "--limit", "1"), capsys)[0] == 0
    assert cli(base_args(models, plain, "--limit", "1"), capsys)[0] == 0
    f, p = read(forced), read(plain)
    assert f[0]["meta"]["loop"] == "batched" and f[0]["meta"]["batched_loop"] is True
    assert all(r["batch"]["size"] == 1 for r in f[1:])
    assert p[0]["meta"]["loop"] == "single" and all("batch" not in r for r in p[1:])
    assert f[0]["meta"]["config_hash"] != p[0]["meta"]["config_hash"]
    assert {r["prompt_id"]: r["new_tokens"] for r in f[1:] if r["method"] == "vanilla"} == \
        {r["prompt_id"]: r["new_tokens"] for r in p[1:] if r["method"] == "vanilla"}


def test_batch_sizes_parse_and_refuse_in_one_line(tmp_path, capsys):
    assert parse_batch_sizes("16,1, 4,4") == [1, 4, 16] and parse_batch_sizes(2) == [2]
    for bad in ("0,2", "2,x", ",", "1,9999"):
        with pytest.raises(SpecbenchError, match="--batch-size"):
            parse_batch_sizes(bad)
    code, _, stderr = cli(["run", "--method", "sps", "--bench", "humaneval", "--batch-size", "1,two",
                           "--out", str(tmp_path / "x.jsonl")], capsys)
    assert code == 2 and "--batch-size" in stderr and "Traceback" not in stderr


def test_each_size_of_a_sweep_has_its_own_default_file_and_identity():
    cfg = RunConfig(sides=[Side("sps")], bench="humaneval", batch_size=4, batch_sweep=[1, 2, 4])
    one, four = cfg.at_batch(1), cfg.at_batch(4)
    assert one.loop == four.loop == "batched" and one.batched_loop
    assert "_B1_" in default_out(one).name and "_B4_" in default_out(four).name
    assert one.identity()["batched_loop"] and "batch_sweep" not in four.identity()
    assert RunConfig(sides=[Side("sps")], bench="humaneval").loop == "single"


def test_a_sweep_interleaves_the_sides_batch_by_batch(models, tmp_path, capsys, monkeypatch):
    """At each B every side decodes one batch before any side starts the next, the first side alternating, so
    that the machine's drift over a sweep reaches every side alike."""
    from specbench.run.runner import Runner

    calls = []
    real = Runner._run_side_batched

    def logged(self, label, drafter, queries, size):
        calls.append((size, label, tuple(q.index for q in queries)))
        return real(self, label, drafter, queries, size)

    monkeypatch.setattr(Runner, "_run_side_batched", logged)
    args = base_args(models, tmp_path / "sweep.jsonl", "--batch-size", "1,2")
    args[args.index("--limit") + 1] = "4"
    code, _, stderr = cli(args, capsys)
    assert code == 0, stderr
    at_1 = [c for c in calls if c[0] == 1]
    assert [c[2] for c in at_1] == [(i,) for i in range(4) for _ in range(2)]  # one prompt, both sides, then the next
    firsts = [at_1[k][1] for k in range(0, 8, 2)]
    assert firsts[0] != firsts[1] and firsts[0] == firsts[2]  # the first side alternates
    at_2 = [c for c in calls if c[0] == 2]
    assert [c[2] for c in at_2] == [(0, 1), (0, 1), (2, 3), (2, 3)]
