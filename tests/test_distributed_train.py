"""Data-parallel training under torchrun (2 CPU processes, gloo): both ranks hold the same weights
after every step, match one process trained on the same global batches, resume together, and
`specbench train` writes one drafter (rank 0) from data both ranks regenerated."""

from __future__ import annotations

import json

import torch

from ddp_train_worker import train
from launch import REPO, torchrun
from test_cli import cli
from test_train_cli import assert_trained, common, lossless, prompt_file


def log_losses(folder):
    lines = [json.loads(line) for line in (folder / "train_log.jsonl").read_text().splitlines()]
    return [(e["step"], e["loss"]) for e in lines if "loss" in e]


def test_two_ranks_step_together_and_match_one_process(tmp_path, monkeypatch):
    two, one = tmp_path / "two", tmp_path / "one"
    two.mkdir()
    done = torchrun([str(REPO / "tests" / "ddp_train_worker.py"), str(two)])
    assert done.returncode == 0, done.stderr[-3000:]
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    one.mkdir()
    train(one)  # the same recipe in this process: a world of one

    rank0, rank1, single = (torch.load(p, weights_only=False) for p in
                            (two / "params-rank0.pt", two / "params-rank1.pt", one / "params-rank0.pt"))
    assert rank0["step"] == rank1["step"] == single["step"] == 9  # 6 steps, then 3 more after the resume
    for name, value in rank0["params"].items():
        assert torch.equal(value, rank1["params"][name]), name  # identical on both ranks, bit for bit
        torch.testing.assert_close(value, single["params"][name], atol=1e-5, rtol=1e-4)
    # Rank 0 alone logs: one entry per step, the global batch's loss, as one process logs it.
    ours, theirs = log_losses(two), log_losses(one)
    assert [s for s, _ in ours] == [s for s, _ in theirs] == list(range(1, 10))
    for (_, a), (_, b) in zip(ours, theirs):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(b))


def test_torchrun_train_medusa_writes_one_drafter(models, tmp_path, monkeypatch, capsys):
    from methods.medusa.drafter import MedusaDrafter, MedusaOptions
    from specbench.engine.target import Target

    out, env_cache = tmp_path / "m", tmp_path / "cache"
    monkeypatch.setenv("SPECBENCH_CACHE", str(env_cache))  # the launched ranks inherit it
    done = torchrun(["-m", "specbench", "train", "medusa", "--heads", "2", *common(models, tmp_path, out)])
    assert done.returncode == 0, done.stderr[-3000:]
    folder = assert_trained(out)
    assert json.loads((folder / "config.json").read_text())["recipe"]["extra"]["processes"] == 2
    assert done.stdout.count("held-out:") == 1  # rank 0 reports
    # The regenerated data: both ranks answered, merged into one file, each prompt once, no parts left.
    data = [p for p in (env_cache / "data").rglob("*") if p.is_file()]
    assert len(data) == 1 and ".part-" not in data[0].name
    ids = [json.loads(line)["id"] for line in data[0].read_text().splitlines()]
    assert sorted(ids) == [f"p{i}" for i in range(6)]
    # ... and the file is the one a single process writes (same answers, same order).
    monkeypatch.setenv("SPECBENCH_CACHE", str(tmp_path / "cache1"))
    code, _, err = cli(["train", "data", "--target", models["target"], "--prompts", prompt_file(tmp_path), "--limit", "6",
                        "--max-new-tokens", "12", "--dtype", "float32"], capsys)
    assert code == 0, err
    assert next((tmp_path / "cache1" / "data").rglob("*.jsonl")).read_bytes() == data[0].read_bytes()
    target = Target.load(models["target"], "float32")
    lossless(target, MedusaDrafter(MedusaOptions(path=str(folder), topk=4)))
